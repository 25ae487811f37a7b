"""Reading torch zip files (``torch.save``: ``.pt``, ``.pth``, ``.bin``, ``.ckpt``) one tensor at a time.

The pickle inside is loaded with ``weights_only=True`` under a ``FakeTensorMode``:
torch then builds every tensor without reading its data and records where its
storage starts in the file (``untyped_storage()._checkpoint_offset``). Each
tensor is later read on its own with ``os.preadv`` straight into the memory
that becomes the parameter, so nothing maps the file and no page of it stays
resident after the load. The file's other entries (a Lightning or Fabric
checkpoint's optimizer state, counters) come from the same pickle, their
tensors read the same way (:meth:`TorchZipFile.other_entries`): the weights are
never read for them.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_lowmem.errors import CheckpointFormatError, UnsafeCheckpointError
from lightning_lowmem.formats.records import TensorRecord, read_exactly, row_span

ZIP_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class _Location:
    offset: int  # byte offset of the storage in the file
    storage_nbytes: int
    storage_offset: int  # in elements
    stride: tuple[int, ...]
    contiguous: bool


def _unsafe_reason(message: str) -> str:
    """The line of torch's weights-only error that names the global it refused."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported global" in line]
    return (named or lines or ["(no detail)"])[0]


def _unwrap(obj: Any, path: Path) -> tuple[Mapping[str, Any], str]:
    """The state dict inside a loaded checkpoint, and where it was found."""
    if isinstance(obj, Mapping):
        for entry in ("state_dict", "model"):  # Lightning Trainer, then Fabric
            inner = obj.get(entry)
            if isinstance(inner, Mapping) and any(isinstance(v, torch.Tensor) for v in inner.values()):
                return inner, entry
        if any(isinstance(v, torch.Tensor) for v in obj.values()):
            return obj, ""
    raise CheckpointFormatError(
        f"{path} holds a {type(obj).__name__} with no tensors at its top level nor under 'state_dict' "
        "(Lightning) or 'model' (Fabric). Save the model's state_dict() and load that file."
    )


class TorchZipFile:
    """A ``torch.save`` zip archive, planned from its pickle and read tensor by tensor."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.entry = ""
        self._fd = fd
        with open(fd, "rb", closefd=False) as f:  # the same descriptor: no second open of the file
            if f.read(4) != ZIP_MAGIC:
                raise CheckpointFormatError(
                    f"{path} is not a torch zip archive; it may use torch's legacy format "
                    "(_use_new_zipfile_serialization=False). Load it once with torch.load and save it again "
                    "with torch.save (or safetensors.torch.save_file)."
                )
            self._check_byteorder(f)
            self._checkpoint = self._load_fake(f)
        size = os.fstat(fd).st_size
        self._records: dict[str, TensorRecord] = {}
        self._locations: dict[str, _Location] = {}
        for key, value in self._state.items():
            if isinstance(value, torch.Tensor):
                self._records[key] = TensorRecord(key=key, shape=tuple(value.shape), dtype=value.dtype, file=path)
                self._locations[key] = self._locate(key, value, size)

    def _locate(self, key: str, value: torch.Tensor, size: int) -> _Location:
        storage = value.untyped_storage()
        loc = _Location(offset=storage._checkpoint_offset, storage_nbytes=storage.nbytes(),
                        storage_offset=value.storage_offset(), stride=tuple(value.stride()),
                        contiguous=value.is_contiguous())
        if loc.offset + loc.storage_nbytes > size:
            raise CheckpointFormatError(
                f"{self.path}: tensor {key!r} needs bytes {loc.offset}..{loc.offset + loc.storage_nbytes}, "
                f"but the file has {size}. The file is truncated: download or save it again."
            )
        return loc

    def _check_byteorder(self, f: BinaryIO) -> None:
        try:
            with zipfile.ZipFile(f) as z:
                names = [n for n in z.namelist() if n.endswith("/byteorder")]
                order = z.read(names[0]).decode() if names else "little"
        except zipfile.BadZipFile as e:
            raise CheckpointFormatError(
                f"{self.path} is a damaged zip archive ({e}); it is most likely truncated. "
                "Download or save it again."
            ) from e
        if order != "little":
            raise CheckpointFormatError(f"{self.path} was saved on a {order}-endian machine; re-save it on this one.")

    def _load_fake(self, f: BinaryIO) -> Any:
        """The whole pickled object, every tensor a fake one; sets :attr:`entry` and the state dict."""
        try:
            # A file object, not the path: torch >= 2.13 hands any path ending in .safetensors to
            # safetensors, and we go by content, not by name.
            f.seek(0)
            with FakeTensorMode(allow_non_fake_inputs=True):
                obj = torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"{self.path} asks to run code when unpickled, and lightning_lowmem only loads data "
                f"(weights_only=True). torch said: {_unsafe_reason(str(e))} "
                "If you trust the file, allow the class with torch.serialization.add_safe_globals([...]); "
                "better, save its state_dict() with safetensors.torch.save_file."
            ) from e
        except RuntimeError as e:
            raise CheckpointFormatError(
                f"{self.path} could not be read as a torch zip archive ({e}). It may be truncated: "
                "download or save it again."
            ) from e
        self._state, self.entry = _unwrap(obj, self.path)
        return obj

    def records(self) -> dict[str, TensorRecord]:
        return self._records

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        rec = self._records[key]
        return self._read_at(self._locations[key], rec.shape, rec.dtype, out)

    def _read_at(self, loc: _Location, shape: tuple[int, ...], dtype: torch.dtype,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if loc.contiguous:
            out = torch.empty(shape, dtype=dtype) if out is None else out
            if out.numel():
                read_exactly(self._fd, out, loc.offset + loc.storage_offset * dtype.itemsize, self.path)
            return out
        # A strided view (rare in checkpoints): read its whole storage, then copy the view out.
        whole = torch.empty(loc.storage_nbytes // dtype.itemsize, dtype=dtype)
        read_exactly(self._fd, whole, loc.offset, self.path)
        return whole.as_strided(shape, loc.stride, loc.storage_offset).clone()

    def other_entries(self) -> dict[str, Any]:
        """The checkpoint's top-level entries other than the weights' (:attr:`entry`), tensors read for real.

        Empty for a bare state dict. The weights are not read.
        """
        if not self.entry:
            return {}
        size = os.fstat(self._fd).st_size

        def real(value: torch.Tensor) -> torch.Tensor:
            return self._read_at(self._locate("(an entry beside the weights)", value, size),
                                 tuple(value.shape), value.dtype)

        return {name: apply_to_collection(value, torch.Tensor, real)
                for name, value in self._checkpoint.items() if name != self.entry}

    def reads_rows(self, key: str) -> bool:
        return self._locations[key].contiguous and len(self._records[key].shape) >= 1

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        rec, loc = self._records[key], self._locations[key]
        if not loc.contiguous:
            raise ValueError(f"{self.path}: {key!r} is a strided view; read it whole with read().")
        skip, shape = row_span(rec, start, stop)
        out = torch.empty(shape, dtype=rec.dtype) if out is None else out
        if out.numel():
            read_exactly(self._fd, out, loc.offset + loc.storage_offset * rec.dtype.itemsize + skip, self.path)
        return out

    def close(self) -> None:
        os.close(self._fd)
