"""setup_kv_cache: k/v, mask and RoPE sized to the request, in the model's dtype; growth, reuse and clear errors."""

from __future__ import annotations

import pytest
import torch
from gen_helpers import kv_formula, tiny_config, tiny_gpt

from lightning_lowmem import KVCacheTooShortError, cache_bytes, init_empty, load_checkpoint, setup_kv_cache


def _rope_bytes(config, length: int, itemsize: int) -> int:
    return 2 * length * config.rope_n_elem * itemsize


@pytest.mark.parametrize("kind", ["pythia", "gqa", "sliding"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch", [1, 3])
def test_bytes_equal_the_formula_in_the_model_dtype(kind, dtype, batch):
    config = tiny_config(kind)
    model = tiny_gpt(config, dtype)
    length = 10 + 17  # prompt + max_new_tokens; past the 8-token window of the sliding config
    allocated = setup_kv_cache(model, batch, length)

    kv = kv_formula(config, batch, length, dtype.itemsize)
    assert allocated == kv + length * length + _rope_bytes(config, length, dtype.itemsize)
    held = cache_bytes(model)
    assert (held.kv, held.mask, held.length, held.batch_size) == (kv, length * length, length, batch)
    for block in model.transformer.h:
        assert block.attn.kv_cache.k.dtype == dtype and block.attn.kv_cache.v.dtype == dtype
    assert model.cos.dtype == dtype and model.cos.shape == (length, config.rope_n_elem)
    assert model.max_seq_length == length and model.mask_cache.shape == (1, 1, length, length)


def test_sliding_window_layers_keep_a_ring_buffer_of_the_window():
    config = tiny_config("sliding")
    model = tiny_gpt(config)
    setup_kv_cache(model, 1, 30)
    sliding, full = (block.attn.kv_cache for block in model.transformer.h)
    assert sliding.k.shape[2] == config.sliding_window_size == 8
    assert full.k.shape[2] == 30


def test_pythia_1b_sizes_without_its_weights():
    """pythia-1b built on meta: the caches are real, the weights never allocated; 64 + 50 tokens = 14.25 MiB."""
    from litgpt import GPT, Config

    config = Config.from_name("pythia-1b")
    with init_empty(include_buffers=True):
        model = GPT(config)
    model.to(torch.bfloat16)
    allocated = setup_kv_cache(model, 1, 64 + 50, device="cpu")
    assert cache_bytes(model).kv == kv_formula(config, 1, 114, 2) == int(14.25 * 2**20)
    assert allocated == int(14.25 * 2**20) + 114 * 114 + _rope_bytes(config, 114, 2)


def test_longer_request_reallocates_shorter_one_reuses():
    config = tiny_config("gqa")
    model = tiny_gpt(config, torch.bfloat16)
    first = setup_kv_cache(model, 1, 20)
    cache = model.transformer.h[0].attn.kv_cache
    pointer = cache.k.data_ptr()
    cache.k.fill_(1.0)

    assert setup_kv_cache(model, 1, 12) == 0  # shorter: the same tensors, zeroed
    assert model.transformer.h[0].attn.kv_cache.k.data_ptr() == pointer
    assert not model.transformer.h[0].attn.kv_cache.k.any()
    assert cache_bytes(model).total == first

    grown = setup_kv_cache(model, 1, 40)  # longer: new tensors of the new size only
    assert grown == kv_formula(config, 1, 40, 2) + 40 * 40 + _rope_bytes(config, 40, 2)
    assert cache_bytes(model).total == grown
    assert setup_kv_cache(model, 2, 40) == kv_formula(config, 2, 40, 2) + 40 * 40 + _rope_bytes(config, 40, 2)


def test_generation_after_reuse_matches_a_fresh_cache():
    from litgpt.generate.base import generate

    config = tiny_config("gqa")
    model = tiny_gpt(config)
    prompt = torch.tensor([3, 14, 15, 92, 65])
    setup_kv_cache(model, 1, 40)
    generate(model, torch.tensor([1, 2, 3]), 40, temperature=0.0)  # fills the cache
    setup_kv_cache(model, 1, 15)  # reused
    reused = generate(model, prompt, 15, temperature=0.0)
    fresh_model = tiny_gpt(config)
    setup_kv_cache(fresh_model, 1, 15)
    assert torch.equal(reused, generate(fresh_model, prompt, 15, temperature=0.0))


def test_request_past_the_block_size_is_a_clear_error():
    model = tiny_gpt(tiny_config("pythia"))
    with pytest.raises(ValueError, match=r"65 positions.*block size.*is 64"):
        setup_kv_cache(model, 1, 65)
    assert model.mask_cache is None  # nothing was allocated


def test_request_past_a_fixed_cache_is_a_clear_error_not_index_error():
    from litgpt.generate.base import generate

    config = tiny_config("pythia")
    model = tiny_gpt(config)
    setup_kv_cache(model, 1, 10)
    with pytest.raises(KVCacheTooShortError, match=r"position 11.*holds 10 positions") as info:
        model(torch.ones(1, 1, dtype=torch.long), torch.tensor([11]), input_pos_maxp1=12)
    assert (info.value.needed, info.value.available) == (12, 10)
    model.max_seq_length = 64  # as litgpt's LLM leaves it beside a fixed cache: its own length check passes
    with pytest.raises(KVCacheTooShortError, match=r"position 10.*holds 10 positions"):
        generate(model, torch.arange(1, 9), 8 + 5, temperature=0.0)  # writes positions 0..11
    with pytest.raises(KVCacheTooShortError, match="batch of 2"):
        model(torch.ones(2, 1, dtype=torch.long), torch.tensor([0]))

    reference = tiny_gpt(config)  # litgpt alone, in the same state: the bare IndexError this replaces
    reference.set_kv_cache(1, max_seq_length=10)  # max_seq_length stays 64
    with pytest.raises(IndexError):
        generate(reference, torch.arange(1, 9), 8 + 5, temperature=0.0)


def test_explicit_dtype_and_caches_usable_for_training_after_inference():
    config = tiny_config("gqa")
    model = tiny_gpt(config)
    with torch.inference_mode():
        setup_kv_cache(model, 1, 16, dtype=torch.bfloat16)
    assert model.transformer.h[0].attn.kv_cache.k.dtype == torch.bfloat16
    assert not model.cos.is_inference()
    model.train()
    model(torch.randint(0, 100, (1, 16))).sum().backward()  # RoPE built outside inference mode


def test_litgpt_model_loaded_by_lightning_lowmem_has_no_full_context_rope(tmp_path):
    config = tiny_config("gqa", block_size=4096)
    reference = tiny_gpt(config)
    torch.save(reference.state_dict(), tmp_path / "lit_model.pth")
    from litgpt import GPT

    with init_empty(include_buffers=True):
        model = GPT(config)
    load_checkpoint(model, tmp_path / "lit_model.pth")
    assert model.cos.shape[0] == 0 and model.mask_cache is None  # nothing sized to the 4096 context

    x = torch.randint(0, 100, (1, 12))
    torch.testing.assert_close(model(x), reference(x))  # RoPE grown to 12 rows on first use
    assert model.cos.shape[0] == 12
    setup_kv_cache(model, 1, 20)
    assert model.cos.shape[0] == 20 and cache_bytes(model).length == 20


class ProtocolModel(torch.nn.Module):
    """Not litgpt: only the protocol (settable max_seq_length, set_kv_cache, clear_kv_cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, dtype=torch.float16)
        self.max_seq_length = 128
        self.register_buffer("cache", None, persistent=False)

    def set_kv_cache(self, batch_size, max_seq_length=None, device=None, dtype=None) -> None:
        self.cache = torch.zeros(batch_size, max_seq_length, 8, device=device, dtype=dtype)

    def clear_kv_cache(self) -> None:
        self.cache = None


def test_any_model_with_the_protocol():
    model = ProtocolModel()
    assert setup_kv_cache(model, 2, 50) == 2 * 50 * 8 * 2  # fp16, the model's dtype
    assert model.max_seq_length == 50 and model.cache.dtype == torch.float16
    with pytest.raises(TypeError, match="protocol"):
        setup_kv_cache(torch.nn.Linear(2, 2), 1, 4)
