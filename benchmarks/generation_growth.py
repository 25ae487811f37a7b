"""Memory over a long generation: resident memory after the prompt's forward and after the last token, and the peak,
against the estimate, with and without the freed heap handed back while generating.

A litgpt model whose key-value heads serve 8 query heads each (2 blocks, 2048 wide, 32 heads, 4 groups, MLP 512,
vocabulary 1024; weights from N(0, 0.3), as the tests draw them) goes through ``lightning_lowmem.generate(path,
<64 token ids>, max_new_tokens=N, top_k=1, quantize=...)`` in a fresh process per row. ``--no-handback`` replaces
``memory.heap.handing_back_heap`` with a block that does nothing: the library as it was before it handed the heap
back. Measured: RSS above the RSS after the imports, read after each forward of the model, and the peak of the whole
call (the kernel's high-water mark) above the same floor.

    python benchmarks/generation_growth.py [--new 1400] [--schemes none bnb.nf4 bnb.int8 torchao.int8wo] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from common import ROOT, WORKDIR, MiB, environment, markdown, run_fresh

PROMPT = 64
SCHEMES = ("none", "bnb.nf4", "bnb.int8", "torchao.int8wo")
CONFIG = dict(name="wide-gqa", n_layer=2, n_embd=2048, n_head=32, n_query_groups=4, intermediate_size=512,
              vocab_size=1024, padded_vocab_size=1024, mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm",
              rotary_percentage=1.0, parallel_residual=False, bias=False, block_size=2048)


def write_model(directory: Path) -> Path:
    """The model's ``lit_model.pth`` (bf16) and ``model_config.yaml``, written once."""
    if (directory / "lit_model.pth").exists():
        return directory
    import torch
    from litgpt import GPT, Config
    from litgpt.utils import save_config

    torch.manual_seed(0)
    model = GPT(Config(**CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(model.to(torch.bfloat16).state_dict(), directory / "lit_model.pth")
    save_config(model.config, directory)
    return directory


def child(directory: Path, scheme: str, new: int, handback: bool) -> dict:
    """One row, in this fresh process."""
    import litgpt
    import litgpt.generate.base  # noqa: F401  (imported by the floor, as a script has it)
    import psutil

    import lightning_lowmem
    import lightning_lowmem.litgpt.generation as generation
    from lightning_lowmem.memory import MemoryMonitor

    if not handback:
        generation.handing_back_heap = lambda module: contextlib.nullcontext()
    process, after = psutil.Process(), []
    forward = litgpt.model.GPT.forward

    def recorded(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        after.append(process.memory_info().rss)
        return out

    litgpt.model.GPT.forward = recorded
    with MemoryMonitor() as monitor:
        lightning_lowmem.generate(directory, list(range(1, PROMPT + 1)), max_new_tokens=new, top_k=1,
                                  quantize=None if scheme == "none" else scheme)
    start = monitor.usage.rss_start
    return {"prompt": after[0] - start, "last": after[-1] - start, "peak": monitor.usage.rss_peak_delta}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    parser.add_argument("--new", type=int, default=1400)
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=4, metavar=("PATH", "SCHEME", "NEW", "HANDBACK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, scheme, new, handback = args.child
        print(json.dumps(child(Path(path), scheme, int(new), handback == "1")))
        return
    from lightning_lowmem import estimate_memory

    directory = write_model(args.workdir / "generation-growth")
    rows = []
    for scheme in args.schemes:
        est = estimate_memory(directory, quantize=None if scheme == "none" else scheme,
                              max_seq_length=PROMPT + args.new, prompt_length=PROMPT)
        for handback in (False, True):
            got = run_fresh(__file__, ["--child", str(directory), scheme, str(args.new), str(int(handback))],
                            timeout=3600)
            rows.append({"scheme": scheme, "handback": handback, "estimate": est.peak, **got})
    if args.json:
        print(json.dumps(rows))
        return
    print(environment(["litgpt", "bitsandbytes", "torchao"]))
    print(f"\n2 x 2048 GQA (32 heads, 4 groups), N(0, 0.3) weights, {PROMPT}-token prompt + {args.new} new tokens, "
          "greedy, CPU; one fresh process per row\n")
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["scheme"], "yes" if r["handback"] else "no", f"failed: {r['error']}", "", "", "", ""])
            continue
        table.append([r["scheme"], "yes" if r["handback"] else "no", f"{r['prompt'] / MiB:.1f}",
                      f"{r['last'] / MiB:.1f}", f"{(r['last'] - r['prompt']) / MiB:+.1f}", f"{r['peak'] / MiB:.1f}",
                      f"{r['estimate'] / MiB:.1f}"])
    print(markdown(["scheme", "freed heap handed back", "RSS after the prompt MiB", "after the last token MiB",
                    "growth MiB", "peak MiB", "estimate MiB"], table))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
