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


# ---------------------------------------------------------------- litgpt's pinned behaviours, with and without the patch
# Each scenario repeats what one of litgpt 0.5.13's own tests pins (its test files are not in its wheel), and returns
# its outcome: the values it produced, or the error it raised. The patch may change memory, nothing else: the outcome
# is the same with and without it, and an error it raises is an instance of the type litgpt raised there.

def _outcome(scenario, *args):
    try:
        return "returned", scenario(*args)
    except Exception as e:  # noqa: BLE001  (the type is the outcome)
        return "raised", e


def _past_the_cache(tiny_config):
    """litgpt tests/test_model.py::test_kv_cache: a forward past a 23-position cache of a 25-block model."""
    from litgpt import GPT, Config

    torch.manual_seed(0)
    model = GPT(Config(block_size=25, padded_vocab_size=5, n_layer=2, n_head=2, n_embd=8))
    model.max_seq_length = 23
    model.set_kv_cache(1)
    with torch.inference_mode():
        model(torch.zeros(1, 5, dtype=torch.long), torch.arange(5))
        return model(torch.zeros(1, 1, dtype=torch.long), torch.tensor([23]))


def _generate_past_max_seq_length(tiny_config):
    """litgpt tests/generate/test_main.py::test_generate: max_seq_length 10 for 5 + 20 tokens."""
    from litgpt import GPT, Config
    from litgpt.generate.base import generate

    torch.manual_seed(0)
    model = GPT(Config(block_size=128, vocab_size=16, n_layer=1, n_head=4, n_embd=8))
    model.max_seq_length = 10
    model.set_kv_cache(batch_size=1)
    return generate(model, torch.arange(0, 5), 5 + 20, top_k=1)


def _batch_cache_resized(tiny_config, positions):
    """litgpt tests/test_batch.py::test_simple_batch and tests/test_model.py::test_kv_cache_buffer_shape: a cache set
    up for 2 sequences, then for 1; then a batch of 2 on it, with positions of shape (B, T) or (T,)."""
    from litgpt import GPT

    torch.manual_seed(0)
    model = GPT(tiny_config("gqa")).eval()
    x0, pos0 = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 7]]), torch.tensor([[0, 1, 2, 3], [0, 1, 2, 2]])
    with torch.inference_mode():
        model.set_kv_cache(2)
        model(x0, pos0)
        model.set_kv_cache(1)
        shapes = [tuple(b.attn.kv_cache.k.shape) for b in model.transformer.h]
        model(x0[:1], pos0[0])
        model(x0, pos0 if positions == "(B, T)" else pos0[0])  # a batch of 2 on a cache of 1
    return shapes, model.max_seq_length


def test_a_forward_past_the_cache_is_an_index_error_with_and_without_the_patch(tiny_config):
    unpatched = _outcome(_past_the_cache, tiny_config)
    with patch_litgpt():
        patched = _outcome(_past_the_cache, tiny_config)
    assert unpatched[0] == patched[0] == "raised" and type(unpatched[1]) is IndexError
    assert isinstance(patched[1], IndexError) and isinstance(patched[1], KVCacheTooShortError)
    assert "position 23" in str(patched[1])


def test_generate_past_max_seq_length_is_litgpts_not_implemented_error_with_and_without_the_patch(tiny_config):
    unpatched = _outcome(_generate_past_max_seq_length, tiny_config)
    with patch_litgpt():
        patched = _outcome(_generate_past_max_seq_length, tiny_config)
    assert type(unpatched[1]) is NotImplementedError and isinstance(patched[1], NotImplementedError)
    assert str(patched[1]) == str(unpatched[1]) == "max_seq_length 10 needs to be >= 24"


@pytest.mark.parametrize("positions", ["(B, T)", "(T,)"])
def test_a_batch_past_the_cache_keeps_litgpts_error_type_with_and_without_the_patch(tiny_config, positions):
    """litgpt builds the new caches at the batch asked for; a batch past them is its bare AssertionError (positions
    (B, T)) or torch's RuntimeError from index_copy_ (positions (T,))."""
    unpatched = _outcome(_batch_cache_resized, tiny_config, positions)
    with patch_litgpt():
        patched = _outcome(_batch_cache_resized, tiny_config, positions)
    kind = AssertionError if positions == "(B, T)" else RuntimeError
    assert type(unpatched[1]) is kind
    assert isinstance(patched[1], kind) and isinstance(patched[1], KVCacheTooShortError)
    assert "batch of 2" in str(patched[1])


def test_the_caches_after_set_kv_cache_have_litgpts_shapes_and_max_seq_length(tiny_config):
    """``set_kv_cache(batch_size, max_seq_length)`` under the patch: caches of exactly that batch and length (as
    litgpt builds them; smaller than before too), and ``model.max_seq_length`` left as litgpt leaves it."""
    from litgpt import GPT

    def shapes(model):
        return [tuple(b.attn.kv_cache.k.shape) for b in model.transformer.h], model.max_seq_length

    def scenario():
        model = GPT(tiny_config("gqa"))
        seen = []
        for batch, length in ((2, 20), (1, 20), (1, 10), (3, 30)):
            model.set_kv_cache(batch, length)
            seen.append(shapes(model))
        model.max_seq_length = 16
        model.set_kv_cache(1)
        return seen + [shapes(model)]

    unpatched = scenario()
    with patch_litgpt():
        patched = scenario()
    assert patched == unpatched
    assert unpatched[1] == ([(1, 2, 20, 8)] * 2, 64)


@pytest.mark.parametrize("request_", ["overflow", "past the context", "far past the context"])
def test_llm_generate_past_a_fixed_cache_raises_litgpts_type_with_and_without_the_patch(checkpoint_dir, request_):
    """litgpt tests/test_api.py::test_fixed_kv_cache: a fixed cache of 10 positions and a request past it: litgpt's
    IndexError from its mask lookup, or, past the model's max_seq_length, its NotImplementedError (with its words)."""
    max_new_tokens = {"overflow": 7, "past the context": 70, "far past the context": 2**63}[request_]

    def scenario():
        return _llm(checkpoint_dir, fixed_kv_cache_size=10).generate(PROMPT, max_new_tokens=max_new_tokens, top_k=1)

    unpatched = _outcome(scenario)
    with patch_litgpt():
        patched = _outcome(scenario)
    kind = IndexError if request_ == "overflow" else NotImplementedError
    assert type(unpatched[1]) is kind
    assert isinstance(patched[1], kind) and isinstance(patched[1], KVCacheTooShortError)
    if kind is NotImplementedError:
        assert str(patched[1]).startswith(str(unpatched[1]))  # litgpt's own words first ("max_seq_length 64 needs...")


def test_llm_generate_past_the_context_raises_litgpts_type_with_and_without_the_patch(checkpoint_dir):
    """A request longer than the model's context without a fixed cache: litgpt's NotImplementedError."""
    def scenario():
        return _llm(checkpoint_dir).generate(PROMPT, max_new_tokens=70, top_k=1)

    unpatched = _outcome(scenario)
    with patch_litgpt():
        patched = _outcome(scenario)
    assert type(unpatched[1]) is NotImplementedError
    assert isinstance(patched[1], NotImplementedError) and str(patched[1]).startswith(str(unpatched[1]))


def test_llm_generate_returns_the_same_values_with_and_without_the_patch(checkpoint_dir):
    """litgpt tests/test_api.py: ``generate`` returns the reply as text (not the prompt), its token ids, or a stream of
    either; ``benchmark`` the text and its figures; the model's ``max_seq_length`` stays the model's."""
    def scenario():
        llm = _llm(checkpoint_dir)
        text = llm.generate(PROMPT, max_new_tokens=6, top_k=1)
        ids = llm.generate(PROMPT, max_new_tokens=6, top_k=1, return_as_token_ids=True)
        stream = list(llm.generate(PROMPT, max_new_tokens=6, top_k=1, stream=True))
        stream_ids = list(llm.generate(PROMPT, max_new_tokens=6, top_k=1, stream=True, return_as_token_ids=True))
        bench_text, bench = llm.benchmark(prompt=PROMPT, max_new_tokens=6, top_k=1)
        return (text, ids.tolist(), stream, [t.tolist() for t in stream_ids], bench_text,
                sorted(bench), [type(v[0]) for v in bench.values()], llm.model.max_seq_length)

    unpatched = scenario()
    with patch_litgpt():
        patched = scenario()
    assert patched == unpatched
    text, ids = unpatched[0], unpatched[1]
    assert isinstance(text, str) and len(ids) == 6 and not text.startswith(PROMPT)


def test_llm_generate_under_the_patch_gives_the_tokens_generate_gives(checkpoint_dir):
    """One generation loop: litgpt's LLM.generate under the patch and ``generate()`` answer a prompt alike (greedy,
    bf16, the directory's prompt style applied by both)."""
    from lightning_lowmem import generate

    with patch_litgpt():
        llm = _llm(checkpoint_dir)
        ids = llm.generate(PROMPT, max_new_tokens=12, top_k=1, return_as_token_ids=True)
    assert generate(checkpoint_dir, PROMPT, max_new_tokens=12, top_k=1).new_tokens[0].tolist() == ids.tolist()
