"""setup_kv_cache: k/v, mask and RoPE sized to the request, in the model's dtype; growth, reuse and clear errors.

Sizes are checked against independent outcomes: the tensors the caches hold (``cache_bytes``), the
estimate built from litgpt's own cache builders on meta (``estimate_memory``), the placement plan's
reservation, a fresh model's allocation, and literal sizes of pythia-1b.
"""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem import cache_bytes, estimate_memory, init_empty, placement_plan, setup_kv_cache


@pytest.mark.parametrize("kind", ["pythia", "gqa", "sliding"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch", [1, 3])
def test_bytes_equal_the_estimate_and_the_tensors_in_the_model_dtype(tiny_config, tiny_gpt, kind, dtype, batch):
    config = tiny_config(kind)
    model = tiny_gpt(config, dtype, std=0.3).to(dtype)  # RoPE tables in dtype, as a load in dtype leaves them
    length = 10 + 17  # prompt + max_new_tokens; past the 8-token window of the sliding config
    allocated = setup_kv_cache(model, batch, length)

    est = estimate_memory(config, dtype=dtype, batch_size=batch, max_seq_length=length)
    assert allocated == est.caches > 0
    held = cache_bytes(model)
    assert (held.kv, held.mask, held.rope) == (est.kv_cache, est.mask, est.rope)
    assert (held.length, held.batch_size) == (length, batch)
    tensors = [t for block in model.transformer.h for t in (block.attn.kv_cache.k, block.attn.kv_cache.v)]
    assert held.kv == sum(t.numel() * t.element_size() for t in tensors)
    assert held.total == allocated
    for block in model.transformer.h:
        assert block.attn.kv_cache.k.dtype == dtype and block.attn.kv_cache.v.dtype == dtype
        assert block.attn.kv_cache.k.shape[0] == batch
    assert model.cos.dtype == dtype and model.cos.shape == (length, config.rope_n_elem)
    assert model.max_seq_length == length and model.mask_cache.shape == (1, 1, length, length)


def test_sliding_window_layers_keep_a_ring_buffer_of_the_window(tiny_config, tiny_gpt):
    config = tiny_config("sliding")
    model = tiny_gpt(config, std=0.3)
    setup_kv_cache(model, 1, 30)
    sliding, full = (block.attn.kv_cache for block in model.transformer.h)
    assert sliding.k.shape[2] == config.sliding_window_size == 8
    assert full.k.shape[2] == 30


@pytest.mark.parametrize(("length", "kv_mib"), [(64 + 50, 14.25), (2048, 256)])
def test_pythia_1b_sizes_without_its_weights(length, kv_mib):
    """pythia-1b built on meta: the caches are real, the weights never allocated. bf16 KV: 14.25 MiB at
    64 + 50 tokens, 256 MiB at its full 2048 context; the estimate and the placement plan reserve the same."""
    from litgpt import GPT, Config

    config = Config.from_name("pythia-1b")
    with init_empty(include_buffers=True):
        model = GPT(config)
    model.to(torch.bfloat16)
    allocated = setup_kv_cache(model, 1, length, device="cpu")
    held = cache_bytes(model)
    assert held.kv == int(kv_mib * 2**20)
    assert allocated == held.total
    est = estimate_memory(config, max_seq_length=length)
    assert est.kv_cache == int(kv_mib * 2**20) and est.caches == allocated
    with init_empty():
        meta = GPT(config)
    assert placement_plan(meta, None, {"cpu": "8GiB"}, context=length, dtype=torch.bfloat16).cache_bytes == allocated


def test_longer_request_reallocates_shorter_one_reuses(tiny_config, tiny_gpt):
    config = tiny_config("gqa")
    model = tiny_gpt(config, torch.bfloat16, std=0.3).to(torch.bfloat16)  # RoPE tables in bf16
    first = setup_kv_cache(model, 1, 20)
    cache = model.transformer.h[0].attn.kv_cache
    pointer = cache.k.data_ptr()
    cache.k.fill_(1.0)

    assert setup_kv_cache(model, 1, 12) == 0  # shorter: the same tensors, zeroed
    assert model.transformer.h[0].attn.kv_cache.k.data_ptr() == pointer
    assert not model.transformer.h[0].attn.kv_cache.k.any()
    assert cache_bytes(model).total == first

    grown = setup_kv_cache(model, 1, 40)  # longer: new tensors of the new size only
    assert grown == setup_kv_cache(tiny_gpt(config, torch.bfloat16).to(torch.bfloat16), 1, 40)  # a fresh model's
    assert grown == estimate_memory(config, max_seq_length=40).caches
    assert cache_bytes(model).total == grown
    assert setup_kv_cache(model, 2, 40) == estimate_memory(config, batch_size=2, max_seq_length=40).caches


def test_generation_after_reuse_matches_a_fresh_cache(tiny_config, tiny_gpt):
    from litgpt.generate.base import generate

    config = tiny_config("gqa")
    model = tiny_gpt(config, std=0.3)
    prompt = torch.tensor([3, 14, 15, 92, 65])
    setup_kv_cache(model, 1, 40)
    generate(model, torch.tensor([1, 2, 3]), 40, temperature=0.0)  # fills the cache
    setup_kv_cache(model, 1, 15)  # reused
    reused = generate(model, prompt, 15, temperature=0.0)
    fresh_model = tiny_gpt(config, std=0.3)
    setup_kv_cache(fresh_model, 1, 15)
    assert torch.equal(reused, generate(fresh_model, prompt, 15, temperature=0.0))


def test_request_past_the_block_size_is_a_clear_error(tiny_config, tiny_gpt):
    model = tiny_gpt(tiny_config("pythia"), std=0.3)
    with pytest.raises(ValueError, match=r"65 positions.*block size.*is 64"):
        setup_kv_cache(model, 1, 65)
    assert model.mask_cache is None  # nothing was allocated


def test_explicit_dtype_and_caches_usable_for_training_after_inference(tiny_config, tiny_gpt):
    config = tiny_config("gqa")
    model = tiny_gpt(config, std=0.3)
    with torch.inference_mode():
        setup_kv_cache(model, 1, 16, dtype=torch.bfloat16)
    assert model.transformer.h[0].attn.kv_cache.k.dtype == torch.bfloat16
    assert not model.cos.is_inference()
    model.train()
    model(torch.randint(0, 100, (1, 16))).sum().backward()  # RoPE built outside inference mode


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


def test_the_rope_tables_keep_their_dtype_and_take_the_length_asked(tiny_config, tiny_gpt):
    """Only their length changes: tables litgpt computed again (``reset_parameters()``, its ``max_seq_length`` setter:
    float32) stay float32 in a bf16 model; tables converted with the model (``model.to(bf16)``, Lightning's one-device
    ``bf16-true``, a load in bf16) stay bf16, as litgpt's generate has them. The values are litgpt's own."""
    config = tiny_config("gqa")
    recomputed = tiny_gpt(config, torch.bfloat16)  # reset_parameters() after the conversion: float32 tables
    converted = tiny_gpt(config, torch.bfloat16).to(torch.bfloat16)
    for model, dtype in ((recomputed, torch.float32), (converted, torch.bfloat16)):
        setup_kv_cache(model, 1, 20)
        cos, sin = model.rope_cache()  # litgpt's own tables at this length, float32
        assert model.cos.dtype == dtype and torch.equal(model.cos, cos.to(dtype))
        assert torch.equal(model.sin, sin.to(dtype))
        assert model.transformer.h[0].attn.kv_cache.k.dtype == torch.bfloat16
    setup_kv_cache(converted, 1, 30, rope_dtype=torch.float32)  # better than the eager path, when asked
    assert converted.cos.dtype == torch.float32 and torch.equal(converted.cos, converted.rope_cache()[0])
    converted.clear_kv_cache()
    converted(torch.randint(0, 100, (1, 40)))  # grown by the guard for a longer forward: still float32
    assert converted.cos.dtype == torch.float32 and converted.cos.shape[0] == 40
