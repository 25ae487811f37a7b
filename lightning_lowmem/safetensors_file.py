"""Reading ``.safetensors`` files one tensor at a time, with no file mapping kept alive."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from lightning_lowmem.errors import CheckpointFormatError
from lightning_lowmem.records import TensorRecord

_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsFile:
    """A safetensors file opened with the ``pread`` backend.

    Each :meth:`read` copies one tensor out of the file with ``pread`` into fresh
    memory; no ``mmap`` is held, so a tensor kept after the load pins nothing
    and untouched pages are never counted in this process's RSS.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._handle = safe_open(str(path), framework="pt", device="cpu", backend="pread")
            self._handle.__enter__()
            self._records = {key: self._record(key) for key in self._handle.keys()}
        except CheckpointFormatError:
            raise
        except Exception as e:  # safetensors raises its own SafetensorError type
            raise CheckpointFormatError(
                f"{path} is not a readable safetensors file ({type(e).__name__}: {e}). It may be truncated or "
                "still downloading: compare its size with the source and download it again."
            ) from e

    def _record(self, key: str) -> TensorRecord:
        view = self._handle.get_slice(key)
        name = view.get_dtype()
        if name not in _DTYPES:
            raise CheckpointFormatError(
                f"{self.path}: tensor {key!r} has dtype {name}, which lightning_lowmem cannot load. "
                f"Supported: {', '.join(_DTYPES)}."
            )
        return TensorRecord(key=key, shape=tuple(view.get_shape()), dtype=_DTYPES[name], file=self.path)

    def records(self) -> dict[str, TensorRecord]:
        return self._records

    def read(self, key: str) -> torch.Tensor:
        try:
            return self._handle.get_tensor(key)
        except Exception as e:
            raise CheckpointFormatError(
                f"{self.path}: could not read tensor {key!r} ({type(e).__name__}: {e}). "
                "The file may be truncated or corrupt: download or save it again."
            ) from e

    def close(self) -> None:
        self._handle.__exit__(None, None, None)
