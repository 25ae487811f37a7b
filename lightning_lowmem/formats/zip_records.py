"""A zip archive's records, found through its central directory and read through the file's own descriptor.

``torch.save`` writes a zip archive; its records are located by name in the central directory (Python's
``zipfile`` parses it), and each record's data from its own local header: the record must be there,
stored (not compressed), inside the file, and its local header must name it as the directory does. So a
file written by any zip writer reads as torch reads it, and no offset arithmetic trusts the file.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from collections.abc import Callable, Iterable

import torch

from lightning_lowmem.errors import CheckpointFormatError
from lightning_lowmem.formats.crc_pieces import mismatch
from lightning_lowmem.formats.discovery import ZIP_MAGIC
from lightning_lowmem.formats.files import OpenedFile

RESAVE = "Load it with torch.load (if you trust it) and save it again with torch.save or safetensors.torch.save_file."
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # the zip local file header (30 bytes)


class ZipRecords:
    """The records of the zip archive ``file``, by name.

    Args:
        file: the archive, opened; its central directory is parsed through its descriptor.

    Attributes:
        directory: record name -> its central-directory entry.
        directory_start: where the central directory starts (it and the end records run to the file's end).
    """

    def __init__(self, file: OpenedFile) -> None:
        self._file = file
        with open(file._fd, "rb", closefd=False) as f:  # the same descriptor: no second open of the file
            try:
                archive = zipfile.ZipFile(f)
                self.directory: dict[str, zipfile.ZipInfo] = archive.NameToInfo
                self.directory_start: int = archive.start_dir  # the central directory, then its end records
            except Exception as e:  # BadZipFile, but also ValueError, NotImplementedError, ... on damaged files
                raise CheckpointFormatError(f"{file.path} is a damaged zip archive ({e}); it is most likely "
                                            "truncated. Download or save it again.") from e

    def keep_only(self, names: Iterable[str]) -> None:
        """Forget every entry but ``names`` (an entry costs ~370 bytes; a million records, ~370 MB)."""
        self.directory = {name: self.directory[name] for name in names if name in self.directory}

    def info(self, name: str, limit: int | None = None, what: str = "its pickle") -> zipfile.ZipInfo:
        """The central-directory entry of record ``name``: present, stored, within the file and ``limit``."""
        path, size = self._file.path, self._file.size
        try:
            info = self.directory[name]
        except KeyError:
            raise CheckpointFormatError(f"{path} has no record {name!r}, which {what} refers to. The file is "
                                        f"incomplete or was altered. {RESAVE}") from None
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointFormatError(
                f"{path}: record {info.filename!r} is compressed (zip method {info.compress_type}); torch.save "
                f"stores records uncompressed, and lightning_lowmem reads them in place. {RESAVE}")
        if info.file_size > size or (limit is not None and info.file_size > limit):
            raise CheckpointFormatError(
                f"{path}: record {info.filename!r} claims {info.file_size} bytes"
                + (f", more than the {limit} such a record may hold" if limit is not None else
                   f", more than the file's {size}") + f". The file is damaged. {RESAVE}")
        return info

    def data_offset(self, info: zipfile.ZipInfo) -> int:
        """Where the record's bytes start: after its local header, whose name must match the directory's."""
        file = self._file
        header = file.pread(_LOCAL_HEADER.size, info.header_offset)
        if len(header) < _LOCAL_HEADER.size or header[:4] != ZIP_MAGIC:
            raise CheckpointFormatError(f"{file.path}: record {info.filename!r} has no local header at byte "
                                        f"{info.header_offset}; the file is damaged or truncated. {RESAVE}")
        fields = _LOCAL_HEADER.unpack(header)
        name_length, extra_length = fields[-2], fields[-1]
        name = file.pread(name_length, info.header_offset + _LOCAL_HEADER.size)
        if name not in (info.filename.encode("utf-8"), info.filename.encode("cp437", errors="replace")):
            raise CheckpointFormatError(f"{file.path}: the local header at byte {info.header_offset} names {name!r}, "
                                        f"the central directory {info.filename!r}. The file is damaged. {RESAVE}")
        start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        if start + info.file_size > file.size:
            raise CheckpointFormatError(
                f"{file.path}: record {info.filename!r} needs bytes {start}..{start + info.file_size}, but the file "
                f"has {file.size}. The file is truncated: download or save it again.")
        return start

    def small_record(self, name: str, limit: int | None = None) -> bytes:
        """A record read whole (the pickle, the byte order), checked against its CRC-32."""
        info = self.info(name, limit)
        data = self._file.pread(info.file_size, self.data_offset(info))
        check_crc(self._file.path, info.filename, info.CRC, zlib.crc32(data), name)
        return data


def _crc32() -> Callable[..., int]:
    """libdeflate's CRC-32 (the ``deflate`` package) where installed, else zlib's: the same numbers, libdeflate's
    5x as fast (6.2 against 1.2 GB/s on this project's CPU machine). Checking every record of a 2 GB ``lit_model.pth``
    took 1.7 s with zlib's, which made a mapped load of it 2.7x torch's own (which checks nothing)."""
    try:
        from deflate import crc32
    except ImportError:
        return zlib.crc32
    return crc32


CRC32 = _crc32()


def crc_of(tensor: torch.Tensor, crc: int = 0) -> int:
    """CRC-32 of a CPU tensor's bytes."""
    return CRC32(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()), crc)


def check_crc(path: object, name: str, expected: int, crc: int, what: str) -> None:
    """Raise :class:`CheckpointFormatError` when the CRC-32 ``crc`` of record ``name``'s bytes is not ``expected``."""
    if crc != expected:
        raise mismatch(path, name, expected, crc, what)
