"""Reading ``.safetensors`` files one tensor at a time, with no file mapping kept alive."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from lightning_lowmem.errors import CheckpointFormatError
from lightning_lowmem.formats.files import OpenedFile
from lightning_lowmem.formats.records import TensorRecord, row_span

_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsFile(OpenedFile):
    """A safetensors file, validated by the ``safetensors`` package, read with ``os.preadv``.

    Opening checks the header with ``safe_open`` (offsets that cover the file exactly,
    known dtypes). Each :meth:`read` then copies one tensor straight from the file
    into its tensor with ``preadv`` (no intermediate buffer): loading pythia-1b's bf16
    file took 0.66-0.76 s this way against 1.45-1.74 s through ``safe_open``'s own pread
    backend (same machine, alternating runs, page cache warm). No ``mmap`` is held, so a
    tensor kept after the load pins nothing and untouched pages never count in RSS.

    Args:
        path: the file.
        fd: a descriptor open on it for reading; the reader owns it from here (:meth:`close`).
    """

    def __init__(self, path: Path, fd: int) -> None:
        super().__init__(path, fd)
        try:
            with safe_open(str(path), framework="pt", device="cpu", backend="pread") as handle:
                self._records = {key: self._record(handle, key) for key in handle.keys()}
                self._metadata = dict(handle.metadata() or {})
        except CheckpointFormatError:
            raise
        except Exception as e:  # safetensors raises its own SafetensorError type
            raise CheckpointFormatError(
                f"{path} is not a readable safetensors file ({type(e).__name__}: {e}). It may be truncated or "
                "still downloading: compare its size with the source and download it again."
            ) from e
        self._offsets = self._read_offsets()

    def _read_offsets(self) -> dict[str, int]:
        """Absolute byte offset of each tensor's data (the header was validated by ``safe_open``)."""
        (size,) = struct.unpack("<Q", self.pread(8, 0))
        header = json.loads(self.pread(size, 8))
        return {key: 8 + size + entry["data_offsets"][0] for key, entry in header.items() if key != "__metadata__"}

    def _record(self, handle, key: str) -> TensorRecord:
        view = handle.get_slice(key)
        name = view.get_dtype()
        if name not in _DTYPES:
            raise CheckpointFormatError(
                f"{self.path}: tensor {key!r} has dtype {name}, which lightning_lowmem cannot load. "
                f"Supported: {', '.join(_DTYPES)}."
            )
        return TensorRecord(key=key, shape=tuple(view.get_shape()), dtype=_DTYPES[name], file=self.path)

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
        out = torch.empty(shape, dtype=self._records[key].dtype) if out is None else out
        try:
            self.read_into(out, self._offsets[key] + skip)
        except CheckpointFormatError as e:
            raise CheckpointFormatError(f"Tensor {key!r}: {e}") from e  # e names the file and the offset
        except OSError as e:
            raise CheckpointFormatError(
                f"{self.path}: could not read tensor {key!r} ({type(e).__name__}: {e}). "
                "The file may be truncated or corrupt: download or save it again."
            ) from e
        return out
