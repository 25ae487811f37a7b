"""The transformers its users have, 4.46 through 5.x: what the installed release's ``save_pretrained`` writes loads as
its ``from_pretrained`` loads it, and what the library saves is read by it, or the library says it cannot be.

Every checkpoint here is written by the installed transformers itself, so the file runs as it is under each release
(the oldest, 4.46, and the newest are run by hand; see docs/loading.md). A test of a behaviour only some releases have
skips on the others, naming the release.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from lightning_lowmem import CheckpointFormatError, init_empty, load_checkpoint, save_checkpoint
from lightning_lowmem.transformers.release import at_least, spelled

transformers = pytest.importorskip("transformers")

DTYPE = "dtype" if at_least(4, 56) else "torch_dtype"
"""How from_pretrained and from_config spell the dtype in the installed release (``torch_dtype`` before 4.56)."""


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _pretrained(cls, directory, dtype: torch.dtype | None = None, **kwargs) -> nn.Module:
    """The installed transformers' own ``from_pretrained`` of ``directory`` on the CPU, in eval mode."""
    kwargs |= {DTYPE: dtype} if dtype is not None else {}
    return _quiet(cls.from_pretrained, directory, **kwargs).eval()


def _built(cls, directory, how: str, dtype: torch.dtype | None = None) -> nn.Module:
    """``cls`` of ``directory``'s config, built under ``init_empty()`` or ``torch.device("meta")``."""
    config = transformers.AutoConfig.from_pretrained(directory)
    with init_empty() if how == "init_empty" else torch.device("meta"):
        build = getattr(cls, "from_config", None) or cls._from_config  # an Auto class, or the model's own class
        model = build(config, **({DTYPE: dtype} if dtype is not None else {}))
    return model.eval()


def _assert_same(model: nn.Module, reference: nn.Module) -> None:
    """Every parameter and buffer of ``model`` is ``reference``'s: names, dtypes and values."""
    ours = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    theirs = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype, (name, ours[name].dtype, tensor.dtype)
        assert torch.equal(ours[name], tensor), name


def _random_weights(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


# ---------------------------------------------------------------- names from_pretrained renames

@pytest.fixture(scope="module")
def paligemma_dir(tmp_path_factory):
    """A tiny PaliGemma (Gemma text model, SigLIP vision tower) as ``save_pretrained`` writes it. Since transformers
    4.52 the model holds its language model at ``model.language_model`` and writes ``language_model.model.*``."""
    directory = tmp_path_factory.mktemp("paligemma")
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28,
                  patch_size=14, projection_dim=64)
    config = transformers.PaliGemmaConfig(text_config=text, vision_config=vision, projection_dim=64,
                                          image_token_index=127, vocab_size=128)
    _quiet(lambda: _random_weights(transformers.PaliGemmaForConditionalGeneration(config)).save_pretrained(directory))
    return directory


@pytest.mark.parametrize("how", ["init_empty", "meta device"])
def test_paligemma_saved_with_its_legacy_names_loads_as_from_pretrained_loads_it(paligemma_dir, read_recorder, how):
    cls = transformers.PaliGemmaForConditionalGeneration
    model = _built(cls, paligemma_dir, how)
    report = load_checkpoint(model, paligemma_dir, progress=False)

    _assert_same(model, _pretrained(cls, paligemma_dir))
    if at_least(5):
        assert report.conversion.startswith("transformers' conversion mapping (paligemma, ")
    elif at_least(4, 52):
        assert report.conversion == f"transformers {spelled()} key renaming (paligemma, {cls.__name__})"
    else:  # the model is laid out as its files are named
        assert report.conversion == ""
    assert sorted(read_recorder.keys) == sorted(set(read_recorder.keys))  # each tensor read once


def test_paligemma_held_by_a_plain_module_is_renamed_under_its_prefix(paligemma_dir):
    """A policy holding transformers' PaliGemma as one of its parts (as pi0 does), its weights from the part's own
    ``save_pretrained``."""
    cls = transformers.PaliGemmaForConditionalGeneration

    class Policy(nn.Module):
        def __init__(self, config) -> None:
            super().__init__()
            self.paligemma = cls._from_config(config)

    config = transformers.AutoConfig.from_pretrained(paligemma_dir)
    with init_empty():
        policy = Policy(config).eval()
    load_checkpoint(policy, paligemma_dir, progress=False)
    _assert_same(policy.paligemma, _pretrained(cls, paligemma_dir))


@pytest.fixture(scope="module")
def bert_tf_names_dir(tmp_path_factory):
    """A BertModel checkpoint whose LayerNorms are named as TensorFlow ports name them (``LayerNorm.gamma`` and
    ``.beta``), under its base model prefix (``bert.``, as a task model saves it)."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path_factory.mktemp("bert-tf")
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64)
    _random_weights(transformers.BertModel(config)).save_pretrained(directory)
    state = load_file(directory / "model.safetensors")
    legacy = {"bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in state.items()}
    assert sum(".gamma" in k for k in legacy) == 5
    save_file(legacy, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize("how", ["init_empty", "meta device"])
def test_tensorflow_layernorm_names_load_as_from_pretrained_renames_them(bert_tf_names_dir, how):
    model = _built(transformers.BertModel, bert_tf_names_dir, how)
    report = load_checkpoint(model, bert_tf_names_dir, progress=False)
    _assert_same(model, _pretrained(transformers.BertModel, bert_tf_names_dir))
    assert report.conversion.startswith("transformers' conversion mapping (bert, " if at_least(5) else
                                        f"transformers {spelled()} key renaming (bert, BertModel)")


# ---------------------------------------------------------------- buffers and dtypes as from_pretrained gives them

FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, max_position_embeddings=64)),
    "bert": ("BertModel", "BertConfig", dict(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)),
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                          num_heads=4)),  # keeps its `wo` in float32 under float16
}


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    made = {}

    def get(family: str):
        if family not in made:
            cls, config_cls, kwargs = FAMILIES[family]
            made[family] = tmp_path_factory.mktemp(family)
            model = getattr(transformers, cls)(getattr(transformers, config_cls)(**kwargs))
            _quiet(_random_weights(model).save_pretrained, made[family])
        return made[family]

    return get


@pytest.mark.parametrize("how", ["init_empty", "meta device"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_load_equals_from_pretrained_in_each_dtype(family_dir, family, dtype, how):
    """Non-persistent buffers (RoPE ``inv_freq``, BERT's ``position_ids`` and ``token_type_ids``) as the release's
    ``from_pretrained`` computes them, in the dtype it keeps them in, and its keep-in-fp32 modules in float32."""
    cls = getattr(transformers, FAMILIES[family][0])
    directory = family_dir(family)
    model = _built(cls, directory, how)
    load_checkpoint(model, directory, dtype=dtype, progress=False)
    _assert_same(model, _pretrained(cls, directory, dtype))


def test_a_save_says_its_dtype_as_the_release_reads_it(family_dir, tmp_path):
    """``config.json`` names the dtype where the installed release looks for it (``torch_dtype`` before 4.56), so
    ``from_pretrained(dtype="auto")`` builds the model in the dtype it was saved in."""
    cls = transformers.LlamaForCausalLM
    model = _built(cls, family_dir("llama"), "init_empty")
    load_checkpoint(model, family_dir("llama"), dtype=torch.bfloat16, progress=False)
    save_checkpoint(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["dtype" if at_least(4, 56) else "torch_dtype"] == "bfloat16"
    again = _pretrained(cls, tmp_path, "auto")
    assert again.model.embed_tokens.weight.dtype == torch.bfloat16
    _assert_same(again, model)


# ---------------------------------------------------------------- pre-quantized checkpoints

@pytest.fixture(scope="module")
def llama128_dir(tmp_path_factory):
    """A tiny Llama of 128 dims (bitsandbytes' CPU kernels need at least 64 input features), in bfloat16."""
    directory = tmp_path_factory.mktemp("llama128")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    _quiet(_random_weights(transformers.LlamaForCausalLM(config)).to(torch.bfloat16).save_pretrained, directory)
    return directory


def _needs_bitsandbytes_in_transformers() -> None:
    """Skip where the installed transformers refuses bitsandbytes on this machine (4.46-4.52 run it on CUDA only:
    their backend check refuses a CPU, and fails with an AttributeError under bitsandbytes 0.50 through 4.50)."""
    if at_least(5):
        return
    from transformers.integrations import validate_bnb_backend_availability

    try:
        usable = validate_bnb_backend_availability(raise_exception=False)
    except (AttributeError, RuntimeError) as e:
        usable, why = False, f"{type(e).__name__}: {e}"
    else:
        why = "it finds no device it supports"
    if not usable:
        pytest.skip(f"transformers {spelled()} does not run bitsandbytes on this machine's CPU ({why})")


def _bnb_config(scheme: str):
    if scheme == "bnb.int8":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                           bnb_4bit_use_double_quant=scheme.endswith("-dq"),
                                           bnb_4bit_compute_dtype=torch.bfloat16)


def _logits(model: nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(tokens).logits.float()


@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.nf4-dq", "bnb.int8"])
def test_bitsandbytes_weights_saved_by_transformers_load_as_it_reloads_them(llama128_dir, tmp_path, scheme):
    """In the checkpoint's dtype (bfloat16): transformers 5.25's reload keeps a pre-quantized checkpoint's other
    tensors in their stored dtype whatever ``dtype=`` asks, where 5.3 and 4.x cast them."""
    _needs_bitsandbytes_in_transformers()
    dtype = torch.bfloat16
    cls = transformers.AutoModelForCausalLM
    quantized = _pretrained(cls, llama128_dir, torch.bfloat16, quantization_config=_bnb_config(scheme),
                            device_map="cpu")
    _quiet(quantized.save_pretrained, tmp_path)

    model = _built(cls, tmp_path, "init_empty")
    report = load_checkpoint(model, tmp_path, dtype=dtype, progress=False)
    assert set(report.prequantized.values()) == {scheme} and len(report.prequantized) == 14
    assert torch.equal(_logits(model), _logits(_pretrained(cls, tmp_path, dtype, device_map="cpu")))


@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.int8"])
def test_transformers_reload_without_a_dtype_is_this_load_in_its_default_dtype(llama128_dir, tmp_path, scheme):
    """transformers 4's ``from_pretrained`` of a bitsandbytes checkpoint without a dtype loads the rest of the model
    in float16 (its rule for bitsandbytes), transformers 5 in the dtype the config names: the load given that dtype
    is equal to it (and without one, the module's own dtype is kept)."""
    _needs_bitsandbytes_in_transformers()
    cls = transformers.AutoModelForCausalLM
    quantized = _pretrained(cls, llama128_dir, torch.bfloat16, quantization_config=_bnb_config(scheme),
                            device_map="cpu")
    _quiet(quantized.save_pretrained, tmp_path)
    reference = _pretrained(cls, tmp_path, device_map="cpu")
    default = torch.bfloat16 if at_least(5) else torch.float16
    assert reference.model.norm.weight.dtype == default

    model = _built(cls, tmp_path, "init_empty")
    load_checkpoint(model, tmp_path, dtype=default, progress=False)
    assert torch.equal(_logits(model), _logits(reference))
    kept = _built(cls, tmp_path, "init_empty", torch.bfloat16)
    load_checkpoint(kept, tmp_path, progress=False)
    assert kept.model.norm.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.int8"])
def test_bitsandbytes_saves_are_read_by_transformers(llama128_dir, tmp_path, scheme):
    _needs_bitsandbytes_in_transformers()
    cls = transformers.AutoModelForCausalLM
    model = _built(cls, llama128_dir, "init_empty")
    load_checkpoint(model, llama128_dir, dtype=torch.bfloat16, quantize=scheme, progress=False)
    save_checkpoint(model, tmp_path)
    reference = _pretrained(cls, tmp_path, torch.bfloat16, device_map="cpu")
    assert torch.equal(_logits(reference), _logits(model))


def test_a_quantized_paligemma_with_its_legacy_names_loads_as_from_pretrained_loads_it(tmp_path):
    """The names renamed and the weights loaded as stored, together (a SigLIP without its attention-pooling head,
    whose ``out_proj`` is no plain ``nn.Linear``; key-value heads wide enough for bitsandbytes' CPU kernel)."""
    _needs_bitsandbytes_in_transformers()
    cls = transformers.PaliGemmaForConditionalGeneration
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, head_dim=16, max_position_embeddings=64)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=28,
                  patch_size=14, projection_dim=64, vision_use_head=False)
    config = transformers.PaliGemmaConfig(text_config=text, vision_config=vision, projection_dim=64,
                                          image_token_index=127, vocab_size=128)
    _quiet(_random_weights(cls(config)).save_pretrained, tmp_path / "full")
    quantized = _pretrained(cls, tmp_path / "full", torch.bfloat16, quantization_config=_bnb_config("bnb.nf4"))
    try:
        _quiet(quantized.save_pretrained, tmp_path / "nf4")
    except RuntimeError as e:  # 4.53: "Some tensors share memory" (its tied embedding and lm_head)
        pytest.skip(f"transformers {spelled()} cannot save a quantized PaliGemma ({' '.join(str(e).split())[:120]})")

    model = _built(cls, tmp_path / "nf4", "init_empty", torch.bfloat16)
    report = load_checkpoint(model, tmp_path / "nf4", dtype=torch.bfloat16, progress=False)
    assert len(report.prequantized) == 27 and set(report.prequantized.values()) == {"bnb.nf4"}
    assert report.conversion.startswith("transformers' conversion mapping" if at_least(5) else
                                        f"transformers {spelled()} key renaming")
    tokens = torch.randint(0, 120, (1, 8), generator=torch.Generator().manual_seed(1))
    reference = _pretrained(cls, tmp_path / "nf4", torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, reference(input_ids=tokens).logits)


def _torchao_quantized(directory) -> nn.Module:
    """``directory``'s Llama quantized by torchao's own ``quantize_`` (int8 weights), as transformers' TorchAoConfig
    quantizes it."""
    import torchao.quantization as torchao_q

    model = _pretrained(transformers.AutoModelForCausalLM, directory, torch.bfloat16)
    torchao_q.quantize_(model, torchao_q.Int8WeightOnlyConfig(),
                        filter_fn=lambda module, name: isinstance(module, nn.Linear) and name != "lm_head")
    return model


def test_torchao_weights_pickled_as_transformers_4_saves_them_are_refused_naming_the_way_out(llama128_dir, tmp_path):
    """transformers 4 saves torchao's int8 weights only as a pickle of its tensor subclasses
    (``save_pretrained(safe_serialization=False)``: ``torch.save`` of the state dict); the library builds no tensor
    subclass from a pickle and says so, naming the subclass and what to do."""
    torch.save(_torchao_quantized(llama128_dir).state_dict(), tmp_path / "pytorch_model.bin")
    transformers.AutoConfig.from_pretrained(llama128_dir).save_pretrained(tmp_path)
    model = _built(transformers.AutoModelForCausalLM, tmp_path, "init_empty")
    with pytest.raises(CheckpointFormatError, match=r"q_proj\.weight' is a pickled torchao tensor subclass "
                                                    r"\(torchao\.quantization\.Int8Tensor\), as transformers 4 writes"
                                                    r".*quantize='torchao\.int8wo'"):
        load_checkpoint(model, tmp_path, progress=False)


@pytest.mark.skipif(at_least(5), reason="transformers 5 saves torchao weights as safetensors, whatever it is asked")
def test_transformers_4_torchao_save_is_refused_naming_the_way_out(llama128_dir, tmp_path):
    import torchao.quantization as torchao_q

    try:
        config = transformers.TorchAoConfig(torchao_q.Int8WeightOnlyConfig())
        quantized = _pretrained(transformers.AutoModelForCausalLM, llama128_dir, torch.bfloat16,
                                quantization_config=config)
    except ImportError as e:  # 4.46 imports functions torchao 0.18 no longer has
        pytest.skip(f"transformers {spelled()} cannot quantize with the installed torchao ({e})")
    _quiet(quantized.save_pretrained, tmp_path, safe_serialization=False)
    assert (tmp_path / "pytorch_model.bin").exists() and not list(tmp_path.glob("*.safetensors"))
    with pytest.raises(CheckpointFormatError, match="pickled torchao tensor subclass .*as transformers 4 writes"):
        load_checkpoint(_built(transformers.AutoModelForCausalLM, tmp_path, "init_empty"), tmp_path, progress=False)


def test_a_torchao_save_is_read_by_transformers_5_or_said_unreadable_by_4(llama128_dir, tmp_path):
    cls = transformers.AutoModelForCausalLM
    model = _built(cls, llama128_dir, "init_empty")
    load_checkpoint(model, llama128_dir, dtype=torch.bfloat16, quantize="torchao.int8wo", progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_checkpoint(model, tmp_path)
    said = [str(w.message) for w in caught if "cannot load this save" in str(w.message)]
    if at_least(5):
        assert not said
        assert torch.equal(_logits(_pretrained(cls, tmp_path, torch.bfloat16)), _logits(model))
    else:
        assert len(said) == 1 and said[0].startswith(f"transformers {spelled()} (installed) reads torchao weights "
                                                     "only from a pickled pytorch_model.bin")
        try:  # 4.57 raises; 4.53 loads the model with its quantized Linears missing, initialised at random
            _, info = _quiet(cls.from_pretrained, tmp_path, output_loading_info=True, **{DTYPE: torch.bfloat16})
        except Exception:  # noqa: BLE001  (transformers' own error, whichever it is)
            return
        assert "model.layers.0.self_attn.q_proj.weight" in info["missing_keys"]
