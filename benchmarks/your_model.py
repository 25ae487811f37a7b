"""Research code as its authors wrote it: each pattern of docs/your-model.md against its own way of loading.

    python benchmarks/your_model.py                      # 3 rounds
    python benchmarks/your_model.py --repeat 1 --only entry

The patterns (small modules written here, ``your_model_patterns.py``) and their checkpoints, written once under
``--workdir``: a decoder whose constructor casts and moves itself and computes its RoPE table in its own method
(safetensors, bf16); a model with its own Linear class whose weights sit under ``"model_state_dict"`` of a torch
file (bf16); a plain module holding transformers' PaliGemma and a Gemma expert with float32 sub-configs (float32
and bf16 files); a wrapper whose constructor calls ``T5EncoderModel.from_pretrained`` (float32 shards). Methods:

* ``naive``: the pattern's own way: built for real (initialised, cast as its constructor says), then
  ``load_state_dict`` / ``torch.load(mmap=True)`` / ``safetensors.torch.load_model`` + ``.to(bf16)`` /
  ``from_pretrained`` inside the constructor;
* ``lowmem``: ``with init_empty(): model = TheModel(...)`` then ``load_checkpoint(model, file, dtype=bf16)`` (the
  wrapper: ``load_checkpoint(model.text_encoder_3, its directory)``); ``-nf4`` / ``-int8`` quantize on load
  (bitsandbytes); ``-fallback`` loads bf16 where bf16 is not supported (fp16, ``assume_bf16_support``), against
  ``naive-fp16``, the model built with fp16; ``-budget`` keeps 64 MiB of the encoder in memory and leaves the
  rest in the checkpoint file (``max_memory={"cpu": "64MiB"}, disk_offload=True``).

Each method runs in a fresh process, the files it reads put in the page cache first; rounds are interleaved.
Measured in the process: the peak RSS of build + load (and, for the wrapper, one forward of 64 tokens) above the
RSS just before it, over the pattern's model bytes in bf16 (``peak / model``) and over the row's own final bytes
(``peak / final``: quantized weights by their storage; the budget row, what stays in memory); wall seconds of the
same block. What every row of a pattern imports is imported before it is measured: transformers' classes,
bitsandbytes for the quantized rows, and ``torch._dynamo``, which torch imports on the first ``normal_`` of a meta
tensor (73 MiB, once per process). Statistic: the median over rounds (range in brackets). ``= naive``: every
parameter and buffer (values and dtypes) compared with the naive row's, or, for the budget row, the output of a
forward run on one thread in both (a forward beside the disk tier's reads computes on one thread fewer, and bf16
sums round with the thread count).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from common import WORKDIR, MiB, environment, markdown, median, run_fresh, spread, warm_page_cache

METHODS = {  # method -> (checkpoint, the row it is compared with)
    "moving/naive": ("moving", None), "moving/lowmem": ("moving", "moving/naive"),
    "moving/naive-fp16": ("moving", None), "moving/lowmem-fallback": ("moving", "moving/naive-fp16"),
    "entry/naive": ("entry", None), "entry/lowmem": ("entry", "entry/naive"),
    "entry/lowmem-nf4": ("entry", None), "entry/lowmem-int8": ("entry", None),
    "composite-fp32/naive": ("composite-fp32", None),
    "composite-fp32/lowmem": ("composite-fp32", "composite-fp32/naive"),
    "composite-bf16/naive": ("composite-bf16", None),
    "composite-bf16/lowmem": ("composite-bf16", "composite-bf16/naive"),
    "wrapper/naive": ("wrapper", None), "wrapper/lowmem": ("wrapper", "wrapper/naive"),
    "wrapper/lowmem-budget": ("wrapper", "wrapper/naive"),
}
PATTERNS = {"moving": "constructor casts, moves, computes RoPE (exo's)",
            "entry": "own Linear, torch file's model_state_dict (gemma_pytorch's)",
            "composite-fp32": "transformers parts, float32 sub-configs, float32 file (pi0's)",
            "composite-bf16": "the same, bf16 file",
            "wrapper": "from_pretrained in the constructor, T5 encoder (Pyramid-Flow's)"}


# ---------------------------------------------------------------- worker side

def _tensors(model) -> dict[str, str]:
    """Each parameter and buffer (non-persistent too): its dtype and a digest of its bytes."""
    out = {}
    for prefix, mod in model.named_modules():
        for name, t in [*mod._parameters.items(), *mod._buffers.items()]:
            if t is not None and not t.is_meta:
                data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                out[f"{prefix}.{name}" if prefix else name] = f"{t.dtype} {hashlib.sha1(data).hexdigest()}"
    return out


def worker(method: str, workdir: Path) -> dict:
    import your_model_patterns as patterns
    from lightning_lowmem import MemoryMonitor
    from lightning_lowmem.quantize import module_nbytes

    patterns.import_for(method)
    path = patterns.files(workdir)[METHODS[method][0]]
    with MemoryMonitor() as monitor:
        model = patterns.load(method, path)
        if method.startswith("wrapper"):
            patterns.encode(model)
    digests = _tensors(model)
    if method.startswith("wrapper"):
        # compared on one thread: a forward beside the disk tier's reads computes on one thread fewer, and bf16
        # matmuls round differently with the thread count (docs/budgets-and-offload.md)
        torch.set_num_threads(1)
        output = patterns.encode(model)
        digests = {"output": hashlib.sha1(output.float().numpy().tobytes()).hexdigest()} | (
            {} if method.endswith("budget") else digests)
    (workdir / "your_model" / "digests").mkdir(exist_ok=True)
    (workdir / "your_model" / "digests" / f"{method.replace('/', '--')}.json").write_text(json.dumps(digests))
    return {"peak": monitor.usage.rss_peak_delta, "seconds": monitor.usage.seconds, "final": module_nbytes(model)}


# ---------------------------------------------------------------- parent side

def _same(method: str, workdir: Path) -> str:
    other = METHODS[method][1]
    if other is None:
        return ""
    folder = workdir / "your_model" / "digests"
    ours, theirs = (json.loads((folder / f"{m.replace('/', '--')}.json").read_text()) for m in (method, other))
    if method.endswith("budget"):
        return "output equal" if ours["output"] == theirs["output"] else "output differs"
    differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    if not differ:
        return f"all {len(ours)} tensors equal"
    dtypes = [f"{k} ({theirs.get(k, '-').split()[0]} vs {ours.get(k, '-').split()[0]})" for k in differ[:2]]
    return f"{len(differ)} of {len(theirs)} differ: {', '.join(dtypes)}{' ...' if len(differ) > 2 else ''}"


def rows(runs: dict[str, list[dict]], workdir: Path) -> list[list[str]]:
    out = []
    for method, results in runs.items():
        pattern, way = method.split("/")
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            out.append([pattern, way, f"error: {errors[0]}", "", "", "", "", ""])
            continue
        model = median([r["final"] for r in runs[f"{pattern}/naive"]]) if f"{pattern}/naive" in runs else 0
        ratios = [r["peak"] / model for r in results] if model else []
        own = [r["peak"] / r["final"] for r in results]
        seconds = [r["seconds"] for r in results]
        peak, final = median([r["peak"] for r in results]), median([r["final"] for r in results])
        out.append([pattern, way, f"{median(ratios):.2f} ({spread(ratios, 2)})" if ratios else "",
                    f"{median(own):.2f}", f"{peak / MiB:.0f}", f"{final / MiB:.0f}",
                    f"{median(seconds):.1f} ({spread(seconds)})", _same(method, workdir)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    parser.add_argument("--repeat", type=int, default=3, help="rounds over all methods")
    parser.add_argument("--only", nargs="*", help="run the methods whose name contains one of these")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.workdir)))
        return
    import your_model_patterns as patterns

    t0 = time.perf_counter()
    paths = patterns.write(args.workdir)
    methods = [m for m in METHODS if not args.only or any(s in m for s in args.only)]
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    loads = []
    for _ in range(args.repeat):
        loads.append(os.getloadavg()[0])
        for method in methods:
            path = paths[METHODS[method][0]]
            for file in (path.rglob("*") if path.is_dir() else [path]):
                if file.is_file():
                    warm_page_cache(file)
            runs[method].append(run_fresh(__file__, ["--worker", method, "--workdir", str(args.workdir)]))
            print(f"  {method}: {runs[method][-1]}", file=sys.stderr)
    print(environment(["transformers", "safetensors", "bitsandbytes"]))
    print(f"load average (1 min) at the start of each round: {', '.join(f'{x:.1f}' for x in loads)}; "
          f"{args.repeat} round(s), each method in a fresh process; medians (range)\n")
    for key, what in PATTERNS.items():
        print(f"- {key}: {what}")
    print()
    print(markdown(["pattern", "method", "peak / model", "peak / final", "peak MiB", "final MiB", "seconds", "= naive"],
                   rows(runs, args.workdir)))
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
