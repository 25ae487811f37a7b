"""Which files a checkpoint path stands for: one file, a sharded set's index, or a directory.

Formats are told apart by content (a zip signature, a safetensors header, the
``GGUF`` magic, an index's ``weight_map``), not by file name alone. A directory is
listed as weight sets (:func:`weight_sets`): a single file, or an index with the
shards it names. Which set a load reads when there are several is decided once, by
the engine's resolver (``lightning_lowmem.sources.resolve``), which compares them.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from lightning_lowmem.errors import (
    AmbiguousCheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    format_names,
)
from lightning_lowmem.formats.files import open_regular

log = logging.getLogger(__name__)

ZIP_MAGIC = b"PK\x03\x04"
GGUF_MAGIC = b"GGUF"
HEAD_BYTES = 9
"""Bytes of a file's start that tell its format apart (:func:`kind_of`)."""
MAX_INDEX_BYTES = 64 * 2**20
"""An index larger than this is read only this far (and then fails to parse): no real index comes near it."""

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


WEIGHT_ORDER = (
    "model.safetensors.index.json",
    "*.safetensors.index.json",
    "model.safetensors",
    "*.safetensors",
    "lit_model.pth",
    "pytorch_model.bin.index.json",
    "*.index.json",
    "pytorch_model.bin",
    "*.pth",
    "*.pt",
    "*.bin",
    "*.ckpt",
    "*.gguf",
)
"""The weight files a directory may hold, in the documented order (``docs/loading.md``, "Which file a path
stands for"): a set of several weight sets that hold the same tensors is read from the first."""

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".ckpt", ".gguf")
"""The suffixes of the files a directory's weights are found in (besides ``*.index.json``)."""

NOT_WEIGHTS = ("optimizer.pt", "optimizer.bin", "scheduler.pt", "scheduler.bin", "training_args.bin", "rng_state*.pth")
"""Files of a training run's checkpoint directory (transformers' ``Trainer``) that hold no model weights."""


@dataclass(frozen=True)
class WeightSet:
    """One set of weights in a directory: a single file, or an index and the shards it names.

    Attributes:
        path: what a load opens: the file, or the ``*.index.json``.
        rank: its place in :data:`WEIGHT_ORDER` (lower comes first).
        shards: the files an index names that are there (empty for a single file).
        problem: why an index cannot be read (malformed, a name outside the directory, a shard missing), raised
            by :meth:`check` when the set is a candidate: a stale index beside the set ``prefer`` names is no error.
    """

    path: Path
    rank: int
    shards: tuple[Path, ...] = ()
    problem: Exception | None = None

    @property
    def name(self) -> str:
        return self.path.name

    def check(self) -> None:
        """Raise :attr:`problem`, if any.

        Raises:
            CheckpointFormatError: the index is malformed or names files outside the directory.
            CheckpointNotFoundError: a shard it names is missing.
        """
        if self.problem is not None:
            raise self.problem


def locate(path: str | Path) -> Path:
    """The one file ``path`` names: itself, or the one weight set a directory holds. Reads no weights.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist, or the directory holds no checkpoint.
        AmbiguousCheckpointError: the directory holds several weight sets (``load_checkpoint`` and every face
            compare them; this function does not read them).
        CheckpointFormatError: the one index there is malformed or names files outside the directory.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointNotFoundError(f"Checkpoint {str(path)!r} does not exist. Check the path.")
    if not path.is_dir():
        return path
    sets = weight_sets(path)
    if len(sets) > 1:
        raise AmbiguousCheckpointError(
            f"{path} holds {len(sets)} weight sets ({format_names(s.name for s in sets)}). Pass the file to load "
            f"({path / sets[0].name}), or load through load_checkpoint, which compares them (prefer= picks one).")
    sets[0].check()
    return sets[0].path


def weight_sets(directory: Path) -> list[WeightSet]:
    """Every set of weights in ``directory``, in :data:`WEIGHT_ORDER`; each index with the shards it names.

    Names starting with ``.`` (a save in progress, editor files) and files of a training run that hold no
    weights (:data:`NOT_WEIGHTS`) are not weights; a shard named by an index belongs to that index alone. An index
    that cannot be read is listed with its :attr:`WeightSet.problem` (:meth:`WeightSet.check` raises it).

    Raises:
        CheckpointNotFoundError: the directory holds no weights.
    """
    files = sorted(p for p in directory.iterdir() if is_weight_name(p.name) and p.is_file())
    indexes = [p for p in files if p.name.endswith(".index.json")]
    sets = [_index_set(p) for p in indexes]
    sharded = {shard for s in sets for shard in s.shards}
    sets += [WeightSet(p, _rank(p.name)) for p in files if p not in indexes and p not in sharded]
    if not sets:
        raise CheckpointNotFoundError(
            f"{directory} holds no checkpoint (looked for {', '.join(WEIGHT_ORDER)}). Pass the file, or the "
            "directory it is in.")
    return sorted(sets, key=lambda s: (s.rank, s.name))


def _index_set(index: Path) -> WeightSet:
    """An index and the shards it names that are there; what is wrong with it kept as its problem."""
    try:
        return WeightSet(index, _rank(index.name), tuple(shards_of_index(index, _read_index(index))))
    except CheckpointNotFoundError as e:  # shards missing: those there still belong to it, not to a set of their own
        names = set(_weight_map(index, _read_index(index)).values())
        present = sorted(index.parent / n for n in names if _inside(n) and (index.parent / n).is_file())
        return WeightSet(index, _rank(index.name), tuple(present), problem=e)
    except CheckpointFormatError as e:
        return WeightSet(index, _rank(index.name), problem=e)


def is_weight_name(name: str) -> bool:
    """Whether a file of this name in a directory is one of its weight files (see :func:`weight_sets`).

    Example::

        >>> [is_weight_name(n) for n in ("lit_model.pth", "optimizer.pt", ".model.safetensors.partial", "a.json")]
        [True, False, False, False]
    """
    return (not name.startswith(".") and (name.endswith(".index.json") or name.endswith(WEIGHT_SUFFIXES))
            and not any(fnmatch.fnmatch(name, pattern) for pattern in NOT_WEIGHTS))


def _rank(name: str) -> int:
    return next(i for i, pattern in enumerate(WEIGHT_ORDER) if fnmatch.fnmatch(name, pattern))


def _read_index(index: Path) -> bytes:
    fd = open_regular(index)
    try:
        return os.pread(fd, min(os.fstat(fd).st_size, MAX_INDEX_BYTES), 0)
    finally:
        os.close(fd)


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
