"""Time and peak memory of a checkpoint of many shards: 10,000 files, loaded by safetensors, torch and lightning_lowmem.

    python benchmarks/many_shards.py                            # 10,000 shards, median of 3 runs
    python benchmarks/many_shards.py --shards 1000 --repeat 1   # a quick check

The checkpoint is ``N`` tensors of 256 float32 (``p<i>``), one per shard, as ``save_pretrained`` lays out a
sharded set: ``model-<i>-of-<N>.safetensors`` (or ``pytorch_model-<i>-of-<N>.bin``, written by ``torch.save``)
and the index naming them, written once under --workdir. The model is one module holding the ``N``
parameters, built on meta before the clock starts. Every method runs in a fresh process whose descriptor
limit is lowered to Linux's default, 1024 (when it is higher), the files read once into the page cache just
before:

- into the model: every shard read by ``safetensors.torch.load_file`` (or ``torch.load``) into one state dict,
  then ``load_state_dict(assign=True)``, as transformers' and accelerate's loaders do, against
  ``lightning_lowmem.load_checkpoint`` of the index;
- reading only: the same reads alone, against ``Checkpoint.open`` of the index + ``read`` of every tensor.

Columns: seconds of the load (median and range of --repeat runs), its peak RSS above the RSS just before it
(median), and lightning_lowmem's over the reference on the same files and task.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from common import WORKDIR, comparison_rows, compare, environment, markdown, run_fresh

ELEMENTS = 256
DESCRIPTORS = 1024
CASES = [  # (task, file, reference method, lightning_lowmem method)
    ("into the model", "safetensors", "load_file each + assign", "load_checkpoint"),
    ("into the model", "bin", "torch.load each + assign", "load_checkpoint"),
    ("reading only", "safetensors", "load_file each", "Checkpoint read"),
    ("reading only", "bin", "torch.load each", "Checkpoint read"),
]


def write_shards(n: int, workdir: Path, kind: str) -> Path:
    """``n`` shards of one tensor each and their index (written once); returns the index."""
    import torch
    from safetensors.torch import save_file

    directory = workdir / f"{kind}-{n}"
    stem = "model" if kind == "safetensors" else "pytorch_model"
    index = directory / f"{stem}.{kind}.index.json"
    if index.exists():
        return index
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i in range(n):
        name = f"{stem}-{i + 1:05d}-of-{n:05d}.{kind}"
        part = {f"p{i}": torch.full((ELEMENTS,), float(i))}
        save_file(part, directory / name) if kind == "safetensors" else torch.save(part, directory / name)
        weight_map[f"p{i}"] = name
    index.with_suffix(".tmp").write_text(json.dumps({"metadata": {"total_size": n * ELEMENTS * 4},
                                                     "weight_map": weight_map}))
    index.with_suffix(".tmp").rename(index)
    return index


def child(method: str, index: Path, n: int) -> dict:
    """One method in this fresh process, under at most 1024 descriptors (Linux's default): the load's seconds and
    peak RSS above the RSS just before it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, DESCRIPTORS), hard))
    import torch
    from safetensors.torch import load_file
    from torch import nn

    from lightning_lowmem import Checkpoint, MemoryMonitor, load_checkpoint

    model = nn.Module()
    with torch.device("meta"):
        for i in range(n):
            model.register_parameter(f"p{i}", nn.Parameter(torch.empty(ELEMENTS)))
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    read = load_file if index.name.startswith("model.") else (lambda p: torch.load(p, weights_only=True))
    with MemoryMonitor() as monitor:
        start = time.perf_counter()
        if method == "load_checkpoint":
            load_checkpoint(model, index, progress=False)
        elif method == "Checkpoint read":
            with Checkpoint.open(index) as ckpt:
                state = {key: ckpt.read(key) for key in ckpt.records}
        else:
            state = {}
            for shard in shards:
                state.update(read(index.parent / shard))
            if method.endswith("+ assign"):
                model.load_state_dict(state, assign=True)
        seconds = time.perf_counter() - start
    got = getattr(model, f"p{n - 1}") if method in ("load_checkpoint",) or method.endswith("assign") else \
        state[f"p{n - 1}"]
    assert not got.is_meta and got[0].item() == n - 1
    return {"seconds": seconds, "peak": monitor.usage.rss_peak_delta}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=WORKDIR / "many-shards")
    parser.add_argument("--only", nargs="*", default=["safetensors", "bin"], choices=["safetensors", "bin"],
                        help="the files to load (default: both)")
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "INDEX", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--write", nargs=3, metavar=("N", "WORKDIR", "KIND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]), int(args.child[2]))))
        return
    if args.write:
        write_shards(int(args.write[0]), Path(args.write[1]), args.write[2])
        print("{}")
        return
    for kind in args.only:  # in a process of its own: its memory goes
        run_fresh(__file__, ["--write", str(args.shards), str(args.workdir), kind])
    indexes = {kind: write_shards(args.shards, args.workdir, kind) for kind in args.only}
    rows = []
    for task, kind, reference, ours in [case for case in CASES if case[1] in args.only]:
        def run(method: str, kind: str = kind) -> dict:
            _warm(indexes[kind])
            return run_fresh(__file__, ["--child", method, str(indexes[kind]), str(args.shards)])

        rows += comparison_rows([task, kind], reference, ours, compare([reference, ours], run, args.repeat))
    limit = min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], DESCRIPTORS)
    print(f"{args.shards:,} shards of one {ELEMENTS}-element float32 tensor each, into one module; descriptor limit "
          f"{limit}; median of {args.repeat} fresh processes")
    print(environment(["safetensors"]))
    print(markdown(["task", "files", "method", "seconds", "peak MiB above start", "lowmem / reference"], rows))


def _warm(index: Path) -> None:
    for path in index.parent.iterdir():
        path.read_bytes()



if __name__ == "__main__":
    sys.exit(main())
