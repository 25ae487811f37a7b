"""tensor_nbytes: the bytes a quantized tensor really holds, not the size its outer tensor claims."""

from __future__ import annotations

import torch
from torch import nn

from lightning_lowmem.quantize import tensor_nbytes


def test_tensor_nbytes_counts_quantized_storage(quantize_after_load):
    import torchao.quantization as torchao_q

    linear = nn.Linear(256, 64, bias=False).to(torch.bfloat16)
    torchao_q.quantize_(linear, torchao_q.Int8WeightOnlyConfig())
    # int8 data + float32 scale + int8 zero point per row; the outer storage would claim bf16 size
    assert tensor_nbytes(linear.weight) == 64 * 256 + 64 * 4 + 64
    module = quantize_after_load(nn.Sequential(nn.Linear(256, 64, bias=False).to(torch.bfloat16)), "bnb.nf4",
                                 skip=())[0]
    # 4-bit pairs + one float32 absmax per 64 weights + the 16-entry float32 code table
    assert tensor_nbytes(module.weight) == 64 * 256 // 2 + 64 * 256 // 64 * 4 + 16 * 4
