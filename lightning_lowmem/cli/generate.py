"""``lightning-lowmem generate``: what ``litgpt generate`` does, with the model loaded by lightning_lowmem.

As litgpt 0.5.13's ``litgpt/generate/base.py:main``: the directory's prompt style
(``prompt_style.yaml``, else a GGUF file's own chat template, else the one litgpt picks from the
config's name) is applied to
the prompt with ``--sys_prompt``; the generator is seeded with 1234; generation stops at
the tokenizer's ``eos_id``; each sample's ``tokenizer.decode`` goes to stdout and the
timings to stderr. Unlike ``litgpt generate``, stdout holds each sample's reply without the (styled) prompt, as
litgpt's ``LLM.generate`` returns it. The model is streamed in (quantized on load, on CPU too) and the KV
caches are sized to prompt + ``--max_new_tokens`` by :func:`lightning_lowmem.litgpt.generate`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from lightning_lowmem.cli.exits import EXIT_OK, exit_codes
from lightning_lowmem.cli.options import (
    CHECKPOINT_HELP,
    add_checkpoint,
    add_compile,
    add_load,
    add_sampling,
    add_subcommand,
    check_budgets,
    config_argument,
    default_device,
    positive_int,
)

SEED = 1234  # litgpt generate's L.seed_everything(1234)

EPILOG = """example:
  lightning-lowmem generate checkpoints/EleutherAI/pythia-1b --prompt "What do llamas eat?" \\
      --max_new_tokens 50 --quantize bnb.nf4
  lightning-lowmem generate my-model --prompt "1 2 3"     # a directory without a tokenizer takes token ids
  lightning-lowmem generate checkpoints/EleutherAI/pythia-1.4b --max_memory cpu=1GiB --disk_offload

""" + exit_codes("generate")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_subcommand(
        subparsers, "generate", summary="generate text, as litgpt generate does, with the model streamed in",
        description="Generate text after a prompt, as `litgpt generate` does (same flags, same greedy text), with "
                    "the model streamed in and quantized as it loads, and the KV caches sized to the request. "
                    "The checkpoint is a litgpt directory (lit_model.pth + model_config.yaml), an HF one "
                    "(model.safetensors + config.json), or a .gguf file (config and tokenizer from the file).",
        epilog=EPILOG)
    add_checkpoint(parser, CHECKPOINT_HELP)
    parser.add_argument("--prompt", default="What food do llamas eat?",
                        help="the prompt; token ids ('1 2 3') when the directory has no tokenizer")
    parser.add_argument("--sys_prompt", default=None, help="the system prompt the prompt style puts in")
    parser.add_argument("--num_samples", type=positive_int, default=1, help="samples, one after another (default 1)")
    add_sampling(parser)
    add_load(parser)
    add_compile(parser)
    parser.set_defaults(run=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    """Load, generate ``--num_samples`` samples, print each; timings and memory to stderr."""
    from lightning_lowmem.litgpt.checkpoint_dir import LitgptCheckpoint
    from lightning_lowmem.litgpt.generation import generate

    check_budgets(args, args.parser)
    found = LitgptCheckpoint.find(Path(args.checkpoint), config_argument(args.config), args.weights,
                                  verify=args.verify_weight_sets, entry=args.entry)
    tokenizer = found.tokenizer

    def print_sample(i: int, new: Any, seconds: float) -> None:
        """Each sample's reply (as litgpt's LLM.generate returns it) and time, as soon as it is made."""
        print(tokenizer.decode(new) if tokenizer is not None else " ".join(str(t) for t in new.tolist()), flush=True)
        print(f"Time for inference {i + 1}: {seconds:.02f} sec total, {new.numel() / seconds:.02f} tokens/sec",
              file=sys.stderr, flush=True)

    def print_report(report: Any) -> None:
        print(report, file=sys.stderr, flush=True)  # now, to a file or a pipe too (2> file), not at exit

    result = generate(found, args.prompt, sys_prompt=args.sys_prompt,  # styled as litgpt styles it, by generate()
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_k=args.top_k, top_p=args.top_p, quantize=args.quantize, precision=args.precision,
                      num_samples=args.num_samples, device=None if args.max_memory else default_device(args.device),
                      max_memory=args.max_memory, disk_offload=args.disk_offload or None, seed=SEED,
                      compile=args.compile, on_load=print_report, on_sample=print_sample)
    print(f"Memory: {result.memory}", file=sys.stderr, flush=True)
    return EXIT_OK
