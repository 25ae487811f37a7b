"""Load a pythia-class checkpoint the naive way and with lightning_lowmem; compare peak memory.

    python examples/demo.py                      # pythia-410m: ~0.8 GB of bf16 weights
    python examples/demo.py --model pythia-1b    # ~1.9 GB
    python examples/demo.py --png memory.png     # the picture written here instead

The first run writes a litgpt checkpoint directory (lit_model.pth + model_config.yaml) with
random weights to ~/.cache/lightning_lowmem/demo/<model>; later runs reuse it. Each method
runs in a fresh Python process, so one's memory never hides in another's peak, and records
a memory timeline. The demo prints a table and draws both timelines in one PNG, by default
memory.png next to the checkpoint (this needs matplotlib: `pip install matplotlib`; without
it the table is still printed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

METHODS = {
    "naive": "GPT(config) in bf16, then load_state_dict(torch.load(...))",
    "lowmem": "init_empty() + lightning_lowmem.load_checkpoint(...)",
}


def say(text: str) -> None:
    """Progress, on stderr (the table goes to stdout)."""
    print(text, file=sys.stderr, flush=True)


def make_checkpoint(model_name: str, root: Path) -> Path:
    from litgpt import GPT, Config
    from litgpt.utils import save_config

    directory = root / model_name
    if (directory / "lit_model.pth").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    say(f"      writing a random-weight {model_name} checkpoint to {directory} (once) ...")
    config = Config.from_name(model_name)
    torch.set_default_dtype(torch.bfloat16)
    model = GPT(config)
    torch.save(model.state_dict(), directory / "lit_model.pth.tmp")
    (directory / "lit_model.pth.tmp").rename(directory / "lit_model.pth")
    save_config(config, directory)
    return directory


def child(method: str, directory: Path) -> dict:
    """Load in this fresh process, run one forward pass, report memory (bytes), seconds and the timeline."""
    from litgpt import GPT, Config

    from lightning_lowmem import MemoryMonitor, init_empty, load_checkpoint

    config = Config.from_file(directory / "model_config.yaml")
    with MemoryMonitor(timeline=True) as mon:
        if method == "naive":
            torch.set_default_dtype(torch.bfloat16)
            model = GPT(config)
            mon.mark("model built")
            state = torch.load(directory / "lit_model.pth", weights_only=True)
            mon.mark("checkpoint read")
            model.load_state_dict(state)
            mon.mark("weights loaded")
            del state
        else:
            with init_empty():
                model = GPT(config)
            mon.mark("model built (meta)")
            load_checkpoint(model, directory, dtype=torch.bfloat16, progress=False)
            mon.mark("weights loaded")
    with torch.inference_mode():
        logits = model(torch.arange(8)[None])
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"peak": mon.usage.rss_peak_delta, "seconds": mon.usage.seconds, "model": model_bytes,
            "finite": bool(logits.isfinite().all()), "timeline": mon.usage.timeline.to_dict()}


def run_child(method: str, directory: Path) -> dict:
    """``child(method, directory)`` in a fresh Python process."""
    cmd = [sys.executable, __file__, "--child", method, "--dir", str(directory)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"the {method} load failed (exit code {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine() -> str:
    """This machine in a few words: cores, CPU, memory, torch."""
    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    ram = psutil.virtual_memory().total / 2**30
    return f"{os.cpu_count()}-core {cpu}, {ram:.0f} GiB RAM, torch {torch.__version__}"


def print_table(model_name: str, directory: Path, results: dict) -> None:
    model_gib = results["lowmem"]["model"] / 2**30
    print(f"\n{model_name}: {model_gib:.2f} GiB of bf16 weights, checkpoint {directory / 'lit_model.pth'}\n")
    print(f"{'method':<8} {'how':<58} {'peak RSS added':>15} {'x model':>8} {'seconds':>8}")
    for method, how in METHODS.items():
        r = results[method]
        print(f"{method:<8} {how:<58} {r['peak'] / 2**30:>11.2f} GiB {r['peak'] / r['model']:>8.2f} "
              f"{r['seconds']:>8.1f}")
    saved = 1 - results["lowmem"]["peak"] / results["naive"]["peak"]
    print(f"\nlightning_lowmem needed {saved:.0%} less memory than the naive load; both models ran a forward pass.")


def save_picture(model_name: str, results: dict, png: Path) -> Path | None:
    """Both timelines in one PNG; None (and a note on stderr) without matplotlib."""
    from lightning_lowmem import Timeline, save_timeline

    model_bytes = results["lowmem"]["model"]
    timelines = {f"{m}: {how}": Timeline.from_dict(results[m]["timeline"]) for m, how in METHODS.items()}
    title = (f"{model_name} ({model_bytes / 2**30:.2f} GiB of bf16 weights): memory during the load, "
             f"each in a fresh process\n{machine()}")
    try:
        return save_timeline(timelines, png, title=title, model_bytes=model_bytes, model_label="bf16 model")
    except ImportError as e:
        say(f"      picture skipped: {e}")
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pythia-410m", help="a litgpt config name (default: pythia-410m)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "lightning_lowmem" / "demo")
    parser.add_argument("--png", type=Path, help="where to write the picture (default: memory.png next to the "
                                                 "checkpoint)")
    parser.add_argument("--child", choices=list(METHODS), help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir)))
        return

    say(f"[1/4] checkpoint: {args.model} under {args.cache}")
    directory = make_checkpoint(args.model, args.cache)
    size = (directory / "lit_model.pth").stat().st_size
    say(f"      {directory / 'lit_model.pth'} ({size / 2**30:.2f} GiB)")
    results = {}
    for step, (method, how) in enumerate(METHODS.items(), start=2):
        say(f"[{step}/4] {method} load in a fresh process: {how} ...")
        results[method] = r = run_child(method, directory)
        say(f"      peak RSS +{r['peak'] / 2**30:.2f} GiB, {r['seconds']:.1f} s")
    say("[4/4] drawing the memory timelines ...")
    png = save_picture(args.model, results, args.png or directory / "memory.png")
    if png is not None:
        say(f"      picture: {png}")
    print_table(args.model, directory, results)
    if png is not None:
        print(f"\nMemory over time, both loads: {png}")


if __name__ == "__main__":
    main()
