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
import contextvars
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lightning_lowmem.errors import CheckpointDiffersError, CheckpointFormatError, format_names
from lightning_lowmem.formats.crc_pieces import Unchecked
from lightning_lowmem.formats.discovery import HEAD_BYTES, kind_of, locate, shards_of_index
from lightning_lowmem.formats.files import SAMPLE_BYTES, Fingerprint, open_regular
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


Share = Callable[[Callable[[], Any], Callable[[Any], Any]], Any]
"""``share(make, send)``: ``make()`` on the first rank, ``send(its result)`` given to the others (ranks/agreement.py)."""
_SHARE: contextvars.ContextVar[Share | None] = contextvars.ContextVar("lowmem_share_headers", default=None)
SAMPLE_BLOCKS = 256
"""Blocks of data (of ``files.SAMPLE_BYTES``) the ranks of a sharded load each read and digest per checkpoint, spread
over its files by their sizes (at least one a file), to tell apart files with the same headers and other data."""


@contextlib.contextmanager
def headers_shared(share: Share | None) -> Iterator[None]:
    """Within the block, :meth:`Checkpoint.open` parses headers on the first rank only and ``share`` s the parsed
    readers with the others, which open their own descriptors on the same files; every rank then checks that its
    files hold what the first rank's hold (:func:`_check_same`: sizes, headers, a sample of the data), whatever their
    modification times. Every rank must open the same paths in the same order. None: each rank parses its own."""
    token = _SHARE.set(share)
    try:
        yield
    finally:
        _SHARE.reset(token)


class _First(NamedTuple):
    """What the first rank opened, and the fingerprints of its files."""

    files: list[CheckpointFile]
    prints: list[Fingerprint]


class _Sent(NamedTuple):
    """What the first rank sends: the path it asked for, its readers (None for GGUF: each rank parses its own),
    its files' paths and fingerprints."""

    asked: str
    files: list[CheckpointFile] | None
    paths: list[str]
    prints: list[Fingerprint]


def _shared_open(path: str | Path) -> list[CheckpointFile]:
    """:func:`_open_files`, or, inside :func:`headers_shared`, the first rank's readers when this rank asked for the
    same path (GGUF files, or another path: this rank's own), checked to hold what the first rank's files hold."""
    share = _SHARE.get()
    if share is None:
        return _open_files(path)
    asked = str(Path(path).expanduser().absolute())

    def make() -> _First:
        files = _open_files(path)
        try:
            return _First(files, fingerprints(files, [_blocks(f, files) for f in files]))
        except BaseException:
            for f in files:
                f.close()
            raise

    got = share(make, lambda first: _Sent(asked, None if any(isinstance(f, GGUFFile) for f in first.files)
                                          else first.files, [str(f.path) for f in first.files], first.prints))
    if isinstance(got, _First):
        return got.files  # the first rank's own
    files = got.files if got.files is not None and got.asked == asked else _open_files(path)
    try:
        for f in files:
            if f.received:
                f.attach()
                if len(files) > MAX_OPEN_FILES:
                    f.release()
        _check_same(files, got)
    except BaseException:
        for f in files:
            f.close()
        raise
    return files


def _blocks(file: CheckpointFile, files: list[CheckpointFile]) -> int:
    """Blocks of ``file``'s data to sample: :data:`SAMPLE_BLOCKS` spread over ``files`` by size, at least one."""
    total = sum(f.size for f in files) or 1
    return max(1, SAMPLE_BLOCKS * file.size // total)


def fingerprints(files: list[CheckpointFile], blocks: list[int]) -> list[Fingerprint]:
    """Each file's :class:`~lightning_lowmem.formats.files.Fingerprint`, its data sampled in as many blocks as
    ``blocks`` says; a file released (many files) is released again after."""
    prints = []
    for f, n in zip(files, blocks):
        was_open = f.is_open
        try:
            prints.append(f.fingerprint(n))
        finally:
            if not was_open:
                f.release()
    return prints


def _check_same(files: list[CheckpointFile], first: _Sent) -> None:
    """Raise :class:`CheckpointDiffersError` unless this rank's ``files`` hold what the first rank's held."""
    fix = ("Every rank must load the same checkpoint: copy it again onto this node from where rank 0's came from "
           "(or wait for whatever writes it to finish), then start every rank again.")
    if len(files) != len(first.prints):
        raise CheckpointDiffersError(
            f"The checkpoint stands for {len(files)} files on rank {_rank()} "
            f"({format_names([str(f.path) for f in files], 3)}) and for {len(first.prints)} on rank 0 "
            f"({format_names(first.paths, 3)}). {fix}")
    own = fingerprints(files, [p.blocks for p in first.prints])
    for f, mine, theirs, their_path in zip(files, own, first.prints, first.paths):
        if mine != theirs:
            raise CheckpointDiffersError(
                f"{f.path} on rank {_rank()} does not hold what {their_path} holds on rank 0: "
                f"{_difference(mine, theirs)}. "
                f"{fix}")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _difference(mine: Fingerprint, theirs: Fingerprint) -> str:
    if mine.size != theirs.size:
        return f"it holds {mine.size} bytes, rank 0's {theirs.size}"
    if mine.headers != theirs.headers:
        return "its headers differ (same size)"
    return (f"its data differs (same size and headers; {mine.blocks} blocks of {SAMPLE_BYTES} bytes spread over "
            "it read on both ranks)")


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
        """Open ``path``: a file, a ``*.index.json`` or a directory. Reads headers only (inside
        :func:`headers_shared`: on the first rank, the others getting them from it)."""
        with collector_paused():  # a record or two per tensor: a million of them
            files = _shared_open(path)
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

    def other_entries(self, unread: frozenset[str] = frozenset()) -> tuple[dict[str, Any], list[str]]:
        """A torch checkpoint's entries other than the weights' (optimizer state, counters), read without
        reading the weights, and where in them objects stand that were not built (see
        :meth:`TorchZipFile.other_entries`; the tensors of the entries named in ``unread`` left as
        :class:`~lightning_lowmem.formats.entry_tensor.EntryTensor` handles); empty for safetensors files and bare
        state dicts."""
        out: dict[str, Any] = {}
        inert: list[str] = []
        for f in self.files:
            if isinstance(f, TorchZipFile):
                was_open = f.is_open
                entries, paths = f.other_entries(unread)
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

    def unchecked(self) -> list[Unchecked]:
        """What was read of torch files' records in parts that did not cover them (this rank's rows), so their
        CRC-32s are not checked yet: for the ranks to check together
        (:func:`~lightning_lowmem.formats.crc_pieces.check_unchecked`). Empty for other formats."""
        return [record for f in self.files if isinstance(f, TorchZipFile) for record in f.unchecked()]

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
