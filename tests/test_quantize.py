"""Quantize on load: every scheme that runs here equals the same library's quantize-after-full-load.

The reference for each scheme is the library's own documented path, written out here:
load the whole bf16 model, then bitsandbytes' "swap in Linear4bit / Linear8bitLt and call
``.to(device)``" or torchao's ``quantize_(model, config)``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import lightning_lowmem.quantize.rows as chunks
from lightning_lowmem import Checkpoint, CheckpointFormatError, DeviceUnavailableError, UnsupportedQuantizationError, init_empty, load_checkpoint
from lightning_lowmem.engine import LoadOptions
from lightning_lowmem.plan import make_plan
from lightning_lowmem.quantize import (
    SCHEMES,
    BnbInt8,
    BnbNF4,
    QuantScheme,
    select_linears,
    TorchaoInt4WeightOnly,
    module_nbytes,
    prepare_quantization,
    register_scheme,
    schemes_available_on,
    tensor_nbytes,
)

litgpt = pytest.importorskip("litgpt")
bnb = pytest.importorskip("bitsandbytes")
torchao_q = pytest.importorskip("torchao.quantization")

ALL_SCHEMES = ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8",
               "torchao.int8wo", "torchao.int8dq", "torchao.int4wo"]
CPU = torch.device("cpu")
ON_CPU = schemes_available_on(CPU)


# ---------------------------------------------------------------- references: the libraries' after-load paths

def quantize_after_load(model: nn.Module, scheme: str, skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Quantize an already loaded model the way each library documents it."""
    def wanted(module: nn.Module, name: str) -> bool:
        return type(module) is nn.Linear and name not in skip and module.weight is not _tied_weight(model)

    device = next(model.parameters()).device
    if scheme.startswith("torchao."):
        torchao_q.quantize_(model, _torchao_config(scheme, device), filter_fn=wanted)
        return model
    for name, mod in list(model.named_modules()):
        if wanted(mod, name):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, _bnb_module(mod, scheme))
    return model.to(device)  # bitsandbytes quantizes on .to(device)


def _torchao_config(scheme: str, device: torch.device):
    if scheme == "torchao.int4wo":  # CUDA: torch's tinygemm layout; elsewhere the plain layout (mslk)
        from torchao.quantization.quantize_.workflows import Int4PackingFormat

        packing = Int4PackingFormat.TILE_PACKED_TO_4D if device.type == "cuda" else Int4PackingFormat.PLAIN
        return torchao_q.Int4WeightOnlyConfig(group_size=128, int4_packing_format=packing)
    return {"torchao.int8wo": torchao_q.Int8WeightOnlyConfig,
            "torchao.int8dq": torchao_q.Int8DynamicActivationInt8WeightConfig}[scheme]()


def _bnb_module(linear: nn.Linear, scheme: str) -> nn.Module:
    args = (linear.in_features, linear.out_features, linear.bias is not None)
    if scheme == "bnb.int8":
        new = bnb.nn.Linear8bitLt(*args, has_fp16_weights=False, threshold=6.0, device="meta")
        new.weight = bnb.nn.Int8Params(linear.weight.data, requires_grad=False, has_fp16_weights=False)
    else:
        quant_type, dq = scheme[4:7], scheme.endswith("-dq")
        new = bnb.nn.Linear4bit(*args, compute_dtype=linear.weight.dtype, compress_statistics=dq,
                                quant_type=quant_type, device="meta")
        new.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, compress_statistics=dq,
                                       quant_type=quant_type, module=new)
    new.bias = linear.bias
    return new


def _tied_weight(model: nn.Module) -> torch.Tensor | None:
    get = getattr(model, "get_input_embeddings", None)
    return get().weight if callable(get) else None


def inner(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors that hold a quantized weight's data."""
    if hasattr(weight, "__tensor_flatten__"):
        names, _ = weight.__tensor_flatten__()
        return {name: getattr(weight, name) for name in names}
    out = {"data": weight.data}
    state = getattr(weight, "quant_state", None)
    if state is not None:
        out |= {k: v for k, v in state.as_dict().items() if isinstance(v, torch.Tensor)}
    if getattr(weight, "SCB", None) is not None:
        out["SCB"] = weight.SCB
    return out


def assert_same_weights(model: nn.Module, ref: nn.Module) -> None:
    ref_modules = dict(ref.named_modules())
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            assert type(mod) is type(ref_modules[name]), name
            got, want = inner(mod.weight), inner(ref_modules[name].weight)
            assert got.keys() == want.keys(), name
            for key in want:
                assert torch.equal(got[key], want[key]), f"{name}: {key}"


# ---------------------------------------------------------------- tiny models

LIT_CONFIG = dict(n_layer=2, n_embd=128, n_head=4, block_size=32, vocab_size=256, padded_vocab_size=256,
                  bias=True, intermediate_size=256)


@pytest.fixture(scope="module")
def lit_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(0)
    model = litgpt.GPT(litgpt.Config(**LIT_CONFIG)).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("lit") / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return path


def lit_load(path, **kwargs):
    with init_empty():
        model = litgpt.GPT(litgpt.Config(**LIT_CONFIG))
    report = load_checkpoint(model, path, dtype=torch.bfloat16, **kwargs)
    return model, report


def lit_linears(skip: tuple[str, ...] = ("lm_head",)) -> set[str]:
    with init_empty():
        model = litgpt.GPT(litgpt.Config(**LIT_CONFIG))
    return {n for n, m in model.named_modules() if type(m) is nn.Linear and n not in skip}


TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(TOKENS)
    return (out.logits if hasattr(out, "logits") else out).float()


# ---------------------------------------------------------------- every scheme == the library after a full load

def _with_chunks() -> list:
    """Every scheme whole; those that quantize in blocks of rows also in blocks of 7 rows."""
    params = []
    for scheme in ALL_SCHEMES:
        marks = [] if scheme in ON_CPU else [pytest.mark.skip(reason=f"{scheme} has no kernel on CPU here")]
        params.append(pytest.param(scheme, None, id=f"{scheme}-whole", marks=marks))
        if SCHEMES[scheme].by_rows:
            params.append(pytest.param(scheme, 1000, id=f"{scheme}-chunked", marks=marks))
    return params


@pytest.mark.parametrize(("scheme", "chunk_elements"), _with_chunks())
def test_litgpt_matches_quantize_after_load(lit_checkpoint, scheme, chunk_elements, monkeypatch):
    if chunk_elements is not None:  # 1000 elements: blocks of 7 rows of 128, a ragged last block
        monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", chunk_elements)
    model, report = lit_load(lit_checkpoint, quantize=scheme)
    assert report.bytes_loaded == module_nbytes(model)  # before a forward grows litgpt's lazily built RoPE tables
    full, _ = lit_load(lit_checkpoint)
    full_logits = logits(full)
    ref = quantize_after_load(full, scheme)

    assert report.quantized == {name: scheme for name in lit_linears()}
    assert set(report.left_out) == {"lm_head"} and "kept in full precision: lm_head (" in str(report)
    out = logits(model)
    torch.testing.assert_close(out, logits(ref), rtol=0, atol=0)
    assert_same_weights(model, ref)
    cosine = nn.functional.cosine_similarity(out.flatten(), full_logits.flatten(), dim=0)
    assert cosine > (0.999 if "int8" in scheme else 0.98)
    # non-Linear modules and the skipped head stay as they were, in bf16
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    assert type(model.transformer.wte) is nn.Embedding and model.transformer.wte.weight.dtype == torch.bfloat16
    assert report.quantized_bytes_before == sum(model.get_submodule(n).in_features * model.get_submodule(n).out_features
                                                * 2 for n in report.quantized)
    assert report.quantized_bytes_after < report.quantized_bytes_before * (0.56 if "int8" in scheme else 0.35)


@pytest.mark.parametrize("scheme", [s for s in ["bnb.nf4-dq", "bnb.fp4", "bnb.int8", "torchao.int8wo"] if s in ON_CPU])
def test_odd_shapes_chunked(tmp_path, scheme, monkeypatch):
    """Rows of 100 elements: 4-bit blocks of 64 straddle rows, and the weight has an odd element count."""
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 300)
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(100, 37), nn.GELU(), nn.Linear(37, 13, bias=False)).to(torch.bfloat16)
    save_file(source.state_dict(), tmp_path / "m.safetensors")
    with init_empty():
        model = nn.Sequential(nn.Linear(100, 37), nn.GELU(), nn.Linear(37, 13, bias=False))
    report = load_checkpoint(model, tmp_path / "m.safetensors", dtype=torch.bfloat16, quantize=scheme)
    ref = quantize_after_load(source, scheme, skip=())
    assert set(report.quantized) == {"0", "2"}
    assert_same_weights(model, ref)
    x = torch.randn(3, 100, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["safetensors", "sharded-safetensors", "pth", "lightning", "fp32-safetensors"])
@pytest.mark.parametrize("scheme", [s for s in ["bnb.nf4-dq", "bnb.int8", "torchao.int8wo"] if s in ON_CPU])
def test_weights_read_by_rows_from_every_format(tmp_path, scheme, kind, monkeypatch):
    """Weights are read from the file a block of rows at a time (never whole), in every format.

    Blocks of 1000 elements (7 rows) and a ragged last block; an fp32 file is cast block by block. The
    result must be the bytes the library gives after a full bf16 load.
    """
    from conftest import write_checkpoint

    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 1000)
    torch.manual_seed(0)
    source = litgpt.GPT(litgpt.Config(**LIT_CONFIG))
    state = source.state_dict() if kind.startswith("fp32") else source.to(torch.bfloat16).state_dict()
    path = write_checkpoint(state, kind.removeprefix("fp32-"), tmp_path)
    reads: list[tuple[str, int, int]] = []
    whole: list[str] = []
    real_rows, real_read = Checkpoint.read_rows, Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read_rows", lambda self, key, a, b, out=None: (
        reads.append((key, a, b)), real_rows(self, key, a, b, out))[1])
    monkeypatch.setattr(Checkpoint, "read",
                        lambda self, key, out=None: (whole.append(key), real_read(self, key, out))[1])

    model, report = lit_load(path, quantize=scheme)
    whole_reads = set(whole)
    ref = quantize_after_load(lit_load(path)[0], scheme)
    assert_same_weights(model, ref)
    torch.testing.assert_close(logits(model), logits(ref), rtol=0, atol=0)
    quantized_weights = {f"{name}.weight" for name in report.quantized}
    assert quantized_weights and not quantized_weights & whole_reads  # none of them was read whole
    fc = "transformer.h.0.mlp.fc.weight"  # 256 x 128: blocks of 7 rows, the last one of 4
    assert [(a, b) for key, a, b in reads if key == fc][:37] == [(a, min(a + 7, 256)) for a in range(0, 256, 7)]
    assert {key for key, _, _ in reads} == quantized_weights
    assert report.quantized_bytes_before == sum(2 * model.get_submodule(n).in_features
                                                * model.get_submodule(n).out_features for n in report.quantized)


def test_file_cut_short_while_a_weight_is_read_by_rows(tmp_path, monkeypatch):
    """The file shrinks half-way through a weight read by rows: a typed error, and nothing left loaded."""
    import os

    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 1000)
    torch.manual_seed(0)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in litgpt.GPT(litgpt.Config(**LIT_CONFIG)).to(torch.bfloat16)
               .state_dict().items()}, path)
    real_rows, calls = Checkpoint.read_rows, []

    def read_rows(self, key, start, stop, out=None):
        calls.append(key)
        if len(set(calls)) == 2 and calls[-3] == key:  # 3rd block of the 2nd weight: the file now ends in it
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                begin, end = json.loads(f.read(size))[key]["data_offsets"]
            os.truncate(path, 8 + size + (begin + end) // 2)
        return real_rows(self, key, start, stop, out)

    monkeypatch.setattr(Checkpoint, "read_rows", read_rows)
    with init_empty():
        model = litgpt.GPT(litgpt.Config(**LIT_CONFIG))
    with pytest.raises(CheckpointFormatError, match="truncated") as error:
        load_checkpoint(model, path, dtype=torch.bfloat16, quantize="bnb.nf4", progress=False)
    assert str(path) in str(error.value) and repr(calls[-1]) in str(error.value)
    assert len(set(calls)) == 2  # it failed in that weight, after quantizing another
    assert all(t.is_meta for t in model.state_dict().values())
    assert all(p.is_meta for p in model.parameters())


# ---------------------------------------------------------------- transformers: tied and output embeddings

@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory):
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    configs = {
        "llama-tied": transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64, tie_word_embeddings=True),
        "neox": transformers.GPTNeoXConfig(vocab_size=128, hidden_size=128, intermediate_size=256,
                                           num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.25,
                                           max_position_embeddings=64, tie_word_embeddings=False),
    }
    for name, config in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        model.save_pretrained(root / name, max_shard_size="100KB")  # a sharded index set
    return root, configs


def hf_load(root, configs, name, **kwargs):
    from transformers import AutoModelForCausalLM

    with init_empty():
        model = AutoModelForCausalLM.from_config(configs[name])
    report = load_checkpoint(model, root / name, dtype=torch.bfloat16, **kwargs)
    return model, report


@pytest.mark.parametrize("scheme", [s for s in ["bnb.nf4", "bnb.int8", "torchao.int8wo"] if s in ON_CPU])
def test_transformers_tied_embeddings_stay_tied(hf_checkpoints, scheme):
    root, configs = hf_checkpoints
    for skip in (None, []):  # even when told to quantize everything, a tied head is left alone
        model, report = hf_load(root, configs, "llama-tied", quantize=scheme, skip_quantize=skip)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
        assert "lm_head" not in report.quantized and len(report.quantized) == 14
    full, _ = hf_load(root, configs, "llama-tied")
    ref = quantize_after_load(full, scheme)
    assert_same_weights(model, ref)
    torch.testing.assert_close(logits(model), logits(ref), rtol=0, atol=0)


def test_transformers_output_embeddings_skipped_by_default(hf_checkpoints):
    root, configs = hf_checkpoints
    model, report = hf_load(root, configs, "neox", quantize="bnb.nf4")
    assert type(model.embed_out) is nn.Linear and "embed_out" not in report.quantized  # get_output_embeddings()
    assert type(model.gpt_neox.layers[0].mlp.dense_h_to_4h) is bnb.nn.Linear4bit
    model, report = hf_load(root, configs, "neox", quantize="bnb.nf4", skip_quantize=[])
    assert type(model.embed_out) is bnb.nn.Linear4bit and "embed_out" in report.quantized
    assert logits(model).isfinite().all()


# ---------------------------------------------------------------- skip_quantize, scheme objects, byte counts

def test_skip_quantize_globs(lit_checkpoint):
    model, report = lit_load(lit_checkpoint, quantize="torchao.int8wo", skip_quantize=["transformer.h.0.*", "*.proj"])
    assert set(report.quantized) == {"lm_head", "transformer.h.1.attn.qkv", "transformer.h.1.mlp.fc"}
    for name in lit_linears(skip=()) - set(report.quantized):
        assert model.get_submodule(name).weight.__class__ is nn.Parameter, name
    assert type(model.lm_head.weight).__name__ == "Int8Tensor"


def test_scheme_object_with_options(lit_checkpoint):
    model, report = lit_load(lit_checkpoint, quantize=BnbNF4(blocksize=128))
    assert model.transformer.h[0].mlp.fc.weight.quant_state.blocksize == 128
    assert set(report.quantized.values()) == {"bnb.nf4"}


def test_tensor_nbytes_counts_quantized_storage():
    linear = nn.Linear(256, 64, bias=False).to(torch.bfloat16)
    torchao_q.quantize_(linear, torchao_q.Int8WeightOnlyConfig())
    # int8 data + float32 scale + int8 zero point per row; the outer storage would claim bf16 size
    assert tensor_nbytes(linear.weight) == 64 * 256 + 64 * 4 + 64
    module = _bnb_module(nn.Linear(256, 64, bias=False).to(torch.bfloat16), "bnb.nf4").to("cpu")
    # 4-bit pairs + one float32 absmax per 64 weights + the 16-entry float32 code table
    assert tensor_nbytes(module.weight) == 64 * 256 // 2 + 64 * 256 // 64 * 4 + 16 * 4


# ---------------------------------------------------------------- errors

def test_unknown_scheme_fails_before_any_io(tmp_path):
    with init_empty():
        model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(UnsupportedQuantizationError, match=r"Unknown quantization scheme 'bnb\.nf5'.*'bnb\.nf4'"):
        load_checkpoint(model, tmp_path / "does-not-exist.safetensors", quantize="bnb.nf5")
    with pytest.raises(ValueError):  # UnsupportedQuantizationError is a ValueError too
        LoadOptions(quantize="int4")
    with pytest.raises(TypeError, match="quantize must be"):
        LoadOptions(quantize=4)
    with pytest.raises(TypeError, match="skip_quantize"):
        LoadOptions(quantize="bnb.nf4", skip_quantize=[3])
    assert LoadOptions(quantize="bnb.nf4", skip_quantize="lm_head").skip_quantize == ("lm_head",)


@pytest.mark.skipif(importlib.util.find_spec("mslk") is not None, reason="mslk is installed: int4 runs on CPU")
def test_int4_without_its_kernel_package_fails_before_reading(lit_checkpoint, monkeypatch):
    reads = []
    original = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, key: reads.append(key) or original(self, key))
    with init_empty():
        model = litgpt.GPT(litgpt.Config(**LIT_CONFIG))
    with pytest.raises(UnsupportedQuantizationError) as error:
        load_checkpoint(model, lit_checkpoint, dtype=torch.bfloat16, quantize="torchao.int4wo")
    message = str(error.value)
    for part in ("'torchao.int4wo'", "'cpu'", "'mslk'", "'bnb.nf4'", "'torchao.int8wo'"):
        assert part in message
    assert "'torchao.int4wo'" not in message.split("work on")[1]
    assert reads == []
    assert type(model.transformer.h[0].mlp.fc) is nn.Linear and model.transformer.h[0].mlp.fc.weight.is_meta


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_scheme_without_cuda_names_the_device(lit_checkpoint):
    # through prepare_quantization: load_checkpoint(device="cuda") stops earlier here, in its CUDA memory monitor
    with init_empty():
        model = litgpt.GPT(litgpt.Config(**LIT_CONFIG))
    with Checkpoint.open(lit_checkpoint) as ckpt:
        plan = make_plan(model, ckpt.records, dtype=torch.bfloat16, device=torch.device("cuda"))
    selection = select_linears(model, plan, BnbInt8(), None)
    with pytest.raises(UnsupportedQuantizationError, match=r"'bnb\.int8' cannot run on device 'cuda'.*CUDA is not"):
        prepare_quantization(model, selection, plan, torch.device("cuda"))
    assert type(model.transformer.h[0].mlp.fc) is nn.Linear


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("quantize", [None, "bnb.nf4"])
def test_load_to_cuda_without_cuda_fails_before_reading(lit_checkpoint, monkeypatch, quantize):
    reads = []
    original = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, key: reads.append(key) or original(self, key))
    with init_empty():
        model = litgpt.GPT(litgpt.Config(**LIT_CONFIG))
    with pytest.raises(DeviceUnavailableError, match=r"device='cuda:1'.*CUDA is not available.*device='cpu'"):
        load_checkpoint(model, lit_checkpoint, device="cuda:1", dtype=torch.bfloat16, quantize=quantize)
    assert reads == []
    assert all(p.is_meta for p in model.parameters())


def test_scheme_configs_are_validated_frozen_and_registered():
    assert set(ALL_SCHEMES) <= set(SCHEMES)
    for bad in (lambda: BnbNF4(blocksize=100), lambda: BnbNF4(quant_type="nf3"), lambda: BnbInt8(threshold=-1.0),
                lambda: TorchaoInt4WeightOnly(group_size=100)):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(dataclasses.FrozenInstanceError):
        BnbNF4().blocksize = 128  # type: ignore[misc]
    with pytest.raises(ValueError, match="already registered"):
        register_scheme("bnb.nf4")(BnbInt8)


def test_a_new_scheme_is_a_new_class(lit_checkpoint):
    @dataclasses.dataclass(frozen=True)
    class HalfPrecision(QuantScheme):  # not quantization, but it exercises the protocol end to end
        package = "torch"

        def load_weight(self, module: nn.Module, weight: torch.Tensor) -> None:
            module.weight = nn.Parameter(weight.to(torch.float16), requires_grad=False)

    register_scheme("test.fp16")(HalfPrecision)
    try:
        model, report = lit_load(lit_checkpoint, quantize="test.fp16")
    finally:
        del SCHEMES["test.fp16"]
    assert set(report.quantized) == lit_linears()
    assert model.transformer.h[0].mlp.fc.weight.dtype == torch.float16 and model.lm_head.weight.dtype == torch.bfloat16


# ---------------------------------------------------------------- CUDA (pending a GPU session here)

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.int8", "torchao.int8wo", "torchao.int4wo"])
def test_cuda_matches_quantize_after_load(lit_checkpoint, scheme):
    if scheme not in schemes_available_on(torch.device("cuda")):
        pytest.skip(f"{scheme} has no kernel on this GPU")
    model, report = lit_load(lit_checkpoint, quantize=scheme, device="cuda")
    full, _ = lit_load(lit_checkpoint, device="cuda")
    ref = quantize_after_load(full, scheme)
    assert report.quantized and all(p.device.type == "cuda" for p in model.parameters())
    assert_same_weights(model, ref)
    global TOKENS
    tokens, TOKENS = TOKENS, TOKENS.cuda()
    try:
        torch.testing.assert_close(logits(model), logits(ref), rtol=0, atol=0)
    finally:
        TOKENS = tokens
