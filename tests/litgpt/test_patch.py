"""patch_litgpt(): litgpt's own Python API sizes its caches to the request, in the model's dtype."""

from __future__ import annotations

import pytest
import torch
from lightning_lowmem import KVCacheTooShortError, cache_bytes, estimate_memory, patch_litgpt, unpatch_litgpt
from lightning_lowmem.litgpt.patch import is_litgpt_patched

PROMPT = "t5 t17 t3 t99 t42"  # 5 tokens


@pytest.fixture
def checkpoint_dir(tmp_path, tiny_config, write_litgpt_dir):
    return write_litgpt_dir(tmp_path / "tiny", tiny_config("gqa"), torch.bfloat16)


@pytest.fixture(autouse=True)
def _unpatched():
    unpatch_litgpt()
    yield
    unpatch_litgpt()


def _llm(directory, **distribute):
    from litgpt.api import LLM

    llm = LLM.load(str(directory), distribute=None)
    llm.distribute(accelerator="cpu", precision="bf16-true", **distribute)
    return llm


def test_patch_is_idempotent_and_reversible():
    from litgpt.api import LLM
    from litgpt.model import GPT

    originals = (GPT.set_kv_cache, LLM.generate, LLM.__dict__["load"])
    with patch_litgpt() as patch:
        assert patch.applied and is_litgpt_patched()
        patched = GPT.set_kv_cache
        assert patched is not originals[0]
        assert not patch_litgpt().applied  # a second call changes nothing
        assert GPT.set_kv_cache is patched
    assert not is_litgpt_patched()
    assert (GPT.set_kv_cache, LLM.generate, LLM.__dict__["load"]) == originals


def test_unpatched_api_allocates_fp32_kv_and_full_context_rope(checkpoint_dir):
    """What the patch fixes, seen in litgpt 0.5.13 itself."""
    llm = _llm(checkpoint_dir)
    seen = _record_caches_at_first_forward(llm)
    llm.generate(PROMPT, max_new_tokens=7, top_k=1)
    assert seen[0].dtype == torch.float32
    assert seen[0].kv == estimate_memory(llm.config, dtype=torch.float32, max_seq_length=12).kv_cache
    assert llm.model.cos.shape[0] == llm.config.block_size


def _record_caches_at_first_forward(llm):
    """What the caches hold when generation starts (litgpt converts fp32 k/v in the first forward)."""
    from lightning_lowmem.litgpt.kv_cache import unwrap_model

    seen = []
    unwrap_model(llm.model).register_forward_pre_hook(lambda m, args: seen.append(cache_bytes(m)) if not seen else None)
    return seen


def test_patched_api_sizes_every_cache_to_the_request(checkpoint_dir):
    patch_litgpt()
    llm = _llm(checkpoint_dir)
    assert llm.model.cos.shape[0] == 0  # nothing the size of the context after distribute()
    seen = _record_caches_at_first_forward(llm)
    llm.generate(PROMPT, max_new_tokens=7, top_k=1)
    held = seen[0]
    est = estimate_memory(llm.config, dtype=torch.bfloat16, max_seq_length=12)
    assert held.dtype == torch.bfloat16 and (held.kv, held.mask) == (est.kv_cache, est.mask)
    assert (held.length, llm.model.cos.shape[0]) == (12, 12)

    pointer = llm.model.transformer.h[0].attn.kv_cache.k.data_ptr()
    llm.generate("t1 t2", max_new_tokens=3, top_k=1)  # shorter: reused
    assert llm.model.transformer.h[0].attn.kv_cache.k.data_ptr() == pointer
    llm.generate(PROMPT, max_new_tokens=20, top_k=1)  # longer: grown
    assert cache_bytes(llm.model).kv == estimate_memory(llm.config, dtype=torch.bfloat16, max_seq_length=25).kv_cache


def test_same_tokens_with_and_without_the_patch(checkpoint_dir):
    expected = _llm(checkpoint_dir).generate(PROMPT, max_new_tokens=12, top_k=1, return_as_token_ids=True)
    with patch_litgpt():
        llm = _llm(checkpoint_dir)
        got = llm.generate(PROMPT, max_new_tokens=12, top_k=1, return_as_token_ids=True)
        streamed = list(llm.generate(PROMPT, max_new_tokens=12, top_k=1, stream=True, return_as_token_ids=True))
    assert torch.equal(got, expected)
    assert torch.equal(torch.cat(streamed), expected)


def test_llm_load_with_automatic_distribute(checkpoint_dir):
    from litgpt.api import LLM

    expected = LLM.load(str(checkpoint_dir)).generate(PROMPT, max_new_tokens=8, top_k=1, return_as_token_ids=True)
    with patch_litgpt():
        llm = LLM.load(str(checkpoint_dir))  # distribute="auto": built on meta, streamed in
        assert llm.model.cos.shape[0] == 0
        got = llm.generate(PROMPT, max_new_tokens=8, top_k=1, return_as_token_ids=True)
    assert torch.equal(got, expected)


def test_fixed_cache_in_model_dtype_and_clear_error_past_it(checkpoint_dir):
    patch_litgpt()
    llm = _llm(checkpoint_dir, fixed_kv_cache_size=10)
    held = cache_bytes(llm.model)
    assert (held.dtype, held.length, llm.model.cos.shape[0]) == (torch.bfloat16, 10, 10)
    llm.generate(PROMPT, max_new_tokens=6, top_k=1)  # writes positions 0..9: fits
    with pytest.raises(KVCacheTooShortError, match=r"needs 12 KV-cache positions.*fixed at 10"):
        llm.generate(PROMPT, max_new_tokens=7)


def test_unpatched_fixed_cache_overflow_is_litgpts_index_error(checkpoint_dir):
    llm = _llm(checkpoint_dir, fixed_kv_cache_size=10)
    with pytest.raises(IndexError):
        llm.generate(PROMPT, max_new_tokens=7)


def test_litgpt_generate_cli_path_under_the_patch(checkpoint_dir, litgpt_cli_tokens):
    """litgpt's CLI sets max_seq_length then set_kv_cache(batch_size=1): patched, the same tokens."""
    expected = litgpt_cli_tokens(checkpoint_dir, PROMPT, "bf16-true", 6)
    assert len(expected) == 5 + 6
    with patch_litgpt():
        assert litgpt_cli_tokens(checkpoint_dir, PROMPT, "bf16-true", 6) == expected


def test_set_kv_cache_keeps_the_rope_dtype_litgpt_gave_it(tiny_config, tiny_gpt, litgpt_cli_stdout, chat_model_dir):
    """litgpt's chat sets max_seq_length (RoPE in fp32), then set_kv_cache: k/v in bf16, RoPE kept in fp32, so the
    replies are litgpt chat's, reply for reply (a bf16 RoPE changes a token of the second one here)."""
    model = tiny_gpt(tiny_config("gqa"), torch.bfloat16, std=0.3)
    with patch_litgpt():
        model.max_seq_length = 20  # litgpt's setter: rope_cache() in fp32
        model.set_kv_cache(batch_size=1)
    held = cache_bytes(model)
    assert (held.dtype, held.length, model.cos.dtype, model.cos.shape[0]) == (torch.bfloat16, 20, torch.float32, 20)

    turns = "t5 t17 t3\nt1 t2 t3 t4 t5 t6 t7 t8 t9\nt42\n\n"
    expected = litgpt_cli_stdout("chat", chat_model_dir, stdin=turns, max_new_tokens=12, top_k=1)
    with patch_litgpt():
        assert litgpt_cli_stdout("chat", chat_model_dir, stdin=turns, max_new_tokens=12, top_k=1) == expected


def test_llm_load_with_layers_left_on_disk(tmp_path, tiny_config, write_litgpt_dir):
    """``patch_litgpt(options=...)``: litgpt's own LLM, its layers beyond the budget read from lit_model.pth."""
    from litgpt.api import LLM

    from lightning_lowmem import LoadOptions

    directory = write_litgpt_dir(tmp_path / "six", tiny_config("gqa", n_layer=6), torch.bfloat16)
    expected = LLM.load(str(directory)).generate(PROMPT, max_new_tokens=8, top_k=1, return_as_token_ids=True)
    with patch_litgpt(options=LoadOptions(max_memory={"cpu": "40KiB"}, disk_offload=True)):
        llm = LLM.load(str(directory))
        units = [m for m in llm.model.modules() if "_lowmem_on_disk" in m.__dict__]
        got = llm.generate(PROMPT, max_new_tokens=8, top_k=1, return_as_token_ids=True)
    assert len(units) >= 4
    assert torch.equal(got, expected)
