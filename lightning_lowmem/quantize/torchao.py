"""torchao schemes: ``quantize_`` applied to each ``nn.Linear`` alone, the moment its weight arrives.

torchao keeps ``nn.Linear`` and swaps its weight for a quantized tensor subclass,
so nothing is replaced before the load: the full-precision weight is put into
the Linear and ``torchao.quantization.quantize_`` is called on that one module,
with the same config object a user would pass after a full load.

The int8 schemes (one scale per output row) are applied to blocks of rows, each read from
the file on its own, as the bitsandbytes ones are: ``quantize_`` runs on a Linear holding
the block, and the pieces are joined into the tensor ``quantize_`` makes of the whole
weight (the tests check it bit for bit). On pythia-1b (int8wo, bf16 safetensors, two runs
each) the load peaked at the final model + 97-109 MiB and took 8.2-8.7 s by blocks of 512 Ki
elements, + 156 MiB and 10.4-11.7 s whole (blocks of 2 Mi: + 134-172 MiB, 9.1-9.2 s).

``torchao.int4wo`` uses torchao's ``Int4WeightOnlyConfig``: on CUDA with the
``tile_packed_to_4d`` layout (the tinygemm kernel shipped in PyTorch, compute
capability >= 8.0), elsewhere with the ``plain`` layout, whose kernels come from
the separate ``mslk`` package (torchao 0.18).

Sizes, measured on CPU in a fresh process (torchao 0.18): ``quantize_`` on one 512 Ki-element
bf16 block holds 11-12 bytes per element (int8wo, int8dq); importing torchao costs 11.8 MiB and
its first call 13.6 MiB. int4's transient (7 bytes per element of the whole weight) is not
measured here (no CPU kernel).

``torchao.nf4`` is QLoRA's NF4 in torchao's ``NF4Tensor``, the one quantized tensor that composes with
FSDP2 (``fully_shard``): each Linear becomes an ``NF4Linear`` (see ``nf4.py``), built on meta before the
model is sharded; each rank reads and quantizes only its rows, the mean of the whole weight's block
scales agreed across the ranks (``nf4.quantize_own_rows``). Quantizing pythia-1b's
8192 x 2048 weight by blocks of rows held 42-72 MiB above the bf16 weight (torchao's ``to_nf4`` on
the whole weight: 134-143 MiB); its forward holds 16.5 bytes per weight element (a dequantized copy
made through int64 codes).

The configs are frozen dataclasses; :class:`TorchaoTransform` and :class:`TorchaoNF4Transform` are their
transforms. How int8 weights are saved and read back: ``torchao_layout.py``.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from lightning_lowmem.quantize.nf4 import (CODE_BLOCK, CODE_WORKSPACE, NF4Linear, nf4_parts, quantize_own_rows,
                                            quantize_rows)
from lightning_lowmem.quantize.rows import RowSource, map_rows
from lightning_lowmem.quantize.schemes import QuantScheme, Transform, register_scheme, register_transform


@dataclass(frozen=True)
class TorchaoScheme(QuantScheme):
    """Shared by the torchao schemes applied with ``quantize_``: each names the torchao config it stands for."""

    package: ClassVar[str] = "torchao"
    transient: ClassVar[float] = 12.0
    library_bytes: ClassVar[int] = 25 * 2**20
    library_import_bytes: ClassVar[int] = 13 * 2**20  # measured: 11.4-11.8 MiB
    forward_heap: ClassVar[int] = 8 * 2**20  # measured: generate() peaked 0.1 MiB (pythia-410m) and, over 200 new
    # tokens, 3.6 MiB (SmolLM2's shapes) above an estimate without it

    def torchao_config(self, device: torch.device) -> Any:
        """The ``torchao.quantization`` config object for weights on ``device``."""
        raise NotImplementedError


@register_scheme("torchao.int8wo")
@dataclass(frozen=True)
class TorchaoInt8WeightOnly(TorchaoScheme):
    """int8 weights, one scale per output row; activations stay in full precision."""

    by_rows: ClassVar[bool] = True

    def stored_nbytes(self, shape: tuple[int, ...]) -> int:
        """int8 codes, and an fp32 scale and an int8 zero point per output row."""
        return sum(self.stored_parts(shape))

    def stored_parts(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return math.prod(shape), 4 * shape[0], shape[0]

    def torchao_config(self, device: torch.device) -> Any:
        from torchao.quantization import Int8WeightOnlyConfig

        return Int8WeightOnlyConfig()


@register_scheme("torchao.int8dq")
@dataclass(frozen=True)
class TorchaoInt8Dynamic(TorchaoScheme):
    """int8 weights (per row) and activations quantized to int8 per token at run time."""

    by_rows: ClassVar[bool] = True
    library_bytes: ClassVar[int] = 60 * 2**20  # measured: generate() peaked up to 34 MiB above int8wo's 25 MiB

    def stored_nbytes(self, shape: tuple[int, ...]) -> int:
        """int8 codes, and an fp32 scale and an int8 zero point per output row."""
        return sum(self.stored_parts(shape))

    def stored_parts(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return math.prod(shape), 4 * shape[0], shape[0]

    def torchao_config(self, device: torch.device) -> Any:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig

        return Int8DynamicActivationInt8WeightConfig()


@register_scheme("torchao.int4wo")
@dataclass(frozen=True)
class TorchaoInt4WeightOnly(TorchaoScheme):
    """int4 weights in groups of ``group_size`` along the input dimension (bf16 weights).

    Attributes:
        group_size: input features per scale; Linears whose ``in_features`` it does not
            divide stay in full precision.
    """

    group_size: int = 128
    mslk_min_version: ClassVar[str] = "1.0.0"
    transient: ClassVar[float] = 7.0

    def __post_init__(self) -> None:
        if self.group_size not in (32, 64, 128, 256):
            raise ValueError(f"group_size must be one of 32, 64, 128, 256, got {self.group_size!r}.")

    def stored_nbytes(self, shape: tuple[int, ...]) -> int:
        """Packed 4-bit pairs, and a bf16 scale and zero point per group (torchao's ``Int4WeightOnlyConfig``
        layout; not measured here: no CPU kernel)."""
        return sum(self.stored_parts(shape))

    def stored_parts(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        n = math.prod(shape)
        return math.ceil(n / 2), 2 * math.ceil(n / self.group_size), 2 * math.ceil(n / self.group_size)

    def unavailable_reason(self, device: torch.device) -> str | None:
        reason = super().unavailable_reason(device)
        if reason is not None:
            return reason
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            if major < 8:
                return (f"its tinygemm kernel needs CUDA compute capability >= 8.0, and {device} has "
                        f"{major}.{minor}")
            return None
        if importlib.util.find_spec("mslk") is None:
            return (f"torchao's Int4WeightOnlyConfig takes its {device.type} kernels from the package 'mslk' "
                    f"(>= {self.mslk_min_version}), which is not installed")
        return None

    def layer_reason(self, linear: nn.Linear, dtype: torch.dtype) -> str | None:
        if dtype != torch.bfloat16:
            return f"int4 weight-only needs bfloat16 weights, this one arrives as {dtype} (pass dtype=torch.bfloat16)"
        if linear.in_features % self.group_size:
            return f"in_features={linear.in_features} is not a multiple of group_size={self.group_size}"
        return None

    def torchao_config(self, device: torch.device) -> Any:
        from torchao.quantization import Int4WeightOnlyConfig
        from torchao.quantization.quantize_.workflows import Int4PackingFormat

        packing = Int4PackingFormat.TILE_PACKED_TO_4D if device.type == "cuda" else Int4PackingFormat.PLAIN
        return Int4WeightOnlyConfig(group_size=self.group_size, int4_packing_format=packing)


@register_scheme("torchao.nf4")
@dataclass(frozen=True)
class TorchaoNF4(QuantScheme):
    """QLoRA's 4-bit NormalFloat in torchao's ``NF4Tensor``: the scheme that shards under FSDP2.

    Each chosen Linear becomes an :class:`~lightning_lowmem.quantize.nf4.NF4Linear` (frozen, 4-bit weight;
    its forward dequantizes to the input's dtype). On one device the whole weight is quantized; under FSDP2
    each rank quantizes its own rows, the mean of the whole weight's block scales agreed across the ranks
    (:meth:`TorchaoNF4Transform.quantize_own_rows`), which gives the same numbers as quantizing on one device
    and sharding after (bf16 weights: bit for bit).

    Attributes:
        block_size: weights per int8 scale.
        scaler_block_size: int8 scales per scale of scales.
    """

    block_size: int = 64
    scaler_block_size: int = 256
    package: ClassVar[str] = "torchao"
    shardable: ClassVar[bool] = True
    shards_by_rows: ClassVar[bool] = True
    transient: ClassVar[float] = 4.5
    library_bytes: ClassVar[int] = 36 * 2**20  # measured: generate() on SmolLM2's shapes peaked 6.7 MiB above an
    # estimate counting 25 MiB here, in one of two runs 9 MiB apart
    library_import_bytes: ClassVar[int] = 13 * 2**20  # measured: 11.4-11.8 MiB
    first_forward: ClassVar[float] = 16.5
    forward_heap: ClassVar[int] = 8 * 2**20
    forward_heap_per_weight: ClassVar[float] = 16.5  # one more dequantized transient of the largest Linear kept until
    # the forward ends. Measured: generate() peaked 7-41 MiB (pythia-160m, its largest Linear's transient 37 MiB) and
    # 7-34 MiB (pythia-410m, 66 MiB) above an estimate without it, from run to run; nothing on SmolLM2's shapes

    def __post_init__(self) -> None:
        for name in ("block_size", "scaler_block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 1, got {value!r}.")

    def transient_nbytes(self, numel: int) -> int:
        """:attr:`transient` bytes per element, and never less than the workspace of one block of codes (``nf4.py``'s
        ``CODE_BLOCK`` elements, or the whole weight where it is smaller): ``CODE_WORKSPACE`` bytes per element."""
        return max(super().transient_nbytes(numel), min(numel, CODE_BLOCK) * CODE_WORKSPACE)

    def stored_nbytes(self, shape: tuple[int, ...]) -> int:
        """4-bit codes, an int8 scale per block, a bf16 scale per ``scaler_block_size`` scales, a bf16 mean and
        the 16-value bf16 code table (bf16 weights; fp32 ones store those three in fp32)."""
        return sum(self.stored_parts(shape))

    def stored_parts(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """An ``NF4Tensor``'s inner tensors (``nf4_parts``)."""
        return nf4_parts(math.prod(shape), self.block_size, self.scaler_block_size)

    def layer_reason(self, linear: nn.Linear, dtype: torch.dtype) -> str | None:
        reason = super().layer_reason(linear, dtype)
        unit = self.block_size * self.scaler_block_size
        if reason is None and linear.weight.numel() % unit:
            reason = (f"its {linear.weight.numel()} weights are not a multiple of block_size x scaler_block_size "
                      f"= {unit}, which torchao's NF4 needs")
        return reason

    def shard_reason(self, shape: tuple[int, ...], count: int) -> str | None:
        unit = self.block_size * self.scaler_block_size
        if shape[0] % count:
            return f"its {shape[0]} rows do not split evenly into {count} shards"
        if (math.prod(shape) // unit) % count:
            return f"its {math.prod(shape) // unit} blocks of {unit} weights do not split evenly into {count} shards"
        return None


@register_transform(TorchaoScheme)
class TorchaoTransform(Transform[TorchaoScheme]):
    """``quantize_`` with the scheme's torchao config, applied to the one Linear whose weight arrived; torchao
    keeps ``nn.Linear`` and swaps its weight for a tensor subclass, so nothing is replaced before the load.

    Schemes with :attr:`~QuantScheme.by_rows` (one scale per output row) apply it to blocks of rows and join
    the pieces into the tensor ``quantize_`` makes of the whole weight.
    """

    def quantize(self, module: nn.Module, weight: torch.Tensor | RowSource) -> None:
        from torchao.quantization import quantize_

        if self.scheme.by_rows:
            source = weight if isinstance(weight, RowSource) else RowSource.of(weight)
            module.weight = nn.Parameter(self._quantize_by_rows(source), requires_grad=False)
            return
        module.weight = nn.Parameter(weight.whole() if isinstance(weight, RowSource) else weight, requires_grad=False)
        quantize_(module, self.scheme.torchao_config(module.weight.device))

    def _quantize_by_rows(self, weight: RowSource) -> torch.Tensor:
        """The tensor subclass ``quantize_`` makes of the whole weight, made a block of rows at a time.

        Each block goes through ``quantize_`` on a Linear of its own; the block's inner tensors
        (``__tensor_flatten__``: int8 codes, per-row scales and zero points) are written into
        whole-weight ones, and the subclass is rebuilt around them with its own ``__tensor_unflatten__``.
        """
        from torchao.quantization import quantize_

        config = self.scheme.torchao_config(weight.device)
        made: dict[str, Any] = {}

        def quantize(rows: torch.Tensor) -> list[torch.Tensor]:
            with torch.device("meta"):
                block = nn.Linear(rows.shape[1], rows.shape[0], bias=False)
            block.weight = nn.Parameter(rows, requires_grad=False)
            quantize_(block, config)
            names, context = block.weight.__tensor_flatten__()
            made.update(cls=type(block.weight), names=names, context=context)
            return [getattr(block.weight, name) for name in names]

        inner = map_rows(weight, quantize, lengths=weight.shape[0])
        return made["cls"].__tensor_unflatten__(dict(zip(made["names"], inner, strict=True)), made["context"],
                                                torch.Size(weight.shape), (weight.shape[1], 1))


@register_transform(TorchaoNF4)
class TorchaoNF4Transform(Transform[TorchaoNF4]):
    """An :class:`~lightning_lowmem.quantize.nf4.NF4Linear` in the Linear's place, built on meta (before the model
    is sharded, under FSDP2); the whole weight quantized and a rank's rows kept (:meth:`quantize_shard`), or a
    rank's rows quantized alone (:meth:`quantize_own_rows`)."""

    def replace(self, linear: nn.Linear, dtype: torch.dtype) -> nn.Module:
        return NF4Linear.on_meta(linear, dtype, self.scheme.block_size, self.scheme.scaler_block_size)

    def built(self, module: nn.Module) -> bool:
        return isinstance(module, NF4Linear)

    def quantize(self, module: nn.Module, weight: torch.Tensor | RowSource) -> None:
        whole = weight.whole() if isinstance(weight, RowSource) else weight
        module.weight = nn.Parameter(self.quantize_shard(whole, 0, 1), requires_grad=False)

    def quantize_shard(self, weight: torch.Tensor, index: int, count: int) -> torch.Tensor:
        return quantize_rows(weight.contiguous(), index, count, self.scheme.block_size, self.scheme.scaler_block_size)

    def quantize_own_rows(self, rows: torch.Tensor, shape: tuple[int, ...],
                          sum_across: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return quantize_own_rows(rows.contiguous(), shape[0], self.scheme.block_size, self.scheme.scaler_block_size,
                                 sum_across)
