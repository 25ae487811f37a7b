"""Time and peak memory per tensor: a million scalar tensors, loaded by torch, safetensors and lightning_lowmem.

    python benchmarks/many_tensors.py                          # 1,000,000 tensors, median of 3 runs
    python benchmarks/many_tensors.py --tensors 100000 --repeat 1   # a quick check (~1 minute)
    python benchmarks/many_tensors.py --only safetensors            # one file format

The checkpoint is ``N`` float32 scalars named ``p<i>``, written once under --workdir as one safetensors file
(``save_file``) and one torch file (``torch.save``). The model is one module holding the ``N`` scalar
parameters, built on meta before the clock starts. (One module, because torch's ``load_state_dict`` hands each
child module the keys under its prefix by scanning every key: with 10,000 children of 100 parameters,
``load_state_dict`` of a million keys did not finish in 20 minutes.)
Every method runs in a fresh process (the file read once into the page cache just before):

- into the model: ``torch.load`` or ``safetensors.torch.load_file``, then ``load_state_dict(assign=True)``,
  against ``lightning_lowmem.load_checkpoint`` of the same file;
- reading only: ``torch.load`` or ``load_file`` alone, against ``Checkpoint.open`` + ``read`` of every tensor.

Columns: seconds of the load (median and range of --repeat runs), its peak RSS above the RSS just before it
(median), and lightning_lowmem's over torch's or safetensors' on the same file and task.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import WORKDIR, comparison_rows, compare, environment, markdown, run_fresh, warm_page_cache

CASES = [  # (task, file, reference method, lightning_lowmem method)
    ("into the model", "safetensors", "load_file + assign", "load_checkpoint"),
    ("into the model", "pth", "torch.load + assign", "load_checkpoint"),
    ("reading only", "safetensors", "load_file", "Checkpoint read"),
    ("reading only", "pth", "torch.load", "Checkpoint read"),
]


def write_checkpoints(n: int, workdir: Path) -> dict[str, Path]:
    """The ``n`` scalars as ``scalars-<n>.safetensors`` and ``scalars-<n>.pth`` (written once)."""
    import torch
    from safetensors.torch import save_file

    paths = {kind: workdir / f"scalars-{n}.{kind}" for kind in ("safetensors", "pth")}
    if all(p.exists() for p in paths.values()):
        return paths
    workdir.mkdir(parents=True, exist_ok=True)
    state = {f"p{i}": torch.tensor(float(i)) for i in range(n)}
    save_file(state, paths["safetensors"].with_suffix(".tmp"))
    paths["safetensors"].with_suffix(".tmp").rename(paths["safetensors"])
    torch.save(state, paths["pth"].with_suffix(".tmp"))
    paths["pth"].with_suffix(".tmp").rename(paths["pth"])
    return paths


def build(n: int):
    """One module of ``n`` scalar parameters ``p<i>``, on meta."""
    import torch
    from torch import nn

    model = nn.Module()
    with torch.device("meta"):
        for i in range(n):
            model.register_parameter(f"p{i}", nn.Parameter(torch.empty(())))
    return model


def child(method: str, path: Path, n: int) -> dict:
    """One method in this fresh process: the load's seconds and peak RSS above the RSS just before it."""
    import torch
    from safetensors.torch import load_file

    from lightning_lowmem import Checkpoint, MemoryMonitor, load_checkpoint

    model = build(n) if method in ("load_file + assign", "torch.load + assign", "load_checkpoint") else None
    read = (lambda: load_file(path)) if path.suffix == ".safetensors" else (lambda: torch.load(path, weights_only=True))
    with MemoryMonitor() as monitor:
        start = time.perf_counter()
        if method in ("load_file + assign", "torch.load + assign"):
            model.load_state_dict(read(), assign=True)
        elif method == "load_checkpoint":
            load_checkpoint(model, path, progress=False)
        elif method in ("load_file", "torch.load"):
            state = read()
        elif method == "Checkpoint read":
            with Checkpoint.open(path) as ckpt:
                state = {key: ckpt.read(key) for key in ckpt.records}
        else:
            raise ValueError(method)
        seconds = time.perf_counter() - start
    got = getattr(model, f"p{n - 1}") if model is not None else state[f"p{n - 1}"]
    assert got.item() == n - 1 and not got.is_meta
    return {"seconds": seconds, "peak": monitor.usage.rss_peak_delta}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=WORKDIR / "many-tensors")
    parser.add_argument("--only", nargs="*", default=["safetensors", "pth"], choices=["safetensors", "pth"],
                        help="the files to load (default: both)")
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "PATH", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--write", nargs=2, metavar=("N", "WORKDIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]), int(args.child[2]))))
        return
    if args.write:
        write_checkpoints(int(args.write[0]), Path(args.write[1]))
        print("{}")
        return
    run_fresh(__file__, ["--write", str(args.tensors), str(args.workdir)])  # a process of its own: its memory goes
    paths = write_checkpoints(args.tensors, args.workdir)
    rows = []
    for task, kind, reference, ours in [case for case in CASES if case[1] in args.only]:
        def run(method: str, kind: str = kind) -> dict:
            warm_page_cache(paths[kind])
            return run_fresh(__file__, ["--child", method, str(paths[kind]), str(args.tensors)])

        rows += comparison_rows([task, kind], reference, ours, compare([reference, ours], run, args.repeat))
    print(f"{args.tensors:,} float32 scalar tensors into one module; median of {args.repeat} fresh processes")
    print(environment(["safetensors"]))
    print(markdown(["task", "file", "method", "seconds", "peak MiB above start", "lowmem / reference"], rows))



if __name__ == "__main__":
    sys.exit(main())
