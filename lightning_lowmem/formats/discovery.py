"""Which files a checkpoint path stands for: one file, a sharded set's index, or a directory.

Formats are told apart by content (a zip signature, a safetensors header, the
``GGUF`` magic, an index's ``weight_map``), not by file name alone. In a directory
with several candidates, safetensors wins over pickle-based files and those over
a ``.gguf`` file, and the choice is logged.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path, PurePosixPath

from lightning_lowmem.errors import CheckpointFormatError, CheckpointNotFoundError, format_names

log = logging.getLogger(__name__)

ZIP_MAGIC = b"PK\x03\x04"
GGUF_MAGIC = b"GGUF"
HEAD_BYTES = 9
"""Bytes of a file's start that tell its format apart (:func:`kind_of`)."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".ckpt", ".gguf")
"""The suffixes of the files a directory's weights are found in (besides ``*.index.json``)."""

# Directory entries in order of preference: safetensors before pickle-based files.
_DIRECTORY_CANDIDATES = (
    "model.safetensors.index.json",
    "*.safetensors.index.json",
    "model.safetensors",
    "*.safetensors",
    "lit_model.pth",
    "pytorch_model.bin.index.json",
    "*.bin.index.json",
    "pytorch_model.bin",
    "*.pth",
    "*.pt",
    "*.bin",
    "*.ckpt",
    "*.gguf",
)


def kind_of(head: bytes, path: Path) -> str:
    """``'safetensors'``, ``'torch'``, ``'gguf'`` or ``'index'``, from the first :data:`HEAD_BYTES` bytes of ``path``.

    Example::

        >>> kind_of(b"PK\\x03\\x04\\x00\\x00\\x00\\x00\\x00", Path("m.bin"))
        'torch'
        >>> kind_of(b"GGUF\\x03\\x00\\x00\\x00\\x00", Path("model.Q4_0.gguf"))
        'gguf'
    """
    if head[:4] == ZIP_MAGIC:
        return "torch"
    if head[:4] == GGUF_MAGIC:
        return "gguf"
    if len(head) == HEAD_BYTES and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] < 100 * 2**20:
        return "safetensors"
    if head.lstrip()[:1] == b"{":
        return "index"
    if path.suffix == ".gguf":
        raise CheckpointFormatError(
            f"{path} is named .gguf but does not start with the GGUF magic (first bytes: {head!r}): it is damaged "
            "or not a GGUF file. Download or convert it again.")
    if head[:1] == b"\x80":  # a bare pickle: torch.save(..., _use_new_zipfile_serialization=False)
        raise CheckpointFormatError(
            f"{path} is a bare pickle (torch's legacy format), which cannot be read without unpickling "
            "everything at once. Load it once with torch.load(weights_only=True) and save it again with "
            "torch.save (or safetensors.torch.save_file)."
        )
    raise CheckpointFormatError(
        f"{path} is neither a safetensors file, a torch zip archive, a GGUF file nor a JSON index (first bytes: "
        f"{head!r}). Pass a .safetensors file, a torch.save file, a .gguf file, a *.index.json or a directory "
        "holding them."
    )


def locate(path: str | Path) -> Path:
    """The one file ``path`` names: itself, or the checkpoint a directory holds. Opens nothing.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist, or the directory holds no checkpoint.
        CheckpointFormatError: the directory holds several candidates and no index naming them.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointNotFoundError(f"Checkpoint {str(path)!r} does not exist. Check the path.")
    return _pick_in_directory(path) if path.is_dir() else path


def _pick_in_directory(directory: Path) -> Path:
    for pattern in _DIRECTORY_CANDIDATES:
        found = sorted(p for p in directory.glob(pattern) if p.is_file())
        if pattern.startswith("*") and not pattern.endswith(".index.json"):
            # A plain glob must not pick up the shards of an index we skipped.
            found = [p for p in found if ".index" not in p.name]
        if len(found) == 1:
            others = [p.name for p in directory.iterdir() if p.is_file() and p != found[0]
                      and p.suffix in WEIGHT_SUFFIXES]
            if others:
                log.info("Checkpoint directory %s: using %s (also present: %s)", directory, found[0].name,
                         format_names(others))
            return found[0]
        if len(found) > 1:
            raise CheckpointFormatError(
                f"{directory} holds several candidate checkpoints matching {pattern!r} and no index naming "
                f"them: {format_names(p.name for p in found)}. Pass the one file to load, or an index.json."
            )
    raise CheckpointNotFoundError(
        f"{directory} holds no checkpoint (looked for {', '.join(_DIRECTORY_CANDIDATES)}). "
        "Pass the file, or the directory it is in."
    )


def shards_of_index(index: Path, text: bytes) -> list[Path]:
    """The shard files that the index ``index`` (whose content is ``text``) names, each checked to exist.

    Shard names must be plain relative names inside the index's directory: an absolute path or a
    ``..`` component is refused (a symlink inside the directory, as in the Hugging Face cache, is
    followed).

    Raises:
        CheckpointFormatError: not valid JSON, no ``weight_map`` of names to file names, or a name that
            leaves the directory.
        CheckpointNotFoundError: a shard the index names is not there.
    """
    weight_map = _weight_map(index, text)
    shards = sorted(set(weight_map.values()))
    escaping = [s for s in shards if not _inside(s)]
    if escaping:
        keys = [k for k, s in weight_map.items() if s in escaping]
        raise CheckpointFormatError(
            f"{index} names shard files outside its directory: {format_names(escaping)} (for {format_names(keys, 3)}). "
            "Shard names must be plain file names next to the index; nothing was opened. Fix the index, or "
            "download the checkpoint again.")
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        keys = [k for k, s in weight_map.items() if s in missing]
        raise CheckpointNotFoundError(
            f"{index} names {len(shards)} shards, but {len(missing)} are missing from {index.parent}: "
            f"{format_names(missing)} (holding {len(keys)} tensors, e.g. {format_names(keys, 3)}). "
            "Download the missing shards, or pass the complete directory."
        )
    return [index.parent / s for s in shards]


def _weight_map(index: Path, text: bytes) -> dict[str, str]:
    """The index's ``weight_map``, checked to map tensor names (str) to file names (str)."""
    try:
        weight_map = json.loads(text)["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointFormatError(
            f"{index} is not a sharded-checkpoint index (no 'weight_map' in valid UTF-8 JSON: {type(e).__name__}: "
            f"{str(e)[:200]}). Pass the index that save_pretrained wrote, or a checkpoint file."
        ) from e
    if not isinstance(weight_map, dict):
        raise CheckpointFormatError(f"{index}: 'weight_map' is a {type(weight_map).__name__}, not a mapping of tensor "
                                    "names to shard files. Pass the index that save_pretrained wrote.")
    bad = [f"{k!r}: {v!r}" for k, v in weight_map.items() if not isinstance(v, str) or not v]
    if bad:
        raise CheckpointFormatError(f"{index}: 'weight_map' values must be shard file names (strings); got "
                                    f"{format_names(bad, quote=False)}. Pass the index that save_pretrained wrote.")
    return weight_map


def _inside(name: str) -> bool:
    """Whether ``name`` is a relative path that stays inside the directory it is relative to."""
    path = PurePosixPath(name)
    return (not path.is_absolute() and ".." not in path.parts and "\\" not in name and "\x00" not in name
            and name.strip() == name)
