"""Generate text with a litgpt model loaded by lightning_lowmem, lit-gpt style.

The flags are litgpt's (``litgpt generate``)::

    python examples/generate.py --checkpoint_dir checkpoints/EleutherAI/pythia-1b \\
        --prompt "What food do llamas eat?" --max_new_tokens 50 --quantize bnb.nf4

A directory without a tokenizer takes token ids: ``--prompt '1 2 3'``. The
checkpoint is a litgpt directory (``lit_model.pth`` + ``model_config.yaml``) or
an HF-format one (``model.safetensors``). The KV cache, mask and RoPE tables are
sized to prompt + max_new_tokens; the script prints tokens/s and the memory of
weights, caches and the peak. It goes through ``lightning_lowmem.generate()``,
the same setup a notebook uses: the model is built and streamed in by
``Fabric(strategy=LowMemStrategy(quantize=...))``, then litgpt's own generate loop runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lightning_lowmem import generate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", type=Path, help="the checkpoint directory (or --checkpoint_dir)")
    parser.add_argument("--checkpoint_dir", type=Path, default=None)
    parser.add_argument("--prompt", default="What food do llamas eat?")
    parser.add_argument("--max_new_tokens", type=int, default=50)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_k", type=int, default=50)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--quantize", default=None,
                        help="bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq, bnb.int8, torchao.int8wo, ...")
    parser.add_argument("--precision", default=None, help="bf16-true (default), 16-true or 32-true")
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--device", default=None, help="cpu (default) or cuda")
    args = parser.parse_args(argv)
    args.checkpoint_dir = args.checkpoint_dir or args.checkpoint
    if args.checkpoint_dir is None:
        parser.error("give the checkpoint directory (positional or --checkpoint_dir)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = generate(args.checkpoint_dir, args.prompt, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, quantize=args.quantize,
                      precision=args.precision, num_samples=args.num_samples, device=args.device)
    if result.load_report is not None:
        print(result.load_report, file=sys.stderr)
    for i, tokens in enumerate(result.tokens):
        print(result.texts[i] if result.texts is not None else " ".join(str(t) for t in tokens.tolist()))
        new = tokens.numel() - result.prompt_length
        print(f"Time for inference {i + 1}: {result.seconds[i]:.02f} sec total, "
              f"{new / result.seconds[i]:.02f} tokens/sec", file=sys.stderr)
    print(f"Memory: {result.memory}", file=sys.stderr)
    if torch.cuda.is_available() and result.memory.device_peak is not None:
        print(f"Memory used: {result.memory.device_peak / 1e9:.02f} GB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
