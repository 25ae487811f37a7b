"""Reading and computing at once: how much of the memory bus a read from the page cache leaves to a decode step.

    python benchmarks/memory_bus.py                 # 512 MiB buffers, median of 5
    python benchmarks/memory_bus.py --mib 128       # smaller buffers

A read from the page cache is a memory copy (the kernel's ``copy_to_user``), and a bf16 decode step on a CPU is
mostly matrix-vector products, bound by how fast the weights come from memory. The disk tier
(``disk_offload=True``) runs the two at once: the next layer copied in while this one computes. This script
times each alone and both together, on buffers far larger than the CPU's caches:

- ``read``: ``os.preadv`` of a ``--mib`` MiB file held in the page cache into a reused buffer, as the disk tier
  reads (bytes read per second; the system call lets go of Python's lock, so it runs beside torch);
- ``matvec``: ``x @ W.T`` with a bf16 ``W`` of ``--mib`` MiB (weight bytes read per second), on one thread and on
  two;
- ``read + matvec``: a thread reading while the main thread multiplies (on one torch thread), both in loops for
  the same wall time: the rate of each while the other runs.

Statistic: median of ``--repeat`` runs of each (the together rows: of each side's own rounds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time

import torch

from common import environment, markdown, median

GB = 1e9


def read_rate(fd: int, buffer: memoryview) -> float:
    """One read of the whole file at ``fd`` into ``buffer``, in bytes per second."""
    start, done = time.perf_counter(), 0
    while done < len(buffer):
        with buffer[done:] as rest:
            got = os.preadv(fd, [rest], done)
        if got <= 0:
            raise OSError(f"the file ended after {done} of {len(buffer)} bytes")
        done += got
    return done / (time.perf_counter() - start)


def matvec_rate(weight: torch.Tensor, x: torch.Tensor) -> float:
    start = time.perf_counter()
    x @ weight.T
    return weight.numel() * weight.element_size() / (time.perf_counter() - start)


def together(fd: int, buffer: memoryview, weight: torch.Tensor, x: torch.Tensor,
             seconds: float) -> tuple[list[float], list[float]]:
    """Reads in a thread and products in this one, each in a loop for ``seconds``: the rates of each."""
    reads: list[float] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            reads.append(read_rate(fd, buffer))

    thread = threading.Thread(target=reader)
    thread.start()
    products, end = [], time.perf_counter() + seconds
    try:
        while time.perf_counter() < end:
            products.append(matvec_rate(weight, x))
    finally:
        stop.set()
        thread.join()
    return reads[1:-1] or reads, products[1:-1] or products  # the first and last overlap only in part


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="MiB of each buffer (default 512)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    nbytes = args.mib * 2**20
    directory = tempfile.mkdtemp(prefix="memory-bus-")
    path = os.path.join(directory, "weights.bin")
    with open(path, "wb") as f:  # written, so in the page cache
        f.write(os.urandom(2**20) * args.mib)
    fd = os.open(path, os.O_RDONLY)
    buffer = memoryview(bytearray(nbytes))
    cols = 4096
    weight = torch.randn(nbytes // 2 // cols, cols, dtype=torch.bfloat16)
    x = torch.randn(1, cols, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        read_rate(fd, buffer), matvec_rate(weight, x)  # first touch
        alone_read = [read_rate(fd, buffer) for _ in range(args.repeat)]
        alone_mv = [matvec_rate(weight, x) for _ in range(args.repeat)]
        torch.set_num_threads(max(threads, 2))
        two_mv = [matvec_rate(weight, x) for _ in range(args.repeat)]
        torch.set_num_threads(1)
        seconds = max(3.0, args.repeat * nbytes / median(alone_read) * 2)
        both_read, both_mv = together(fd, buffer, weight, x, seconds)
    finally:
        torch.set_num_threads(threads)
        os.close(fd)
        shutil.rmtree(directory, ignore_errors=True)
    rows = [["read from the page cache (1 thread)", "alone", f"{median(alone_read) / GB:.1f}", ""],
            ["matvec bf16 (1 thread)", "alone", f"{median(alone_mv) / GB:.1f}", ""],
            [f"matvec bf16 ({max(threads, 2)} threads)", "alone", f"{median(two_mv) / GB:.1f}", ""],
            ["read from the page cache (1 thread)", "beside the matvec", f"{median(both_read) / GB:.1f}",
             f"{median(both_read) / median(alone_read):.2f}"],
            ["matvec bf16 (1 thread)", "beside the read", f"{median(both_mv) / GB:.1f}",
             f"{median(both_mv) / median(alone_mv):.2f}"]]
    print(environment([]))
    print(f"buffers of {args.mib} MiB; median of {args.repeat} runs (together: of {len(both_read)} reads and "
          f"{len(both_mv)} products in the same {seconds:.1f} s)\n")
    print(markdown(["what", "when", "GB/s", "of its rate alone"], rows))


if __name__ == "__main__":
    main()
