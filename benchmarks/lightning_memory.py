"""Peak host memory of loading one checkpoint through Lightning: its own paths vs lightning_lowmem's.

    python benchmarks/lightning_memory.py                          # pythia-1b config, random bf16 weights
    python benchmarks/lightning_memory.py --model pythia-160m --schemes bf16
    python benchmarks/lightning_memory.py --schemes bnb.nf4 --repeats 3      # nf4 peaks vary run to run

Writes the checkpoint once (cached in --workdir): a bare state dict ``lit_model.pth`` (keys of the
GPT) and a Lightning ``model.ckpt`` (``state_dict`` with keys of a LightningModule holding the GPT
as ``self.model``), same random bf16 weights. Each method runs in its own fresh process:

- ``load_checkpoint``: ``init_empty`` + ``load_checkpoint`` (the floor the integrations must match),
- ``fabric``: Lightning's ``Fabric(precision="bf16-true")``, ``init_module(empty_init=True)`` + ``load_raw``,
- ``fabric-lowmem``: ``Fabric(strategy="lowmem")``: ``init_module()`` + ``load_raw`` + ``setup``,
- ``trainer``: Lightning's ``Trainer(precision="bf16-true").predict(ckpt_path=model.ckpt)``, model built in
  ``configure_model``,
- ``trainer-lowmem``: the same ``Trainer.predict`` with ``LowMemCallback(model.ckpt)``.

Every process imports torch, lightning, litgpt and lightning_lowmem, then measures from the RSS
just before it builds anything: the peak until the model is ready (for the Trainer: at
``on_predict_start``, after restore and ``strategy.setup``), then the peak including one forward on
8 tokens (the Trainer's predict step; a direct call for the others; on CPU, bitsandbytes repacks
4-bit weights on the first inference forward, which costs memory of its own), and the process's
lifetime peak above a bare ``import torch`` process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import torch

MiB = 2**20
METHODS = ["load_checkpoint", "fabric", "fabric-lowmem", "trainer", "trainer-lowmem"]
CHECKPOINT_OF = {"load_checkpoint": "lit_model.pth", "fabric": "lit_model.pth", "fabric-lowmem": "lit_model.pth",
                 "trainer": "model.ckpt", "trainer-lowmem": "model.ckpt", "load_checkpoint-ckpt": "model.ckpt"}


def make_checkpoints(model_name: str, workdir: Path) -> Path:
    """Random bf16 weights with the real architecture, as lit_model.pth and as a Lightning .ckpt."""
    import lightning
    from litgpt import GPT, Config

    out = workdir / model_name
    if (out / "lit_model.pth").exists() and (out / "model.ckpt").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GPT(Config.from_name(model_name)).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    torch.save(state, out / "lit_model.pth")
    torch.save({"state_dict": {f"model.{k}": v for k, v in state.items()}, "epoch": 0, "global_step": 0,
                "pytorch-lightning_version": lightning.__version__}, out / "model.ckpt")
    return out


def child(method: str, model_name: str, path: Path, quantize: str | None) -> dict:
    """Run one method in this (fresh) process and return what it measured."""
    import lightning as L
    from litgpt import GPT, Config

    from lightning_lowmem import LowMemCallback, MemoryMonitor
    from lightning_lowmem.memory import lifetime_peak_rss

    config = Config.from_name(model_name)

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: torch.nn.Module | None = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = GPT(config)

        def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(batch)[:, -1].argmax(-1)

    trainer_kwargs = dict(accelerator="cpu", devices=1, precision="bf16-true", logger=False,
                          enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    tokens = torch.randint(0, config.vocab_size, (1, 8))
    ready: list[tuple[int, int]] = []  # (VmHWM, model bytes) when the model is ready, before its first forward

    def mark_ready(module: torch.nn.Module) -> None:
        ready.append((lifetime_peak_rss(), sum(t.numel() * t.element_size() for t in module.state_dict().values())))

    with MemoryMonitor() as mon:
        if method in ("trainer", "trainer-lowmem"):
            model = Lit()
            callbacks = [L.pytorch.callbacks.LambdaCallback(on_predict_start=lambda _, m: mark_ready(m))]
            callbacks += ([LowMemCallback(path, quantize=quantize)] if method == "trainer-lowmem" else [])
            trainer = L.Trainer(callbacks=callbacks, **trainer_kwargs)
            trainer.predict(model, torch.utils.data.DataLoader(tokens, batch_size=1),
                            ckpt_path=path if method == "trainer" else None)
        else:
            model = load(method, config, path, quantize)
            mark_ready(model)
            with torch.no_grad():
                model.eval()(tokens)  # eval, as in the Trainer's predict
    return {"ready": ready[0][0] - mon.usage.rss_start, "peak": mon.usage.rss_peak_delta,
            "lifetime_peak": lifetime_peak_rss(), "final": ready[0][1], "seconds": mon.usage.seconds}


def load(method: str, config: object, path: Path, quantize: str | None) -> torch.nn.Module:
    """Build and load the model the way ``method`` does (the Fabric and bare paths)."""
    import lightning as L
    from litgpt import GPT

    from lightning_lowmem import LowMemStrategy, init_empty, load_checkpoint

    if method.startswith("load_checkpoint"):
        with init_empty():
            model = GPT(config)
        load_checkpoint(model, path, dtype=torch.bfloat16, quantize=quantize, progress=False,
                        key_map={"model.": ""} if path.suffix == ".ckpt" else None)
        return model
    if method == "fabric":
        fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true")
        with fabric.init_module(empty_init=True):
            model = GPT(config)
    elif method == "fabric-lowmem":
        fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true",
                          strategy=LowMemStrategy(quantize=quantize) if quantize else "lowmem")
        with fabric.init_module():
            model = GPT(config)
    else:
        raise ValueError(method)
    fabric.load_raw(path, model)
    return fabric.setup(model)


def bare_torch_floor() -> int:
    code = "import torch; print(open('/proc/self/status').read())"  # VmHWM: peak RSS of the process
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return next(int(line.split()[1]) * 1024 for line in out.stdout.splitlines() if line.startswith("VmHWM"))


def run_fresh(method: str, model_name: str, path: Path, quantize: str | None, repeats: int) -> dict:
    """Median of ``repeats`` fresh processes (and the range of the load peak)."""
    cmd = [sys.executable, __file__, "--child", method, "--model", model_name, "--path", str(path)]
    cmd += ["--quantize", quantize] if quantize else []
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    runs = []
    for _ in range(repeats):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"rc={out.returncode}"}
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    result = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    result["ready_range"] = (min(r["ready"] for r in runs), max(r["ready"] for r in runs))
    return result


def print_table(rows: list[tuple[str, str, dict]], floor: int, repeats: int) -> None:
    print(f"(median of {repeats} fresh processes per row; load peak range in brackets)" if repeats > 1 else "")
    print("| weights | method | checkpoint | load peak (MiB) | load peak / load_checkpoint's (same file) "
          "| + 1 forward (MiB) | final model (MiB) | lifetime peak above bare torch (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    bare = {(scheme, CHECKPOINT_OF[method]): r["ready"] for scheme, method, r in rows
            if method.startswith("load_checkpoint") and "ready" in r}
    for scheme, method, r in rows:
        if "error" in r:
            print(f"| {scheme} | {method} | {CHECKPOINT_OF[method]} | {r['error'][:90]} | | | | |")
            continue
        low, high = r["ready_range"]
        spread = f" [{low / MiB:.0f}-{high / MiB:.0f}]" if repeats > 1 else ""
        print(f"| {scheme} | {method} | {CHECKPOINT_OF[method]} | {r['ready'] / MiB:.0f}{spread} | "
              f"{r['ready'] / bare[scheme, CHECKPOINT_OF[method]]:.3f} | {r['peak'] / MiB:.0f} | "
              f"{r['final'] / MiB:.0f} | {(r['lifetime_peak'] - floor) / MiB:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pythia-1b", help="litgpt config name (default: pythia-1b)")
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "lightning_lowmem" / "bench")
    parser.add_argument("--schemes", nargs="*", default=["bf16", "bnb.nf4"])
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per row (median reported)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--quantize", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.path, args.quantize)))
        return

    directory = make_checkpoints(args.model, args.workdir)
    floor = bare_torch_floor()
    rows = []
    for scheme in args.schemes:
        quantize = None if scheme == "bf16" else scheme
        for method in [*METHODS[:1], "load_checkpoint-ckpt", *METHODS[1:]]:
            if quantize and method in ("fabric", "trainer"):  # BitsandbytesPrecision refuses CPU
                rows.append((scheme, method, {"error": "n/a: Lightning's bitsandbytes plugin runs on CUDA only"}))
                continue
            path = directory / CHECKPOINT_OF[method]
            rows.append((scheme, method, run_fresh(method, args.model, path, quantize, args.repeats)))
            print(f"  ran {scheme} / {method}", file=sys.stderr)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM")
    print("versions: " + ", ".join(f"{n} {version(n)}" for n in ["torch", "lightning", "litgpt", "bitsandbytes"]))
    print(f"model: {args.model} config, random bf16 weights; bare `import torch` peak RSS {floor / MiB:.0f} MiB")
    print_table(rows, floor, args.repeats)


if __name__ == "__main__":
    main()
