"""Quantize once, load fast: quantize-on-load from bf16 against a reload of the saved quantized checkpoint.

Model: litgpt's ``pythia-1b`` config (1.01 B parameters, 2.02 GB in bf16), random weights (seed 0), the same
checkpoints as ``quantize_memory.py``: a bf16 safetensors file and its HF GPTNeoX twin, cached under
``--workdir``. For each scheme that runs on CPU, prepared once in a fresh process (not timed in the table):
the bf16 file is quantized on load and saved with ``save_checkpoint`` (litgpt layout), and the HF twin is
loaded into a meta-built ``GPTNeoXForCausalLM``, quantized on load and saved (HF layout, ``config.json``
with the ``quantization_config`` transformers reads). Then, each in a fresh process:

* ``quantize on load``: litgpt ``GPT`` on meta, ``load_checkpoint(bf16 file, quantize=scheme)``;
* ``reload (litgpt)``: litgpt ``GPT`` on meta, ``load_checkpoint(saved directory)``: the file says the scheme;
* ``reload (HF)``: ``GPTNeoXForCausalLM`` on meta, ``load_checkpoint(saved HF directory)``;
* ``transformers``: ``from_pretrained(saved HF directory, device_map="cpu")``.

Columns (each states its statistic over ``--repeat`` rounds):

* ``peak/bf16``: peak RSS (``VmHWM``, file-backed pages included) after the load and the touch, minus that of a
  bare ``import torch`` process, over the
  bf16 model bytes (imports included);
* ``load peak/bf16``: peak RSS minus the RSS after the imports (the scheme's library imported first, alike
  for every row), over the bf16 model bytes: what building and loading cost;
* ``final``: bytes of the loaded model (quantized tensors by their inner storage);
* ``seconds``: build + load + touching every page of every weight (transformers maps the file and reads a page at
  first use) wall time, imports excluded;
* ``logits``: whether the logits (2 x 32 fixed tokens) are equal, bit for bit, to the row named.

Usage::

    python benchmarks/prequantized.py [--workdir DIR] [--only SUBSTRING ...] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from common import (
    WORKDIR,
    GiB,
    MiB,
    bare_torch_floor,
    current_rss,
    environment,
    markdown,
    median,
    peak_rss,
    run_fresh,
    spread,
    touch,
)

MODEL = "pythia-1b"
SCHEMES = ("bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.int8", "torchao.int8wo")
METHODS = {"quantize": "quantize on load (bf16 file)", "reload-lit": "reload saved (litgpt layout)",
           "reload-hf": "reload saved (HF layout)", "transformers": "transformers from_pretrained (same HF dir)"}
SAME_AS = {"reload-lit": "quantize", "reload-hf": "transformers", "transformers": "reload-hf"}
LABELS = {"quantize": "quantize on load", "reload-hf": "reload (HF layout)", "transformers": "transformers"}


def _dirs(workdir: Path, scheme: str) -> dict[str, Path]:
    base = workdir / MODEL
    return {"bf16": base / "bf16.safetensors", "hf-bf16": base / "hf", "lit": base / "saved" / scheme,
            "hf": base / "saved-hf" / scheme}


# ---------------------------------------------------------------- worker side

def _gpt():
    from litgpt import GPT, Config

    from lightning_lowmem import init_empty

    with init_empty():
        return GPT(Config.from_name(MODEL))


def _neox(directory: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_lowmem import init_empty

    with init_empty():
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.bfloat16)


def _build(method: str, scheme: str, workdir: Path):
    from lightning_lowmem import load_checkpoint

    dirs = _dirs(workdir, scheme)
    if method == "quantize":
        model = _gpt()
        load_checkpoint(model, dirs["bf16"], dtype=torch.bfloat16, quantize=scheme, progress=False)
    elif method == "reload-lit":
        model = _gpt()
        load_checkpoint(model, dirs["lit"], dtype=torch.bfloat16, progress=False)
    elif method == "reload-hf":
        model = _neox(dirs["hf"])
        load_checkpoint(model, dirs["hf"], progress=False)  # in the dtypes the model was built in, as transformers
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(dirs["hf"], device_map="cpu")
    return model.eval()


def _import_for(scheme: str) -> None:
    import litgpt  # noqa: F401
    import transformers  # noqa: F401

    import lightning_lowmem.quantize  # noqa: F401

    __import__("bitsandbytes" if scheme.startswith("bnb") else "torchao.quantization")


def worker(method: str, scheme: str, workdir: Path) -> dict:
    """One method in this (fresh) process: its peaks, seconds and final bytes; its logits saved beside."""
    _import_for(scheme)
    before = current_rss()
    t0 = time.perf_counter()
    model = _build(method, scheme, workdir)
    touch(model)  # a mapped load defers its reads to first use: every method pays them here
    seconds = time.perf_counter() - t0
    peak = peak_rss()
    from lightning_lowmem.quantize import module_nbytes

    tokens = torch.randint(0, 50000, (2, 32), generator=torch.Generator().manual_seed(1234))
    with torch.inference_mode():
        out = model(tokens)
    logits = getattr(out, "logits", out).float()
    torch.save(logits, workdir / MODEL / f"logits-{method}-{scheme}.pt")
    return {"peak": peak, "before": before, "seconds": seconds, "final": module_nbytes(model)}


def prepare(scheme: str, workdir: Path) -> dict:
    """Quantize on load and save, in both layouts (unless cached); the litgpt save's seconds and extra peak."""
    from lightning_lowmem import MemoryMonitor, load_checkpoint, save_checkpoint

    dirs = _dirs(workdir, scheme)
    out: dict = {}
    if not (dirs["lit"] / "model.safetensors").exists():
        model = _gpt()
        load_checkpoint(model, dirs["bf16"], dtype=torch.bfloat16, quantize=scheme, progress=False)
        with MemoryMonitor() as monitor:
            files = save_checkpoint(model, dirs["lit"])
        out = {"save_seconds": monitor.usage.seconds, "save_peak": monitor.usage.rss_peak_delta,
               "saved_bytes": sum(f.stat().st_size for f in files)}
    if not (dirs["hf"] / "config.json").exists():
        model = _neox(dirs["hf-bf16"])
        load_checkpoint(model, dirs["hf-bf16"], quantize=scheme, progress=False)
        save_checkpoint(model, dirs["hf"])
    return out


# ---------------------------------------------------------------- parent side

def _merge(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    seconds = [r["seconds"] for r in ok]
    return {"peak": max(r["peak"] for r in ok), "before": min(r["before"] for r in ok), "final": ok[0]["final"],
            "seconds": median(seconds), "spread": spread(seconds), "all_seconds": seconds}


def _logits_equal(workdir: Path, method: str, scheme: str) -> str:
    other = SAME_AS.get(method)
    paths = [workdir / MODEL / f"logits-{m}-{scheme}.pt" for m in (method, other)] if other else []
    if not paths or not all(p.exists() for p in paths):
        return "-"
    same = torch.equal(torch.load(paths[0]), torch.load(paths[1]))
    return f"{'equal' if same else 'differ'} to {LABELS[other]}"


def _row(scheme: str, method: str, r: dict, floor: int, bf16: int, logits: str) -> list[str]:
    if "error" in r:
        return [scheme, METHODS[method], *["n/a"] * 5, r["error"]]
    return [scheme, METHODS[method], f"{(r['peak'] - floor) / bf16:.2f}", f"{(r['peak'] - r['before']) / bf16:.2f}",
            f"{r['final'] / GiB:.2f} GiB", f"{r['seconds']:.1f}", r["spread"], logits]


def main() -> None:
    global MODEL
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=MODEL, help=f"litgpt config name (default: {MODEL})")
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    parser.add_argument("--only", nargs="*", default=None, help="the schemes whose name contains one of these")
    parser.add_argument("--repeat", type=int, default=1, help="rounds (peaks: the highest; seconds: the median)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per process")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--prepare", help=argparse.SUPPRESS)
    args = parser.parse_args()
    MODEL = args.model
    if args.worker:
        print(json.dumps(worker(*args.worker, args.workdir)))
        return
    if args.prepare:
        print(json.dumps(prepare(args.prepare, args.workdir)))
        return
    schemes = [s for s in SCHEMES if args.only is None or any(o in s for o in args.only)]
    shared = ["--model", MODEL, "--workdir", str(args.workdir)]
    bf16_ready = run_fresh(Path(__file__).with_name("quantize_memory.py"), ["--prepare", *shared])
    saved = {s: run_fresh(__file__, ["--prepare", s, *shared], args.timeout) for s in schemes}
    if "error" in bf16_ready or any("error" in r for r in saved.values()):
        sys.exit(f"preparing the checkpoints failed: {bf16_ready} {saved}")
    runs = {(s, m): [] for s in schemes for m in METHODS}
    for _ in range(args.repeat):
        for scheme, method in runs:
            runs[scheme, method].append(run_fresh(__file__, ["--worker", method, scheme, *shared], args.timeout))
            print(f"{scheme} {method}: {runs[scheme, method][-1]}", file=sys.stderr, flush=True)
    _report(args, schemes, saved, {key: _merge(r) for key, r in runs.items()})


def _report(args, schemes: list[str], saved: dict, results: dict) -> None:
    from lightning_lowmem import Checkpoint

    with Checkpoint.open(_dirs(args.workdir, schemes[0])["bf16"]) as ckpt:
        bf16 = sum(r.nbytes for r in ckpt.records.values())
    floor = bare_torch_floor()
    n = args.repeat
    print(environment(["bitsandbytes", "torchao", "transformers", "litgpt", "safetensors"]))
    print(f"model: {MODEL} config, random bf16 weights: {bf16 / GiB:.2f} GiB; floor (a bare `import torch` "
          f"process) {floor / MiB:.0f} MiB; {n} fresh process(es) per row, in rounds\n")
    header = ["scheme", "method", f"peak/bf16 (max of {n})", f"load peak/bf16 (max of {n})", "final",
              f"seconds (median of {n})", f"seconds (min-max of {n})", "logits"]
    rows = [_row(s, m, results[s, m], floor, bf16, _logits_equal(args.workdir, m, s)) for s in schemes for m in METHODS]
    print(markdown(header, rows))
    print()
    for scheme in schemes:
        quantize, reload = results[scheme, "quantize"], results[scheme, "reload-lit"]
        if "seconds" in quantize and "seconds" in reload:
            ratios = [a / b for a, b in zip(quantize["all_seconds"], reload["all_seconds"])]
            print(f"{scheme}: quantize on load / reload seconds, round by round: "
                  f"{', '.join(f'{r:.1f}x' for r in ratios)}")
        s = saved[scheme]
        if s:
            print(f"{scheme}: save_checkpoint (one run) {s['save_seconds']:.1f} s, peak {s['save_peak'] / MiB:.0f} MiB "
                  f"above the loaded model, {s['saved_bytes'] / GiB:.2f} GiB on disk")


if __name__ == "__main__":
    main()
