"""Exactly what the eager path gives: after a load, every parameter and buffer (values as bytes, dtype, device) and the
logits equal what the same user code gives without the library, for each face against its own path:

| face | the same user code without the library |
|---|---|
| ``load_checkpoint``, a transformers model | ``from_pretrained(directory, dtype=dtype)`` |
| ``load_checkpoint``, litgpt's ``GPT`` | ``GPT(config).to(dtype)``, ``load_state_dict`` |
| ``Fabric(strategy="lowmem")`` | ``Fabric(precision=...)``: ``init_module(empty_init=True)``, ``setup``, ``load_raw`` |
| ``LowMemCallback`` | ``Trainer(precision=...)``: ``configure_model`` builds the model and ``load_state_dict`` s it |
| ``generate`` | ``litgpt generate`` (``litgpt.generate.base.main``) |
| ``Fabric(strategy="lowmem_fsdp")`` (2 ranks, slow) | Lightning's ``ModelParallelStrategy``, ``setup``, ``load_raw`` |

x {float32, bfloat16, float16} x tiny transformers Llama, Mistral, Qwen2, Qwen3, Gemma2, Phi3, GPT-NeoX, OLMo2, Mixtral,
GPT-2, BERT, T5 and litgpt configs with partial RoPE (pythia), GQA and a sliding window. litgpt's RoPE tables are sized
to the request (what the library is for): they are compared on the rows the loaded model holds, which must be the eager
tables' first rows, in the same dtype.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_lowmem import LowMemCallback, generate, init_empty, load_checkpoint

transformers = pytest.importorskip("transformers")

PRECISIONS = {torch.float32: "32-true", torch.bfloat16: "bf16-true", torch.float16: "16-true"}
DTYPES = list(PRECISIONS)
DTYPE_IDS = ["float32", "bfloat16", "float16"]

_COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               max_position_embeddings=64)
HF = {  # name: (model class, config class, config kwargs beyond _COMMON)
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=2)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(num_key_value_heads=2, sliding_window=8)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(num_key_value_heads=2)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(num_key_value_heads=2, head_dim=8)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(num_key_value_heads=2, head_dim=8, sliding_window=8)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(num_key_value_heads=2, pad_token_id=0)),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {}),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(num_key_value_heads=2)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_key_value_heads=2, num_local_experts=4,
                                                            num_experts_per_tok=2)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    "bert": ("BertForMaskedLM", "BertConfig", {}),
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)),
}
LITGPT = ["pythia", "gqa", "sliding"]
IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))


# ---------------------------------------------------------------- models, checkpoints, comparisons

def _hf_config(name: str):
    cls, config_cls, kwargs = HF[name]
    return getattr(transformers, config_cls)(**{**_COMMON, **kwargs})


def _hf_build(name: str):
    return lambda: getattr(transformers, HF[name][0])(_hf_config(name))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """``hf_dir(name)``: a directory ``save_pretrained`` wrote (float32, weights from N(0, 0.2)) with the same weights
    as a torch file (``torch/weights.pth``: what Lightning's ``load_raw`` reads), each written once."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            directory = tmp_path_factory.mktemp(name)
            torch.manual_seed(0)
            model = _hf_build(name)()
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0, 0.2)
            model.save_pretrained(directory)
            (directory / "torch").mkdir()
            torch.save(model.state_dict(), directory / "torch" / "weights.pth")
            made[name] = directory
        return made[name]

    return get


@pytest.fixture(scope="module")
def lit_dir(tmp_path_factory, tiny_config, write_litgpt_dir):
    """``lit_dir(kind)``: a litgpt directory (``lit_model.pth``, ``model_config.yaml``, a tokenizer) and its config."""
    made: dict[str, tuple[Path, object]] = {}

    def get(kind: str) -> tuple[Path, object]:
        if kind not in made:
            config = tiny_config(kind)
            made[kind] = write_litgpt_dir(tmp_path_factory.mktemp(kind) / kind, config), config
        return made[kind]

    return get


def _logits(model: nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    """The model's logits for ``ids`` (a transformers model's ``.logits``; T5 decodes the ids it encodes)."""
    with torch.no_grad():
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            return model(input_ids=ids, decoder_input_ids=ids).logits
        out = model(ids)
        return out.logits if hasattr(out, "logits") else out


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def assert_same(ours: nn.Module, theirs: nn.Module) -> None:
    """Every parameter and buffer: the same names, dtype, device, shape and bytes (litgpt's RoPE tables on the rows
    ``ours`` holds: it sizes them to the request)."""
    mine, eager = _tensors(ours), _tensors(theirs)
    assert mine.keys() == eager.keys()
    for name, tensor in eager.items():
        got = mine[name].detach()
        tensor = tensor.detach()
        if name.rpartition(".")[2] in ("cos", "sin") and got.dim() == 2 and got.size(0) <= tensor.size(0):
            assert got.size(0) > 0, name  # built for the forward that ran
            tensor = tensor[:got.size(0)]
        assert (got.dtype, got.device, got.shape) == (tensor.dtype, tensor.device, tensor.shape), name
        assert torch.equal(_bytes(got), _bytes(tensor)), name


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def assert_same_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == theirs.dtype and torch.equal(_bytes(ours), _bytes(theirs))


# ---------------------------------------------------------------- load_checkpoint

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", HF)
def test_load_checkpoint_of_a_transformers_model_is_from_pretrained(hf_dir, name, dtype):
    """RoPE ``inv_freq`` / ``original_inv_freq`` in float32 under bf16 and fp16 (the class builds them so), T5's
    ``wo`` in float32 under fp16 (its keep-in-fp32 modules): as ``from_pretrained`` keeps them."""
    directory = hf_dir(name)
    reference = getattr(transformers, HF[name][0]).from_pretrained(directory, dtype=dtype).eval()
    with torch.device("meta"):
        model = _hf_build(name)()
    load_checkpoint(model, directory, dtype=dtype, progress=False)
    assert_same(model.eval(), reference)
    assert_same_logits(_logits(model), _logits(reference))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", LITGPT)
def test_load_checkpoint_of_a_litgpt_model_is_the_model_cast_and_loaded(lit_dir, meta_gpt, kind, dtype):
    from litgpt import GPT

    directory, config = lit_dir(kind)
    reference = GPT(config).to(dtype)
    reference.load_state_dict(torch.load(directory / "lit_model.pth"))
    model = meta_gpt(config)
    load_checkpoint(model, directory / "lit_model.pth", dtype=dtype, progress=False)
    assert_same_logits(_logits(model.eval()), _logits(reference.eval()))
    assert_same(model, reference)


# ---------------------------------------------------------------- Fabric, one device

def _fabric_load(strategy: str, precision: str, build, path: Path) -> tuple[torch.Tensor, nn.Module]:
    """Fabric's documented order: build in ``init_module(empty_init=True)``, ``setup``, ``load_raw``; the logits of
    the set-up model (Fabric converts its outputs) and the module."""
    fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision, strategy=strategy)
    with fabric.init_module(empty_init=True):
        model = build()
    model = fabric.setup(model)
    with contextlib.redirect_stderr(io.StringIO()):
        fabric.load_raw(path, model)
    model.eval()
    return _logits(model), model.module


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", [*HF, *LITGPT])
def test_fabric_lowmem_is_fabric(hf_dir, lit_dir, name, dtype):
    """Lightning's one-device precision converts the whole module (``module.to(dtype)``): transformers' ``inv_freq``
    and litgpt's RoPE tables in bf16 under ``bf16-true``, as Fabric without the library leaves them."""
    if name in HF:
        build, path = _hf_build(name), hf_dir(name) / "torch" / "weights.pth"
    else:
        from litgpt import GPT

        directory, config = lit_dir(name)
        build, path = (lambda: GPT(config)), directory / "lit_model.pth"
    logits, model = _fabric_load("lowmem", PRECISIONS[dtype], build, path)
    eager_logits, eager = _fabric_load("auto", PRECISIONS[dtype], build, path)
    assert_same_logits(logits, eager_logits)
    assert_same(model, eager)


# ---------------------------------------------------------------- Trainer, one device

class _Wrapped(L.LightningModule):
    """A LightningModule building its model in ``configure_model``; with ``path``, loading it there as users do
    without the library (``load_state_dict``)."""

    def __init__(self, build, path: Path | None = None) -> None:
        super().__init__()
        self.build, self.path = build, path
        self.model: nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.build()
            if self.path is not None:
                self.model.load_state_dict(torch.load(self.path, weights_only=True))

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return _logits(self.model, batch)


def _trainer_predict(precision: str, build, path: Path, callback: bool) -> tuple[torch.Tensor, nn.Module]:
    module = _Wrapped(build, None if callback else path)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=precision, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[LowMemCallback(path, progress=False)] if callback else [])
    (out,) = trainer.predict(module, DataLoader(IDS, batch_size=len(IDS)))
    return out, module.model


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", [*LITGPT, *[pytest.param(n, marks=pytest.mark.slow) for n in HF]])
def test_the_callback_is_the_trainer(hf_dir, lit_dir, name, dtype):
    """The reported case: under ``bf16-true`` the Trainer converts litgpt's RoPE tables to bf16 (its precision plugin
    after ``configure_model``); the callback's model predicts with the same tables, not float32 ones."""
    if name in HF:
        build, path = _hf_build(name), hf_dir(name) / "torch" / "weights.pth"
    else:
        from litgpt import GPT

        directory, config = lit_dir(name)
        build, path = (lambda: GPT(config)), directory / "lit_model.pth"
    out, model = _trainer_predict(PRECISIONS[dtype], build, path, callback=True)
    eager_out, eager = _trainer_predict(PRECISIONS[dtype], build, path, callback=False)
    assert_same_logits(out, eager_out)
    assert_same(model, eager)


# ---------------------------------------------------------------- generate

class _Recorded:
    """litgpt's ``generate`` function, recording the model's RoPE tables and KV caches after each call."""

    def __init__(self, original) -> None:
        self.original, self.calls = original, []

    def __call__(self, model, prompt, max_returned_tokens, *args, **kwargs):
        tokens = self.original(model, prompt, max_returned_tokens, *args, **kwargs)
        gpt = getattr(model, "module", model)
        cache = gpt.transformer.h[0].attn.kv_cache
        self.calls.append(dict(tokens=tokens.clone(), cos=gpt.cos.clone(), sin=gpt.sin.clone(),
                               kv=(cache.k.dtype, tuple(cache.k.shape)), mask=tuple(gpt.mask_cache.shape)))
        return tokens


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", LITGPT)
def test_generate_is_litgpt_generate(lit_dir, monkeypatch, kind, dtype):
    """litgpt's own ``litgpt generate`` sets ``max_seq_length`` (RoPE in float32) and then converts the model with
    its precision: bf16 tables under ``bf16-true``. The library's generate holds the same tables (sized to prompt +
    max_new_tokens, as litgpt's), the same KV caches, and gives the same tokens."""
    import litgpt.generate.base as base

    directory, _ = lit_dir(kind)
    recorded = _Recorded(base.generate)
    monkeypatch.setattr(base, "generate", recorded)
    prompt = "t1 t2 t3 t4 t5"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        base.main(directory, prompt=prompt, max_new_tokens=12, top_k=1, precision=PRECISIONS[dtype])
        generate(directory, prompt, max_new_tokens=12, top_k=1, precision=PRECISIONS[dtype])
    eager, ours = recorded.calls
    assert torch.equal(ours["tokens"], eager["tokens"])
    assert (ours["kv"], ours["mask"]) == (eager["kv"], eager["mask"])
    for table in ("cos", "sin"):
        assert ours[table].dtype == eager[table].dtype == dtype and torch.equal(ours[table], eager[table])


def test_generate_quantized_with_bitsandbytes_keeps_the_rope_tables_litgpt_keeps(lit_dir):
    """litgpt's generate quantizes through Lightning's ``BitsandbytesPrecision`` (CUDA only, so not run here), whose
    ``convert_module`` converts no buffer: its tables stay as ``rope_cache()`` computes them after the
    ``max_seq_length`` setter, float32. The library's generate keeps them so (and counts them so)."""
    from lightning_lowmem import estimate_memory
    from lightning_lowmem.litgpt.generation import load_for_generation
    from lightning_lowmem.litgpt.kv_cache import setup_kv_cache

    pytest.importorskip("bitsandbytes")
    directory, _ = lit_dir("gqa")
    model, _, _ = load_for_generation(directory, quantize="bnb.nf4")
    setup_kv_cache(model, 1, 17)
    gpt = model.module
    cos, sin = gpt.rope_cache()
    assert gpt.cos.dtype == torch.float32 and torch.equal(gpt.cos, cos) and torch.equal(gpt.sin, sin)
    assert gpt.transformer.h[0].attn.kv_cache.k.dtype == torch.bfloat16
    assert estimate_memory(directory, quantize="bnb.nf4", max_seq_length=17).rope == 2 * cos.numel() * 4


# ---------------------------------------------------------------- FSDP2, two ranks

FSDP = """
import lightning as L
from lightning.fabric.strategies import ModelParallelStrategy
from litgpt import GPT
from lightning_lowmem.placement import shard_model

dtype = {"32-true": torch.float32, "bf16-true": torch.bfloat16}[args["precision"]]
tokens = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(1))
results = {}
for face in ("eager", "lowmem"):
    strategy = "lowmem_fsdp" if face == "lowmem" else ModelParallelStrategy(
        parallelize_fn=shard_model, data_parallel_size=world, tensor_parallel_size=1)  # as lowmem_fsdp's "auto"
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, precision=args["precision"])
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = GPT(config())
    model = fabric.setup(model)
    fabric.load_raw(args["path"], model)  # Lightning's own (each rank torch.load, rank 0's values broadcast), or ours
    with torch.no_grad():
        logits = model(tokens)
    inner = model.module
    results[face] = dict(logits=logits, cos=inner.cos, sin=inner.sin,
                         shards={n: p.to_local() if hasattr(p, "to_local") else p for n, p in inner.named_parameters()})
ours, eager = results["lowmem"], results["eager"]
rows = ours["cos"].size(0)
emit(logits=torch.equal(ours["logits"], eager["logits"]) and ours["logits"].dtype == eager["logits"].dtype,
     rope_dtypes=[str(ours["cos"].dtype), str(eager["cos"].dtype)], rows=rows,
     rope=all(torch.equal(ours[t], eager[t][:rows]) for t in ("cos", "sin")),
     shards=ours["shards"].keys() == eager["shards"].keys() and all(
         torch.equal(p, eager["shards"][n]) and p.dtype == eager["shards"][n].dtype for n, p in ours["shards"].items()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
def test_lowmem_fsdp_is_lightnings_model_parallel_strategy(run_ranks, shard_config, write_checkpoint, tiny_gpt,
                                                           tmp_path, precision):
    """FSDP2 without the library (Lightning's ModelParallelStrategy and load_raw): ``setup`` converts the model,
    then materializes it (``to_empty`` + ``reset_parameters()``), which computes litgpt's RoPE tables again in
    float32. The library's face holds the same tables, shards and logits, on each of 2 ranks."""
    from litgpt import Config

    path = write_checkpoint(tiny_gpt(Config(**shard_config), std=0.3).state_dict(), "pth", tmp_path)
    ranks = run_ranks(FSDP, dict(config=shard_config, path=str(path), precision=precision), init=False, timeout=500)
    for result in ranks:
        assert result.returncode == 0, result.stderr[-3000:]
        got = result.values
        assert got["rope_dtypes"] == ["torch.float32", "torch.float32"] and got["rows"] > 0, got
        assert got["rope"] and got["shards"] and got["logits"], got


TRAINER_FSDP = """
import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy
from litgpt import GPT
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from lightning_lowmem import LowMemCallback
from lightning_lowmem.placement import shard_model

class Lit(L.LightningModule):
    def __init__(self, load):
        super().__init__()
        self.model, self.load = None, load

    def configure_model(self):
        if self.model is None:  # on meta (the strategy's init context, or the callback's), sharded
            self.model = shard_model(GPT(config()), self.device_mesh)

    def on_predict_start(self):
        if self.load:  # without the library: after the strategy materialized the shards, the full state set into them
            set_model_state_dict(self.model, torch.load(args["path"], weights_only=True),
                                 options=StateDictOptions(full_state_dict=True))

    def predict_step(self, batch, batch_idx):
        return self.model(batch)

data = torch.utils.data.DataLoader(torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(0)),
                                   batch_size=2)
results = {}
for face in ("eager", "lowmem"):
    module = Lit(load=face == "eager")
    trainer = L.Trainer(accelerator="cpu", devices=world, precision=args["precision"], logger=False,
                        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                        callbacks=[LowMemCallback(args["path"], progress=False)] if face == "lowmem" else [],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    (logits,) = trainer.predict(module, data)
    inner = module.model
    results[face] = dict(logits=logits, cos=inner.cos, shards={
        n: p.to_local() if hasattr(p, "to_local") else p for n, p in inner.named_parameters()})
ours, eager = results["lowmem"], results["eager"]
rows = ours["cos"].size(0)
emit(logits=torch.equal(ours["logits"], eager["logits"]) and ours["logits"].dtype == eager["logits"].dtype,
     rope_dtypes=[str(ours["cos"].dtype), str(eager["cos"].dtype)], rows=rows,
     rope=torch.equal(ours["cos"], eager["cos"][:rows]),
     shards=ours["shards"].keys() == eager["shards"].keys() and all(
         torch.equal(p, eager["shards"][n]) and p.dtype == eager["shards"][n].dtype for n, p in ours["shards"].items()))
"""


@pytest.mark.slow
def test_the_callback_under_model_parallel_strategy_is_the_trainer(run_ranks, shard_config, write_checkpoint,
                                                                    tiny_gpt, tmp_path):
    """The Trainer's ModelParallelStrategy materializes the shards (``reset_parameters()``: float32 RoPE tables) and
    then converts the module with its precision (bf16-true: bf16 tables), the other order from Fabric's. The callback
    loads in ``configure_model``; the Trainer's conversion then converts its tables as it converts the eager ones."""
    from litgpt import Config

    path = write_checkpoint(tiny_gpt(Config(**shard_config), std=0.3).state_dict(), "pth", tmp_path)
    ranks = run_ranks(TRAINER_FSDP, dict(config=shard_config, path=str(path), precision="bf16-true"), init=False,
                      timeout=500)
    for result in ranks:
        assert result.returncode == 0, result.stderr[-3000:]
        got = result.values
        assert got["rope_dtypes"] == ["torch.bfloat16", "torch.bfloat16"] and got["rows"] > 0, got
        assert got["rope"] and got["shards"] and got["logits"], got
