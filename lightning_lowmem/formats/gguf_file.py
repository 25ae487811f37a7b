"""Reading ``.gguf`` files (llama.cpp's format) one tensor at a time; block-quantized tensors dequantized as read.

The header is parsed in one bounded walk (``gguf_header.py``, which says why not with gguf's
``GGUFReader``); nothing is mapped, and every tensor is then read on its own with ``os.preadv``
from the offset the header gives. The ``gguf`` package supplies the types, their block sizes and the
dequantization (``gguf.quants.dequantize``).

What a record says (``TensorRecord``):

* ``shape``: the logical shape, in torch's order (ggml lists dimensions innermost first);
* ``dtype``: ``F32``, ``F16``, ``BF16``, ``F64`` and ``I8``-``I64`` tensors are read as they are
  stored; a tensor in a block format (``Q8_0``, ``Q4_0``, ``Q4_K``, ...) is read as float32, the dtype
  gguf's ``dequantize`` gives;
* ``nbytes``: the bytes the file stores, which is what a load reads (``tensor_nbytes``: once dequantized).

A block-quantized tensor is dequantized a block of rows at a time (:data:`DEQUANTIZE_ELEMENTS`),
straight into the float32 tensor it becomes, so dequantizing holds the tensor plus a few MiB.
Each row of such a tensor is a whole number of blocks, so a block of rows is read on its own
(:meth:`GGUFFile.read_rows`): a load that quantizes it again (``quantize="bnb.nf4"``) never holds it whole.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lightning_lowmem.errors import CheckpointFormatError, CheckpointReadError
from lightning_lowmem.formats.files import OpenedFile
from lightning_lowmem.formats.gguf_header import HeaderLayout, TensorInfo, import_gguf, walk_header
from lightning_lowmem.formats.records import TensorRecord, row_span

PLAIN_TYPES: dict[str, torch.dtype] = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
}
"""ggml types read as they are stored; every other type is dequantized to float32."""
DEQUANTIZE_ELEMENTS = 1 << 18
"""Elements dequantized at once (1 MiB of float32). gguf 0.19's dequantizers on 4096-wide rows, 2 cores: blocks of
64 Ki / 256 Ki / 1 Mi elements ran Q8_0 at 453 / 1041 / 154 M elements/s, Q4_0 at 278 / 283 / 255, Q4_K at
230 / 241 / 182, Q6_K at 228 / 241 / 69 (larger blocks leave the cache and take fresh pages)."""
DEQUANTIZE_WORKSPACE = 4 * 2**20
"""Bytes a block of :data:`DEQUANTIZE_ELEMENTS` holds while it is dequantized: gguf's result and temporaries peaked
at 2.3-2.6 MiB (tracemalloc; Q8_0, Q4_0, Q4_K, Q6_K), plus the block as stored (under 1 MiB)."""


class GGUFFile(OpenedFile):
    """A GGUF file: its header parsed in one bounded walk, its tensors read with ``os.preadv``.

    Example::

        >>> import tempfile, numpy as np, gguf
        >>> path = tempfile.mkdtemp() + "/tiny.gguf"
        >>> writer = gguf.GGUFWriter(path, "llama")
        >>> q8_0 = gguf.GGMLQuantizationType.Q8_0
        >>> writer.add_tensor("w", gguf.quants.quantize(np.full((2, 32), 127.0, np.float32), q8_0), raw_dtype=q8_0)
        >>> writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
        >>> from lightning_lowmem.formats import Checkpoint
        >>> with Checkpoint.open(path) as ckpt:
        ...     rec = ckpt.records["w"]
        ...     print(rec.shape, rec.dtype, rec.encoding, rec.nbytes, ckpt.read("w").sum().item())
        (2, 32) torch.float32 Q8_0 68 8128.0

    Attributes:
        layout: the header (version, alignment, where the data starts, tensors, fields).
        fields: the header's scalar fields (``general.architecture``, ``llama.block_count``, ...);
            its array fields (the vocabulary) are ``layout.arrays``, kept compact.

    Args:
        path: the file.
        fd: a descriptor open on it for reading; the reader owns it from here (:meth:`close`).
    """

    def __init__(self, path: Path, fd: int) -> None:
        super().__init__(path, fd)
        self.gguf = import_gguf()
        self.layout: HeaderLayout = walk_header(self)
        self.fields = self.layout.metadata
        if self.layout.split_count > 1:
            raise CheckpointFormatError(
                f"{path} is one of {self.layout.split_count} parts of a split GGUF model. Merge the parts into one "
                "file first (llama.cpp: llama-gguf-split --merge <first part> <merged.gguf>) and load that.")
        self._infos: dict[str, TensorInfo] = {t.name: t for t in self.layout.tensors}
        self._records = {t.name: self._record(t) for t in self.layout.tensors}

    def _record(self, info: TensorInfo) -> TensorRecord:
        shape = tuple(reversed(info.dims))
        if info.type_name in PLAIN_TYPES:
            return TensorRecord(info.name, shape, PLAIN_TYPES[info.type_name], self.path)
        qtype = self.gguf.GGMLQuantizationType[info.type_name]
        try:  # gguf's own dequantizer, on one block of zeros: a type it cannot dequantize fails here, before any read
            self.gguf.quants.dequantize(np.zeros((1, self.gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
        except NotImplementedError as e:
            raise CheckpointFormatError(
                f"{self.path}: tensor {info.name!r} is stored as {info.type_name}, which the installed gguf package "
                f"({getattr(self.gguf, '__version__', 'unknown version')}) cannot dequantize. Upgrade gguf "
                "(pip install -U gguf), or use a file quantized to another type (Q8_0, Q4_K, ...).") from e
        return TensorRecord(info.name, shape, torch.float32, self.path, info.type_name, info.nbytes)

    def header_spans(self) -> list[tuple[int, int]]:
        """Everything before the tensors' data: the header, its metadata and the tensor infos."""
        return [(0, self.layout.data_start)]

    def data_span(self) -> tuple[int, int]:
        """The tensors' bytes: GGUF keeps no checksum of them."""
        return self.layout.data_start, self.size

    def records(self) -> dict[str, TensorRecord]:
        return self._records

    def stored_types(self) -> dict[str, str]:
        """Each tensor's ggml type as the file stores it (``"Q4_1"``, ``"F16"``, ...), by key."""
        return {key: info.type_name for key, info in self._infos.items()}

    def metadata(self) -> dict[str, str]:
        """Nothing: a GGUF file's fields are not text beside the tensors (they are :attr:`fields`)."""
        return {}

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        rec = self._records[key]
        if not rec.shape:  # a 0-d tensor: one element, stored plainly
            return self._read_rows(key, 0, 1, None if out is None else out.reshape(1)).reshape(())
        return self._read_rows(key, 0, rec.shape[0], out)

    def map(self, key: str) -> torch.Tensor | None:
        """Tensor ``key`` over the file's mapped pages (see :meth:`OpenedFile.mapped_view`); None for a
        block-quantized tensor, which must be dequantized."""
        rec = self._records[key]
        if rec.encoding is not None:
            return None
        return self.mapped_view(self._infos[key].offset, rec.shape, rec.dtype)

    def reads_rows(self, key: str) -> bool:
        """Plain tensors by rows along dim 0; block-quantized ones when a row along dim 0 holds whole blocks (2-d+)."""
        rec = self._records[key]
        return len(rec.shape) >= (1 if rec.encoding is None else 2)

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._read_rows(key, start, stop, out)

    def _read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None) -> torch.Tensor:
        rec = self._records[key]
        skip, shape = row_span(rec, start, stop) if rec.shape else (0, (1,))
        out = torch.empty(shape, dtype=rec.dtype, device="cpu") if out is None else out
        offset = self._infos[key].offset + skip
        try:
            if rec.encoding is None:
                return self.read_into(out, offset)
            return self._dequantize(rec, offset, out)
        except CheckpointFormatError as e:
            raise CheckpointFormatError(f"Tensor {key!r}: {e}") from e  # e names the file and the offset
        except CheckpointReadError as e:  # the system's error (EIO, EACCES), already ours
            raise CheckpointReadError(e.errno, f"Tensor {key!r}: {e.strerror}") from e
        except (OSError, ValueError) as e:
            raise CheckpointFormatError(
                f"{self.path}: could not read tensor {key!r} ({rec.encoding or rec.dtype}, {type(e).__name__}: {e}). "
                "The file may be truncated or corrupt: download or convert it again.") from e

    def _dequantize(self, rec: TensorRecord, offset: int, out: torch.Tensor) -> torch.Tensor:
        """``out`` (float32) filled from the block-quantized bytes at ``offset``, a block of ggml rows at a time."""
        qtype = self.gguf.GGMLQuantizationType[rec.encoding]
        cols = rec.shape[-1]  # a ggml row: ne[0] elements, a whole number of blocks
        rows = out.numel() // cols if cols else 0
        row_bytes = rec.nbytes // (rec.numel // cols) if rows else 0
        flat = out.detach().view(rows, cols).numpy()  # numpy's copy: torch's copy_ took 8x longer on 2 busy cores
        per = max(1, DEQUANTIZE_ELEMENTS // max(cols, 1))
        raw = torch.empty(min(per, rows) * row_bytes, dtype=torch.uint8, device="cpu")
        for first in range(0, rows, per):
            n = min(per, rows - first)
            block = self.read_into(raw[:n * row_bytes], offset + first * row_bytes)
            flat[first:first + n] = self.gguf.quants.dequantize(block.numpy().reshape(n, row_bytes), qtype)
        return out
