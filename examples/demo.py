"""Load a pythia-class checkpoint the naive way and with lightning_lowmem; compare peak memory.

    python examples/demo.py                      # pythia-410m: ~0.8 GB of bf16 weights
    python examples/demo.py --model pythia-1b    # ~1.9 GB

The first run writes a litgpt checkpoint directory (lit_model.pth + model_config.yaml) with
random weights to ~/.cache/lightning_lowmem/demo/<model>; later runs reuse it. Each method
runs in a fresh Python process, so one's memory never hides in another's peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

METHODS = {
    "naive": "GPT(config) in bf16, then load_state_dict(torch.load(...))",
    "lowmem": "init_empty() + lightning_lowmem.load_checkpoint(...)",
}


def make_checkpoint(model_name: str, root: Path) -> Path:
    from litgpt import GPT, Config
    from litgpt.utils import save_config

    directory = root / model_name
    if (directory / "lit_model.pth").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    print(f"Writing a random-weight {model_name} checkpoint to {directory} (once) ...", file=sys.stderr)
    config = Config.from_name(model_name)
    torch.set_default_dtype(torch.bfloat16)
    model = GPT(config)
    torch.save(model.state_dict(), directory / "lit_model.pth.tmp")
    (directory / "lit_model.pth.tmp").rename(directory / "lit_model.pth")
    save_config(config, directory)
    return directory


def child(method: str, directory: Path) -> dict:
    """Load in this fresh process, run one forward pass, report memory (bytes) and seconds."""
    from litgpt import GPT, Config

    from lightning_lowmem import MemoryMonitor, init_empty, load_checkpoint

    config = Config.from_file(directory / "model_config.yaml")
    with MemoryMonitor() as mon:
        if method == "naive":
            torch.set_default_dtype(torch.bfloat16)
            model = GPT(config)
            model.load_state_dict(torch.load(directory / "lit_model.pth", weights_only=True))
        else:
            with init_empty():
                model = GPT(config)
            load_checkpoint(model, directory, dtype=torch.bfloat16, progress=False)
    with torch.inference_mode():
        logits = model(torch.arange(8)[None])
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"peak": mon.usage.rss_peak_delta, "seconds": mon.usage.seconds, "model": model_bytes,
            "finite": bool(logits.isfinite().all())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pythia-410m", help="a litgpt config name (default: pythia-410m)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "lightning_lowmem" / "demo")
    parser.add_argument("--child", choices=list(METHODS), help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir)))
        return

    directory = make_checkpoint(args.model, args.cache)
    results = {}
    for method in METHODS:
        cmd = [sys.executable, __file__, "--child", method, "--dir", str(directory)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[method] = json.loads(out.stdout.strip().splitlines()[-1])

    model_gib = results["lowmem"]["model"] / 2**30
    print(f"\n{args.model}: {model_gib:.2f} GiB of bf16 weights, checkpoint {directory / 'lit_model.pth'}\n")
    print(f"{'method':<8} {'how':<58} {'peak RSS added':>15} {'x model':>8} {'seconds':>8}")
    for method, how in METHODS.items():
        r = results[method]
        print(f"{method:<8} {how:<58} {r['peak'] / 2**30:>11.2f} GiB {r['peak'] / r['model']:>8.2f} "
              f"{r['seconds']:>8.1f}")
    saved = 1 - results["lowmem"]["peak"] / results["naive"]["peak"]
    print(f"\nlightning_lowmem needed {saved:.0%} less memory than the naive load; both models ran a forward pass.")


if __name__ == "__main__":
    main()
