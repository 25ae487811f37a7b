"""The devices a load may target: an unavailable one is refused before any file is opened."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem import DeviceUnavailableError, load_checkpoint


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("quantize", [None, "bnb.nf4"])
def test_load_to_cuda_without_cuda_fails_before_reading(quant_checkpoint, quant_config, meta_gpt, read_recorder,
                                                        quantize):
    model = meta_gpt(quant_config)
    with pytest.raises(DeviceUnavailableError, match=r"device='cuda:1'.*CUDA is not available.*device='cpu'"):
        load_checkpoint(model, quant_checkpoint, device="cuda:1", dtype=torch.bfloat16, quantize=quantize)
    assert read_recorder.keys == []
    assert all(p.is_meta for p in model.parameters())
