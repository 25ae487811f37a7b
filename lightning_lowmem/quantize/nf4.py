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
shard's rows only (``NF4Tensor.convert_to_norm_float_weight``). On pythia-1b's 8192 x 2048 MLP
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
    blocks = numel // block_size
    return math.ceil(numel / 2) + blocks + itemsize * (blocks // scaler_block_size) + itemsize + 16 * itemsize
