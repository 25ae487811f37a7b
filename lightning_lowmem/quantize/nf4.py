"""torchao's ``NF4Tensor`` (QLoRA's 4-bit NormalFloat), made a block of rows at a time, whole or one row shard.

``torchao``'s ``to_nf4(weight)`` stores, for ``n`` elements: 4-bit codes (``n/2`` bytes), an int8
scale per 64-element block (``n/64``), a scale of those per 256 blocks and one mean over all of
them (the "double quantization"), and the 16-value code table. The mean is taken over the whole
weight, so a shard quantized on its own rows gets other numbers: each rank quantizes the whole
weight's scales and keeps its rows (torch.chunk's, which FSDP2 also cuts).

:func:`quantize_rows` gives the same tensor as ``torch.chunk(to_nf4(weight), count)[index]``, bit
for bit (the tests check it), with torchao's own functions applied to blocks of rows: the block
maxima of the whole weight a block at a time (``get_block_absmax``), their double quantization
(``NF4Tensor.double_quantize_scalers`` on the maxima, with blocks of one), then the codes of the
shard's rows only (``NF4Tensor.convert_to_norm_float_weight``).

:func:`quantize_own_rows` makes the same shard from the shard's rows alone. Everything but the mean is
computed block by block (a block's scale from its 64 weights, a scale of scales from 256 block scales,
which lie in one shard when a shard's weights are a multiple of 64 x 256), so the one number a rank
needs from the others is the sum of their block maxima: one float64 all-reduce per weight. The mean is
then made as ``Tensor.mean`` makes it (a float32 sum divided by the count, rounded to the weight's dtype).
The float64 sum is exact, so for bf16 and fp16 weights the mean, and the shard, equal ``to_nf4``'s bit for
bit unless torch's own float32 summation rounds across a bf16 step, which none of the tests' weights
(skewed on purpose, 4 shapes x 1, 2, 4 shards) showed. For float32 weights the mean can differ from
``to_nf4``'s in its last bit (torch's float32 sum is not exact), and with it the scales of scales. On pythia-1b's 8192 x 2048 MLP
weight (bf16, 32 MiB), ``to_nf4`` held 134-143 MiB above the weight and took 3.4 s; by blocks of
rows ... (see ``docs/many-ranks.md``).

:class:`NF4Linear` holds such a weight: ``F.linear`` dequantizes it to the input's dtype
(torchao's ``linear_nf4``: 16.5 bytes per weight element held during each forward on CPU), and a
dtype conversion of the module (``model.to(torch.bfloat16)``, a precision plugin's
``convert_module``) leaves it 4-bit where ``NF4Tensor.to(dtype)`` would dequantize it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from lightning_lowmem.meta import empty_like
from lightning_lowmem.quantize.rows import map_rows


CODE_BLOCK = 1 << 17
"""Elements whose codes are computed at once: torchao compares each with the 16 code values in the weight's dtype
(two ``(n, 16)`` temporaries: 8 MiB for bf16 blocks of 128 Ki elements, 32 MiB at 512 Ki)."""

CODE_WORKSPACE = 128
"""Bytes per element of a block of codes counted for quantizing one weight (the block's two ``(n, 16)`` temporaries,
the block maxima's pass and the heap they leave). Measured with bf16 weights (:func:`quantize_rows` in a fresh
process, the peak above the start less the result, 4 runs each of 0.9, 4.2 and 16.8 M elements): 7.5-15.7 MiB
from run to run, 60-125 bytes per element of a block."""


@functools.cache
def nf4_module() -> ModuleType:
    """torchao's module that defines ``NF4Tensor`` (moved in torchao 0.15)."""
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:  # torchao < 0.15
        from torchao.dtypes import nf4tensor as nf4_tensor
    return nf4_tensor


def is_nf4(tensor: object) -> bool:
    """Whether ``tensor`` is an ``NF4Tensor``, or a DTensor whose local shard is one."""
    local = getattr(tensor, "_local_tensor", tensor)
    return isinstance(local, nf4_module().NF4Tensor)


def meta_nf4(shape: tuple[int, int], dtype: torch.dtype, block_size: int, scaler_block_size: int) -> torch.Tensor:
    """An ``NF4Tensor`` of ``shape`` on the meta device (no memory): what ``to_nf4`` makes of such a weight."""
    return nf4_module().to_nf4(torch.empty(shape, dtype=dtype, device="meta"), block_size, scaler_block_size)


def quantize_rows(weight: torch.Tensor, index: int, count: int, block_size: int,
                  scaler_block_size: int) -> torch.Tensor:
    """``torch.chunk(to_nf4(weight, block_size, scaler_block_size), count)[index]``, with temporaries the size
    of a block of rows; codes are computed for the shard's rows only.

    ``weight`` is 2-D and contiguous; its rows must split evenly into ``count`` shards, and its element count be
    a multiple of ``block_size * scaler_block_size * count`` (see ``TorchaoNF4.shard_reason``).
    """
    nf4 = nf4_module()
    rows, cols = weight.shape
    n_blocks = rows * cols // block_size
    absmax, = map_rows(weight, lambda b: [nf4.get_block_absmax(b.reshape(-1), block_size)], n_blocks, block_size)
    # the blocks' maxima are >= 0: blocks of one element give them back as they are, so this is the
    # double quantization to_nf4 does over the whole weight
    scalers, factor, mean = nf4.NF4Tensor.double_quantize_scalers(absmax, 1, scaler_block_size)
    del absmax
    table = _code_table(weight.dtype, weight.device)
    local_rows = rows // count
    start = index * local_rows
    codes, = map_rows(weight[start:start + local_rows], lambda b: [nf4.NF4Tensor.convert_to_norm_float_weight(
        b, b.numel() // block_size, block_size, table)], local_rows * cols // 2, block_size, CODE_BLOCK)
    scalers, factor = (t.chunk(count)[index].clone() for t in (scalers, factor))
    args = nf4.SubclassTensorArgs(torch.Size((local_rows, cols)), (cols, 1), 0, weight.dtype, weight.device, False)
    return nf4.NF4Tensor(args, block_size, n_blocks, scaler_block_size, scalers, factor, mean, codes, table)


def quantize_own_rows(rows: torch.Tensor, whole_rows: int, block_size: int, scaler_block_size: int,
                      sum_across: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """This rank's shard of ``to_nf4(weight)`` (``torch.chunk``'s, as FSDP2 cuts it) from its own ``rows`` alone.

    Args:
        rows: this rank's rows of the weight (2-D, contiguous, in the dtype quantized); their element count a
            multiple of ``block_size * scaler_block_size`` (``TorchaoNF4.shard_reason``).
        whole_rows: the whole weight's row count.
        block_size, scaler_block_size: as ``to_nf4``'s.
        sum_across: the sum of a float64 scalar over every rank holding a shard of this weight (an all-reduce);
            called once.

    Example::

        >>> weight = torch.randn(256, 128).to(torch.bfloat16)
        >>> whole = nf4_module().to_nf4(weight)
        >>> alone = quantize_own_rows(weight, 256, 64, 256, lambda total: total)  # one rank: all the rows
        >>> torch.equal(alone.quantized_data, whole.quantized_data), torch.equal(alone.scaler_mean, whole.scaler_mean)
        (True, True)
    """
    nf4 = nf4_module()
    local_rows, cols = rows.shape
    n_blocks = whole_rows * cols // block_size
    absmax, = map_rows(rows, lambda b: [nf4.get_block_absmax(b.reshape(-1), block_size)],
                       local_rows * cols // block_size, block_size)
    total = sum_across(absmax.sum(dtype=torch.float64))  # exact: block maxima have 8 to 24 significant bits
    mean = (total.to(torch.float32) / n_blocks).to(rows.dtype)  # as Tensor.mean: float32 sum / count, rounded once
    scalers, factor = _double_quantize(absmax, mean.to(absmax.device), scaler_block_size)
    del absmax
    table = _code_table(rows.dtype, rows.device)
    codes, = map_rows(rows, lambda b: [nf4.NF4Tensor.convert_to_norm_float_weight(
        b, b.numel() // block_size, block_size, table)], local_rows * cols // 2, block_size, CODE_BLOCK)
    args = nf4.SubclassTensorArgs(torch.Size((local_rows, cols)), (cols, 1), 0, rows.dtype, rows.device, False)
    return nf4.NF4Tensor(args, block_size, n_blocks, scaler_block_size, scalers, factor, mean, codes, table)


def _double_quantize(absmax: torch.Tensor, mean: torch.Tensor,
                     scaler_block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``NF4Tensor.double_quantize_scalers`` after its mean, given the mean: int8 scales and each block of
    ``scaler_block_size`` scales' factor, computed as torchao computes them (torchao takes the mean itself)."""
    centered = absmax - mean
    n_scaler_blocks = centered.numel() // scaler_block_size
    blocks = centered.view(n_scaler_blocks, scaler_block_size)
    scaler_absmax = nf4_module().get_block_absmax(centered, scaler_block_size)
    factor = 256 / (2 * scaler_absmax.unsqueeze(-1).expand(n_scaler_blocks, scaler_block_size))
    quantized = (blocks * factor).round().clamp(-128, 127)
    return quantized.flatten().to(torch.int8), factor[:, 0].contiguous()


def _code_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 16 NF4 values, as ``to_nf4`` makes them (of a small tensor, so the table is torchao's own)."""
    return nf4_module().to_nf4(torch.zeros(64 * 256, dtype=dtype, device=device), 64, 256).nf4


class NF4Linear(nn.Linear):
    """An ``nn.Linear`` whose frozen weight is a torchao ``NF4Tensor`` (or a DTensor shard of one).

    Converting the module's dtype leaves the weight 4-bit (the forward dequantizes it to the input's
    dtype); moving the module moves it.
    """

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        params = self._parameters
        weight = params.get("weight")
        if weight is None:
            return super()._apply(fn, recurse)
        self._parameters = {k: v for k, v in params.items() if k != "weight"}
        try:
            super()._apply(fn, recurse)
        finally:
            rest, self._parameters = self._parameters, params
            params.update(rest)
        where = fn(torch.empty(0, dtype=weight.dtype, device=weight.device)).device
        if where != weight.device:
            moved = empty_like(weight, where) if weight.is_meta else weight.to(where)
            torch.utils.swap_tensors(weight, nn.Parameter(moved, requires_grad=False))
        return self

    @classmethod
    def on_meta(cls, linear: nn.Linear, dtype: torch.dtype, block_size: int, scaler_block_size: int) -> NF4Linear:
        """An ``NF4Linear`` in ``linear``'s place: its bias and training mode, an NF4 weight on meta."""
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta", dtype=dtype)
        new.weight = nn.Parameter(meta_nf4((linear.out_features, linear.in_features), dtype, block_size,
                                           scaler_block_size), requires_grad=False)
        new.bias = linear.bias
        new.train(linear.training)
        return new


def nf4_nbytes(numel: int, block_size: int, scaler_block_size: int, itemsize: int = 2) -> int:
    """Bytes of an ``NF4Tensor`` of ``numel`` elements (``itemsize``: bytes of the weight's dtype, bf16: 2).

    Example::

        >>> nf4_nbytes(8192 * 2048, 64, 256)  # codes, int8 scales, bf16 scales of scales, mean, table
        8652834
    """
    return sum(nf4_parts(numel, block_size, scaler_block_size, itemsize))


def nf4_parts(numel: int, block_size: int, scaler_block_size: int, itemsize: int = 2) -> tuple[int, ...]:
    """Bytes of each inner tensor of an ``NF4Tensor`` of ``numel`` elements: the 4-bit codes, an int8 scale per
    block, a scale per ``scaler_block_size`` scales, the scales' mean and the 16-value code table."""
    blocks = numel // block_size
    return math.ceil(numel / 2), blocks, itemsize * (blocks // scaler_block_size), itemsize, 16 * itemsize
