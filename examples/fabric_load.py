"""Load a litgpt model with ``Fabric(strategy="lowmem")``: built on meta, streamed in, optionally quantized.

    python examples/fabric_load.py                         # pythia-14m architecture, bf16
    python examples/fabric_load.py --quantize bnb.nf4      # 4-bit weights, on CPU too
    python examples/fabric_load.py --model pythia-160m --workdir /tmp/lowmem-example

It first writes a checkpoint to load (the litgpt architecture with random weights, saved as
``lit_model.pth`` the way litgpt saves it) under ``--workdir``, by default
~/.cache/lightning_lowmem/examples/fabric_load (later runs reuse it), then loads it the way an
existing Fabric script does, with one flag changed, and checks the output against an eagerly loaded copy.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from litgpt import GPT, Config

import lightning_lowmem  # noqa: F401  (registers strategy="lowmem")
from lightning_lowmem import LowMemStrategy, format_bytes


def make_checkpoint(model_name: str, workdir: Path) -> Path:
    """A litgpt ``lit_model.pth`` with random weights (no download needed)."""
    path = workdir / model_name / "lit_model.pth"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        torch.save(GPT(Config.from_name(model_name)).state_dict(), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pythia-14m")
    parser.add_argument("--quantize", default=None, help='e.g. "bnb.nf4", "bnb.int8", "torchao.int8wo"')
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "lightning_lowmem" / "examples"
                        / "fabric_load", help="where the checkpoint is written (default: %(default)s)")
    args = parser.parse_args()
    path = make_checkpoint(args.model, args.workdir)
    config = Config.from_name(args.model)

    # The only change to a Fabric script: the strategy (the string "lowmem" when no options are needed).
    strategy = LowMemStrategy(quantize=args.quantize) if args.quantize else "lowmem"
    fabric = L.Fabric(accelerator="auto", devices=1, strategy=strategy, precision="bf16-true")
    with fabric.init_module():  # parameters on meta: nothing allocated yet
        model = GPT(config)
    fabric.print(f"built on {model.lm_head.weight.device}")
    fabric.load_raw(path, model)  # each tensor read, cast to bf16 (and quantized), then placed
    model = fabric.setup(model)
    report = fabric.strategy.reports[-1]
    fabric.print(report)

    prompt = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    tokens = fabric.to_device(prompt)
    with torch.no_grad():
        for _ in range(8):  # greedy decoding, full forward each step (no KV cache: this is a demo)
            tokens = torch.cat([tokens, model(tokens)[:, -1:].argmax(-1)], dim=1)
    fabric.print(f"generated token ids: {tokens[0, 12:].tolist()}")

    eager = GPT(config).to(torch.bfloat16)  # the usual way, for comparison: allocated, then copied into
    eager.load_state_dict(torch.load(path, weights_only=True))
    with torch.no_grad():
        logits, expected = model(prompt).float().cpu(), eager(prompt).float()
    if args.quantize is None:
        assert torch.equal(logits, expected), "streamed model differs from the eagerly loaded one"
        fabric.print("output identical to the eagerly loaded model")
    else:
        cos = torch.nn.functional.cosine_similarity(logits.flatten(), expected.flatten(), dim=0).item()
        fabric.print(f"{args.quantize}: cosine similarity of logits to bf16 = {cos:.4f}; quantized weights "
                     f"{format_bytes(report.quantized_bytes_before)} -> {format_bytes(report.quantized_bytes_after)}")


if __name__ == "__main__":
    main()
