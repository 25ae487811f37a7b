"""Offload hooks: outputs equal the resident model's, device copies are temporary, masters stay on the host.

CPU is both ends here: the hooks still copy every offloaded tensor for each
forward, so the mechanism (copy in, run, drop, prefetch order) is exercised;
the CUDA tests at the end run only where a GPU is present.
"""

from __future__ import annotations

import copy

import pytest
import safetensors.torch
import torch
from torch import nn

from lightning_lowmem import (
    dispatch,
    enable_offload,
    init_empty,
    layer_offload,
    load_checkpoint,
    placement_plan,
    sequential_offload,
)
from lightning_lowmem.runtime import offloaded
from lightning_lowmem.quantize import module_nbytes
from lightning_lowmem.transfer import block_nbytes, lay_out


@pytest.fixture
def gpt(tiny_config, tiny_gpt):
    """``gpt(n_layer=4)``: the tiny GPT with ``n_layer`` layers, built for real."""
    return lambda n_layer=4: tiny_gpt(tiny_config(n_layer=n_layer))


class Pipeline(nn.Module):
    """A text encoder that runs once per prompt, and the model that uses its output."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True, dropout=0.0)
        self.text_encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.denoiser = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, prompt: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        context = self.text_encoder(prompt).mean(dim=1, keepdim=True)
        for _ in range(3):
            latents = latents + self.denoiser(latents + context)
        return latents


def storage_ptrs(module: nn.Module) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in module.named_parameters()}


def watch_forward(module: nn.Module, seen: list[dict[str, int]]) -> None:
    """Record the storages ``module``'s parameters point at while its forward runs."""
    module.register_forward_hook(lambda mod, args, out: seen.append(storage_ptrs(mod)))


def test_layer_offload_output_equals_resident_and_copies_are_temporary(gpt):
    model = gpt()
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        expected = reference(idx)
    seen: list[dict[str, int]] = []
    watch_forward(model.transformer.h[1], seen)  # registered first: runs while the copy is installed
    handle = layer_offload(model, "cpu")
    masters = storage_ptrs(model.transformer.h[1])
    with torch.no_grad():
        first, second = model(idx), model(idx)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert all(seen[0][n] != masters[n] for n in masters)  # ran on a copy
    assert storage_ptrs(model.transformer.h[1]) == masters  # and the master is back
    assert handle.stats.resident_bytes == 0  # nothing kept on the device between forwards
    block_bytes = handle.weights["transformer.h.0"].nbytes
    assert block_bytes <= handle.stats.max_resident_bytes <= 2 * block_bytes  # current + prefetched
    assert handle.stats.prefetch_hits >= 2 * (4 - 1)  # every block after the first was prefetched


def test_layer_offload_keeps_the_kv_cache_across_generation_steps(gpt):
    model, reference = gpt(), gpt()
    for m in (model, reference):
        m.set_kv_cache(batch_size=1, max_seq_length=24)
    caches = [block.attn.kv_cache.k for block in model.transformer.h]
    layer_offload(model, "cpu")
    prompt = torch.randint(0, 100, (1, 8))
    with torch.no_grad():
        pos = torch.arange(8)
        got, want = model(prompt, input_pos=pos), reference(prompt, input_pos=pos)
        assert torch.equal(got, want)
        token = want[:, -1:].argmax(-1)
        for step in range(8, 12):  # decode: each step reads the cache the previous ones wrote
            pos = torch.tensor([step])
            got, want = model(token, input_pos=pos), reference(token, input_pos=pos)
            assert torch.equal(got, want)
            token = want.argmax(-1)
    assert all(block.attn.kv_cache.k is k for block, k in zip(model.transformer.h, caches))


def test_sequential_offload_of_a_text_encoder_equals_resident():
    torch.manual_seed(0)
    pipe = Pipeline().eval()
    reference = copy.deepcopy(pipe)
    prompt, latents = torch.randn(2, 7, 32), torch.randn(2, 1, 32)
    with torch.no_grad():
        expected = reference(prompt, latents)
    seen: list[dict[str, int]] = []
    watch_forward(pipe.text_encoder, seen)
    handle = sequential_offload(pipe.text_encoder, "cpu")
    masters = storage_ptrs(pipe.text_encoder)  # the masters, in the block of host memory the offload keeps them in
    with torch.no_grad():
        out = pipe(prompt, latents)
    assert torch.equal(out, expected)
    assert len(seen) == 1 and all(seen[0][n] != masters[n] for n in masters)
    assert storage_ptrs(pipe.text_encoder) == masters
    assert handle.stats.resident_bytes == 0
    assert handle.stats.max_resident_bytes == handle.offloaded_bytes  # the whole encoder, once
    assert handle.stats.prefetch_hits == 0


@pytest.mark.parametrize("scheme", ["torchao.int8wo", "bnb.int8"])
def test_offloaded_bytes_of_a_quantized_module_are_what_it_holds(tmp_path, scheme):
    # a torchao weight is a tensor subclass whose outer dtype is bf16: counted as numel x 2 it was 525,312 bytes
    # here, where its int8 codes, scales and zero points (and the bias) hold 265,728
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"0.weight": torch.randn(512, 512), "0.bias": torch.zeros(512)}, path)
    with init_empty():
        model = nn.Sequential(nn.Linear(512, 512))
    load_checkpoint(model, path, dtype=torch.bfloat16, quantize=scheme, progress=False)
    x = torch.randn(2, 512, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x)
    held = module_nbytes(model)  # its inner tensors, each once (an int8 weight's codes are its CB)
    handle = sequential_offload(model, "cpu")
    with torch.no_grad():
        out = model(x)
    assert torch.equal(out, expected)
    assert handle.offloaded_bytes == held == handle.stats.max_resident_bytes
    if scheme.startswith("torchao"):
        assert held == 512 * 512 + 5 * 512 + 2 * 512
    # the masters' host memory: one block, each part 64-byte aligned, whole pages
    parts = [p for entry in handle.weights[""].entries for p in entry.parts.values()]
    assert handle.pinned_bytes == block_nbytes(lay_out(p.nbytes for p in parts)[1]) >= held


def test_dispatch_offloads_exactly_the_layers_the_plan_put_on_the_cpu(gpt):
    model = gpt(n_layer=6)
    reference = copy.deepcopy(model)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    plan = placement_plan(model, None, {"cuda:0": total // 2, "cpu": "1GiB"}, context=16)
    assert plan.offloaded
    handle = dispatch(model, plan, device="cpu")  # the plan's accelerator played by the CPU
    assert handle is not None
    assert set(handle.weights) == {m for layer in plan.offloaded for m in layer.modules}
    assert handle.prefetch == plan.prefetch
    idx = torch.randint(0, 100, (1, 16))
    with torch.no_grad():
        assert torch.equal(model(idx), reference(idx))
    assert handle.stats.fetches >= len(handle.weights)
    assert dispatch(model, placement_plan(model, None, {"cpu": "1GiB"})) is None


def test_learned_order_follows_the_forward_not_the_module_order(gpt):
    model = gpt(n_layer=2)
    reference = copy.deepcopy(model)
    # module order is lm_head, wte, h.0, h.1, ln_f; the forward runs wte, h.0, h.1, ln_f, lm_head
    names = ["lm_head", "transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.ln_f"]
    handle = layer_offload(model, "cpu", layers=names)
    idx = torch.randint(0, 100, (1, 5))
    with torch.no_grad():
        model(idx)
        hits, fetches = handle.stats.prefetch_hits, handle.stats.fetches
        out = model(idx)
    assert torch.equal(out, reference(idx))
    assert handle.stats.prefetch_hits - hits == 4  # every module but the first came prefetched
    assert handle.stats.fetches - fetches == 5  # and nothing was fetched in vain
    assert handle.stats.resident_bytes == 0


def test_remove_leaves_the_masters_and_a_working_model(gpt):
    model = gpt()
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 100, (1, 6))
    with offloaded(model, "layers", "cpu") as handle:
        masters = storage_ptrs(model)
        with torch.no_grad():
            model(idx)
    fetches = handle.stats.fetches
    with torch.no_grad():
        assert torch.equal(model(idx), reference(idx))
    assert handle.stats.fetches == fetches  # the hooks are gone
    assert storage_ptrs(model) == masters


def test_a_failed_forward_does_not_leave_copies_installed(gpt):
    model = gpt()
    reference = copy.deepcopy(model)
    handle = layer_offload(model, "cpu")
    masters = storage_ptrs(model)

    def fail(*args: object) -> None:
        raise RuntimeError("failed inside block 2")

    bad = model.transformer.h[2].mlp.register_forward_pre_hook(fail)  # after the block's weights came in
    with torch.no_grad(), pytest.raises(RuntimeError, match="block 2"):
        model(torch.randint(0, 100, (1, 6)))
    bad.remove()
    assert storage_ptrs(model) == masters and handle.stats.resident_bytes == 0
    idx = torch.randint(0, 100, (1, 6))
    with torch.no_grad():
        assert torch.equal(model(idx), reference(idx))


def test_unknown_offload_mode_is_refused():
    with pytest.raises(ValueError, match="sequential"):
        enable_offload(nn.Linear(2, 2), "disk", "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ModuleList"):
        layer_offload(nn.Sequential(nn.Linear(2, 2)), "cpu")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("prefetch", [True, False])
def test_cuda_layer_offload_equals_resident_and_frees_the_device(gpt, prefetch: bool):
    model = gpt().cuda()
    reference = copy.deepcopy(model)
    handle = layer_offload(model, "cuda", prefetch=prefetch)  # the blocks' masters go back to the host
    blocks = model.transformer.h
    assert all(p.device.type == "cpu" and p.is_pinned() for b in blocks for p in b.parameters())
    assert model.lm_head.weight.is_cuda
    idx = torch.randint(0, 100, (2, 12), device="cuda")
    with torch.no_grad():
        expected = reference(idx)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = model(idx)
        del out
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        torch.testing.assert_close(model(idx), expected)
    assert after == before  # no copy kept on the device after the forward
    assert handle.stats.resident_bytes == 0
    assert (handle.stats.prefetch_hits > 0) == prefetch


@needs_cuda
def test_cuda_sequential_offload_of_a_text_encoder():
    torch.manual_seed(0)
    pipe = Pipeline().eval()
    reference = copy.deepcopy(pipe).cuda()
    pipe.denoiser.cuda()
    sequential_offload(pipe.text_encoder, "cuda")
    prompt, latents = torch.randn(2, 7, 32), torch.randn(2, 1, 32, device="cuda")
    with torch.no_grad():
        expected = reference(prompt.cuda(), latents)
        out = pipe(prompt, latents)  # the prompt is moved in by the hook
    torch.testing.assert_close(out, expected)
    assert all(p.device.type == "cpu" for p in pipe.text_encoder.parameters())


@needs_cuda
def test_cuda_load_over_budget_offloads_and_matches_resident(tmp_path, tiny_config, tiny_gpt, meta_gpt,
                                                             write_checkpoint):
    from lightning_lowmem import load_checkpoint

    # the budget below is sized for this model: a vocabulary of 256 and an MLP of 64
    config = tiny_config(n_layer=6, vocab_size=256, padded_vocab_size=256, intermediate_size=64)
    source = tiny_gpt(config)
    path = write_checkpoint(source.state_dict(), "safetensors", tmp_path)
    model = meta_gpt(config).eval()
    budget = sum(t.numel() * t.element_size() for t in model.state_dict().values()) // 2 + 200_000
    report = load_checkpoint(model, path, max_memory={"cuda:0": budget, "cpu": "1GiB"}, context=16)
    assert report.placement.offloaded and report.offload is not None
    idx = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        expected = source.cuda()(idx.cuda())
        source.cpu()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        out = model(idx.cuda())
        peak = torch.cuda.max_memory_allocated()
    torch.testing.assert_close(out, expected)
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_cuda)
    assert resident <= report.placement.weights_per_device()["cuda:0"]
    assert start <= report.placement.weights_per_device()["cuda:0"] + expected.nbytes
    assert peak <= budget + expected.nbytes  # the reference output is the only other tensor on the device


@needs_cuda
@pytest.mark.cuda
def test_cuda_offload_on_a_gpu_without_bf16_computes_in_fp16_and_matches_the_resident_fp16_model(
        tmp_path, tiny_config, tiny_gpt, meta_gpt, write_checkpoint):
    """bf16 asked for, the GPU taken for one without bf16: the offloaded layers (kept on the CPU, which has bf16)
    compute on the GPU, so they get fp16 like the resident ones; the forward matches the model loaded whole in
    fp16 (before, the offloaded layers stayed bf16: "mat1 and mat2 must have the same dtype")."""
    from lightning_lowmem import BF16FallbackWarning, assume_bf16_support, load_checkpoint

    config = tiny_config(n_layer=6, vocab_size=256, padded_vocab_size=256, intermediate_size=64)
    path = write_checkpoint(tiny_gpt(config, torch.bfloat16).state_dict(), "safetensors", tmp_path)
    resident, model = meta_gpt(config).eval(), meta_gpt(config).eval()
    budget = sum(t.numel() * t.element_size() for t in model.state_dict().values()) // 2 + 200_000
    with assume_bf16_support("cuda", False), pytest.warns(BF16FallbackWarning):
        load_checkpoint(resident, path, device="cuda:0", dtype=torch.bfloat16)
        report = load_checkpoint(model, path, dtype=torch.bfloat16, max_memory={"cuda:0": budget, "cpu": "1GiB"},
                                 context=16)
    assert report.placement.offloaded and report.offload is not None
    assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {torch.float16}
    assert any(p.device.type == "cpu" for p in model.parameters())
    idx = torch.randint(0, 256, (1, 10), device="cuda")
    with torch.no_grad():
        out, expected = model(idx), resident(idx)
    assert out.dtype == expected.dtype == torch.float16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_a_tensor_two_offloaded_modules_share_has_one_master_counted_once():
    """A tied embedding and head offloaded as two modules: one master (``offloaded_bytes`` counted it twice)."""
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.h = nn.Embedding(100, 16), nn.ModuleList([nn.Linear(16, 16)])
            self.head = nn.Linear(16, 100, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.h[0](self.wte(x)))

    torch.manual_seed(0)
    model = Tied().eval()
    reference = copy.deepcopy(model)
    handle = layer_offload(model, "cpu", layers=["wte", "h.0", "head"])
    assert handle.offloaded_bytes == (100 * 16 + 16 * 16 + 16) * 4
    assert handle.weights["wte"].masters[0] is handle.weights["head"].masters[0]
    x = torch.randint(0, 100, (2, 5))
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert model.head.weight is model.wte.weight
