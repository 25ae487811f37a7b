"""The cache guard: a request past a fixed KV cache is a clear error naming the lengths, not litgpt's IndexError."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem import KVCacheTooShortError, setup_kv_cache


def test_request_past_a_fixed_cache_is_a_clear_error_not_index_error(tiny_config, tiny_gpt):
    from litgpt.generate.base import generate

    config = tiny_config("pythia")
    model = tiny_gpt(config, std=0.3)
    setup_kv_cache(model, 1, 10)
    with pytest.raises(KVCacheTooShortError, match=r"position 11.*holds 10 positions") as info:
        model(torch.ones(1, 1, dtype=torch.long), torch.tensor([11]), input_pos_maxp1=12)
    assert (info.value.needed, info.value.available) == (12, 10)
    model.max_seq_length = 64  # as litgpt's LLM leaves it beside a fixed cache: its own length check passes
    with pytest.raises(KVCacheTooShortError, match=r"position 10.*holds 10 positions"):
        generate(model, torch.arange(1, 9), 8 + 5, temperature=0.0)  # writes positions 0..11
    with pytest.raises(KVCacheTooShortError, match="batch of 2"):
        model(torch.ones(2, 1, dtype=torch.long), torch.tensor([0]))

    reference = tiny_gpt(config, std=0.3)  # litgpt alone, in the same state: the bare IndexError this replaces
    reference.set_kv_cache(1, max_seq_length=10)  # max_seq_length stays 64
    with pytest.raises(IndexError):
        generate(reference, torch.arange(1, 9), 8 + 5, temperature=0.0)
