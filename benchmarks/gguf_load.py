"""Loading GGUF files into transformers' LlamaForCausalLM: lightning_lowmem against transformers and the limits.

    python benchmarks/gguf_load.py                   # 6 layers x 2048 dims, 32k vocabulary (402 M parameters), Q8_0 and Q4_0
    python benchmarks/gguf_load.py --preset smollm   # SmolLM2-135M's shapes as Q4_1 (82 MiB, a 49k-token vocabulary)
    python benchmarks/gguf_load.py --layers 2 --repeat 1

The model is a Llama (GQA) with random weights, written once under ``--workdir`` (``gguf_files.py``: names, F32
norms, 2-d weights quantized by gguf's own quantizers, a BPE vocabulary of the model's size in the header). Every
method runs in a fresh process, the file read into the page cache just before; the model's dtype is bf16. Methods:

- ``transformers``: ``AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.bfloat16)``
  (it dequantizes every tensor to float32 into one state dict, then loads it);
- ``lowmem``: ``gguf_config`` + ``LlamaForCausalLM`` built under ``init_empty()`` + ``gguf_to_transformers``
  + ``load_checkpoint(dtype=torch.bfloat16)`` (each tensor dequantized, un-permuted and cast a block of rows at a
  time into its final tensor);
- ``lowmem int8wo``: the same with ``quantize="torchao.int8wo"``: each Linear quantized again as it is read;
- ``read + dequantize`` (the limit): the header parsed and every tensor read and dequantized to float32 by this
  library's reader, then dropped: what any GGUF load has to do.

Columns: peak RSS above a bare ``import torch`` process (the floor; transformers and lightning_lowmem are imported
before the measured block, so their import counts here), peak RSS above the RSS just before the load, as MiB and as
a multiple of the final bf16 model; the load's seconds (config, build and load). Under the table, the limits:
time 2 x ``read + dequantize``; load peak: the final model + its largest tensor in bf16 + 64 MiB.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import WORKDIR, MiB, bare_torch_floor, environment, markdown, median, peak_rss, run_fresh, spread
from common import warm_page_cache
from gguf_files import SMOLLM, tensor_shapes, write_llama_gguf

METHODS = ("transformers", "lowmem", "lowmem int8wo", "read + dequantize")
LIMIT = "read + dequantize"


def child(method: str, path: Path) -> dict:
    """Run one method in this (fresh) process; what it measured."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401  (imported before the block)
    import transformers.modeling_gguf_pytorch_utils  # noqa: F401

    from lightning_lowmem import Checkpoint, MemoryMonitor, gguf_config, gguf_to_transformers, init_empty
    from lightning_lowmem import load_checkpoint

    final = 0
    with MemoryMonitor() as mon:
        if method == LIMIT:
            with Checkpoint.open(path) as ckpt:
                for key in ckpt.records:
                    ckpt.read(key)
        elif method == "transformers":
            model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                      dtype=torch.bfloat16)
        else:
            with init_empty():
                model = transformers.LlamaForCausalLM(gguf_config(path))
            conversion = gguf_to_transformers(path, model)
            load_checkpoint(model, path, key_map=conversion.key_map, transform=conversion.transform,
                            dtype=torch.bfloat16, quantize="torchao.int8wo" if method.endswith("int8wo") else None,
                            progress=False)
    if method != LIMIT:
        final = sum(p.numel() * 2 for p in model.parameters())  # the bf16 model
    return {"lifetime_peak": peak_rss(), "load_delta": mon.usage.rss_peak_delta, "seconds": mon.usage.seconds,
            "final": final}


def table(runs: dict[tuple[str, str], list[dict]], floor: int, repeat: int, final: int) -> str:
    header = ["file", "method", f"peak above floor, MiB (max of {repeat})", f"load peak, MiB (max of {repeat})",
              "load peak / bf16 model", f"seconds (median of {repeat})", f"seconds (min-max of {repeat})"]
    rows = []
    for (kind, method), results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            rows.append([kind, method, f"failed: {results[0]['error'][:80]}", "", "", "", ""])
            continue
        peak, load = max(r["lifetime_peak"] for r in ok), max(r["load_delta"] for r in ok)
        seconds = [r["seconds"] for r in ok]
        rows.append([kind, method, f"{(peak - floor) / MiB:.0f}", f"{load / MiB:.0f}", f"{load / final:.2f}",
                     f"{median(seconds):.2f}", spread(seconds, 2)])
    return markdown(header, rows)


def limits(runs: dict[tuple[str, str], list[dict]], kinds: list[str], final: int, largest: int) -> str:
    """Per file: lightning_lowmem's bf16 load against the limits (time: 2 x reading and dequantizing; peak: the
    final model + its largest tensor in bf16 + 64 MiB)."""
    lines = []
    for kind in kinds:
        ours, limit = runs.get((kind, "lowmem"), []), runs.get((kind, LIMIT), [])
        ours, limit = [r for r in ours if "error" not in r], [r for r in limit if "error" not in r]
        if not ours or not limit:
            continue
        seconds, floor_seconds = median([r["seconds"] for r in ours]), median([r["seconds"] for r in limit])
        peak, bound = max(r["load_delta"] for r in ours), final + largest + 64 * MiB
        lines.append(f"- {kind}: lightning_lowmem {seconds:.2f} s = {seconds / floor_seconds:.2f} x reading and "
                     f"dequantizing ({floor_seconds:.2f} s; limit 2 x); load peak {peak / MiB:.0f} MiB against the "
                     f"limit {bound / MiB:.0f} MiB (final {final / MiB:.0f} + largest bf16 tensor "
                     f"{largest / MiB:.0f} + 64)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in [("layers", 6), ("hidden", 2048), ("intermediate", 5632), ("heads", 16), ("kv_heads", 4),
                          ("vocab", 32000), ("repeat", 3)]:
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--kinds", nargs="+", default=["Q8_0", "Q4_0"])
    parser.add_argument("--preset", choices=["smollm"], default=None, help="SmolLM2-135M's shapes, tied, as Q4_1")
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.path)))
        return
    shape = dict(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, heads=args.heads,
                 kv_heads=args.kv_heads, vocab=args.vocab, tie=False)
    if args.preset == "smollm":
        shape, args.kinds = dict(SMOLLM), ["Q4_1"]
    run(args, shape)


def run(args: argparse.Namespace, shape: dict) -> None:
    t0 = time.perf_counter()
    name = (f"gguf-llama-{shape['layers']}x{shape['hidden']}-{shape['vocab']}-{shape.get('context', 2048)}"
            + ("-tied" if shape["tie"] else ""))
    paths = {kind: write_llama_gguf(args.workdir / name / f"model.{kind}.gguf", kind, **shape) for kind in args.kinds}
    floor = bare_torch_floor()
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeat):  # rounds, so that a disturbance hits one run of each method, not all of one
        for kind in args.kinds:
            for method in METHODS:
                warm_page_cache(paths[kind])
                runs.setdefault((kind, method), []).append(
                    run_fresh(__file__, ["--child", method, "--path", str(paths[kind])], timeout=1800))
                print(f"  ran {kind} / {method}", file=sys.stderr)
    final = next((r["final"] for results in runs.values() for r in results if r.get("final")), 0)
    largest = max(2 * (rows * cols) for rows, cols in
                  (s for s in tensor_shapes(**shape).values() if len(s) == 2))
    print(environment(["transformers", "gguf", "torchao", "numpy"]))
    sizes = ", ".join(f"{kind} file {paths[kind].stat().st_size / MiB:.0f} MiB" for kind in args.kinds)
    print(f"model: Llama, {shape['layers']} layers x {shape['hidden']} dims, {shape['heads']}/{shape['kv_heads']} "
          f"heads, MLP {shape['intermediate']}, vocabulary {shape['vocab']} (BPE, with its merges, in the header), "
          f"{'tied, ' if shape['tie'] else ''}random weights; bf16 model {final / MiB:.0f} MiB; {sizes}; floor: a "
          f"bare `import torch` process peaks at {floor / MiB:.0f} MiB")
    print(f"page cache warm before each run; {args.repeat} fresh process(es) per method, in rounds\n")
    print(table(runs, floor, args.repeat, final or 1))
    print("\nlimits:\n" + limits(runs, args.kinds, final, largest))
    print(f"\n(total benchmark time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
