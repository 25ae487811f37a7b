"""Generation memory: litgpt's CLI and Python API against lightning_lowmem, each path in a fresh process.

pythia-1b config with random weights (a litgpt checkpoint directory written
here, with a word-level tokenizer whose token ``w<i>`` is id ``i``), a 64-token
prompt, 50 new tokens, greedy (``top_k=1``), batch 1, CPU.

Paths:
  litgpt-cli          ``litgpt generate <dir>`` (run in-process through litgpt's own CLI entry point)
  litgpt-api          ``LLM.load(dir).generate(...)``
  litgpt-api-patched  the same after ``lightning_lowmem.patch_litgpt()``
  script              ``examples/generate.py --checkpoint_dir <dir>``
  entry-point         ``lightning_lowmem.generate(dir, ...)``

Each child reports its whole-process peak RSS (``VmHWM``), the KV-cache bytes
the model held during generation and tokens/s; the table also has the estimate,
and under it the estimate over each lightning_lowmem path's measured peak.

With ``--gguf``: a SmolLM2-135M-Instruct-shaped GGUF file (Q4_1, random weights, a
49k-token BPE vocabulary and the chat template in its header; ``gguf_files.py``)
through ``lightning_lowmem.generate(file, <64 token ids>)`` (litgpt cannot load a
GGUF file); the import floor then also imports transformers and gguf, which a GGUF
load uses.

    python benchmarks/generate_memory.py [--workdir /tmp/lowmem-bench] [--quantize none bnb.nf4]
    python benchmarks/generate_memory.py --gguf
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import runpy
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import ROOT, WORKDIR, MiB, environment, markdown, peak_rss, random_state, run_fresh
from gguf_files import SMOLLM, write_llama_gguf

PATHS = ("litgpt-cli", "litgpt-api", "litgpt-api-patched", "script", "entry-point")
OURS = ("script", "entry-point")
GGUF_IMPORTS = ", transformers, transformers.modeling_gguf_pytorch_utils, transformers.integrations.ggml, gguf"
PROMPT_TOKENS, NEW_TOKENS = 64, 50


def prompt_text() -> str:
    return " ".join(f"w{i}" for i in range(1, PROMPT_TOKENS + 1))


def write_checkpoint(directory: Path, model_name: str) -> None:
    """A litgpt checkpoint directory with random bf16 weights (``common.random_state``) and a word-level tokenizer."""
    import torch
    from litgpt import Config
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    config = Config.from_name(model_name)
    torch.save(random_state(model_name), directory / "lit_model.pth")
    save_config(config, directory)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(config.padded_vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                 "add_bos_token": False}))


def _ids(text: str) -> list[int]:
    return [int(tok[1:]) for tok in text.split() if re.fullmatch(r"w\d+", tok)]


def child(path: str, directory: Path, quantize: str | None) -> dict:
    """Run one path in this (fresh) process; returns what it measured."""
    import torch

    torch.manual_seed(1234)
    kv_seen = _record_kv_at_first_cached_forward()
    out: dict = {"path": path}
    if path in ("litgpt-api", "litgpt-api-patched"):
        from litgpt.api import LLM

        if path.endswith("patched"):
            import lightning_lowmem

            lightning_lowmem.patch_litgpt()
        llm = LLM.load(str(directory), distribute=None)
        llm.distribute(accelerator="cpu", precision="bf16-true", quantize=quantize)
        t0 = time.perf_counter()
        tokens = llm.generate(prompt_text(), max_new_tokens=NEW_TOKENS, top_k=1, return_as_token_ids=True)
        seconds = time.perf_counter() - t0
        out.update(new=tokens.tolist(), tokens_per_s=len(tokens) / seconds)
    elif path == "entry-point":
        import lightning_lowmem

        prompt = list(range(1, PROMPT_TOKENS + 1)) if directory.suffix == ".gguf" else prompt_text()
        result = lightning_lowmem.generate(directory, prompt, max_new_tokens=NEW_TOKENS, top_k=1,
                                           quantize=quantize, precision="bf16-true")
        out.update(new=result.new_tokens[0].tolist(), tokens_per_s=result.tokens_per_second,
                   own_peak=result.memory.peak)
    else:
        out.update(_run_cli(path, directory, quantize))
    out["kv"] = kv_seen[0] if kv_seen else 0
    out["peak_rss"] = peak_rss()
    return out


def _record_kv_at_first_cached_forward() -> list[int]:
    """Records the KV bytes the model holds when generation starts (litgpt converts fp32 k/v in that forward)."""
    from litgpt.model import GPT

    from lightning_lowmem import cache_bytes

    seen: list[int] = []
    original = GPT.forward

    def forward(self, *args, **kwargs):  # allocates nothing
        if not seen and self.mask_cache is not None:
            seen.append(cache_bytes(self).kv)
        return original(self, *args, **kwargs)

    GPT.forward = forward
    return seen


def _run_cli(path: str, directory: Path, quantize: str | None) -> dict:
    """litgpt's CLI or examples/generate.py, run in this process with its own argv; stdout/stderr captured."""
    flags = ["--prompt", prompt_text(), "--max_new_tokens", str(NEW_TOKENS), "--top_k", "1",
             "--precision", "bf16-true"] + (["--quantize", quantize] if quantize else [])
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        if path == "litgpt-cli":
            from litgpt.__main__ import main

            sys.argv = ["litgpt", "generate", str(directory), *flags]
            main()
        else:
            sys.argv = ["generate.py", "--checkpoint_dir", str(directory), *flags]
            with contextlib.suppress(SystemExit):
                runpy.run_path(str(ROOT / "examples" / "generate.py"), run_name="__main__")
    speed = re.search(r"([\d.]+) tokens/sec", stderr.getvalue())
    lines = [line for line in stdout.getvalue().splitlines() if line.startswith("w")]
    ids = _ids(lines[-1]) if lines else []  # litgpt prints prompt + reply, examples/generate.py the reply
    return {"new": ids[PROMPT_TOKENS:] if path == "litgpt-cli" else ids,
            "tokens_per_s": float(speed.group(1)) if speed else 0.0}


def run_child(path: str, directory: Path, quantize: str | None, gguf: bool = False) -> dict:
    flags = ["--gguf", "--workdir", str(directory.parent.parent)] if gguf else [
        "--workdir", str(directory.parent), "--model", directory.name]
    result = run_fresh(__file__, ["--child", path, *flags, "--quantize", quantize or "none"])
    return {"path": path, **result}


def estimate(directory: Path, quantize: str | None) -> Any:
    """``estimate_memory`` of the request (a ``MemoryEstimate``)."""
    from lightning_lowmem import estimate_memory

    return estimate_memory(directory, quantize=quantize, max_seq_length=PROMPT_TOKENS + NEW_TOKENS,
                           prompt_length=PROMPT_TOKENS)


def ratios(rows: list[dict], floor: int, est: Any) -> str:
    """The estimate over the measured peaks of each lightning_lowmem path: the process's above the import floor
    (the table's column), and generate()'s own (the call's peak above the RSS when it started, what the command
    prints as "peak RSS +N above ..."): a GGUF file's tokenizer is built before that, so it is compared with the
    estimate without its tokenizer line."""
    lines = []
    for r in rows:
        if r["path"] not in OURS or "error" in r:
            continue
        measured = r["peak_rss"] - floor
        lines.append(f"- estimate / measured peak, {r['path']}, the process above the import floor: "
                     f"{est.peak / MiB:.1f} / {measured / MiB:.1f} MiB = {est.peak / measured:.3f}")
        if r.get("own_peak"):
            own = est.peak - est.tokenizer
            lines.append(f"- estimate{' without the tokenizer' if est.tokenizer else ''} / measured peak, {r['path']}, "
                         f"generate()'s own: {own / MiB:.1f} / {r['own_peak'] / MiB:.1f} MiB = {own / r['own_peak']:.3f}")
    return "\n".join(lines)


def table(rows: list[dict], quantize: str | None, floor: int, est: Any) -> str:
    ref = next((r["new"] for r in rows if "new" in r and r["path"] == "litgpt-cli"), None)
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["path"], f"failed: {r['error']}", "", "", "", ""])
            continue
        same = "yes" if ref is not None and r["new"] == ref else ("-" if ref is None else "no")
        out.append([r["path"], f"{r['peak_rss'] / MiB:.0f}", f"{(r['peak_rss'] - floor) / MiB:.0f}",
                    f"{r['kv'] / MiB:.2f}", f"{r['tokens_per_s']:.1f}", same])
    out.append(["`estimate_memory`", "", f"{est.peak / MiB:.0f}", "", "", ""])
    header = ["path", "peak RSS MiB (one run)", "peak - import floor MiB", "KV cache MiB", "tokens/s (one run)",
              "same tokens as CLI"]
    return (f"\n### {quantize or 'bf16'} (import floor {floor / MiB:.0f} MiB)\n\n" + markdown(header, out) + "\n\n"
            + ratios(rows, floor, est))


def import_floor(extra: str = "") -> int:
    """Peak RSS of a process that imports torch, litgpt and lightning_lowmem (and ``extra``, ``", a, b"``)."""
    code = (f"import torch, litgpt, litgpt.api, litgpt.generate.base, lightning_lowmem{extra}\n"
            "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')))")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=WORKDIR / "generate")
    parser.add_argument("--model", default="pythia-1b")
    parser.add_argument("--quantize", nargs="+", default=["none", "bnb.nf4"])
    parser.add_argument("--paths", nargs="+", default=list(PATHS))
    parser.add_argument("--gguf", action="store_true", help="a SmolLM2-135M-shaped Q4_1 GGUF file instead")
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    directory = args.workdir / args.model
    if args.gguf:
        directory = write_llama_gguf(args.workdir / "gguf-smollm2-135m" / "model.Q4_1.gguf", "Q4_1", **SMOLLM)
        args.model, args.paths = directory.name, ["entry-point"]
    if args.child:
        quantize = None if args.quantize[0] == "none" else args.quantize[0]
        print(json.dumps(child(args.child, directory, quantize)))
        return
    if not args.gguf and not (directory / "lit_model.pth").is_file():
        write_checkpoint(directory, args.model)
    print(environment(["lightning", "litgpt", "bitsandbytes"] + (["transformers", "gguf"] if args.gguf else [])))
    model = "SmolLM2-135M-shaped GGUF (Q4_1)" if args.gguf else f"{args.model} config"
    print(f"model: {model}, random weights, {PROMPT_TOKENS}-token prompt + {NEW_TOKENS} new tokens, "
          "greedy, batch 1, CPU; each path one fresh process")
    floor = import_floor(GGUF_IMPORTS if args.gguf else "")
    for q in args.quantize:
        quantize = None if q == "none" else q
        rows = [run_child(path, directory, quantize, args.gguf) for path in args.paths]
        print(table(rows, quantize, floor, estimate(directory, quantize)))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the parent estimates with this checkout's library, as its children run it
    main()
