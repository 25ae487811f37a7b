"""load_checkpoint: streamed load == eager load, for every format and dtype; a module is loaded whole or left as it
was: what cannot be filled fails before any read, and any later failure puts everything back."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_lowmem import CheckpointFormatError, CheckpointNotFoundError, MetaTensorError, init_empty, load_checkpoint


@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_streamed_equals_eager(tmp_path, litgpt_model, checkpoint_format, source_dtype, write_checkpoint, meta_gpt,
                               eager_gpt):
    reference = litgpt_model.to(source_dtype)
    path = write_checkpoint(reference.state_dict(), checkpoint_format, tmp_path)
    model = meta_gpt(reference.config)

    report = load_checkpoint(model, path, dtype=torch.bfloat16)

    eager_model = eager_gpt(reference, torch.bfloat16)  # what users do today
    for (name, ours), (_, theirs) in zip(model.state_dict().items(), eager_model.state_dict().items()):
        assert ours.dtype == torch.bfloat16, name
        assert torch.equal(ours, theirs), name
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    x = torch.randint(0, 100, (2, 16))
    torch.testing.assert_close(model.eval()(x), eager_model(x), rtol=0, atol=0)
    assert report.tensors == len(reference.state_dict())
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in reference.state_dict().values())


def test_litgpt_checkpoint_directory(tmp_path, litgpt_model, write_checkpoint, meta_gpt):
    write_checkpoint(litgpt_model.state_dict(), "pth", tmp_path)  # lit_model.pth
    model = meta_gpt(litgpt_model.config)
    report = load_checkpoint(model, tmp_path)
    assert [p.name for p in report.files] == ["lit_model.pth"]
    x = torch.randint(0, 100, (1, 8))
    torch.testing.assert_close(model.eval()(x), litgpt_model(x), rtol=0, atol=0)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny Llama with tied embeddings and rotary buffers, written sharded by save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("hf")
    model.save_pretrained(directory, max_shard_size="20KB")
    return model, directory


def test_transformers_sharded_save_pretrained(hf_llama):
    from transformers import LlamaForCausalLM

    reference, directory = hf_llama
    assert len(list(directory.glob("*.safetensors"))) >= 4
    with init_empty():
        model = LlamaForCausalLM(reference.config)
    report = load_checkpoint(model, directory)

    assert report.files[0].parent == directory and len(report.files) >= 4
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied, loaded once
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    x = torch.randint(0, 128, (2, 8))
    torch.testing.assert_close(model.eval()(x).logits, reference(x).logits, rtol=0, atol=0)


def test_real_module_keeps_parameter_objects_and_dtype(tmp_path, litgpt_model, write_checkpoint, tiny_gpt):
    """A model that already has real tensors keeps its Parameter objects (optimizers hold them)."""
    path = write_checkpoint(litgpt_model.to(torch.float32).state_dict(), "safetensors", tmp_path)
    model = tiny_gpt(litgpt_model.config, seed=1)
    before = {n: id(p) for n, p in model.named_parameters()}
    load_checkpoint(model, path)
    assert before == {n: id(p) for n, p in model.named_parameters()}
    assert torch.equal(model.lm_head.weight, litgpt_model.lm_head.weight)


def test_report_is_readable(tmp_path, litgpt_model, write_checkpoint, meta_gpt):
    path = write_checkpoint(litgpt_model.state_dict(), "sharded-safetensors", tmp_path)
    report = load_checkpoint(meta_gpt(litgpt_model.config), path, progress=False)
    text = str(report)
    assert f"Loaded {report.tensors} tensors" in text and "peak RSS" in text
    assert report.memory.rss_peak >= report.memory.rss_start > 0
    assert len(report.files) == 4


def test_load_with_a_cpu_budget_matches_a_plain_load(tmp_path, tiny_config, tiny_gpt, meta_gpt, write_checkpoint):
    config = tiny_config(n_layer=3)
    source = tiny_gpt(config)
    path = write_checkpoint(source.state_dict(), "safetensors", tmp_path)
    model = meta_gpt(config).eval()
    report = load_checkpoint(model, path, max_memory={"cpu": "1GiB"}, context=16)
    assert report.placement is not None and report.offload is None
    assert "placement:" in str(report)
    idx = torch.randint(0, 100, (1, 10))
    with torch.no_grad():
        assert torch.equal(model(idx), source(idx))
    with pytest.raises(ValueError, match="not both"):
        load_checkpoint(meta_gpt(config), path, device="cpu", max_memory={"cpu": "1GiB"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_straight_to_cuda(tmp_path, litgpt_model, write_checkpoint, meta_gpt, eager_gpt):
    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    model = meta_gpt(litgpt_model.config)
    report = load_checkpoint(model, path, device="cuda", dtype=torch.bfloat16)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cuda"}
    assert report.memory.device_peak is not None and report.memory.device_peak > 0
    x = torch.randint(0, 100, (1, 8))
    expected = eager_gpt(litgpt_model, torch.bfloat16)(x)
    torch.testing.assert_close(model.eval()(x.cuda()).cpu(), expected, rtol=2e-2, atol=2e-2)


def test_errors_leave_a_meta_module_untouched(tmp_path):
    with init_empty():
        layer = torch.nn.Linear(4, 4)
    with pytest.raises(CheckpointNotFoundError):
        load_checkpoint(layer, tmp_path / "missing.safetensors")
    assert layer.weight.is_meta and layer.bias.is_meta


@pytest.mark.parametrize("kind", ["safetensors", "sharded-safetensors", "pth"])
def test_read_failing_mid_load_leaves_everything_on_meta(tmp_path, litgpt_model, write_checkpoint, meta_gpt, kind):
    """The file is cut short while the load runs (another process rewriting it): a real read error, half-way."""
    import os

    path = write_checkpoint(litgpt_model.state_dict(), kind, tmp_path)
    files = sorted(tmp_path.glob("*.safetensors")) or [path]
    seen: list[str] = []

    def truncate_after_first(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not seen:
            for f in files:
                os.truncate(f, os.path.getsize(f) // 2)
        seen.append(name)
        return tensor

    model = meta_gpt(litgpt_model.config)
    with pytest.raises(CheckpointFormatError, match=r"changed \(size \d+ -> \d+ bytes") as error:
        load_checkpoint(model, path, dtype=torch.bfloat16, transform=truncate_after_first, progress=False)
    assert str(files[0].parent) in str(error.value)
    assert 1 <= len(seen) < len(litgpt_model.state_dict())  # it failed half-way, after loading something
    assert all(t.is_meta for t in model.state_dict().values())  # nothing that looks loaded is handed back


# ---------------------------------------------------------------- loaded whole, or left as it was

def test_strict_false_with_a_parameter_the_checkpoint_lacks_fails_before_any_read(tmp_path, litgpt_model,
                                                                                   write_checkpoint, meta_gpt,
                                                                                   read_recorder):
    state = {k: v for k, v in litgpt_model.state_dict().items() if k != "transformer.ln_f.weight"}
    path = write_checkpoint(state, "safetensors", tmp_path)
    model = meta_gpt(litgpt_model.config)
    with pytest.raises(MetaTensorError, match=r"'transformer\.ln_f\.weight' is not in the checkpoint.*nothing was read"):
        load_checkpoint(model, path, strict=False)
    assert read_recorder.calls == []
    assert all(t.is_meta for t in model.state_dict().values())


@pytest.mark.parametrize("quantize", [None, "bnb.int8"])
def test_a_failure_after_the_plan_leaves_the_module_as_it_was(tmp_path, litgpt_model, write_checkpoint, meta_gpt,
                                                             quantize):
    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    model = meta_gpt(litgpt_model.config)
    before = {name: (type(mod), dict(mod._parameters)) for name, mod in model.named_modules()}
    calls = []

    def fail_late(name: str, tensor: torch.Tensor) -> torch.Tensor:
        calls.append(name)
        if len(calls) == len(litgpt_model.state_dict()):
            raise RuntimeError("the last tensor fails")
        return tensor

    with pytest.raises(RuntimeError, match="the last tensor fails"):
        load_checkpoint(model, path, quantize=quantize, transform=fail_late, progress=False)
    after = {name: (type(mod), dict(mod._parameters)) for name, mod in model.named_modules()}
    assert after.keys() == before.keys()
    for name, (cls, params) in before.items():
        assert after[name][0] is cls, name  # quantized Linears swapped back
        assert all(after[name][1][k] is p for k, p in params.items()), name  # the very same (meta) parameters


def test_a_failure_leaves_a_real_module_with_its_own_weights(tmp_path, litgpt_model, write_checkpoint, tiny_gpt):
    path = write_checkpoint({k: v + 1 for k, v in litgpt_model.state_dict().items()}, "safetensors", tmp_path)
    model = tiny_gpt(litgpt_model.config)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def fail_half_way(name: str, tensor: torch.Tensor) -> torch.Tensor:
        calls.append(name)
        if len(calls) > 3:
            raise RuntimeError("half way")
        return tensor

    with pytest.raises(RuntimeError, match="half way"):
        load_checkpoint(model, path, transform=fail_half_way, progress=False)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, original[name]), name


# ---------------------------------------------------------------- mapped, not copied

def _mappings_of(path) -> int:
    with open("/proc/self/maps") as f:
        return sum(str(path) in line for line in f)


@pytest.mark.parametrize("kind", ["safetensors", "sharded-safetensors", "pth"])
def test_a_mapped_load_equals_a_copied_one_and_reads_nothing(tmp_path, litgpt_model, write_checkpoint, meta_gpt, kind):
    reference = litgpt_model.to(torch.bfloat16)
    path = write_checkpoint(reference.state_dict(), kind, tmp_path)
    mapped, copied = meta_gpt(reference.config), meta_gpt(reference.config)
    report = load_checkpoint(mapped, path, dtype=torch.bfloat16, mmap=True, progress=False)
    load_checkpoint(copied, path, dtype=torch.bfloat16, progress=False)
    assert report.mapped and report.bytes_read == 0 and "mapped, not read" in str(report)
    assert all(torch.equal(a, b) for a, b in zip(mapped.state_dict().values(), copied.state_dict().values(),
                                                 strict=True))
    files = sorted(tmp_path.glob("*.safetensors")) or [path]
    assert all(_mappings_of(f) for f in files)  # the weights are the file's pages
    x = torch.randint(0, 100, (1, 8))
    torch.testing.assert_close(mapped.eval()(x), copied.eval()(x), rtol=0, atol=0)
    del mapped, report
    import gc

    gc.collect()
    assert not any(_mappings_of(f) for f in files)  # the mapping goes with the last tensor


@pytest.mark.parametrize("change", ["cast", "quantize", "transform"])
def test_a_load_that_changes_a_tensor_never_keeps_the_file_mapped(tmp_path, litgpt_model, write_checkpoint, meta_gpt,
                                                                 change):
    path = write_checkpoint(litgpt_model.to(torch.bfloat16).state_dict(), "safetensors", tmp_path)
    options = {"cast": dict(dtype=torch.float32), "quantize": dict(dtype=torch.bfloat16, quantize="bnb.int8"),
               "transform": dict(dtype=torch.bfloat16, transform=lambda name, t: t)}[change]
    model = meta_gpt(litgpt_model.config)
    report = load_checkpoint(model, path, mmap=True, progress=False, **options)
    assert not report.mapped and report.bytes_read > 0
    assert _mappings_of(path) == 0


def _params(names: list[str], shape: tuple[int, ...], tie: tuple[str, str] | None = None) -> torch.nn.Module:
    with init_empty():
        module = torch.nn.Module()
        for name in names:
            module.register_parameter(name, torch.nn.Parameter(torch.empty(shape)))
    if tie:
        setattr(module, tie[1], getattr(module, tie[0]))
    return module


def test_a_mapped_torch_file_is_checked_against_its_crc(tmp_path):
    """A flipped byte in a mapped .pth loaded silently: the CRC-32 was skipped. It is now computed over the mapped
    pages at load (reading each once), and the module is left as it was."""
    import zipfile

    torch.save({"w": torch.randn(64, 64)}, tmp_path / "src.pth")
    data = bytearray((tmp_path / "src.pth").read_bytes())
    with zipfile.ZipFile(tmp_path / "src.pth") as z:
        info = z.getinfo("src/data/0")
    data[info.header_offset + 30 + len(info.filename) + len(info.extra) + 999] ^= 0x55
    (tmp_path / "flipped.pth").write_bytes(bytes(data))
    module = _params(["w"], (64, 64))
    with pytest.raises(CheckpointFormatError, match=r"flipped\.pth: 'w': the bytes of record 'src/data/0' do not match "
                                                    r"the CRC-32"):
        load_checkpoint(module, tmp_path / "flipped.pth", mmap=True, progress=False)
    assert module.w.is_meta


def test_mapped_tensors_keep_the_copying_loads_ties_and_never_alias(tmp_path):
    """Two keys on one storage (a tie saved twice, or overlapping views) mapped as views of the same pages: writing
    one parameter wrote the other. As the copying default does, separate parameters are separate tensors, and a
    tie in the module stays one parameter."""
    base, other = torch.arange(8.0), torch.arange(10.0, 20.0)
    torch.save({"a": base, "b": base, "c": other[:6], "d": other[4:], "e": torch.ones(3)}, tmp_path / "shared.pth")
    mapped = _params(["a", "b"], (8,))
    with init_empty():
        mapped.c, mapped.d = torch.nn.Parameter(torch.empty(6)), torch.nn.Parameter(torch.empty(6))
        mapped.e = torch.nn.Parameter(torch.empty(3))
    report = load_checkpoint(mapped, tmp_path / "shared.pth", mmap=True, progress=False)
    assert report.mapped
    with torch.no_grad():
        mapped.a.add_(100)
        mapped.c.add_(100)
    assert torch.equal(mapped.b, base) and torch.equal(mapped.d, other[4:]), (mapped.b, mapped.d)

    tied = _params(["a"], (8,), tie=("a", "b"))
    load_checkpoint(tied, tmp_path / "shared.pth", mmap=True, strict=False, progress=False)
    assert tied.a is tied.b and torch.equal(tied.a, base)


def test_a_file_cut_short_after_it_was_opened_is_a_typed_error_not_a_crash(tmp_path, write_checkpoint):
    from lightning_lowmem import Checkpoint

    path = write_checkpoint({"w": torch.randn(256, 256)}, "safetensors", tmp_path)
    module = _params(["w"], (256, 256))
    with Checkpoint.open(path) as ckpt:
        os.truncate(path, path.stat().st_size - 4096)
        with pytest.raises(CheckpointFormatError, match=r"model\.safetensors changed \(size \d+ -> \d+ bytes"):
            load_checkpoint(module, ckpt, mmap=True, progress=False)
    assert module.w.is_meta


_CUT_UNDER_A_MAPPED_MODEL = """
import os, sys, torch
from lightning_lowmem import init_empty, load_checkpoint
path = sys.argv[1]
with init_empty():
    layer = torch.nn.Linear(1024, 1024, bias=False)
load_checkpoint(layer, path, mmap=True, progress=False)
os.truncate(path, 4096)
print(float(layer.weight[-1].sum()))  # touches a page past the end of the file
"""


def test_a_file_cut_short_under_a_mapped_model_kills_the_process(tmp_path, write_checkpoint, child_env):
    """What docs/threat-model.md says of mmap=True: the mapped pages are the file's, and a file truncated under a
    mapped model crashes the process (SIGBUS) when the model touches what was cut. Copying (the default) cannot."""
    import signal
    import subprocess
    import sys

    path = write_checkpoint({"weight": torch.randn(1024, 1024)}, "safetensors", tmp_path)
    proc = subprocess.run([sys.executable, "-c", _CUT_UNDER_A_MAPPED_MODEL, str(path)], capture_output=True, text=True,
                          env=child_env, timeout=300)
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stderr[-2000:])


def test_load_prepared_streams_a_prepared_load_whole_or_puts_the_module_back(tmp_path, tiny_config, tiny_gpt,
                                                                             meta_gpt, write_checkpoint):
    """The engine's two-step API (prepare from headers, then stream) loads as load_checkpoint does, and a file
    cut short during the read leaves the module on meta."""
    from lightning_lowmem import LoadOptions
    from lightning_lowmem.engine import load_prepared, prepare_load, resolved

    config = tiny_config()
    source = tiny_gpt(config)
    path = write_checkpoint(source.state_dict(), "safetensors", tmp_path)
    model, options = meta_gpt(config), LoadOptions(progress=False)
    with resolved(path, model, options) as resolved_source:
        report = load_prepared(prepare_load(model, resolved_source, options))
    assert report.tensors == len(source.state_dict()) and report.memory is not None
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.state_dict().values()))

    model = meta_gpt(config)
    with resolved(path, model, options) as resolved_source:
        prepared = prepare_load(model, resolved_source, options)
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 64)
        with pytest.raises(CheckpointFormatError):
            load_prepared(prepared)
    assert all(p.is_meta for p in model.parameters())
