"""Quantize on load vs load-then-quantize: peak host memory, final bytes, time and logit quality.

Model: litgpt's ``pythia-1b`` config (1.01 B parameters, 2.02 GB in bf16) with random
weights (seed 0, litgpt's own init, built directly in bf16), written once as one
safetensors file (``benchmarks/common.py``). The transformers rows read the *same* weights,
converted to the HF GPTNeoX layout with litgpt's ``copy_weights_gpt_neox`` and written by
``GPTNeoXForCausalLM.save_pretrained``. Both are cached under ``--workdir``.

Every method runs in a fresh subprocess. Columns:

* ``peak/bf16``: the process's peak RSS (``VmHWM``) during build + load + quantize, minus
  the peak RSS of a process that only ran ``import torch``, over the bf16 model bytes. It
  includes the imports (litgpt alone adds ~200 MB, 0.10x);
* ``load peak/bf16``: the same peak minus the RSS after the imports (the method's quantization
  library included, for every method alike), before the model is built: what building, loading
  and quantizing cost;
* ``final``: bytes of the loaded model's parameters and buffers (quantized tensors counted
  by their inner storage, see ``lightning_lowmem.quantize.module_nbytes``);
* ``peak with forward/bf16``: the peak after one forward on the quality batch (mmap-backed
  weights are only paged in by their first use);
* ``seconds``: build + load + quantize wall time, imports excluded;
* ``cosine`` / ``SQNR``: logits (float64) on a fixed batch of 2 x 32 tokens against the same
  family's bf16 model (litgpt rows vs the lightning_lowmem bf16 load, transformers rows vs
  transformers bf16), from the first round (the weights and the batch are the same every round).

With ``--repeat N`` the peaks are the highest of the N rounds and the seconds their median
(and, in a column of their own, their range).

Usage::

    python benchmarks/quantize_memory.py [--workdir DIR] [--only SUBSTRING ...] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    write_checkpoints,
    write_hf_twin,
)

MODEL = "pythia-1b"
BATCH = (2, 32)  # (batch, tokens) of the fixed quality batch

# name -> (family, description); the worker dispatches on the prefix before ":"
METHODS: dict[str, str] = {
    "lowmem:bf16": "lightning_lowmem, bf16 (no quantization)",
    "hf:bf16": "transformers from_pretrained, bf16",
    "after-torchao:int8wo": "torchao: load, then quantize_ int8wo",
    "after-torchao:int8dq": "torchao: load, then quantize_ int8dq",
    "after-bnb:nf4": "bitsandbytes: load, then swap + .to() nf4",
    "after-bnb:int8": "bitsandbytes: load, then swap + .to() int8",
    "hf-torchao:int8wo": "transformers + TorchAoConfig int8wo",
    "hf-bnb:nf4": "transformers + BitsAndBytesConfig nf4",
    "hf-bnb:int8": "transformers + BitsAndBytesConfig int8",
    **{f"lowmem:{s}": f"lightning_lowmem {s}" for s in (
        "bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8",
        "torchao.int8wo", "torchao.int8dq", "torchao.int4wo")},
    "lowmem:bnb.nf4:all": "lightning_lowmem bnb.nf4, lm_head quantized too",
    "lowmem:bnb.int8:all": "lightning_lowmem bnb.int8, lm_head quantized too",
    "lowmem:torchao.int8wo:all": "lightning_lowmem torchao.int8wo, lm_head quantized too",
}


# ---------------------------------------------------------------- measurements (worker side)

def _lit_path(workdir: Path) -> Path:
    return workdir / MODEL / "bf16.safetensors"


def _lit_config():
    from litgpt import Config

    return Config.from_name(MODEL)


def _batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, _lit_config().vocab_size, BATCH, generator=gen)


def _skip_lm_head(module: torch.nn.Module, fqn: str) -> bool:
    return type(module) is torch.nn.Linear and fqn not in ("lm_head", "embed_out")


def _build_lowmem(workdir: Path, scheme: str) -> torch.nn.Module:
    from litgpt import GPT

    from lightning_lowmem import init_empty, load_checkpoint

    name, _, extent = scheme.partition(":")
    with init_empty():
        model = GPT(_lit_config())
    load_checkpoint(model, _lit_path(workdir), dtype=torch.bfloat16,
                    quantize=None if name == "bf16" else name, skip_quantize=[] if extent == "all" else None)
    return model


def _load_then(workdir: Path) -> torch.nn.Module:
    """The usual idiom: meta model, ``load_file`` (mmap), ``load_state_dict(assign=True)``."""
    from litgpt import GPT
    from safetensors.torch import load_file

    with torch.device("meta"):
        model = GPT(_lit_config())
    model.load_state_dict(load_file(_lit_path(workdir)), assign=True)
    model.cos, model.sin = model.rope_cache(device=torch.device("cpu"))  # non-persistent, left on meta
    return model


def _build_after_torchao(workdir: Path, scheme: str) -> torch.nn.Module:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    model = _load_then(workdir)
    config = {"int8wo": Int8WeightOnlyConfig, "int8dq": Int8DynamicActivationInt8WeightConfig}[scheme]()
    quantize_(model, config, filter_fn=_skip_lm_head)
    return model


def _build_after_bnb(workdir: Path, scheme: str) -> torch.nn.Module:
    import bitsandbytes as bnb

    model = _load_then(workdir)
    for name, mod in list(model.named_modules()):
        if not _skip_lm_head(mod, name):
            continue
        if scheme == "int8":
            new = bnb.nn.Linear8bitLt(mod.in_features, mod.out_features, mod.bias is not None,
                                      has_fp16_weights=False, threshold=6.0, device="meta")
            new.weight = bnb.nn.Int8Params(mod.weight.data, requires_grad=False, has_fp16_weights=False)
        else:
            new = bnb.nn.Linear4bit(mod.in_features, mod.out_features, mod.bias is not None,
                                    compute_dtype=torch.bfloat16, compress_statistics=False, quant_type=scheme,
                                    device="meta")
            new.weight = bnb.nn.Params4bit(mod.weight.data, requires_grad=False, compress_statistics=False,
                                           quant_type=scheme, module=new)
        new.bias = mod.bias
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)
    return model.to("cpu")  # bitsandbytes quantizes on .to(device)


def _build_hf(workdir: Path, scheme: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TorchAoConfig

    configs = {"bf16": lambda: None,
               "int8wo": lambda: TorchAoConfig(__import__("torchao.quantization").quantization.Int8WeightOnlyConfig()),
               "nf4": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                 bnb_4bit_compute_dtype=torch.bfloat16),
               "int8": lambda: BitsAndBytesConfig(load_in_8bit=True)}
    return AutoModelForCausalLM.from_pretrained(workdir / MODEL / "hf", dtype=torch.bfloat16, device_map="cpu",
                                                quantization_config=configs[scheme]())


BUILDERS = {"lowmem": _build_lowmem, "after-torchao": _build_after_torchao, "after-bnb": _build_after_bnb,
            "hf": _build_hf, "hf-torchao": _build_hf, "hf-bnb": _build_hf}


def _import_for(method: str) -> None:
    """Import what the method needs (its quantization library included, for every method alike) before the
    measured block starts."""
    import litgpt  # noqa: F401

    import lightning_lowmem.quantize  # noqa: F401  (module_nbytes for the final bytes)

    if "bnb" in method:
        import bitsandbytes  # noqa: F401
    if "torchao" in method:
        import torchao.quantization  # noqa: F401
    if method.startswith("hf"):
        import transformers  # noqa: F401


def _logits(model: torch.nn.Module, family: str) -> torch.Tensor:
    with torch.inference_mode():
        out = model(_batch())
    return (out.logits if family == "hf" else out).double()


def worker(method: str, workdir: Path) -> dict:
    """Run one method in this (fresh) process; return its measurements."""
    kind, _, scheme = method.partition(":")
    _import_for(method)
    rss_before = current_rss()
    t0 = time.perf_counter()
    model = BUILDERS[kind](workdir, scheme)
    seconds = time.perf_counter() - t0
    peak = peak_rss()
    from lightning_lowmem.quantize import module_nbytes

    family = "hf" if kind.startswith("hf") else "lit"
    logits = _logits(model, family)
    peak_forward = peak_rss()
    ref_path = workdir / f"ref-logits-{family}.pt"
    if scheme == "bf16":
        torch.save(logits, ref_path)
    ref = torch.load(ref_path)
    cos = torch.nn.functional.cosine_similarity(logits.flatten(), ref.flatten(), dim=0).item()
    err = (logits - ref).pow(2).sum().item()
    sqnr = float("inf") if err == 0 else 10 * torch.log10(ref.pow(2).sum() / err).item()
    return {"peak": peak, "peak_forward": peak_forward, "final": module_nbytes(model),
            "before": rss_before, "seconds": seconds,
            "cosine": cos, "sqnr": sqnr}


# ---------------------------------------------------------------- checkpoints (prepared once, in a subprocess)

def prepare(workdir: Path) -> None:
    """Write the random bf16 litgpt checkpoint and its HF GPTNeoX twin, unless cached."""
    lit_path = write_checkpoints(MODEL, workdir, ["bf16.safetensors"])["bf16.safetensors"]
    hf_dir = workdir / MODEL / "hf"
    if not (hf_dir / "model.safetensors").exists():
        write_hf_twin(MODEL, lit_path, hf_dir)


# ---------------------------------------------------------------- the table (parent side)

def _row(name: str, r: dict, floor: int, model_bytes: int) -> list[str]:
    if "error" in r:
        return [METHODS[name], *["n/a"] * 7, r["error"]]
    peak, load = (r["peak"] - floor) / model_bytes, (r["peak"] - r["before"]) / model_bytes
    final = f"{r['final'] / GiB:.2f} GiB ({r['final'] / model_bytes:.2f})"
    return [METHODS[name], f"{peak:.2f}", f"{load:.2f}", final, f"{(r['peak_forward'] - floor) / model_bytes:.2f}",
            f"{r['seconds']:.1f}", r["spread"], f"{r['cosine']:.5f}", f"{r['sqnr']:.1f} dB"]


# lightning_lowmem row -> the same library's load-then-quantize row, for the load-time ratio
SAME_LIBRARY = {"lowmem:bnb.nf4": "after-bnb:nf4", "lowmem:bnb.int8": "after-bnb:int8",
                "lowmem:torchao.int8wo": "after-torchao:int8wo", "lowmem:torchao.int8dq": "after-torchao:int8dq"}


def _merge(runs: list[dict]) -> dict:
    """Several runs of one method: the highest peaks, the median seconds (and their range)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    merged = dict(ok[0])
    for key in ("peak", "peak_forward", "final"):
        merged[key] = max(r[key] for r in ok)
    merged["before"] = min(r["before"] for r in ok)
    seconds = [r["seconds"] for r in ok]
    merged["seconds"], merged["spread"] = median(seconds), spread(seconds)
    return merged


def _time_ratios(runs: dict[str, list[dict]], ours: str, theirs: str) -> list[float]:
    """Our seconds over theirs, round by round (the two ran minutes apart, under the same load)."""
    return [a["seconds"] / b["seconds"] for a, b in zip(runs.get(ours, []), runs.get(theirs, []))
            if "seconds" in a and "seconds" in b]


def main() -> None:
    global MODEL
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=MODEL, help=f"litgpt config name (default: {MODEL})")
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    parser.add_argument("--only", nargs="*", default=None, help="run the methods whose name contains one of these")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per method")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds over all methods (peaks: the highest; seconds: the median and range)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    MODEL = args.model
    if args.worker:
        print(json.dumps(worker(args.worker, args.workdir)))
        return
    if args.prepare:
        prepare(args.workdir)
        print(json.dumps({"prepared": str(args.workdir)}))
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    prepared = run_fresh(__file__, ["--prepare", "--model", MODEL, "--workdir", str(args.workdir)])
    if "error" in prepared:
        sys.exit(f"writing the checkpoints failed: {prepared['error']}")
    model_bytes = _bf16_bytes(_lit_path(args.workdir))
    floor = bare_torch_floor()
    names = [n for n in METHODS if args.only is None or "bf16" in n or any(o in n for o in args.only)]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.repeat):  # rounds, so that a slow spell on the machine hits every method alike
        for name in names:
            runs[name].append(run_fresh(__file__, ["--worker", name, "--model", MODEL, "--workdir", str(args.workdir)],
                                        args.timeout))
            print(f"{name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    results = {name: _merge(r) for name, r in runs.items()}
    print(environment(["bitsandbytes", "torchao", "transformers", "litgpt"]))
    print(f"model: {MODEL} config, random bf16 weights: {model_bytes / GiB:.2f} GiB; floor (a bare `import torch` "
          f"process) {floor / MiB:.0f} MiB; {args.repeat} fresh process(es) per method, in rounds\n")
    header = ["method", f"peak/bf16 (max of {args.repeat})", f"load peak/bf16 (max of {args.repeat})",
              "final (/bf16)", f"peak with forward/bf16 (max of {args.repeat})", f"seconds (median of {args.repeat})",
              f"seconds (min-max of {args.repeat})", "cosine", "SQNR"]
    print(markdown(header, [_row(name, results[name], floor, model_bytes) for name in names]))
    print()
    for ours, theirs in SAME_LIBRARY.items():
        ratios = _time_ratios(runs, ours, theirs)
        if ratios:
            print(f"load time {ours} / {theirs}: median {statistics.median(ratios):.2f} "
                  f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})")


def _bf16_bytes(path: Path) -> int:
    from lightning_lowmem import Checkpoint

    with Checkpoint.open(path) as ckpt:
        return sum(r.nbytes for r in ckpt.records.values())


if __name__ == "__main__":
    main()
