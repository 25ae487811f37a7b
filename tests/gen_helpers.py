"""Tiny litgpt configs and checkpoint directories for the generation tests."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch


def tiny_config(kind: str = "pythia", **overrides):
    """A 2-layer litgpt ``Config``: ``pythia`` (multi-head, partial RoPE), ``gqa`` (Llama-like, 2 query groups)
    or ``sliding`` (``gqa`` with an 8-token sliding window on layer 0)."""
    from litgpt import Config

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


def tiny_gpt(config, dtype: torch.dtype = torch.float32, seed: int = 0):
    from litgpt import GPT

    torch.manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():  # larger weights than the default init, so greedy tokens vary
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.to(dtype).eval()


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer: token ``t<i>`` is id ``i``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}))


def write_litgpt_dir(directory: Path, config, dtype: torch.dtype = torch.float32, tokenizer: bool = True,
                     seed: int = 0) -> Path:
    """``lit_model.pth`` + ``model_config.yaml`` (+ tokenizer) as litgpt writes them; returns the directory."""
    from litgpt.utils import save_config

    directory.mkdir(parents=True, exist_ok=True)
    torch.save(tiny_gpt(config, dtype, seed).state_dict(), directory / "lit_model.pth")
    save_config(config, directory)
    if tokenizer:
        write_tokenizer(directory, config.padded_vocab_size)
    return directory


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


def write_hf_dir(directory: Path, family: str, *, hidden: int = 32, tie: bool = False,
                 max_shard_size: str | None = None, tokenizer: bool = True):
    """An HF checkpoint of ``family`` (``HF_FUSED``) as ``save_pretrained`` writes it, ``model_config.yaml`` beside
    it; returns the transformers model and the litgpt config."""
    import transformers
    from litgpt.utils import save_config

    cls, hf_kwargs, lit_kwargs = HF_FUSED[family]
    hf_config = getattr(transformers, cls.replace("ForCausalLM", "Config"))(
        vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tie, **hf_kwargs)
    torch.manual_seed(0)
    hf = getattr(transformers, cls)(hf_config).eval()
    with torch.no_grad():  # larger weights than the default init, so greedy tokens vary
        for p in hf.parameters():
            p.normal_(0, 0.3)
    hf.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    config = tiny_config("gqa", n_embd=hidden, intermediate_size=2 * hidden, vocab_size=128, padded_vocab_size=128,
                         norm_eps=1e-5, **lit_kwargs)
    save_config(config, directory)
    if tokenizer:
        write_tokenizer(directory, 128)
    return hf, config


def litgpt_converted(directory: Path, config, destination: Path) -> Path:
    """A copy of HF ``directory`` converted by litgpt's own ``convert_hf_checkpoint`` (``lit_model.pth``)."""
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


def litgpt_cli_tokens(directory: Path, prompt: str, precision: str, max_new_tokens: int) -> list[int]:
    """litgpt's own CLI (``litgpt generate``), run in-process; the ids parsed back from its ``t<i>`` text."""
    from litgpt.generate.base import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        main(directory, prompt=prompt, max_new_tokens=max_new_tokens, top_k=1, precision=precision)
    return [int(t) for t in re.findall(r"\bt(\d+)\b", out.getvalue().strip().splitlines()[-1])]


def kv_formula(config, batch: int, length: int, itemsize: int) -> int:
    """2 * B * n_query_groups * L_layer * head_size * itemsize summed over layers, written out here for the test."""
    total = 0
    for layer in range(config.n_layer):
        sliding = config.sliding_window_size is not None and config.sliding_window_indices[layer]
        span = min(length, config.sliding_window_size) if sliding else length
        total += 2 * batch * config.n_query_groups * span * config.head_size * itemsize
    return total


ROOT = Path(__file__).resolve().parents[1]
PEAK_PROMPT = " ".join(f"t{i}" for i in range(1, 65))
_MEASURE = """
import contextlib, io, json, runpy, sys, torch, litgpt, litgpt.api, litgpt.generate.base, lightning_lowmem
from lightning_lowmem.memory import MemoryMonitor
directory, path, prompt, script = sys.argv[1:]
out, err, model_peak = io.StringIO(), io.StringIO(), None
with MemoryMonitor() as monitor, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    if path == 'entry-point':
        result = lightning_lowmem.generate(directory, prompt, max_new_tokens=50, top_k=1)
        tokens, model_peak = result.tokens[0].tolist(), result.memory.peak
    elif path == 'script':
        sys.argv = [script, '--checkpoint_dir', directory, '--prompt', prompt, '--max_new_tokens', '50', '--top_k', '1']
        with contextlib.suppress(SystemExit):
            runpy.run_path(script, run_name='__main__')
        tokens = [int(t[1:]) for t in out.getvalue().split()]
    else:
        lightning_lowmem.patch_litgpt()
        llm = litgpt.api.LLM.load(directory, distribute=None)
        llm.distribute(accelerator='cpu', precision='bf16-true')
        ids = llm.generate(prompt, max_new_tokens=50, top_k=1, return_as_token_ids=True)
        tokens = list(range(1, 65)) + ids.tolist()
print(json.dumps({'peak': monitor.usage.rss_peak_delta, 'tokens': tokens, 'stderr': err.getvalue(),
                  'model_peak': model_peak}))
"""


def peak_model(base: Path) -> Path:
    """A 45M-parameter bf16 pythia-like checkpoint (87 MiB) with a tokenizer, written once per test session."""
    directory = base / "peak-model"
    if not (directory / "lit_model.pth").is_file():
        config = tiny_config("pythia", n_layer=4, n_embd=512, n_head=8, intermediate_size=2048, vocab_size=32000,
                             padded_vocab_size=32000, block_size=256)
        write_litgpt_dir(directory, config, torch.bfloat16)
    return directory


@functools.lru_cache(maxsize=None)
def measure_in_fresh_process(directory: Path, path: str) -> dict:
    """Peak RSS (above the RSS after imports), tokens and stderr of one generation path, 64 + 50 tokens, greedy.

    For ``entry-point``, ``model_peak`` is generate()'s own measure (load + generation, tokenizer excluded).

    ``path``: ``entry-point`` (lightning_lowmem.generate), ``script`` (examples/generate.py) or
    ``litgpt-api-patched`` (litgpt's LLM after patch_litgpt()).
    """
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(directory), path, PEAK_PROMPT,
                           str(ROOT / "examples" / "generate.py")],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{path} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
