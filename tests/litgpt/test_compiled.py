"""generate(compile=True): litgpt's decode step compiled; the same greedy tokens and cache bytes as without compile,
one graph for requests of every length, and eager decoding, with one warning, where compile cannot apply."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_lowmem import estimate_memory, generate

PROMPT = "t5 t17 t3 t99 t42 t8"


def _unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "quantize"), [("pythia", None), ("gqa", None), ("pythia", "bnb.nf4"),
                                                ("gqa", "bnb.nf4"), ("pythia", "torchao.int8wo")])
def test_greedy_tokens_and_cache_bytes_equal_those_without_compile(tmp_path, tiny_config, write_litgpt_dir,
                                                                   litgpt_cli_tokens, kind, quantize):
    directory = write_litgpt_dir(tmp_path / kind, tiny_config(kind, n_embd=64, intermediate_size=256),
                                 torch.bfloat16)
    eager = generate(directory, PROMPT, max_new_tokens=20, temperature=0.0, quantize=quantize)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiled = generate(directory, PROMPT, max_new_tokens=20, temperature=0.0, quantize=quantize, compile=True)
    assert not [w for w in seen if "compile=True" in str(w.message)]  # one graph: compiled, nothing to say
    assert compiled.tokens[0].tolist() == eager.tokens[0].tolist()
    if quantize is None:
        assert eager.tokens[0].tolist() == litgpt_cli_tokens(directory, PROMPT, "bf16-true", 20)
    memory, expected = compiled.memory, eager.memory
    assert (memory.kv_cache, memory.mask, memory.rope) == (expected.kv_cache, expected.mask, expected.rope)
    est = estimate_memory(directory, max_seq_length=26, prompt_length=6, quantize=quantize)
    assert (memory.kv_cache, memory.mask, memory.rope) == (est.kv_cache, est.mask, est.rope)


@pytest.mark.slow
def test_where_compiled_and_eager_part_the_eager_logits_are_a_near_tie(tmp_path, tiny_config, write_litgpt_dir):
    """Compiled kernels sum in another order than eager ones: logits differ by a few bf16 roundings, and greedy
    tokens part where eager's two best logits are that close (this model: torchao int8 weights, 6th new token)."""
    from lightning_lowmem.litgpt.generation import load_for_generation

    directory = write_litgpt_dir(tmp_path / "gqa", tiny_config("gqa", n_embd=64, intermediate_size=256),
                                 torch.bfloat16)
    eager = generate(directory, PROMPT, max_new_tokens=20, temperature=0.0, quantize="torchao.int8wo")
    compiled = generate(directory, PROMPT, max_new_tokens=20, temperature=0.0, quantize="torchao.int8wo",
                        compile=True)
    e, c = eager.tokens[0].tolist(), compiled.tokens[0].tolist()
    parted = next((i for i, (a, b) in enumerate(zip(e, c)) if a != b), None)
    if parted is None:
        return
    model, _, _ = load_for_generation(directory, quantize="torchao.int8wo")
    with torch.no_grad():
        logits = model(torch.tensor([e[:parted]]))[0, -1].float()  # eager's choice at the step where they part
    top = logits.topk(2)
    assert sorted([e[parted], c[parted]]) == sorted(top.indices.tolist())  # the two best, each path took one
    assert top.values[0] - top.values[1] <= 0.0625  # a bf16 rounding of a logit in [8, 16)


@pytest.mark.slow
def test_one_graph_serves_requests_of_other_lengths(tiny_config, tiny_gpt):
    """The caches are sized to each request (other lengths, other buffers); the compiled step is not redone."""
    model = tiny_gpt(tiny_config("pythia", n_layer=3), torch.bfloat16, std=0.3).eval()
    generate(model, [1, 2, 3, 4, 5, 6], max_new_tokens=10, temperature=0.0, compile=True)
    graphs = _unique_graphs()
    for prompt, new in (([7, 8, 9], 30), (list(range(1, 40)), 5)):
        got = generate(model, prompt, max_new_tokens=new, temperature=0.0, compile=True)
        eager = generate(model, prompt, max_new_tokens=new, temperature=0.0)
        assert got.tokens[0].tolist() == eager.tokens[0].tolist()
        assert got.memory.kv_cache == eager.memory.kv_cache == 2 * 3 * 4 * (len(prompt) + new) * 8 * 2  # bf16 k, v
    assert _unique_graphs() == graphs


@pytest.mark.slow
def test_a_one_token_prompt_runs_its_forward_eagerly_and_decodes_with_the_one_graph(tiny_config, tiny_gpt):
    """The prompt's forward (prefill) is told by its position, not by its length: a 1-token prompt is a prefill."""
    model = tiny_gpt(tiny_config("pythia", n_layer=1, n_head=2), torch.bfloat16, std=0.3).eval()
    torch._dynamo.reset()  # dynamo compiles one function at most 8 times a process: leave the tests after room
    generate(model, [1, 2, 3], max_new_tokens=4, temperature=0.0, compile=True)
    graphs = _unique_graphs()
    for prompt in ([7], [9]):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = generate(model, prompt, max_new_tokens=6, temperature=0.0, compile=True)
        assert not [w for w in seen if "compile=True" in str(w.message)]
        assert got.tokens[0].tolist() == generate(model, prompt, max_new_tokens=6, temperature=0.0).tokens[0].tolist()
    assert _unique_graphs() == graphs


@pytest.mark.slow
def test_a_scheme_whose_kernels_split_the_graph_runs_compiled_and_says_so(tmp_path, tiny_config, write_litgpt_dir):
    """bitsandbytes' int8 kernels return shapes that depend on the data: one graph break at each of their calls."""
    directory = write_litgpt_dir(tmp_path / "int8", tiny_config("gqa", n_embd=64, intermediate_size=256),
                                 torch.bfloat16)
    eager = generate(directory, PROMPT, max_new_tokens=8, temperature=0.0, quantize="bnb.int8")
    with pytest.warns(UserWarning, match=r"split the decode step into several graphs \(.*bitsandbytes"):
        compiled = generate(directory, PROMPT, max_new_tokens=8, temperature=0.0, quantize="bnb.int8",
                            compile=True)
    assert compiled.tokens[0].tolist() == eager.tokens[0].tolist()


@pytest.mark.slow
def test_a_compile_that_fails_decodes_eagerly_with_one_warning(tiny_config, tiny_gpt, monkeypatch):
    """No working C++ compiler (inductor's CPU code cannot be built): the decode step runs eagerly."""
    model = tiny_gpt(tiny_config("pythia", n_layer=1, n_head=2), torch.bfloat16, std=0.3).eval()
    torch._dynamo.reset()  # nothing compiled before for this model's shapes may answer instead
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", ("/nonexistent/c++",))
    with pytest.warns(UserWarning, match=r"torch.compile failed on the decode step .*decoding without compile"):
        got = generate(model, [1, 2, 3], max_new_tokens=6, temperature=0.0, compile=True)
    assert got.tokens[0].tolist() == generate(model, [1, 2, 3], max_new_tokens=6, temperature=0.0).tokens[0].tolist()


def test_layers_on_disk_decode_eagerly_with_one_warning(tmp_path, tiny_config, write_litgpt_dir):
    """A disk-tier layer is read for each forward: compiling would trace the reads; the step runs eagerly, fast."""
    import litgpt.generate.base as litgpt_generate

    directory = write_litgpt_dir(tmp_path / "disk", tiny_config("pythia"), tokenizer=False)
    before = litgpt_generate.next_token
    eager = generate(directory, [1, 2, 3], max_new_tokens=5, temperature=0.0)
    with pytest.warns(UserWarning, match=r"not compiling, layers are read from the checkpoint file"):
        got = generate(directory, [1, 2, 3], max_new_tokens=5, temperature=0.0, compile=True,
                       max_memory={"cpu": "30KiB"}, disk_offload=True)
    assert got.load_report.placement.on_disk and got.tokens[0].tolist() == eager.tokens[0].tolist()
    assert litgpt_generate.next_token is before


@pytest.mark.parametrize("loader", ["load_for_generation", "load_checkpoint"])
def test_a_model_with_layers_on_disk_passed_in_decodes_eagerly_with_one_warning(tmp_path, tiny_config,
                                                                                write_litgpt_dir, meta_gpt, loader):
    """Whoever loaded it: generate() finds the layers on disk on the model itself, not in a load report."""
    from lightning_lowmem import load_checkpoint
    from lightning_lowmem.litgpt.generation import load_for_generation

    config = tiny_config("pythia")
    directory = write_litgpt_dir(tmp_path / "disk", config, torch.bfloat16, tokenizer=False)
    eager = generate(directory, [1, 2, 3], max_new_tokens=5, temperature=0.0)
    if loader == "load_for_generation":
        model, _, report = load_for_generation(directory, max_memory={"cpu": "30KiB"}, disk_offload=True)
    else:
        model = meta_gpt(config)
        report = load_checkpoint(model, directory / "lit_model.pth", dtype=torch.bfloat16,
                                 max_memory={"cpu": "30KiB"}, disk_offload=True)
    assert report.placement.on_disk
    with pytest.warns(UserWarning, match=r"not compiling, layers are read from the checkpoint file") as seen:
        got = generate(model.eval(), [1, 2, 3], max_new_tokens=5, temperature=0.0, compile=True)
    assert len([w for w in seen if "compile=True" in str(w.message)]) == 1
    assert got.tokens[0].tolist() == eager.tokens[0].tolist()
    report.disk.close()


def test_litgpts_next_token_is_put_back_when_generation_fails(tiny_config, tiny_gpt):
    import litgpt.generate.base as litgpt_generate

    from lightning_lowmem.litgpt.compiled import DecodeStep, compiled_decoding

    before = litgpt_generate.next_token
    with pytest.raises(RuntimeError, match="stop"), compiled_decoding("cpu") as step:
        assert isinstance(litgpt_generate.next_token, DecodeStep) and step.mode is None and not step.whole_cache
        raise RuntimeError("stop")
    assert litgpt_generate.next_token is before


def test_the_mode_is_litgpts_on_cuda_and_the_default_elsewhere():
    from lightning_lowmem.litgpt.compiled import compile_mode

    assert compile_mode(torch.device("cuda", 0)) == "reduce-overhead" and compile_mode(torch.device("cpu")) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_tokens_with_compile_on_cuda(tmp_path, tiny_config, write_litgpt_dir):
    """mode="reduce-overhead": CUDA graphs replay the decode step; tokens as without compile."""
    directory = write_litgpt_dir(tmp_path / "cuda", tiny_config("gqa"), torch.bfloat16, tokenizer=False)
    eager = generate(directory, [1, 2, 3, 4], max_new_tokens=12, temperature=0.0, device="cuda")
    for prompt in ([1, 2, 3, 4], [5, 6]):
        got = generate(directory, prompt, max_new_tokens=12, temperature=0.0, device="cuda", compile=True)
        if prompt == [1, 2, 3, 4]:
            assert got.tokens[0].tolist() == eager.tokens[0].tolist()
