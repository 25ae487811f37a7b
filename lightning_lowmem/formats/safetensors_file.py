"""Reading ``.safetensors`` files one tensor at a time, with no file mapping kept alive."""

from __future__ import annotations

import struct
from pathlib import Path

import torch

from lightning_lowmem.errors import CheckpointFormatError, CheckpointReadError
from lightning_lowmem.formats.files import OpenedFile
from lightning_lowmem.formats.records import TensorRecord, row_span
from lightning_lowmem.formats.safetensors_header import read_header


class SafetensorsFile(OpenedFile):
    """A safetensors file: its header checked as the ``safetensors`` package checks it, its tensors read with
    ``os.preadv``, header and data through one descriptor.

    Each :meth:`read` copies one tensor straight from the file into its tensor with ``preadv``
    (no intermediate buffer): loading pythia-1b's bf16 file took 0.66-0.76 s this way against
    1.45-1.74 s through ``safe_open``'s own pread backend (same machine, alternating runs, page
    cache warm). No ``mmap`` is held, so a tensor kept after the load pins nothing and untouched
    pages never count in RSS. The header is read through the same descriptor as the data
    (``safetensors_header.py``): a file renamed over the path after the open is never half read.

    Args:
        path: the file.
        fd: a descriptor open on it for reading; the reader owns it from here (:meth:`close`).
    """

    def __init__(self, path: Path, fd: int) -> None:
        super().__init__(path, fd)
        self._records, self._offsets, self._metadata = read_header(self)

    def header_spans(self) -> list[tuple[int, int]]:
        """The size field and the JSON header."""
        (size,) = struct.unpack("<Q", self.pread(8, 0))
        return [(0, 8 + size)]

    def data_span(self) -> tuple[int, int]:
        """The tensors' bytes: safetensors keeps no checksum of them."""
        return self.header_spans()[0][1], self.size

    def records(self) -> dict[str, TensorRecord]:
        return self._records

    def metadata(self) -> dict[str, str]:
        """The header's ``__metadata__`` (str -> str, checked by ``safe_open``); empty when it has none."""
        return self._metadata

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        record = self._records[key]
        return self._read_at(key, 0, record.shape, out)

    def map(self, key: str) -> torch.Tensor | None:
        """Tensor ``key`` over the file's mapped pages, not read (see :meth:`OpenedFile.mapped_view`)."""
        rec = self._records[key]
        return self.mapped_view(self._offsets[key], rec.shape, rec.dtype)

    def reads_rows(self, key: str) -> bool:
        return len(self._records[key].shape) >= 1

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        skip, shape = row_span(self._records[key], start, stop)
        return self._read_at(key, skip, shape, out)

    def _read_at(self, key: str, skip: int, shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
        """``shape`` worth of tensor ``key``'s data, from ``skip`` bytes into it."""
        out = torch.empty(shape, dtype=self._records[key].dtype, device="cpu") if out is None else out
        try:
            self.read_into(out, self._offsets[key] + skip)
        except CheckpointFormatError as e:
            raise CheckpointFormatError(f"Tensor {key!r}: {e}") from e  # e names the file and the offset
        except CheckpointReadError as e:  # the system's error (EIO, EACCES), already ours
            raise CheckpointReadError(e.errno, f"Tensor {key!r}: {e.strerror}") from e
        except OSError as e:
            raise CheckpointFormatError(
                f"{self.path}: could not read tensor {key!r} ({type(e).__name__}: {e}). "
                "The file may be truncated or corrupt: download or save it again."
            ) from e
        return out
