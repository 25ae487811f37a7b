"""load_checkpoint: streamed load == eager load, for every format and dtype."""

from __future__ import annotations

import pytest
import torch
from conftest import FORMATS, tiny_litgpt_config, write_checkpoint
from torch import nn

from lightning_lowmem import (
    Checkpoint,
    CheckpointFormatError,
    CheckpointMismatchError,
    Combine,
    MetaTensorError,
    init_empty,
    load_checkpoint,
)


def _meta_gpt(config=None):
    from litgpt import GPT

    with init_empty():
        return GPT(config or tiny_litgpt_config())


def _eager(reference: nn.Module, dtype: torch.dtype) -> nn.Module:
    """What users do today: build a real model in ``dtype`` and load_state_dict into it."""
    from litgpt import GPT

    model = GPT(reference.config).to(dtype)
    model.load_state_dict(reference.state_dict())
    return model.eval()


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_streamed_equals_eager(tmp_path, litgpt_model, kind, source_dtype):
    reference = litgpt_model.to(source_dtype)
    path = write_checkpoint(reference.state_dict(), kind, tmp_path)
    model = _meta_gpt(reference.config)

    report = load_checkpoint(model, path, dtype=torch.bfloat16)

    eager = _eager(reference, torch.bfloat16)
    for (name, ours), (_, theirs) in zip(model.state_dict().items(), eager.state_dict().items()):
        assert ours.dtype == torch.bfloat16, name
        assert torch.equal(ours, theirs), name
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    x = torch.randint(0, 96, (2, 16))
    torch.testing.assert_close(model.eval()(x), eager(x), rtol=0, atol=0)
    assert report.tensors == len(reference.state_dict())
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in reference.state_dict().values())


def test_rope_buffers_built_when_first_used_when_built_fully_on_meta(tmp_path, litgpt_model):
    """Built under torch.device('meta'), litgpt's cos/sin are meta; the loader leaves them empty (no table the
    size of the whole context) and the first forward builds the rows it needs (lightning_lowmem.cache_guard)."""
    from litgpt import GPT

    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    with torch.device("meta"):
        model = GPT(litgpt_model.config)
    load_checkpoint(model, path)
    assert model.cos.shape[0] == 0 and not model.cos.is_meta
    x = torch.randint(0, 96, (1, 8))
    torch.testing.assert_close(model.eval()(x), litgpt_model(x), rtol=0, atol=0)
    torch.testing.assert_close(model.cos, litgpt_model.cos[:8], rtol=0, atol=0)


def test_litgpt_checkpoint_directory(tmp_path, litgpt_model):
    write_checkpoint(litgpt_model.state_dict(), "pth", tmp_path)  # lit_model.pth
    model = _meta_gpt(litgpt_model.config)
    report = load_checkpoint(model, tmp_path)
    assert [p.name for p in report.files] == ["lit_model.pth"]
    x = torch.randint(0, 96, (1, 8))
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


def test_tied_weights_saved_twice_are_read_once(tmp_path):
    """torch.save writes both names of a tied weight; the loader reads one and keeps the tie."""
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    source = nn.ModuleDict({"wte": emb, "lm_head": head})
    path = write_checkpoint(source.state_dict(), "pth", tmp_path)
    with init_empty():
        target = nn.ModuleDict({"wte": nn.Embedding(10, 4), "lm_head": nn.Linear(4, 10, bias=False)})
        target.lm_head.weight = target.wte.weight
    report = load_checkpoint(target, path)
    assert report.tensors == 1
    assert target.lm_head.weight is target.wte.weight
    assert torch.equal(target.wte.weight, emb.weight)


def test_shape_mismatch_names_file_key_and_both_shapes_before_reading(tmp_path, litgpt_model):
    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    model = _meta_gpt(tiny_litgpt_config(n_embd=64))
    with pytest.raises(CheckpointMismatchError) as err:
        load_checkpoint(model, path)
    message = str(err.value)
    assert "model.safetensors" in message and "'lm_head.weight'" in message
    assert "[96, 32]" in message and "[96, 64]" in message
    assert all(p.is_meta for p in model.parameters())  # nothing was read or assigned


def test_missing_and_unexpected_keys_strict_and_not(tmp_path, litgpt_model):
    state = litgpt_model.state_dict()
    state.pop("transformer.ln_f.weight")
    state["extra.weight"] = torch.zeros(3)
    path = write_checkpoint(state, "safetensors", tmp_path)

    model = _meta_gpt(litgpt_model.config)
    with pytest.raises(CheckpointMismatchError, match=r"transformer\.ln_f\.weight.*extra\.weight"):
        load_checkpoint(model, path)
    assert all(p.is_meta for p in model.parameters())

    with pytest.raises(MetaTensorError, match=r"transformer\.ln_f\.weight"):
        load_checkpoint(model, path, strict=False)  # the missing one would stay on meta

    real = _meta_gpt(litgpt_model.config)
    real.transformer.ln_f.weight = nn.Parameter(torch.full((32,), 2.0))  # a real tensor stays as it is
    report = load_checkpoint(real, path, strict=False)
    assert report.missing == ["transformer.ln_f.weight"] and report.skipped == ["extra.weight"]
    assert torch.equal(real.transformer.ln_f.weight, torch.full((32,), 2.0))


def test_key_map_dict_callable_and_guessed_prefix(tmp_path, litgpt_model):
    state = {f"model.{k}": v for k, v in litgpt_model.state_dict().items()}
    path = write_checkpoint(state, "safetensors", tmp_path)
    x = torch.randint(0, 96, (1, 8))
    for key_map in ({"model.": ""}, lambda k: k.removeprefix("model."), None):
        model = _meta_gpt(litgpt_model.config)
        report = load_checkpoint(model, path, key_map=key_map)
        torch.testing.assert_close(model.eval()(x), litgpt_model(x), rtol=0, atol=0)
    assert "stripped 'model.'" in report.key_note

    # a key the callable sends to None is dropped on purpose: not unexpected, even under strict=True
    extra = write_checkpoint(state | {"model.optimizer_step": torch.zeros(())}, "safetensors", tmp_path / "extra")
    model = _meta_gpt(litgpt_model.config)
    drop = lambda k: None if k == "model.optimizer_step" else k.removeprefix("model.")  # noqa: E731
    report = load_checkpoint(model, extra, key_map=drop)
    assert report.skipped == [] and report.tensors == len(state)

    # the other way: a bare model file into a wrapper module that holds it as .model
    bare = write_checkpoint(litgpt_model.state_dict(), "pth", tmp_path / "bare")
    wrapper = nn.Module()
    wrapper.model = _meta_gpt(litgpt_model.config)
    report = load_checkpoint(wrapper, bare)
    assert "added 'model.'" in report.key_note


def _split_qkv(tmp_path, drop: str | None = None):
    """A q/k/v split checkpoint (GQA widths 16, 8, 8) of a module that holds one fused ``qkv`` Linear."""
    torch.manual_seed(0)
    parts = {f"{layer}.{p}.weight": torch.randn(width, 16) for layer in "ab" for p, width in zip("qkv", (16, 8, 8))}
    parts["a.proj.weight"] = torch.randn(16, 16)
    if drop:
        del parts[drop]
    path = write_checkpoint(parts, "safetensors", tmp_path)
    with init_empty():
        module = nn.ModuleDict({"a": nn.ModuleDict({"qkv": nn.Linear(16, 32, bias=False),
                                                    "proj": nn.Linear(16, 16, bias=False)}),
                                "b": nn.ModuleDict({"qkv": nn.Linear(16, 32, bias=False)})})
    sources = {f"{layer}.qkv.weight": tuple(f"{layer}.{p}.weight" for p in "qkv") for layer in "ab"}
    combine = Combine(sources, lambda name, got: torch.cat([got[key] for key in sources[name]]))
    return parts, path, module, combine


def test_combine_builds_one_tensor_from_several_keys(tmp_path, monkeypatch):
    parts, path, module, combine = _split_qkv(tmp_path)
    reads = []
    original = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, key, **kw: reads.append(key) or original(self, key, **kw))
    report = load_checkpoint(module, path, dtype=torch.bfloat16, combine=combine)

    for layer in "ab":
        fused = torch.cat([parts[f"{layer}.{p}.weight"] for p in "qkv"]).to(torch.bfloat16)
        assert torch.equal(module[layer].qkv.weight, fused)
        assert module[layer].qkv.weight.untyped_storage().nbytes() == fused.nbytes
    assert reads == ["a.q.weight", "a.k.weight", "a.v.weight", "a.proj.weight",  # module order, parts together
                     "b.q.weight", "b.k.weight", "b.v.weight"]
    assert report.tensors == 7 and report.bytes_read == sum(t.nbytes for t in parts.values())
    assert report.skipped == [] and report.missing == []


def test_combine_missing_part_and_bad_shape_fail_before_reading(tmp_path, monkeypatch):
    reads = []
    original = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, key, **kw: reads.append(key) or original(self, key, **kw))
    _, path, module, combine = _split_qkv(tmp_path / "missing", drop="b.k.weight")
    with pytest.raises(CheckpointMismatchError, match=r"'b\.k\.weight' for 'b\.qkv\.weight'") as err:
        load_checkpoint(module, path, combine=combine)
    assert "b.q.weight" not in str(err.value)  # the parts that are there are not "unexpected"

    _, path, module, combine = _split_qkv(tmp_path / "wide")
    with init_empty():
        module["b"]["qkv"] = nn.Linear(16, 48, bias=False)
    with pytest.raises(CheckpointMismatchError, match=r"'b\.qkv\.weight' built from 'b\.q\.weight'.*\[32, 16\]"):
        load_checkpoint(module, path, combine=combine)
    assert reads == []


def test_real_module_keeps_parameter_objects_and_dtype(tmp_path, litgpt_model):
    """A model that already has real tensors keeps its Parameter objects (optimizers hold them)."""
    from litgpt import GPT

    path = write_checkpoint(litgpt_model.to(torch.float32).state_dict(), "safetensors", tmp_path)
    torch.manual_seed(1)
    model = GPT(litgpt_model.config)
    before = {n: id(p) for n, p in model.named_parameters()}
    load_checkpoint(model, path)
    assert before == {n: id(p) for n, p in model.named_parameters()}
    assert torch.equal(model.lm_head.weight, litgpt_model.lm_head.weight)


def test_report_is_readable(tmp_path, litgpt_model):
    path = write_checkpoint(litgpt_model.state_dict(), "sharded-safetensors", tmp_path)
    report = load_checkpoint(_meta_gpt(litgpt_model.config), path, progress=False)
    text = str(report)
    assert f"Loaded {report.tensors} tensors" in text and "peak RSS" in text
    assert report.memory.rss_peak >= report.memory.rss_start > 0
    assert len(report.files) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_straight_to_cuda(tmp_path, litgpt_model):
    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    model = _meta_gpt(litgpt_model.config)
    report = load_checkpoint(model, path, device="cuda", dtype=torch.bfloat16)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cuda"}
    assert report.memory.device_peak is not None and report.memory.device_peak > 0
    x = torch.randint(0, 96, (1, 8))
    expected = _eager(litgpt_model, torch.bfloat16)(x)
    torch.testing.assert_close(model.eval()(x.cuda()).cpu(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["safetensors", "sharded-safetensors", "pth"])
def test_read_failing_mid_load_leaves_everything_on_meta(tmp_path, litgpt_model, kind):
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

    model = _meta_gpt()
    with pytest.raises(CheckpointFormatError, match=r"could not read tensor|truncated") as error:
        load_checkpoint(model, path, dtype=torch.bfloat16, transform=truncate_after_first, progress=False)
    assert str(files[0].parent) in str(error.value)
    assert 1 <= len(seen) < len(litgpt_model.state_dict())  # it failed half-way, after loading something
    assert all(t.is_meta for t in model.state_dict().values())  # nothing that looks loaded is handed back
