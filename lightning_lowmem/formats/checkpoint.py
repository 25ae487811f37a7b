"""``Checkpoint``: every tensor record of every file of a checkpoint.

Opening reads headers only; :meth:`Checkpoint.read` and :meth:`Checkpoint.read_rows`
then read one tensor, or a block of its rows, at a time from the descriptor the
header was read through. A checkpoint of more than :data:`MAX_OPEN_FILES` files holds at most
that many descriptors: a shard is released after its header is read and reopened when it is
read, checked to be the same file (``files.py``), and the least recently read are released
again, so any number of shards loads under the default limit of 1024 descriptors.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_lowmem.errors import CheckpointFormatError, format_names
from lightning_lowmem.formats.discovery import HEAD_BYTES, kind_of, locate, shards_of_index
from lightning_lowmem.formats.files import open_regular
from lightning_lowmem.formats.gguf_file import GGUFFile
from lightning_lowmem.formats.records import CheckpointFile, TensorRecord
from lightning_lowmem.formats.safetensors_file import SafetensorsFile
from lightning_lowmem.formats.torch_zip import TorchZipFile
from lightning_lowmem.memory import collector_paused

_READERS = {"safetensors": SafetensorsFile, "torch": TorchZipFile, "gguf": GGUFFile}
MAX_OPEN_FILES = 64
"""Descriptors a checkpoint of many files holds at most at a time."""


def _open_files(path: str | Path) -> list[CheckpointFile]:
    """The readers of every file ``path`` stands for; an index is followed to its shards."""
    first = locate(path)
    fd = open_regular(first)
    try:
        kind = kind_of(os.pread(fd, HEAD_BYTES, 0), first)
        if kind != "index":
            return [_READERS[kind](first, fd)]
        text = os.pread(fd, os.fstat(fd).st_size, 0)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    files: list[CheckpointFile] = []
    shards = shards_of_index(first, text)
    try:
        for shard in shards:
            files.append(_open_shard(shard))
            if len(shards) > MAX_OPEN_FILES:
                files[-1].release()  # reopened when read
    except BaseException:
        for f in files:
            f.close()
        raise
    return files


def _open_shard(path: Path) -> CheckpointFile:
    fd = open_regular(path)
    try:
        kind = kind_of(os.pread(fd, HEAD_BYTES, 0), path)
        if kind in ("index", "gguf"):
            raise CheckpointFormatError(f"{path} is {'an index' if kind == 'index' else 'a GGUF file'} named by an "
                                        "index; pass the top-level index of safetensors or torch shards, or the file.")
        return _READERS[kind](path, fd)
    except BaseException:
        os.close(fd)
        raise


class Checkpoint:
    """An opened checkpoint: every tensor record of every file, read one at a time.

    Example::

        >>> import tempfile, safetensors.torch
        >>> path = Path(tempfile.mkdtemp()) / "model.safetensors"
        >>> safetensors.torch.save_file({"w": torch.ones(2, 3)}, path)
        >>> with Checkpoint.open(path) as ckpt:
        ...     print(ckpt.records["w"].shape, ckpt.read("w").sum().item())
        (2, 3) 6.0
    """

    def __init__(self, files: list[CheckpointFile]) -> None:
        self.files = files
        self.records: dict[str, TensorRecord] = files[0].records() if len(files) == 1 else {}  # one file: its own dict
        self._owner: dict[str, CheckpointFile] = {}  # empty for one file: it owns every key
        for file in files if len(files) > 1 else ():
            for key, rec in file.records().items():
                if key in self.records:
                    raise CheckpointFormatError(
                        f"Tensor {key!r} is in both {self.records[key].file} and {file.path}; "
                        "a sharded checkpoint must hold each key once. Remove the stray file."
                    )
                self.records[key] = rec
                self._owner[key] = file
        self._limit = MAX_OPEN_FILES if len(files) > MAX_OPEN_FILES else None
        self._open: OrderedDict[int, CheckpointFile] = OrderedDict()  # files holding a descriptor, least recent first
        self._busy: dict[int, int] = {}  # id of a file -> reads in progress (read ahead runs in other threads)
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        """Open ``path``: a file, a ``*.index.json`` or a directory. Reads headers only."""
        with collector_paused():  # a record or two per tensor: a million of them
            files = _open_files(path)
            try:
                return cls(files)
            except BaseException:
                for f in files:
                    f.close()
                raise

    @property
    def paths(self) -> list[Path]:
        return [f.path for f in self.files]

    @property
    def description(self) -> str:
        """The files, for messages: the first three and how many more."""
        return format_names(self.paths, limit=3, quote=False)

    @property
    def metadata(self) -> dict[str, str]:
        """Every file's metadata (a safetensors header's ``__metadata__``) together; a sharded set repeats it in
        each file, and a key two files give different values keeps the last file's."""
        merged: dict[str, str] = {}
        for f in self.files:
            merged.update(f.metadata())
        return merged

    @property
    def entry(self) -> str:
        """The entry a torch file's state dict was found under (``state_dict``, ``model``) or ``''``."""
        return next((f.entry for f in self.files if getattr(f, "entry", "")), "")

    def other_entries(self) -> tuple[dict[str, Any], list[str]]:
        """A torch checkpoint's entries other than the weights' (optimizer state, counters), read without
        reading the weights, and where in them objects stand that were not built (see
        :meth:`TorchZipFile.other_entries`); empty for safetensors files and bare state dicts."""
        out: dict[str, Any] = {}
        inert: list[str] = []
        for f in self.files:
            if isinstance(f, TorchZipFile):
                was_open = f.is_open
                entries, paths = f.other_entries()
                if not was_open and self._limit is not None:
                    f.release()  # read outside the count of open files: released again
                out.update(entries)
                inert += paths
        return out, inert

    @property
    def gguf(self) -> GGUFFile | None:
        """The GGUF file, when the checkpoint is one (its header's metadata, a handle for gguf's parsers)."""
        return next((f for f in self.files if isinstance(f, GGUFFile)), None)

    def check_unchanged(self) -> None:
        """Raise :class:`CheckpointFormatError` when a file changed since it was opened."""
        for f in self.files:
            f.check_unchanged()

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read tensor ``key`` into a new tensor, or into ``out`` (contiguous, of its shape and dtype) when given.

        A strided view stored in a torch file is returned as a new tensor even when ``out`` is given.
        """
        if self._limit is None:  # every file stays open: no bookkeeping per read
            return self._file(key).read(key, out)
        with self._reading(key) as file:
            return file.read(key, out)

    def map(self, key: str) -> torch.Tensor | None:
        """Tensor ``key`` over its file's mapped pages instead of read (None when it cannot be mapped: read it).

        Mapped tensors keep their file's mapping alive, and the file must not change while they live.
        """
        with self._reading(key) as file:
            return file.map(key)

    def reads_rows(self, key: str) -> bool:
        """Whether blocks of rows of ``key`` can be read on their own (:meth:`read_rows`)."""
        return self._file(key).reads_rows(key)

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` (along dim 0) of tensor ``key``, read without the rest of it."""
        with self._reading(key) as file:
            return file.read_rows(key, start, stop, out)

    def _file(self, key: str) -> CheckpointFile:
        return self._owner[key] if self._owner else self.files[0]

    @contextlib.contextmanager
    def _reading(self, key: str) -> Iterator[CheckpointFile]:
        """The file holding ``key``, counted as in use (never released) for the block; with many files, the least
        recently read ones beyond :data:`MAX_OPEN_FILES` are released first."""
        file = self._file(key)
        if self._limit is None:
            yield file
            return
        with self._lock:
            self._busy[id(file)] = self._busy.get(id(file), 0) + 1
            self._open[id(file)] = file
            self._open.move_to_end(id(file))
            for other_id in [i for i in self._open if not self._busy.get(i)][:max(0, len(self._open) - self._limit)]:
                self._open.pop(other_id).release()
        try:
            yield file
        finally:
            with self._lock:
                self._busy[id(file)] -= 1

    def __iter__(self) -> Iterator[TensorRecord]:
        return iter(self.records.values())

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
