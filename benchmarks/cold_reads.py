"""Cold reads: a load from a file the page cache does not hold, beside ``dd`` of the same file and a plain read.

    python benchmarks/cold_reads.py                      # pythia-1b, bf16 .safetensors, 3 rounds
    python benchmarks/cold_reads.py --model pythia-160m --rounds 1

Before every run the file is dropped from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``), and ``fincore``
(util-linux) must then say that none of it is resident; a run that finds the file cached is refused, not counted.
Methods, each a fresh process, interleaved in a rotated order per round:

    dd                      ``dd if=FILE of=/dev/null bs=16M``: the disk's sequential rate as users measure it
    read                    the file read front to back into one reused 64 MiB buffer (``preadv``)
    lightning_lowmem        ``load_checkpoint`` of litgpt's ``GPT`` built on meta (``init_empty``), bf16, on the CPU
    safetensors load_file   torch's idiom: ``GPT`` on meta, ``safetensors.torch.load_file`` + ``load_state_dict(assign=True)``

Columns: the median seconds and GB/s over the rounds (their range), and each method's share of ``dd``'s rate in the
same round (median over the rounds). Seconds are the load's (the model built on meta included, imports excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import WORKDIR, environment, markdown, median, run_fresh, spread, write_checkpoints

METHODS = ("dd", "read", "lightning_lowmem", "safetensors load_file")
MiB = 2**20


def evict(path: Path) -> int:
    """Drop ``path`` from the page cache; the bytes of it still resident (``fincore``), which should be 0."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True,
                         text=True, check=True).stdout.split()
    return int(out[0])


def worker(method: str, path: Path, model: str) -> dict:
    """One cold run of ``method`` in this fresh process: its seconds."""
    if method == "read":
        buffer, offset = memoryview(bytearray(64 * MiB)), 0
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        try:
            while n := os.preadv(fd, [buffer], offset):
                offset += n
        finally:
            os.close(fd)
        return {"seconds": time.perf_counter() - t0}
    import torch
    from litgpt import GPT, Config

    from lightning_lowmem import init_empty, load_checkpoint

    config = Config.from_name(model)
    t0 = time.perf_counter()
    if method == "lightning_lowmem":
        with init_empty():
            gpt = GPT(config)
        load_checkpoint(gpt, path, dtype=torch.bfloat16, progress=False)
    else:
        from safetensors.torch import load_file

        with torch.device("meta"):
            gpt = GPT(config).to(torch.bfloat16)
        gpt.load_state_dict(load_file(path), strict=False, assign=True)
    return {"seconds": time.perf_counter() - t0}


def run(method: str, path: Path, model: str, timeout: float) -> dict:
    resident = evict(path)
    if resident:
        return {"error": f"{resident} bytes of {path.name} still in the page cache after eviction"}
    if method == "dd":
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True, capture_output=True, timeout=timeout)
        return {"seconds": time.perf_counter() - t0}
    return run_fresh(__file__, ["--worker", method, str(path), "--model", model], timeout=timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pythia-1b", help="litgpt config name (default: pythia-1b)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("path", nargs="?", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.path, args.model)))
        return
    if shutil.which("fincore") is None:
        sys.exit("cold_reads.py needs fincore (util-linux) to check that a file left the page cache")
    path = write_checkpoints(args.model, args.workdir, ["bf16.safetensors"])["bf16.safetensors"]
    size = path.stat().st_size
    print(environment(["lightning", "litgpt", "safetensors"]))
    print(f"file: {path} ({size / 1e9:.2f} GB), filesystem {os.statvfs(path).f_bsize}-byte blocks; "
          f"rounds: {args.rounds}")
    results: dict[str, list[float]] = {m: [] for m in METHODS}
    shares: dict[str, list[float]] = {m: [] for m in METHODS}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
        this_round = {}
        for method in order:
            result = run(method, path, args.model, args.timeout)
            if "error" in result:
                print(f"round {r + 1}, {method}: {result['error']}", file=sys.stderr)
                continue
            this_round[method] = result["seconds"]
            results[method].append(result["seconds"])
        for method, seconds in this_round.items():
            if "dd" in this_round:
                shares[method].append(this_round["dd"] / seconds)
        print(f"round {r + 1} (load average {loads[-1]:.2f}): "
              + ", ".join(f"{m} {s:.2f} s" for m, s in this_round.items()), file=sys.stderr)
    rows = []
    for method in METHODS:
        seconds = results[method]
        if not seconds:
            rows.append([method, "error", "", "", ""])
            continue
        rates = [size / s / 1e9 for s in seconds]
        rows.append([method, f"{median(seconds):.2f}", spread(seconds, 2), f"{median(rates):.2f} ({spread(rates, 2)})",
                     f"{median(shares[method]):.0%}" if shares[method] else ""])
    print(f"load average at the start of each round: {', '.join(f'{x:.2f}' for x in loads)}")
    print(markdown(["method", "seconds (median)", "range", "GB/s (range)", "share of dd's rate (median)"], rows))


if __name__ == "__main__":
    main()
