"""Quantize on load: every scheme that runs here equals the same library's quantize-after-full-load.

The reference for each scheme is the library's own documented path (the ``quantize_after_load`` fixture):
load the whole bf16 model, then bitsandbytes' "swap in Linear4bit / Linear8bitLt and call ``.to(device)``"
or torchao's ``quantize_(model, config)``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_lowmem.quantize.rows as rows
from lightning_lowmem.quantize import SCHEMES, module_nbytes, schemes_available_on

ON_CPU = schemes_available_on(torch.device("cpu"))


def _with_chunks() -> list:
    """Every scheme whole; those that quantize in blocks of rows also in blocks of 7 rows."""
    params = []
    for scheme in ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8",
                   "torchao.int8wo", "torchao.int8dq", "torchao.int4wo"]:
        marks = [] if scheme in ON_CPU else [pytest.mark.skip(reason=f"{scheme} has no kernel on CPU here")]
        params.append(pytest.param(scheme, None, id=f"{scheme}-whole", marks=marks))
        if SCHEMES[scheme].by_rows:
            params.append(pytest.param(scheme, 1000, id=f"{scheme}-chunked", marks=marks))
    return params


@pytest.mark.parametrize(("scheme", "chunk_elements"), _with_chunks())
def test_litgpt_matches_quantize_after_load(quant_checkpoint, quant_load, quant_linears, quantize_after_load,
                                            assert_same_weights, forward_logits, scheme, chunk_elements,
                                            monkeypatch):
    if chunk_elements is not None:  # 1000 elements: blocks of 7 rows of 128, a ragged last block
        monkeypatch.setattr(rows, "CHUNK_ELEMENTS", chunk_elements)
    model, report = quant_load(quant_checkpoint, quantize=scheme)
    assert report.bytes_loaded == module_nbytes(model)  # before a forward grows litgpt's lazily built RoPE tables
    full, _ = quant_load(quant_checkpoint)
    full_logits = forward_logits(full)
    ref = quantize_after_load(full, scheme)

    assert report.quantized == {name: scheme for name in quant_linears()}
    assert set(report.left_out) == {"lm_head"} and "kept in full precision: lm_head (" in str(report)
    out = forward_logits(model)
    torch.testing.assert_close(out, forward_logits(ref), rtol=0, atol=0)
    assert_same_weights(model, ref)
    cosine = nn.functional.cosine_similarity(out.flatten(), full_logits.flatten(), dim=0)
    assert cosine > (0.999 if "int8" in scheme else 0.98)
    # non-Linear modules and the skipped head stay as they were, in bf16
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    assert type(model.transformer.wte) is nn.Embedding and model.transformer.wte.weight.dtype == torch.bfloat16
    assert report.quantized_bytes_before == sum(model.get_submodule(n).in_features * model.get_submodule(n).out_features
                                                * 2 for n in report.quantized)
    assert report.quantized_bytes_after < report.quantized_bytes_before * (0.56 if "int8" in scheme else 0.35)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.int8", "torchao.int8wo", "torchao.int4wo"])
def test_cuda_matches_quantize_after_load(quant_checkpoint, quant_load, quantize_after_load, assert_same_weights,
                                          forward_logits, scheme):
    if scheme not in schemes_available_on(torch.device("cuda")):
        pytest.skip(f"{scheme} has no kernel on this GPU")
    model, report = quant_load(quant_checkpoint, quantize=scheme, device="cuda")
    full, _ = quant_load(quant_checkpoint, device="cuda")
    ref = quantize_after_load(full, scheme)
    assert report.quantized and all(p.device.type == "cuda" for p in model.parameters())
    assert_same_weights(model, ref)
    torch.testing.assert_close(forward_logits(model), forward_logits(ref), rtol=0, atol=0)
