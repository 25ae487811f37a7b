"""bitsandbytes schemes: ``Linear4bit`` (nf4, fp4, with or without double quantization) and ``Linear8bitLt``.

The configs are frozen dataclasses; their transforms (:class:`Bnb4bitTransform`,
:class:`BnbInt8Transform`) swap each ``nn.Linear`` for bitsandbytes' own module, built on meta. When
its weight arrives it is quantized with the same ``bitsandbytes.functional``
call that ``Params4bit._quantize`` / ``Int8Params._quantize`` make on
``module.to(device)`` (the library's documented "load, then move" path), so the
result is the one bitsandbytes would give after a full load. The weight is
quantized a block of rows at a time (see ``rows.py``): same bytes, smaller
temporaries. bitsandbytes 0.50 quantizes and runs both on CPU (pure PyTorch
ops) as well as on CUDA.

Sizes, measured on CPU in a fresh process (bitsandbytes 0.50.2): quantizing one 512 Ki-element
bf16 block of rows holds 14.3 bytes per element in ``quantize_4bit`` and 15.0 in
``int8_vectorwise_quant`` (its float16 copy included); importing bitsandbytes costs 46.6 MiB,
its first 4-bit call 11.4 MiB, its first int8 call 6.5 MiB; a 4-bit layer's first forward on a
CPU with AVX512-bf16 repacks its weight (an int32 unpacked copy and byte copies: 7 bytes per
weight on pythia-1b). How their modules are saved and read back: ``bnb_layout.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from lightning_lowmem.memory.heap import trim_after_first_forward
from lightning_lowmem.quantize.rows import RowSource, map_rows
from lightning_lowmem.quantize.schemes import QuantScheme, Transform, register_scheme, register_transform

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""The block sizes bitsandbytes' 4-bit kernels take (weights per scale; the scales' own blocks too)."""
_MiB = 2**20


@dataclass(frozen=True)
class BnbScheme(QuantScheme):
    """Shared by the bitsandbytes schemes: the CUDA build check."""

    package: ClassVar[str] = "bitsandbytes"
    by_rows: ClassVar[bool] = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        reason = super().unavailable_reason(device)
        if reason is None and device.type == "cuda":
            from bitsandbytes.cextension import ErrorHandlerMockBNBNativeLibrary, lib

            if isinstance(lib, ErrorHandlerMockBNBNativeLibrary):
                reason = "bitsandbytes found no native CUDA library for this CUDA version"
        return reason


@dataclass(frozen=True)
class Bnb4bit(BnbScheme):
    """4-bit blockwise weights in ``bitsandbytes.nn.Linear4bit`` (QLoRA).

    Attributes:
        quant_type: ``"nf4"`` or ``"fp4"``.
        double_quant: also quantize the per-block scales (bitsandbytes' ``compress_statistics``).
        blocksize: weights per scale.
        quant_storage: dtype that holds the packed 4-bit pairs.
    """

    quant_type: str = "nf4"
    double_quant: bool = False
    blocksize: int = 64
    quant_storage: torch.dtype = torch.uint8
    transient: ClassVar[float] = 14.3
    library_bytes: ClassVar[int] = 58 * _MiB
    library_import_bytes: ClassVar[int] = 48 * _MiB  # measured: 46.1 MiB beside torch, litgpt and Lightning
    library_import_in_transformers: ClassVar[int] = 8 * _MiB  # measured: 37.6 MiB beside transformers' classes
    first_forward: ClassVar[float] = 7.0

    def __post_init__(self) -> None:
        if self.quant_type not in ("nf4", "fp4"):
            raise ValueError(f"quant_type must be 'nf4' or 'fp4', got {self.quant_type!r}.")
        if self.blocksize not in BLOCKSIZES:
            raise ValueError(f"blocksize must be one of {BLOCKSIZES}, got {self.blocksize!r}.")

    def stored_nbytes(self, shape: tuple[int, ...]) -> int:
        """Packed 4-bit pairs, the 16-value fp32 code table, and the scales: fp32 per block, or (double
        quantization) uint8 per block with an fp32 scale per 256 of them, an fp32 offset and their code."""
        return sum(self.stored_parts(shape))

    def stored_parts(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The packed data, the scales and the code table (and with double quantization the offset, the scales'
        scales and their code table): the tensors of a ``Params4bit`` and its ``quant_state``."""
        n = math.prod(shape)
        blocks = math.ceil(n / self.blocksize)
        if self.double_quant:
            return math.ceil(n / 2), blocks, 64, 4, 4 * math.ceil(blocks / 256), 1024
        return math.ceil(n / 2), 4 * blocks, 64

    def stack_reason(self, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
        return None if dtype.is_floating_point else f"its weight is {dtype}, not floating point"


@register_scheme("bnb.nf4")
@dataclass(frozen=True)
class BnbNF4(Bnb4bit):
    """4-bit NormalFloat weights."""


@register_scheme("bnb.nf4-dq")
@dataclass(frozen=True)
class BnbNF4DQ(Bnb4bit):
    """4-bit NormalFloat weights with quantized scales."""

    double_quant: bool = True


@register_scheme("bnb.fp4")
@dataclass(frozen=True)
class BnbFP4(Bnb4bit):
    """4-bit float weights."""

    quant_type: str = "fp4"
    transient: ClassVar[float] = 32.0  # measured: 30.6-31.6 bytes per element on CPU (nf4's: 13.5-15.9)


@register_scheme("bnb.fp4-dq")
@dataclass(frozen=True)
class BnbFP4DQ(Bnb4bit):
    """4-bit float weights with quantized scales."""

    quant_type: str = "fp4"
    double_quant: bool = True
    transient: ClassVar[float] = 32.0


@register_scheme("bnb.int8")
@dataclass(frozen=True)
class BnbInt8(BnbScheme):
    """LLM.int8(): row-wise int8 weights in ``bitsandbytes.nn.Linear8bitLt``.

    Attributes:
        threshold: activation outlier threshold of the mixed-precision decomposition
            (6.0 as in litgpt and transformers; 0.0 turns it off).
    """

    threshold: float = 6.0
    transient: ClassVar[float] = 15.0
    library_bytes: ClassVar[int] = 53 * _MiB
    library_import_bytes: ClassVar[int] = 48 * _MiB
    library_import_in_transformers: ClassVar[int] = 8 * _MiB

    def __post_init__(self) -> None:
        if self.threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold!r}.")

    def stored_nbytes(self, shape: tuple[int, ...]) -> int:
        """int8 codes and an fp32 scale per output row."""
        return sum(self.stored_parts(shape))

    def stored_parts(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return math.prod(shape), 4 * shape[0]


@register_transform(Bnb4bit)
class Bnb4bitTransform(Transform[Bnb4bit]):
    """A ``Linear4bit`` in the Linear's place; the weight quantized as ``Params4bit`` does on ``.to(device)``."""

    def replace(self, linear: nn.Linear, dtype: torch.dtype) -> nn.Module:
        from bitsandbytes.nn import Linear4bit

        s = self.scheme
        new = Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         compute_dtype=dtype, compress_statistics=s.double_quant, quant_type=s.quant_type,
                         quant_storage=s.quant_storage, device="meta")
        return _adopt(new, linear)

    def quantize(self, module: nn.Module, weight: torch.Tensor | RowSource) -> None:
        from bitsandbytes.nn import Params4bit

        s = self.scheme
        weight = weight if isinstance(weight, RowSource) else RowSource.of(weight)
        packed, state = self._quantize(weight)
        module.weight = Params4bit(packed, requires_grad=False, quant_state=state, blocksize=s.blocksize,
                                   compress_statistics=s.double_quant, quant_type=s.quant_type,
                                   quant_storage=s.quant_storage, module=module, bnb_quantized=True)
        module.quant_state = state

    def quantize_stack(self, module: nn.Module, name: str, weight: torch.Tensor | RowSource,
                       shape: tuple[int, ...]) -> None:
        """bitsandbytes' own way to quantize a parameter that is no Linear weight (``bitsandbytes.nn.parametrize``,
        made for MoE experts): the packed weight becomes the parameter, and a parametrization dequantizes it when
        the module reads it (once per forward of the module)."""
        from bitsandbytes.nn.parametrize import replace_parameter_4bit_prequantized

        packed, state = self._quantize(weight if isinstance(weight, RowSource) else RowSource.of(weight))
        state.shape = torch.Size(shape)
        module._parameters[name] = nn.Parameter(packed, requires_grad=False)
        replace_parameter_4bit_prequantized(module, name, state.as_dict(packed=True), packed.device)

    def _quantize(self, weight: RowSource) -> tuple[torch.Tensor, Any]:
        """What ``bitsandbytes.functional.quantize_4bit`` returns, computed a block of rows at a time."""
        import bitsandbytes.functional as F

        s = self.scheme
        if s.quant_storage != torch.uint8:  # packed pairs viewed as another dtype: quantize whole
            return F.quantize_4bit(weight.whole().contiguous(), blocksize=s.blocksize,
                                   compress_statistics=s.double_quant, quant_type=s.quant_type,
                                   quant_storage=s.quant_storage)

        def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            packed, state = F.quantize_4bit(rows, blocksize=s.blocksize, quant_type=s.quant_type)
            return packed, state.absmax

        n = weight.numel
        packed, absmax = map_rows(weight, quantize, lengths=((n + 1) // 2, -(-n // s.blocksize)), align=s.blocksize)
        # the rest as quantize_4bit does it, on the whole weight's scales
        common = dict(shape=torch.Size(weight.shape), dtype=weight.dtype, blocksize=s.blocksize,
                      quant_type=s.quant_type, code=F.get_4bit_type(s.quant_type, device=weight.device))
        if not s.double_quant:
            return packed, F.QuantState(absmax=absmax, **common)
        offset = absmax.mean()
        qabsmax, state2 = F.quantize_blockwise(absmax - offset, blocksize=256)
        return packed, F.QuantState(absmax=qabsmax, offset=offset, state2=state2, **common)


@register_transform(BnbInt8)
class BnbInt8Transform(Transform[BnbInt8]):
    """A ``Linear8bitLt`` in the Linear's place; the weight quantized as ``Int8Params`` does on ``.to(device)``."""

    def replace(self, linear: nn.Linear, dtype: torch.dtype) -> nn.Module:
        from bitsandbytes.nn import Linear8bitLt

        new = Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                           has_fp16_weights=False, threshold=self.scheme.threshold, device="meta")
        return _adopt(new, linear)

    def quantize(self, module: nn.Module, weight: torch.Tensor | RowSource) -> None:
        import bitsandbytes.functional as F
        from bitsandbytes.nn import Int8Params

        def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            qrows, scales, _ = F.int8_vectorwise_quant(rows.to(torch.float16))  # as Int8Params._quantize
            return qrows, scales

        qweight, scales = map_rows(weight, quantize, lengths=(weight.shape[0], weight.shape[0]))
        module.weight = Int8Params(qweight, requires_grad=False, has_fp16_weights=False, CB=qweight, SCB=scales)


def trim_bnb_after_first_forward(model: nn.Module) -> None:
    """:func:`~lightning_lowmem.memory.heap.trim_after_first_forward` for ``model`` and every bitsandbytes module in it,
    wherever they were quantized (bitsandbytes 4-bit layers repack their weight in their first CPU forward)."""
    for module in model.modules():
        if type(module).__module__.startswith("bitsandbytes"):
            trim_after_first_forward(module)


def _adopt(new: nn.Module, old: nn.Linear) -> nn.Module:
    """Give ``new`` the bias Parameter (meta or real) and training mode of ``old``."""
    if old.bias is not None:
        new.bias = old.bias
    new.train(old.training)
    return new
