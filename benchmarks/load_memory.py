"""Peak host memory and time of loading one checkpoint, each method in a fresh process.

    python benchmarks/load_memory.py                    # pythia-1b config, random bf16 weights
    python benchmarks/load_memory.py --model pythia-160m --repeat 3

The checkpoint is written once (``benchmarks/common.py``) as one safetensors file, a sharded
safetensors set (4 shards + index) and a torch ``.pth``, plus an fp32 safetensors file for the
fp32 -> bf16 rows. Every method runs in its own process with the checkpoint read into the page
cache just before it. Columns:

- peak RSS above a bare ``import torch`` process, as a multiple of the final bf16 model's bytes
  (this includes importing lightning/litgpt/accelerate: ~0.10x of pythia-1b);
- peak RSS of the load itself above the RSS just before it, as a multiple of the model;
- the load's peak anonymous (allocated) and file-backed (mapped file pages) RSS;
- seconds for build + load + touching every page of every weight once (a memory-mapped load
  defers its reads to first use; touching makes every method pay them in the block);
- time over the fastest other method on the same checkpoint (medians).
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
    MiB,
    bare_torch_floor,
    environment,
    markdown,
    median,
    peak_rss,
    run_fresh,
    spread,
    touch,
    warm_page_cache,
    write_checkpoints,
)

METHODS = {
    "naive": "build in bf16, load_state_dict(load(...))",
    "torch-native": "meta + mmap load + load_state_dict(assign=True)",
    "accelerate": "init_empty_weights + load_checkpoint_and_dispatch",
    "fabric": "Fabric.init_module(empty_init=True) + load_raw",
    "lowmem": "lightning_lowmem init_empty + load_checkpoint",
    "lowmem-mmap": "lightning_lowmem init_empty + load_checkpoint(mmap=True)",
}
CASES = [  # (checkpoint, methods); Fabric's load_raw goes through torch.load, which reads torch files only
    ("bf16.safetensors", ["naive", "torch-native", "accelerate", "lowmem", "lowmem-mmap"]),
    ("bf16-sharded", ["naive", "torch-native", "accelerate", "lowmem", "lowmem-mmap"]),
    ("bf16.pth", ["naive", "torch-native", "accelerate", "fabric", "lowmem", "lowmem-mmap"]),
    ("fp32.safetensors", ["naive", "torch-native", "accelerate", "lowmem"]),
]


def _load_any(path: Path, mmap: bool) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if path.name.endswith(".index.json"):
        state = {}
        for f in sorted(set(json.loads(path.read_text())["weight_map"].values())):
            state.update(load_file(path.parent / f))
        return state
    if path.suffix == ".safetensors":
        return load_file(path)
    return torch.load(path, mmap=mmap, weights_only=True)


def build_and_load(method: str, config: object, path: Path) -> torch.nn.Module:
    """The model, loaded from ``path`` the way ``method`` does it."""
    from litgpt import GPT

    from lightning_lowmem import init_empty, load_checkpoint

    if method == "naive":
        torch.set_default_dtype(torch.bfloat16)
        model = GPT(config)
        model.load_state_dict(_load_any(path, mmap=False))
    elif method == "torch-native":
        with torch.device("meta"):
            model = GPT(config)
        model.load_state_dict(_load_any(path, mmap=True), assign=True)
        model = model.to(torch.bfloat16)  # assign=True keeps the checkpoint's dtype
        model.cos, model.sin = model.rope_cache()  # built on meta: recompute the RoPE buffers
    elif method == "accelerate":
        from accelerate import init_empty_weights, load_checkpoint_and_dispatch

        with init_empty_weights():
            model = GPT(config)
        target = path.parent if path.name.endswith(".index.json") else path
        model = load_checkpoint_and_dispatch(model, str(target), device_map={"": "cpu"}, dtype=torch.bfloat16)
    elif method == "fabric":
        import lightning as L

        fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true")
        with fabric.init_module(empty_init=True):
            model = GPT(config)
        fabric.load_raw(path, model)
    elif method in ("lowmem", "lowmem-mmap"):
        with init_empty():
            model = GPT(config)
        load_checkpoint(model, path, dtype=torch.bfloat16, progress=False, mmap=method == "lowmem-mmap")
    else:
        raise ValueError(method)
    return model


def child(method: str, model_name: str, path: Path) -> dict:
    """Run one method in this (fresh) process and return what it measured."""
    from litgpt import Config

    from lightning_lowmem import MemoryMonitor

    config = Config.from_name(model_name)
    with MemoryMonitor() as mon:
        model = build_and_load(method, config, path)
        touch(model)
    final = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {"lifetime_peak": peak_rss(), "anon": mon.usage.anon_peak_delta, "file": mon.usage.file_peak,
            "load_delta": mon.usage.rss_peak_delta, "seconds": mon.usage.seconds, "final": final}


def summarize(results: list[dict]) -> dict:
    """One row from several runs of a method: the highest peaks, the median seconds and their range."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[0]
    row = {key: max(r[key] for r in ok) for key in ("lifetime_peak", "anon", "file", "load_delta")}
    seconds = [r["seconds"] for r in ok]
    return row | {"seconds": median(seconds), "spread": spread(seconds), "final": ok[0]["final"]}


def table(rows: list[tuple[str, str, dict]], floor: int, model_bytes: int, repeat: int) -> str:
    header = ["checkpoint", "method", f"peak above floor / model (max of {repeat})",
              f"load peak / model (max of {repeat})", f"anon / file-backed MiB (max of {repeat})",
              f"seconds (median of {repeat})", f"seconds (min-max of {repeat})", "time / fastest other (medians)"]
    out = []
    for case, method, r in rows:
        if "error" in r:
            out.append([case, method, f"failed: {r['error'][:80]}", "", "", "", "", ""])
            continue
        others = [o["seconds"] for c, m, o in rows if c == case and m != method and "error" not in o]
        out.append([case, method, f"{(r['lifetime_peak'] - floor) / model_bytes:.2f}",
                    f"{r['load_delta'] / model_bytes:.2f}", f"{r['anon'] / MiB:.0f} / {r['file'] / MiB:.0f}",
                    f"{r['seconds']:.1f}", r["spread"], f"{r['seconds'] / min(others):.2f}" if others else ""])
    return markdown(header, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pythia-1b", help="litgpt config name (default: pythia-1b)")
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    parser.add_argument("--only", nargs="*", help="run only these methods")
    parser.add_argument("--repeat", type=int, default=1, help="rounds over all methods")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.path)))
        return
    t0 = time.perf_counter()
    paths = write_checkpoints(args.model, args.workdir, [case for case, _ in CASES])
    floor = bare_torch_floor()
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeat):  # rounds, so that a disturbance hits one run of each method, not all of one
        for case, methods in CASES:
            for method in methods:
                if args.only and method not in args.only:
                    continue
                warm_page_cache(paths[case])
                result = run_fresh(__file__, ["--child", method, "--model", args.model, "--path", str(paths[case])])
                runs.setdefault((case, method), []).append(result)
                print(f"  ran {case} / {method}", file=sys.stderr)
    rows = [(case, method, summarize(results)) for (case, method), results in runs.items()]
    model_bytes = next((r["final"] for _, _, r in rows if "final" in r), 0)
    print(environment(["lightning", "litgpt", "safetensors", "accelerate"]))
    print(f"model: {args.model} config, random weights, final bf16 model {model_bytes / MiB:.0f} MiB; "
          f"floor: a bare `import torch` process peaks at {floor / MiB:.0f} MiB")
    print(f"page cache warm before each run; {args.repeat} fresh process(es) per method, in rounds\n")
    print(table(rows, floor, model_bytes, args.repeat))
    print(f"\n(total benchmark time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
