"""The directory a checkpoint is saved into: checked before a byte is written, its weight files told apart.

A directory is loaded from its weight files: ``*.safetensors``, ``*.bin``, ``*.pth``, ``*.pt``, ``*.ckpt``,
``*.gguf`` and ``*.index.json``. Those of an earlier save of this library (named as ``save_pretrained`` names
them, with the writer key, or from older versions the scheme key, in their metadata) are replaced by a new
save. Any other is *foreign*: a save beside it would leave two weight sets in one directory, and every loader
would have to guess which to read (``generate`` reads ``lit_model.pth`` first). Such a save is refused before
anything is written, unless ``overwrite=True``: then they are removed when the new save is switched in.

::

    check_save_target(directory, sizes, overwrite)   a file? foreign weights? writable, switchable, free space?
    with checkpoint_directory(directory, ...) as new:    the new directory to write into; switched in whole
        write files into new                               (atomic_directory), old weight files not carried over
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

from lightning_lowmem.errors import ForeignWeightsError, format_names
from lightning_lowmem.saving.atomic_directory import check_switchable, resolved_target, switch_directory, tidy
from lightning_lowmem.formats.discovery import is_weight_name
from lightning_lowmem.saving.safetensors_writer import (
    INDEX_FILE,
    SCHEME_KEY,
    SHARD_NAME,
    SINGLE_FILE,
    WRITER,
    WRITER_KEY,
)

_MAX_HEADER = 100 * 2**20  # bytes of a safetensors header or an index read to tell whose a file is
_OLD_PARTIAL = re.compile(r"\.(model\.safetensors|model-\d{5}-of-\d{5}\.safetensors)\.partial")  # earlier versions'


def is_weight_file(entry: os.DirEntry | Path) -> bool:
    """Whether a loader may read weights from ``entry``: a file (or a link to one) whose name the loaders take for
    weights (:func:`~lightning_lowmem.formats.discovery.is_weight_name`)."""
    return is_weight_name(entry.name) and os.path.isfile(entry)


def weight_files(directory: Path) -> tuple[list[str], list[str]]:
    """The weight files in ``directory``: ``(ours, foreign)``, each sorted by name. Ours: an earlier save's."""
    ours, foreign = [], []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if is_weight_file(entry):
            (ours if _is_ours(Path(entry.path)) else foreign).append(entry.name)
    return ours, foreign


def check_save_target(directory: str | Path, *, sizes: Sequence[int] = (), overwrite: bool = False) -> Path:
    """Check, before anything is written, that a checkpoint can be saved into ``directory``; returns it resolved
    (a link to a directory followed). Leftovers of a killed earlier save there are removed first.

    Args:
        directory: the directory to save into (it may not exist yet).
        sizes: bytes of the files to write, for the free-space check.
        overwrite: whether weight files this library did not write may be removed.

    Raises:
        ValueError: ``directory`` is a file.
        ForeignWeightsError: it holds weight files this library did not write, and ``overwrite`` is False.
        SaveError: it cannot be written or switched (not writable, a mount point), or there is not enough
            free space (the message names the path, the bytes needed and free).
    """
    target = resolved_target(directory)
    tidy(target)
    if target.is_dir() and not overwrite:
        _refuse_foreign(target)
    check_switchable(target, sizes)
    return target


@contextlib.contextmanager
def checkpoint_directory(directory: str | Path, *, sizes: Sequence[int] = (), overwrite: bool = False
                         ) -> Iterator[Path]:
    """The new directory a checkpoint is written into, switched in as ``directory`` when the block ends (see
    :func:`~lightning_lowmem.saving.atomic_directory.switch_directory`). What the old directory holds beyond
    the new files is carried over, except its weight files: an earlier save's are replaced, foreign ones
    (only with ``overwrite``) removed.

    Raises:
        The errors of :func:`check_save_target`, and ``SaveError`` when a write fails.
    """
    target = check_save_target(directory, sizes=sizes, overwrite=overwrite)
    with switch_directory(target, sizes=sizes, drop=_not_carried) as new:
        yield new
        if target.is_dir() and not overwrite:
            _refuse_foreign(target)  # one that appeared while the save ran


def _not_carried(entry: os.DirEntry) -> bool:
    return is_weight_file(entry) or bool(_OLD_PARTIAL.fullmatch(entry.name))


def _refuse_foreign(target: Path) -> None:
    foreign = weight_files(target)[1]
    if foreign:
        raise ForeignWeightsError(
            f"{target} holds weight files that lightning_lowmem did not write: {format_names(foreign)}. A save "
            "beside them would leave two weight sets in one directory, and a loader would have to guess which to "
            "read (generate reads lit_model.pth first). Save into another directory, move them away, or pass "
            "overwrite=True (lightning-lowmem quantize: --overwrite) to remove them once the new save is in "
            "place; nothing was written.", path=str(target), files=foreign)


def _is_ours(path: Path) -> bool:
    """Whether ``path`` is a file of an earlier save of this library (read through a link, its header only)."""
    if path.name == INDEX_FILE:
        return _index_is_ours(path)
    if path.name != SINGLE_FILE and not SHARD_NAME.fullmatch(path.name):
        return False
    metadata = _safetensors_metadata(path)
    return metadata is not None and (metadata.get(WRITER_KEY) == WRITER or SCHEME_KEY in metadata)


def _index_is_ours(path: Path) -> bool:
    """Ours when its metadata says so, or (a save of an earlier version) when every shard it names is ours."""
    text = _read_regular(path, _MAX_HEADER)
    try:
        index = json.loads(text) if text is not None else None
    except (ValueError, RecursionError):
        return False
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        return False
    if isinstance(index.get("metadata"), dict) and index["metadata"].get(WRITER_KEY) == WRITER:
        return True
    shards = set(index["weight_map"].values())
    return bool(shards) and all(isinstance(s, str) and SHARD_NAME.fullmatch(s) and _is_ours(path.parent / s)
                                for s in shards)


def _safetensors_metadata(path: Path) -> dict | None:
    """The ``__metadata__`` of a safetensors header, or None when ``path`` is no safetensors file."""
    head = _read_regular(path, 8)
    if head is None or len(head) < 8 or struct.unpack("<Q", head)[0] > _MAX_HEADER:
        return None
    text = _read_regular(path, 8 + struct.unpack("<Q", head)[0])
    try:
        header = json.loads(text[8:]) if text is not None else None
    except (ValueError, RecursionError):
        return None
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else None


def _read_regular(path: Path, limit: int) -> bytes | None:
    """The first ``limit`` bytes of ``path`` when it is (or links to) a regular file; a FIFO never blocks it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return f.read(limit)
