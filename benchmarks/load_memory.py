"""Peak host memory and time of loading one checkpoint, each method in a fresh process.

    python benchmarks/load_memory.py                    # pythia-1b config, random bf16 weights
    python benchmarks/load_memory.py --model pythia-160m --workdir /tmp/bench

Writes the checkpoint once (cached in --workdir) as one safetensors file, a sharded
safetensors set (4 shards + index) and a torch .pth, plus an fp32 safetensors file for
the fp32 -> bf16 rows. Every method then runs in its own process; the table gives
- peak RSS above a bare ``import torch`` process, as a multiple of the final bf16 model's
  bytes (this includes importing lightning/litgpt/accelerate: ~300 MiB),
- peak RSS of the load itself above the RSS just before it, as a multiple of the model,
- the load's peak anonymous (allocated) and file-backed (mapped file pages) RSS,
- seconds for build + load + touching every page of every weight once (a memory-mapped
  load defers its reads to first use; touching makes every method pay them in the block).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

MiB = 2**20
METHODS = {
    "naive": "build in bf16, load_state_dict(load(...))",
    "torch-native": "meta + mmap load + load_state_dict(assign=True)",
    "accelerate": "init_empty_weights + load_checkpoint_and_dispatch",
    "fabric": "Fabric.init_module(empty_init=True) + load_raw",
    "lowmem": "lightning_lowmem init_empty + load_checkpoint",
}
CASES = [  # (checkpoint, methods)
    # Fabric's load_raw goes through torch.load, which reads torch files only.
    ("bf16.safetensors", ["naive", "torch-native", "accelerate", "lowmem"]),
    ("bf16-sharded", ["naive", "torch-native", "accelerate", "lowmem"]),
    ("bf16.pth", ["naive", "torch-native", "accelerate", "fabric", "lowmem"]),
    ("fp32.safetensors", ["naive", "torch-native", "accelerate", "lowmem"]),
]


def make_checkpoints(model_name: str, workdir: Path) -> dict[str, Path]:
    """Random weights with the real architecture, in every layout the benchmark reads."""
    from litgpt import GPT, Config
    from safetensors.torch import save_file

    out = workdir / model_name
    paths = {
        "bf16.safetensors": out / "bf16.safetensors",
        "bf16-sharded": out / "sharded" / "model.safetensors.index.json",
        "bf16.pth": out / "bf16.pth",
        "fp32.safetensors": out / "fp32.safetensors",
    }
    if all(p.exists() for p in paths.values()):
        return paths
    (out / "sharded").mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GPT(Config.from_name(model_name)).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    save_file(state, paths["bf16.safetensors"])
    torch.save(state, paths["bf16.pth"])
    keys, weight_map = list(state), {}
    for i in range(4):
        name = f"model-{i + 1:05d}-of-00004.safetensors"
        part = {k: state[k] for k in keys[i::4]}
        save_file(part, out / "sharded" / name)
        weight_map.update(dict.fromkeys(part, name))
    paths["bf16-sharded"].write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({k: v.float() for k, v in state.items()}, paths["fp32.safetensors"])
    return paths


def _load_any(path: Path, mmap: bool) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if path.name.endswith(".index.json"):
        files = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        state = {}
        for f in files:
            state.update(load_file(path.parent / f))
        return state
    if path.suffix == ".safetensors":
        return load_file(path)
    return torch.load(path, mmap=mmap, weights_only=True)


def touch(model: torch.nn.Module) -> None:
    """Read one byte of every page of every weight, as the first forward would.

    Without it a memory-mapped load looks free: its pages are only faulted in (and only
    then counted in RSS and paid for in time) on first use.
    """
    for t in model.state_dict().values():
        if t.numel():
            t.detach().reshape(-1).view(torch.uint8)[::4096].sum()


def child(method: str, model_name: str, path: Path) -> dict:
    """Run one method in this (fresh) process and return what it measured."""
    from litgpt import GPT, Config

    from lightning_lowmem import MemoryMonitor, init_empty, load_checkpoint

    config = Config.from_name(model_name)
    with MemoryMonitor() as mon:
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
        elif method == "lowmem":
            with init_empty():
                model = GPT(config)
            load_checkpoint(model, path, dtype=torch.bfloat16, progress=False)
        else:
            raise ValueError(method)
        touch(model)
    final = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    dtypes = sorted({str(t.dtype) for t in model.parameters()})
    from lightning_lowmem.memory import lifetime_peak_rss

    return {"lifetime_peak": lifetime_peak_rss(), "anon": mon.usage.anon_peak_delta, "file": mon.usage.file_peak,
            "load_delta": mon.usage.rss_peak_delta, "seconds": mon.usage.seconds, "final": final, "dtypes": dtypes}


def bare_torch_floor() -> int:
    # Read VmHWM directly: importing lightning_lowmem would import lightning too and raise the floor.
    code = ("import torch; print([int(l.split()[1]) * 1024 for l in open('/proc/self/status') "
            "if l.startswith('VmHWM')][0])")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def warm_page_cache(path: Path) -> None:
    """Read the checkpoint's files once, so that every method starts with them in the page cache."""
    files = sorted(path.parent.glob("*.safetensors")) if path.suffix == ".json" else [path]
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 * MiB):
                pass


def run_fresh(method: str, model_name: str, path: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", method, "--model", model_name, "--path", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"rc={out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def combine(results: list[dict]) -> dict:
    """One row from several runs of a method: the highest peaks, the median seconds and their range."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[0]
    row = {key: max(r[key] for r in ok) for key in ("lifetime_peak", "anon", "file", "load_delta")}
    seconds = sorted(r["seconds"] for r in ok)
    return row | {"seconds": seconds[len(seconds) // 2], "range": (seconds[0], seconds[-1]), "final": ok[0]["final"]}


def print_environment(model_name: str, model_bytes: int) -> None:
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, {platform.system()}")
    libs = ["torch", "lightning", "litgpt", "safetensors", "accelerate"]
    print("versions: python " + platform.python_version() + ", " + ", ".join(f"{n} {version(n)}" for n in libs))
    print(f"model: {model_name} config, random weights, final bf16 model {model_bytes / MiB:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pythia-1b", help="litgpt config name (default: pythia-1b)")
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "lightning_lowmem" / "bench")
    parser.add_argument("--only", nargs="*", help="run only these methods")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds over all methods; peaks: the highest, seconds: the median (and the range)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.path)))
        return

    t0 = time.perf_counter()
    paths = make_checkpoints(args.model, args.workdir)
    floor = bare_torch_floor()
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeat):  # rounds, so that a disturbance hits one run of each method, not all of one
        for case, methods in CASES:
            for method in methods:
                if args.only and method not in args.only:
                    continue
                warm_page_cache(paths[case])
                runs.setdefault((case, method), []).append(run_fresh(method, args.model, paths[case]))
                print(f"  ran {case} / {method}", file=sys.stderr)
    rows = [(case, method, combine(results)) for (case, method), results in runs.items()]
    model_bytes = next((r["final"] for _, _, r in rows if "final" in r), 0)
    print_environment(args.model, model_bytes)
    print(f"floor: bare `import torch` process peak RSS {floor / MiB:.0f} MiB")
    print()
    print(f"page cache: warm (each checkpoint read just before each run); {args.repeat} run(s) per method")
    print()
    print("| checkpoint | method | peak above floor / model | load peak / model | anon / file-backed (MiB) "
          "| seconds (median, range) | time / fastest other |")
    print("|---|---|---|---|---|---|---|")
    for case, method, r in rows:
        if "error" in r:
            print(f"| {case} | {method} | failed: {r['error'][:80]} | | | | |")
            continue
        ratio = (r["lifetime_peak"] - floor) / model_bytes
        others = [o["seconds"] for c, m, o in rows if c == case and m != method and "error" not in o]
        versus = f"{r['seconds'] / min(others):.2f}" if others else ""
        low, high = r["range"]
        print(f"| {case} | {method} | {ratio:.2f} | {r['load_delta'] / model_bytes:.2f} "
              f"| {r['anon'] / MiB:.0f} / {r['file'] / MiB:.0f} | {r['seconds']:.1f} ({low:.1f}-{high:.1f}) "
              f"| {versus} |")
    print(f"\n(total benchmark time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
