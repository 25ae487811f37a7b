"""Loading GGUF files (Q8_0, Q4_0) into transformers' LlamaForCausalLM: lightning_lowmem against transformers.

    python benchmarks/gguf_load.py                  # 6 layers x 2048 dims, 32k vocabulary: 384 M parameters
    python benchmarks/gguf_load.py --layers 2 --repeat 1

The model is a Llama (GQA 16/4 heads) with random weights, written once under ``--workdir`` with gguf's
``GGUFWriter`` as llama.cpp's converter lays it out (names, F32 norms, the 2-d weights quantized by gguf's
own quantizers), one tensor at a time. Every method runs in a fresh process, the file read into the page
cache just before; the model's dtype is bf16. Methods:

- ``transformers``: ``AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.bfloat16)``
  (it dequantizes every tensor to float32 into one state dict, then loads it);
- ``lowmem``: ``gguf_config`` + ``LlamaForCausalLM`` built under ``init_empty()`` + ``gguf_to_transformers``
  + ``load_checkpoint(dtype=torch.bfloat16)`` (each tensor dequantized, converted and cast on its own);
- ``lowmem int8wo``: the same with ``quantize="torchao.int8wo"``: each Linear quantized again as it is read.

Columns: peak RSS above a bare ``import torch`` process (the floor; transformers and lightning_lowmem are
imported before the measured block, so their import counts here), peak RSS above the RSS just before the
load, as MiB and as a multiple of the final bf16 model; the load's seconds (config, build and load).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import WORKDIR, MiB, bare_torch_floor, environment, markdown, median, peak_rss, run_fresh, spread
from common import warm_page_cache

METHODS = ("transformers", "lowmem", "lowmem int8wo")
KINDS = ("Q8_0", "Q4_0")


def shapes(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int) -> dict:
    """GGUF name -> shape in torch's order (out, in), in llama.cpp's order of writing."""
    kv = hidden // heads * kv_heads
    out = {"token_embd.weight": (vocab, hidden)}
    for i in range(layers):
        out |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.attn_q.weight": (hidden, hidden),
                f"blk.{i}.attn_k.weight": (kv, hidden), f"blk.{i}.attn_v.weight": (kv, hidden),
                f"blk.{i}.attn_output.weight": (hidden, hidden), f"blk.{i}.ffn_norm.weight": (hidden,),
                f"blk.{i}.ffn_gate.weight": (intermediate, hidden), f"blk.{i}.ffn_up.weight": (intermediate, hidden),
                f"blk.{i}.ffn_down.weight": (hidden, intermediate)}
    return out | {"output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}


def write_gguf(path: Path, kind: str, args: argparse.Namespace) -> Path:
    """A random-weight Llama as a GGUF file of ``kind``, written tensor by tensor (never whole in memory)."""
    import gguf
    import numpy as np

    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    qtype, rng = gguf.GGMLQuantizationType[kind], np.random.default_rng(0)
    tensors = shapes(args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    for add, value in [("add_name", "bench-llama"), ("add_context_length", 2048), ("add_embedding_length", args.hidden),
                       ("add_block_count", args.layers), ("add_feed_forward_length", args.intermediate),
                       ("add_rope_dimension_count", args.hidden // args.heads), ("add_head_count", args.heads),
                       ("add_head_count_kv", args.kv_heads), ("add_layer_norm_rms_eps", 1e-5),
                       ("add_rope_freq_base", 10000.0), ("add_vocab_size", args.vocab),
                       ("add_file_type", getattr(gguf.LlamaFileType, "MOSTLY_" + kind))]:
        getattr(writer, add)(value)
    for name, shape in tensors.items():
        t = qtype if len(shape) == 2 else gguf.GGMLQuantizationType.F32
        block, size = gguf.GGML_QUANT_SIZES[t]
        writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) // block * size, raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape in tensors.items():
        data = (rng.standard_normal(shape, dtype=np.float32) * 0.02) if len(shape) == 2 else np.ones(shape, np.float32)
        writer.write_tensor_data(gguf.quants.quantize(data, qtype) if len(shape) == 2 else data)
    writer.close()
    tmp.rename(path)
    return path


def child(method: str, path: Path) -> dict:
    """Run one method in this (fresh) process; what it measured."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401  (imported before the block)
    import transformers.modeling_gguf_pytorch_utils  # noqa: F401

    from lightning_lowmem import MemoryMonitor, gguf_config, gguf_to_transformers, init_empty, load_checkpoint

    with MemoryMonitor() as mon:
        if method == "transformers":
            model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                      dtype=torch.bfloat16)
        else:
            with init_empty():
                model = transformers.LlamaForCausalLM(gguf_config(path))
            conversion = gguf_to_transformers(path, model)
            load_checkpoint(model, path, key_map=conversion.key_map, transform=conversion.transform,
                            dtype=torch.bfloat16, quantize="torchao.int8wo" if method.endswith("int8wo") else None,
                            progress=False)
    final = sum(p.numel() * 2 for p in model.parameters())  # the bf16 model
    return {"lifetime_peak": peak_rss(), "load_delta": mon.usage.rss_peak_delta, "seconds": mon.usage.seconds,
            "final": final}


def table(runs: dict[tuple[str, str], list[dict]], floor: int, repeat: int) -> str:
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
        rows.append([kind, method, f"{(peak - floor) / MiB:.0f}", f"{load / MiB:.0f}", f"{load / ok[0]['final']:.2f}",
                     f"{median(seconds):.1f}", spread(seconds)])
    return markdown(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in [("layers", 6), ("hidden", 2048), ("intermediate", 5632), ("heads", 16), ("kv_heads", 4),
                          ("vocab", 32000), ("repeat", 3)]:
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.path)))
        return
    t0 = time.perf_counter()
    name = f"gguf-llama-{args.layers}x{args.hidden}-{args.vocab}"
    paths = {kind: write_gguf(args.workdir / name / f"model.{kind}.gguf", kind, args) for kind in KINDS}
    floor = bare_torch_floor()
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeat):  # rounds, so that a disturbance hits one run of each method, not all of one
        for kind in KINDS:
            for method in METHODS:
                warm_page_cache(paths[kind])
                runs.setdefault((kind, method), []).append(
                    run_fresh(__file__, ["--child", method, "--path", str(paths[kind])], timeout=1800))
                print(f"  ran {kind} / {method}", file=sys.stderr)
    final = next((r["final"] for results in runs.values() for r in results if "final" in r), 0)
    print(environment(["transformers", "gguf", "torchao", "numpy"]))
    sizes = ", ".join(f"{kind} file {paths[kind].stat().st_size / MiB:.0f} MiB" for kind in KINDS)
    print(f"model: Llama, {args.layers} layers x {args.hidden} dims, {args.heads}/{args.kv_heads} heads, MLP "
          f"{args.intermediate}, vocabulary {args.vocab}, random weights; bf16 model {final / MiB:.0f} MiB; {sizes}; "
          f"floor: a bare `import torch` process peaks at {floor / MiB:.0f} MiB")
    print(f"page cache warm before each run; {args.repeat} fresh process(es) per method, in rounds\n")
    print(table(runs, floor, args.repeat))
    print(f"\n(total benchmark time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
