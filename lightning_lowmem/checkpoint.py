"""Finding and opening a checkpoint: one file, a sharded set, or a directory.

Formats are told apart by content (a zip signature, a safetensors header, an
index's ``weight_map``), not by file name alone. In a directory with several
candidates, safetensors wins over pickle-based files, and the choice is logged.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from lightning_lowmem.errors import CheckpointError, CheckpointFormatError, format_names
from lightning_lowmem.records import CheckpointFile, TensorRecord
from lightning_lowmem.safetensors_file import SafetensorsFile
from lightning_lowmem.torch_file import ZIP_MAGIC, TorchZipFile

log = logging.getLogger(__name__)

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
)


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path, or a file it refers to, does not exist."""


def sniff(path: Path) -> str:
    """``'safetensors'``, ``'torch'`` or ``'index'``, from the first bytes of ``path``."""
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:4] == ZIP_MAGIC:
        return "torch"
    if len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] < 100 * 2**20:
        return "safetensors"
    if head.lstrip()[:1] == b"{":
        return "index"
    if head[:1] == b"\x80":  # a bare pickle: torch.save(..., _use_new_zipfile_serialization=False)
        raise CheckpointFormatError(
            f"{path} is a bare pickle (torch's legacy format), which cannot be read without unpickling "
            "everything at once. Load it once with torch.load(weights_only=True) and save it again with "
            "torch.save (or safetensors.torch.save_file)."
        )
    raise CheckpointFormatError(
        f"{path} is neither a safetensors file, a torch zip archive nor a JSON index (first bytes: {head!r}). "
        "Pass a .safetensors file, a torch.save file, a *.index.json or a directory holding them."
    )


def resolve_files(path: str | Path) -> list[Path]:
    """The checkpoint files that ``path`` (a file, an index or a directory) stands for."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointNotFoundError(f"Checkpoint {str(path)!r} does not exist. Check the path.")
    if path.is_dir():
        path = _pick_in_directory(path)
    if sniff(path) == "index":
        return _files_of_index(path)
    return [path]


def _pick_in_directory(directory: Path) -> Path:
    for pattern in _DIRECTORY_CANDIDATES:
        found = sorted(p for p in directory.glob(pattern) if p.is_file())
        if pattern.startswith("*") and not pattern.endswith(".index.json"):
            # A plain glob must not pick up the shards of an index we skipped.
            found = [p for p in found if ".index" not in p.name]
        if len(found) == 1:
            others = [p.name for p in directory.iterdir() if p.is_file() and p != found[0]
                      and p.suffix in (".safetensors", ".bin", ".pth", ".pt", ".ckpt")]
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


def _files_of_index(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointFormatError(
            f"{index} is not a sharded-checkpoint index (no 'weight_map' in valid JSON: {e}). "
            "Pass the index that save_pretrained wrote, or a checkpoint file."
        ) from e
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        keys = [k for k, s in weight_map.items() if s in missing]
        raise CheckpointNotFoundError(
            f"{index} names {len(shards)} shards, but {len(missing)} are missing from {index.parent}: "
            f"{format_names(missing)} (holding {len(keys)} tensors, e.g. {format_names(keys, 3)}). "
            "Download the missing shards, or pass the complete directory."
        )
    return [index.parent / s for s in shards]


def _open_file(path: Path) -> CheckpointFile:
    kind = sniff(path)
    if kind == "safetensors":
        return SafetensorsFile(path)
    if kind == "torch":
        return TorchZipFile(path)
    raise CheckpointFormatError(f"{path} is an index inside an index; pass the top-level index instead.")


class Checkpoint:
    """An opened checkpoint: every tensor record of every file, read one at a time.

    Example::

        >>> with Checkpoint.open("model.safetensors") as ckpt:  # doctest: +SKIP
        ...     rec = ckpt.records["lm_head.weight"]
        ...     w = ckpt.read(rec.key)
    """

    def __init__(self, files: list[CheckpointFile]) -> None:
        self.files = files
        self.records: dict[str, TensorRecord] = {}
        self._owner: dict[str, CheckpointFile] = {}
        for file in files:
            for key, rec in file.records().items():
                if key in self.records:
                    raise CheckpointFormatError(
                        f"Tensor {key!r} is in both {self.records[key].file} and {file.path}; "
                        "a sharded checkpoint must hold each key once. Remove the stray file."
                    )
                self.records[key] = rec
                self._owner[key] = file

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        """Open ``path``: a file, a ``*.index.json`` or a directory. Reads headers only."""
        files: list[CheckpointFile] = []
        try:
            for p in resolve_files(path):
                files.append(_open_file(p))
        except BaseException:
            for f in files:
                f.close()
            raise
        return cls(files)

    @property
    def paths(self) -> list[Path]:
        return [f.path for f in self.files]

    @property
    def entry(self) -> str:
        """The entry a torch file's state dict was found under (``state_dict``, ``model``) or ``''``."""
        return next((f.entry for f in self.files if getattr(f, "entry", "")), "")

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read tensor ``key`` into a new tensor, or into ``out`` (contiguous, of its shape and dtype) when given.

        A strided view stored in a torch file is returned as a new tensor even when ``out`` is given.
        """
        return self._owner[key].read(key, out)

    def reads_rows(self, key: str) -> bool:
        """Whether blocks of rows of ``key`` can be read on their own (:meth:`read_rows`)."""
        return self._owner[key].reads_rows(key)

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` (along dim 0) of tensor ``key``, read without the rest of it."""
        return self._owner[key].read_rows(key, start, stop, out)

    def __iter__(self) -> Iterator[TensorRecord]:
        return iter(self.records.values())

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
