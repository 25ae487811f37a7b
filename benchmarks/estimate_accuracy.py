"""The estimate against the measured peak: every scheme, bf16 and GGUF sources, litgpt and transformers models.

Each row is one fresh process. A litgpt model (SmolLM2's shapes, ``--layers`` of them, random
weights) from a bf16 ``lit_model.pth`` and from a Q4_1 GGUF file (the same shapes, its 49k-token
vocabulary and chat template in the header; ``gguf_files.py``), and pythia-160m's and pythia-410m's shapes from a
bf16 ``lit_model.pth``, go through
``lightning_lowmem.generate(path, <64 token ids>, max_new_tokens=N, top_k=1, quantize=...)``, N 50 and, for the
SmolLM2 ``lit_model.pth``, a long generation of ``--long`` new tokens too (a scheme's memory may grow with the tokens
decoded); a transformers model litgpt does not know (a ``BertModel``, bf16 ``model.safetensors``) through
``load_checkpoint`` into the model its ``config.json`` describes, built on meta.

Measured: peak RSS above the RSS after the imports a user's script has done anyway (torch, litgpt,
lightning, lightning_lowmem; for BERT, transformers and its BERT classes, which built the model), so that
what the load imports counts, as the estimate counts it (the quantization library; for a GGUF file,
transformers' GGUF code and model classes):

* load: the load's own peak (``report.memory``, the kernel's high-water mark) above that floor;
* generate: the peak of the whole ``generate()`` call above it (a GGUF file's tokenizer included).

The estimate is ``estimate_memory`` of the same request, in the parent: ``load_peak`` against the
load, ``peak`` against the generation. A row passes when measured <= estimate, and the estimate less the terms it
takes at their upper bound (``bounds``: a library's import, the freed heap of a load and of a generation, transformers'
classes) <= 1.10 x measured.

    python benchmarks/estimate_accuracy.py [--layers 30] [--bert-layers 24] [--bert-hidden 1024] [--schemes ...]
        [--sources ...] [--long 200] [--long-only] [--jobs 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import ROOT, WORKDIR, MiB, environment, markdown, run_fresh
from gguf_files import SMOLLM, write_llama_gguf

SCHEMES = ("none", "bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8", "torchao.int8wo", "torchao.int8dq",
           "torchao.nf4")
"""Every scheme that runs on a CPU (``torchao.int4wo`` needs CUDA)."""
SOURCES = ("litgpt-bf16", "litgpt-gguf", "pythia-160m", "pythia-410m", "bert-bf16")
PYTHIA = {"pythia-160m": "pythia-160m", "pythia-410m": "pythia-410m"}
"""Sources of litgpt's own named configs (random weights in a bf16 ``lit_model.pth``): the sizes of the table."""
LONG_SOURCES = ("litgpt-bf16",)
"""The sources measured over a long generation too (``--long`` new tokens)."""
PROMPT, NEW, LONG = 64, 50, 200
BOUND = 1.10
LITGPT_IMPORTS = "torch, litgpt, litgpt.generate.base, lightning, lightning_lowmem"
FLOOR_IMPORTS = {
    "litgpt-bf16": LITGPT_IMPORTS,
    "litgpt-gguf": LITGPT_IMPORTS,
    **dict.fromkeys(PYTHIA, LITGPT_IMPORTS),
    "bert-bf16": "torch, lightning_lowmem, transformers, transformers.models.bert.modeling_bert",
}


def write_sources(workdir: Path, layers: int, bert_layers: int, bert_hidden: int,
                  sources: tuple[str, ...] | list[str] = SOURCES) -> dict[str, Path]:
    """The checkpoints of ``sources``, written once under ``workdir`` (kept when there)."""
    out = workdir / f"estimate-{layers}-{bert_layers}x{bert_hidden}"
    paths = {"litgpt-bf16": out / "smollm2-bf16", "litgpt-gguf": out / "smollm2.Q4_1.gguf",
             **{source: workdir / f"estimate-{name}" for source, name in PYTHIA.items()},
             "bert-bf16": out / "bert-bf16"}
    if "litgpt-bf16" in sources and not (paths["litgpt-bf16"] / "lit_model.pth").exists():
        _write_litgpt(paths["litgpt-bf16"], "SmolLM2-135M", layers)
    for source, name in PYTHIA.items():
        if source in sources and not (paths[source] / "lit_model.pth").exists():
            _write_litgpt(paths[source], name)
    if "litgpt-gguf" in sources:
        write_llama_gguf(paths["litgpt-gguf"], "Q4_1", **{**SMOLLM, "layers": layers})
    if "bert-bf16" in sources and not (paths["bert-bf16"] / "model.safetensors").exists():
        _write_bert(paths["bert-bf16"], bert_layers, bert_hidden)
    return {source: path for source, path in paths.items() if source in sources}


def _write_litgpt(directory: Path, name: str, layers: int | None = None) -> None:
    import torch
    from litgpt import GPT, Config
    from litgpt.utils import save_config

    config = Config.from_name(name, **({"n_layer": layers} if layers else {}))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.02)
    directory.mkdir(parents=True, exist_ok=True)
    torch.save({k: v for k, v in model.state_dict().items() if not k.endswith(("cos", "sin", "mask_cache"))},
               directory / "lit_model.pth")
    save_config(config, directory)


def _write_bert(directory: Path, layers: int, hidden: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 64,
                                     intermediate_size=4 * hidden)  # 24 x 1024: bert-large's shapes
    transformers.BertModel(config).to(torch.bfloat16).save_pretrained(directory)


def child(source: str, path: Path, scheme: str, new: int) -> dict:
    """One row's measurement, in this fresh process."""
    for module in FLOOR_IMPORTS[source].split(", "):
        __import__(module)
    from lightning_lowmem.memory import MemoryMonitor

    quantize = None if scheme == "none" else scheme
    if source == "bert-bf16":
        import torch

        from lightning_lowmem import load_checkpoint
        from lightning_lowmem.placement import build_meta_model

        model, _ = build_meta_model(path)
        with MemoryMonitor() as outer:
            load_checkpoint(model, path, dtype=torch.bfloat16, quantize=quantize, progress=False)
        return {"load": outer.usage.rss_peak_delta}
    import lightning_lowmem

    with MemoryMonitor() as outer:
        result = lightning_lowmem.generate(path, list(range(1, PROMPT + 1)), max_new_tokens=new, top_k=1,
                                           quantize=quantize)
    return {"load": result.load_report.memory.rss_peak - outer.usage.rss_start,
            "generate": outer.usage.rss_peak_delta, "own": result.memory.peak}


def estimate(source: str, path: Path, scheme: str, new: int) -> dict:
    """The estimate's load peak and peak for the row, and its notes."""
    from lightning_lowmem import estimate_memory

    from lightning_lowmem.quantize.quantizer import TRIM_AT

    est = estimate_memory(path, quantize=None if scheme == "none" else scheme, max_seq_length=PROMPT + new,
                          prompt_length=PROMPT)
    # the terms the estimate takes at their upper bound (its notes say which): what it may be over by
    heap = TRIM_AT if any("freed heap" in note for note in est.notes) else 0
    bounds = {"load": est.library_import + est.imports + heap, "generate": est.library + est.imports + est.heap}
    return {"load": est.load_peak, "generate": None if source == "bert-bf16" else est.peak, "notes": est.notes,
            "bounds": bounds}


def measure(paths: dict[str, Path], schemes: list[str], jobs: int, long: int = LONG,
            long_only: bool = False) -> list[dict]:
    """Every (source, scheme, new tokens) row: estimate and measurement, ``jobs`` fresh processes at a time."""
    def lengths(source: str) -> tuple[int, ...]:
        longs = (long,) if source in LONG_SOURCES and long else ()
        return longs if long_only else (NEW, *longs)

    rows = [{"source": s, "scheme": q, "new": n, "estimate": estimate(s, paths[s], q, n)}
            for s in paths for n in lengths(s) for q in schemes]

    def run(row: dict) -> dict:
        row["measured"] = run_fresh(__file__, ["--child", row["source"], str(paths[row["source"]]), row["scheme"],
                                               str(row["new"])], timeout=1200)
        return row

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(run, rows))


def ratios(row: dict) -> dict[str, float | None]:
    """estimate / measured, for the load and the generation (None where not measured)."""
    est, got = row["estimate"], row["measured"]
    return {phase: est[phase] / got[phase] if est.get(phase) and got.get(phase) else None
            for phase in ("load", "generate")}


def table(rows: list[dict]) -> str:
    out = []
    for row in rows:
        got, est, ratio = row["measured"], row["estimate"], ratios(row)
        if "error" in got:
            out.append([row["source"], row["scheme"], str(row["new"]), f"failed: {got['error']}", "", "", "", "", ""])
            continue
        cells = []
        for phase in ("load", "generate"):
            if ratio[phase] is None:
                cells += ["-", "-", "-"]
            else:
                cells += [f"{est[phase] / MiB:.1f}", f"{got[phase] / MiB:.1f}", f"{ratio[phase]:.3f}"]
        out.append([row["source"], row["scheme"], "-" if row["source"] == "bert-bf16" else str(row["new"]), *cells])
    header = ["source", "scheme", "new tokens", "load: estimate MiB", "measured MiB", "ratio", "generate: estimate MiB",
              "measured MiB", "ratio"]
    return markdown(header, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    parser.add_argument("--layers", type=int, default=30, help="SmolLM2 blocks (30: SmolLM2-135M)")
    parser.add_argument("--bert-layers", type=int, default=24)
    parser.add_argument("--bert-hidden", type=int, default=1024, help="BERT's width (24 x 1024: bert-large)")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    parser.add_argument("--sources", nargs="+", default=list(SOURCES))
    parser.add_argument("--long", type=int, default=LONG, help="new tokens of the long-generation rows (0: none)")
    parser.add_argument("--long-only", action="store_true", help="only the long-generation rows")
    parser.add_argument("--jobs", type=int, default=2, help="fresh processes at a time")
    parser.add_argument("--json", action="store_true", help="one JSON object of every row instead of the table")
    parser.add_argument("--child", nargs=4, metavar=("SOURCE", "PATH", "SCHEME", "NEW"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]), args.child[2], int(args.child[3]))))
        return
    written = write_sources(args.workdir, args.layers, args.bert_layers, args.bert_hidden, args.sources)
    paths = {s: p for s, p in written.items() if s in args.sources}
    rows = measure(paths, args.schemes, args.jobs, args.long, args.long_only)
    if args.json:
        print(json.dumps({"rows": rows, "bound": BOUND}))
        return
    every = [r for row in rows if "error" not in row["measured"] for r in ratios(row).values() if r is not None]
    print(environment(["torch", "litgpt", "bitsandbytes", "torchao", "transformers", "gguf"]))
    print(f"\nSmolLM2 shapes, {args.layers} blocks; pythia-160m's and pythia-410m's; BERT, {args.bert_layers} x "
          f"{args.bert_hidden}; {PROMPT}-token prompt + {NEW} new tokens (SmolLM2's lit_model.pth also + {args.long}), "
          "greedy, CPU; one fresh process per row\n")
    print(table(rows))
    if every:
        under = sum(r < 1 for r in every)
        print(f"\nestimate / measured: lowest {min(every):.3f}, highest {max(every):.3f}; "
              + (f"UNDER the measured peak in {under} of {len(every)}" if under else f"never under, in {len(every)}"))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
