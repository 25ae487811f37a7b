"""The memory of a generation whose layers stay on disk, over time: the picture in docs/budgets-and-offload.md.

The model of ``disk_offload.py`` (litgpt's ``pythia-410m`` config here by default: random bf16 weights, its
litgpt-layout file and HF twin under ``--workdir``), a 16-token prompt and ``--tokens`` greedy tokens on the CPU,
each method in a fresh process under ``MemoryMonitor(timeline=True)`` from before the load to the end:

* ``in RAM``: ``load_for_generation(dir)``, the whole model in memory;
* ``lowmem disk``: ``load_for_generation(dir, max_memory={"cpu": model / 5}, disk_offload=True)``;
* ``accelerate``: ``from_pretrained(hf twin, device_map=...)`` for the same CPU budget, the rest on ``"disk"``.

The panels show the RSS above its value before the load (anonymous and file-backed), with marks where the load
ends and the tokens start; the dashed line is the bf16 model. Memory figures, not timings: the time axis is
whatever the machine gave.

    python benchmarks/disk_timeline.py [--model pythia-410m] [--out docs/images/disk-offload-memory.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from common import ROOT, environment, run_fresh
from disk_offload import decode, load, prepare, weight_files
from lightning_lowmem import MemoryMonitor, Timeline, save_timeline

FRACTION = 5
PANELS = {"ram": "in RAM (lightning_lowmem)", "lowmem": f"lightning_lowmem disk_offload, CPU budget 1/{FRACTION}",
          "accelerate": f"accelerate disk offload (transformers device_map), CPU budget 1/{FRACTION}"}


def child(method: str, workdir: Path, model_name: str, budget: int, tokens: int) -> dict:
    """Load and generate with ``method`` under a timeline; the timeline as JSON."""
    lit_dir, hf_dir = prepare(workdir, model_name)
    prompt = torch.randint(0, 50000, (16,), generator=torch.Generator().manual_seed(0))
    with MemoryMonitor(timeline=True) as monitor:
        model, info = load(method, hf_dir if method == "accelerate" else lit_dir, budget or None)
        monitor.mark("loaded")
        report = info.pop("report", None)
        decode(model, info["family"], prompt, tokens, cold=False)
        monitor.mark(f"{tokens} tokens")
        if report is not None and report.disk is not None:
            report.disk.close()
    return {"timeline": monitor.usage.timeline.to_dict()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pythia-410m")
    parser.add_argument("--workdir", type=Path, default=None, help="default: disk_offload.py's")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "disk-offload-memory.png")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from common import WORKDIR

    args.workdir = args.workdir or WORKDIR / "disk_offload"
    if args.child:
        print(json.dumps(child(args.child, args.workdir, args.model, args.budget, args.tokens)))
        return
    lit_dir, _ = prepare(args.workdir, args.model)
    weights = sum(f.stat().st_size for f in weight_files(lit_dir))
    print(environment(["transformers", "accelerate", "litgpt"]))
    timelines = {}
    for method, title in PANELS.items():
        budget = weights // FRACTION if method != "ram" else 0
        result = run_fresh(__file__, ["--child", method, "--workdir", str(args.workdir), "--model", args.model,
                                      "--budget", str(budget), "--tokens", str(args.tokens)])
        if "error" in result:
            print(f"{title}: {result['error']}")
            continue
        timelines[title] = Timeline.from_dict(result["timeline"])
        peak = max(p.anon + p.file for p in timelines[title].points) - (timelines[title].start.anon
                                                                        + timelines[title].start.file)
        print(f"{title}: peak +{peak / 2**20:.0f} MiB above the RSS before the load")
    title = (f"{args.model} (random bf16 weights), CPU: {args.tokens} greedy tokens after a 16-token prompt")
    print(save_timeline(timelines, args.out, title=title, model_bytes=weights, model_label="bf16 model"))


if __name__ == "__main__":
    main()
