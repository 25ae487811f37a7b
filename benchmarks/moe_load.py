"""Loading an MoE checkpoint (one tensor per expert, as save_pretrained writes it) into transformers 5's fused experts:
lightning_lowmem against transformers.

    python benchmarks/moe_load.py                    # Mixtral, 8 layers x 1024 dims, 8 experts of 2048: 0.47 G params
    python benchmarks/moe_load.py --layers 2 --hidden 512 --intermediate 512 --repeat 1   # a quick run

The model is a Mixtral with random weights, saved once in bf16 under ``--workdir`` by ``save_pretrained`` in shards of
1 GB (``block_sparse_moe.experts.<e>.w1/w2/w3``, as every Mixtral checkpoint). Every method runs in a fresh process,
the files read into the page cache just before; the model's dtype is bf16. Methods:

- ``transformers``: ``AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)`` (its conversion mapping
  collects each layer's expert tensors, stacks them per source and concatenates: the parts beside the result);
- ``lowmem``: ``from_config`` under ``init_empty()`` + ``load_checkpoint(directory, dtype=torch.bfloat16)`` (the same
  mapping; each expert tensor read straight into its rows of the fused parameter);
- ``lowmem nf4``: the same with ``quantize="bnb.nf4"`` (Linears and the fused experts quantized a block of rows at a
  time).

Columns: peak RSS above a bare ``import torch`` process (the floor; transformers, bitsandbytes and lightning_lowmem are
imported before the measured block, so their import counts here), peak RSS above the RSS just before the load, as MiB
and as a multiple of the final model (bf16, or quantized for ``lowmem nf4``); the load's seconds (config, build, load).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import WORKDIR, MiB, bare_torch_floor, environment, markdown, median, peak_rss, run_fresh, spread
from common import warm_page_cache

METHODS = ("transformers", "lowmem", "lowmem nf4")


def write_moe(directory: Path, args: argparse.Namespace) -> Path:
    """A random-weight bf16 Mixtral saved by ``save_pretrained`` (built on meta, its weights drawn tensor by tensor)."""
    import torch
    import transformers

    if (directory / "config.json").exists():
        return directory
    config = transformers.MixtralConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
        num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=2048)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="1GB")
    return directory


def child(method: str, directory: Path) -> dict:
    """Run one method in this (fresh) process; what it measured."""
    import bitsandbytes  # noqa: F401  (imported before the block)
    import torch
    import transformers

    from lightning_lowmem import MemoryMonitor, init_empty, load_checkpoint
    from lightning_lowmem.quantize import module_nbytes

    with MemoryMonitor() as mon:
        if method == "transformers":
            model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
        else:
            config = transformers.AutoConfig.from_pretrained(directory)
            with init_empty():
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            load_checkpoint(model, directory, dtype=torch.bfloat16, progress=False,
                            quantize="bnb.nf4" if method.endswith("nf4") else None)
    return {"lifetime_peak": peak_rss(), "load_delta": mon.usage.rss_peak_delta, "seconds": mon.usage.seconds,
            "final": module_nbytes(model)}


def table(runs: dict[str, list[dict]], floor: int, repeat: int) -> str:
    header = ["method", f"peak above floor, MiB (max of {repeat})", f"load peak, MiB (max of {repeat})",
              "final model, MiB", "load peak / final model", f"seconds (median of {repeat})",
              f"seconds (min-max of {repeat})"]
    rows = []
    for method, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            rows.append([method, f"failed: {results[0]['error'][:80]}", "", "", "", "", ""])
            continue
        peak, load, final = max(r["lifetime_peak"] for r in ok), max(r["load_delta"] for r in ok), ok[0]["final"]
        seconds = [r["seconds"] for r in ok]
        rows.append([method, f"{(peak - floor) / MiB:.0f}", f"{load / MiB:.0f}", f"{final / MiB:.0f}",
                     f"{load / final:.2f}", f"{median(seconds):.1f}", spread(seconds)])
    return markdown(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in [("layers", 8), ("hidden", 1024), ("intermediate", 2048), ("experts", 8), ("vocab", 32000),
                          ("repeat", 3)]:
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.path)))
        return
    t0 = time.perf_counter()
    name = f"moe-mixtral-{args.layers}x{args.hidden}-{args.experts}x{args.intermediate}-{args.vocab}"
    directory = write_moe(args.workdir / name, args)
    index = directory / "model.safetensors.index.json"
    floor = bare_torch_floor()
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeat):  # rounds, so that a disturbance hits one run of each method, not all of one
        for method in METHODS:
            warm_page_cache(index if index.exists() else directory / "model.safetensors")
            runs.setdefault(method, []).append(run_fresh(__file__, ["--child", method, "--path", str(directory)],
                                                         timeout=1800))
            print(f"  ran {method}", file=sys.stderr)
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    print(environment(["transformers", "bitsandbytes"]))
    print(f"model: Mixtral, {args.layers} layers x {args.hidden} dims, {args.experts} experts of {args.intermediate}, "
          f"vocabulary {args.vocab}, random weights; checkpoint {size / MiB:.0f} MiB (bf16, one tensor per expert); "
          f"floor: a bare `import torch` process peaks at {floor / MiB:.0f} MiB")
    print(f"page cache warm before each run; {args.repeat} fresh process(es) per method, in rounds\n")
    print(table(runs, floor, args.repeat))
    print(f"\n(total benchmark time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
