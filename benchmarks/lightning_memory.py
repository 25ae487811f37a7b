"""Peak host memory of loading one checkpoint through Lightning: its own paths vs lightning_lowmem's.

    python benchmarks/lightning_memory.py                          # pythia-1b config, random bf16 weights
    python benchmarks/lightning_memory.py --model pythia-160m --schemes bf16
    python benchmarks/lightning_memory.py --schemes bnb.nf4 --repeats 3      # nf4 peaks vary run to run

The checkpoint is written once (``benchmarks/common.py``, cached in --workdir): a bare state dict
``bf16.pth`` (keys of the GPT, as litgpt's ``lit_model.pth``) and a Lightning ``model.ckpt``
(``state_dict`` with keys of a LightningModule holding the GPT as ``self.model``), same random bf16
weights. Each method runs in its own fresh process:

- ``load_checkpoint``: ``init_empty`` + ``load_checkpoint`` (the floor the integrations must match),
- ``fabric``: Lightning's ``Fabric(precision="bf16-true")``, ``init_module(empty_init=True)`` + ``load_raw``,
- ``fabric-lowmem``: ``Fabric(strategy="lowmem")``: ``init_module()`` + ``load_raw`` + ``setup``,
- ``trainer``: Lightning's ``Trainer(precision="bf16-true").predict(ckpt_path=model.ckpt)``, model built in
  ``configure_model``,
- ``trainer-lowmem``: the same ``Trainer.predict`` with ``LowMemCallback(model.ckpt)``.

Every process imports torch, lightning, litgpt and lightning_lowmem, then measures from the RSS
just before it builds anything: the peak until the model is ready (for the Trainer: at
``on_predict_start``, after restore and ``strategy.setup``), then the peak including one forward on
8 tokens (the Trainer's predict step; a direct call for the others; on CPU, bitsandbytes repacks
4-bit weights on the first inference forward, which costs memory of its own), and the process's
lifetime peak above a bare ``import torch`` process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from common import (
    WORKDIR,
    MiB,
    bare_torch_floor,
    environment,
    markdown,
    median,
    peak_rss,
    run_fresh,
    spread,
    write_checkpoints,
)

METHODS = ["load_checkpoint", "fabric", "fabric-lowmem", "trainer", "trainer-lowmem"]
CHECKPOINT_OF = {"load_checkpoint": "bf16.pth", "fabric": "bf16.pth", "fabric-lowmem": "bf16.pth",
                 "trainer": "model.ckpt", "trainer-lowmem": "model.ckpt", "load_checkpoint-ckpt": "model.ckpt"}


def child(method: str, model_name: str, path: Path, quantize: str | None) -> dict:
    """Run one method in this (fresh) process and return what it measured."""
    import lightning as L
    from litgpt import GPT, Config

    from lightning_lowmem import LowMemCallback, MemoryMonitor
    from lightning_lowmem.quantize import tensor_nbytes

    config = Config.from_name(model_name)

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model: torch.nn.Module | None = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = GPT(config)

        def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(batch)[:, -1].argmax(-1)

    trainer_kwargs = dict(accelerator="cpu", devices=1, precision="bf16-true", logger=False,
                          enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    tokens = torch.randint(0, config.vocab_size, (1, 8))
    ready: list[tuple[int, int]] = []  # (VmHWM, model bytes) when the model is ready, before its first forward

    def mark_ready(module: torch.nn.Module) -> None:
        # a quantized tensor's own bytes: a torchao weight's numel x element_size counts its bf16 outer dtype
        ready.append((peak_rss(), sum(tensor_nbytes(t) for t in module.state_dict().values())))

    with MemoryMonitor() as mon:
        if method in ("trainer", "trainer-lowmem"):
            model = Lit()
            callbacks = [L.pytorch.callbacks.LambdaCallback(on_predict_start=lambda _, m: mark_ready(m))]
            callbacks += ([LowMemCallback(path, quantize=quantize)] if method == "trainer-lowmem" else [])
            trainer = L.Trainer(callbacks=callbacks, **trainer_kwargs)
            trainer.predict(model, torch.utils.data.DataLoader(tokens, batch_size=1),
                            ckpt_path=path if method == "trainer" else None)
        else:
            model = load(method, config, path, quantize)
            mark_ready(model)
            with torch.no_grad():
                model.eval()(tokens)  # eval, as in the Trainer's predict
    return {"ready": ready[0][0] - mon.usage.rss_start, "peak": mon.usage.rss_peak_delta,
            "lifetime_peak": peak_rss(), "final": ready[0][1], "seconds": mon.usage.seconds}


def load(method: str, config: object, path: Path, quantize: str | None) -> torch.nn.Module:
    """Build and load the model the way ``method`` does (the Fabric and bare paths)."""
    import lightning as L
    from litgpt import GPT

    from lightning_lowmem import LowMemStrategy, init_empty, load_checkpoint

    if method.startswith("load_checkpoint"):
        with init_empty():
            model = GPT(config)
        load_checkpoint(model, path, dtype=torch.bfloat16, quantize=quantize, progress=False,
                        key_map={"model.": ""} if path.suffix == ".ckpt" else None)
        return model
    if method == "fabric":
        fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true")
        with fabric.init_module(empty_init=True):
            model = GPT(config)
    elif method == "fabric-lowmem":
        fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true",
                          strategy=LowMemStrategy(quantize=quantize) if quantize else "lowmem")
        with fabric.init_module():
            model = GPT(config)
    else:
        raise ValueError(method)
    fabric.load_raw(path, model)
    return fabric.setup(model)


def run_repeated(method: str, model_name: str, path: Path, quantize: str | None, repeats: int) -> dict:
    """``repeats`` fresh processes of one method: the median of each measurement, and the load peaks."""
    args = ["--child", method, "--model", model_name, "--path", str(path)]
    args += ["--quantize", quantize] if quantize else []
    runs = []
    for _ in range(repeats):
        result = run_fresh(__file__, args)
        if "error" in result:
            return result
        runs.append(result)
    return {key: median([r[key] for r in runs]) for key in runs[0]} | {"ready_all": [r["ready"] for r in runs]}


def print_table(rows: list[tuple[str, str, dict]], floor: int, repeats: int) -> None:
    header = ["weights", "method", "checkpoint", f"load peak MiB (median of {repeats})",
              f"load peak MiB (min-max of {repeats})", "load peak / load_checkpoint's, same file (medians)",
              f"+ 1 forward MiB (median of {repeats})", "final model MiB",
              f"lifetime peak above bare torch MiB (median of {repeats})"]
    bare = {(scheme, CHECKPOINT_OF[method]): r["ready"] for scheme, method, r in rows
            if method.startswith("load_checkpoint") and "ready" in r}
    out = []
    for scheme, method, r in rows:
        if "error" in r:
            out.append([scheme, method, CHECKPOINT_OF[method], r["error"][:90], "", "", "", "", ""])
            continue
        ratio = r["ready"] / bare[scheme, CHECKPOINT_OF[method]]
        out.append([scheme, method, CHECKPOINT_OF[method], f"{r['ready'] / MiB:.0f}",
                    spread([v / MiB for v in r["ready_all"]], 0), f"{ratio:.3f}",
                    f"{r['peak'] / MiB:.0f}", f"{r['final'] / MiB:.0f}", f"{(r['lifetime_peak'] - floor) / MiB:.0f}"])
    print(markdown(header, out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pythia-1b", help="litgpt config name (default: pythia-1b)")
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    parser.add_argument("--schemes", nargs="*", default=["bf16", "bnb.nf4"])
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per row (medians reported)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--quantize", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.path, args.quantize)))
        return

    paths = write_checkpoints(args.model, args.workdir, ["bf16.pth", "model.ckpt"])
    floor = bare_torch_floor()
    rows = []
    for scheme in args.schemes:
        quantize = None if scheme == "bf16" else scheme
        for method in [*METHODS[:1], "load_checkpoint-ckpt", *METHODS[1:]]:
            if quantize and method in ("fabric", "trainer"):  # BitsandbytesPrecision refuses CPU
                rows.append((scheme, method, {"error": "n/a: Lightning's bitsandbytes plugin runs on CUDA only"}))
                continue
            path = paths[CHECKPOINT_OF[method]]
            rows.append((scheme, method, run_repeated(method, args.model, path, quantize, args.repeats)))
            print(f"  ran {scheme} / {method}", file=sys.stderr)
    print(environment(["lightning", "litgpt", "bitsandbytes"]))
    print(f"model: {args.model} config, random bf16 weights; bare `import torch` peak RSS {floor / MiB:.0f} MiB; "
          f"{args.repeats} fresh process(es) per row\n")
    print_table(rows, floor, args.repeats)


if __name__ == "__main__":
    main()
