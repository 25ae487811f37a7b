"""``lightning-lowmem estimate``: the memory a load and a generation will need, read from headers or a config."""

from __future__ import annotations

import argparse
import json

from lightning_lowmem.cli.exits import EXIT_OK, exit_codes
from lightning_lowmem.cli.options import (
    add_config,
    add_quantize,
    add_subcommand,
    add_weights,
    bandwidth,
    check_budgets,
    max_memory,
    positive_int,
)

EPILOG = """example:
  lightning-lowmem estimate checkpoints/EleutherAI/pythia-1b --quantize bnb.nf4 --max_seq_length 114
  lightning-lowmem estimate pythia-1b --max_memory cuda:0=600MiB,cpu=8GiB --max_seq_length 2048 --json
  lightning-lowmem estimate checkpoints/EleutherAI/pythia-1.4b --max_memory cpu=1GiB --disk_offload \\
      --max_seq_length 128

""" + exit_codes("estimate")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_subcommand(
        subparsers, "estimate", summary="the memory a load and a generation will need, without reading a weight",
        description="Print the memory a load and a generation will need: weights (quantized where the load "
                    "quantizes), KV cache, mask, RoPE, activations, and the peaks. Reads the checkpoint's headers "
                    "only, or nothing at all for a litgpt model name.",
        epilog=EPILOG)
    parser.add_argument("checkpoint", metavar="CHECKPOINT_OR_LITGPT_NAME",
                        help="a checkpoint file or directory, or a litgpt model name (pythia-1b)")
    add_quantize(parser, "the scheme the load would quantize with")
    parser.add_argument("--precision", default=None, metavar="PRECISION",
                        help="bf16-true (default), 16-true or 32-true: the dtype of the weights and caches")
    parser.add_argument("--max_seq_length", type=positive_int, default=None,
                        help="positions held: prompt + max_new_tokens (default: what generate holds with its "
                             "defaults, --prompt_length + 50 new tokens, within the model's context; a note says so)")
    parser.add_argument("--prompt_length", type=positive_int, default=None,
                        help="tokens in the prompt, for the prefill's activations (default: --max_seq_length; 64 "
                             "without it)")
    parser.add_argument("--batch_size", type=positive_int, default=None, help="sequences at once (default 1)")
    parser.add_argument("--max_memory", type=max_memory, default=None, metavar="DEVICE=SIZE,...",
                        help="device budgets, e.g. cuda:0=6GiB,cpu=20GiB: adds the placement of each layer")
    parser.add_argument("--disk_offload", action="store_true",
                        help="with --max_memory: the layers that fit no budget stay in the checkpoint file; shows "
                             "which, the bytes each token reads and the seconds that takes")
    parser.add_argument("--read_bandwidth", type=bandwidth, default=None, metavar="SPEED",
                        help="the speed the checkpoint is read at with --disk_offload, e.g. 2GB/s; default: "
                             "measured on the file (O_DIRECT: the disk, not the page cache)")
    add_config(parser)
    add_weights(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON object of every number, in bytes")
    parser.set_defaults(run=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    """Estimate and print (a table, or JSON with ``--json``)."""
    from lightning_lowmem.cli.options import config_argument
    from lightning_lowmem.engine import LoadOptions
    from lightning_lowmem.request.defaults import generation_dtype
    from lightning_lowmem.litgpt.estimate_memory import estimate_memory

    check_budgets(args, args.parser)
    est = estimate_memory(args.checkpoint, quantize=args.quantize, dtype=generation_dtype(precision=args.precision),
                          batch_size=args.batch_size, max_seq_length=args.max_seq_length,
                          prompt_length=args.prompt_length, max_memory=args.max_memory,
                          disk_offload=args.disk_offload or None, read_bandwidth=args.read_bandwidth,
                          config=config_argument(args.config),
                          options=LoadOptions(prefer=args.weights, verify_weight_sets=args.verify_weight_sets,
                                              entry=args.entry))
    print(json.dumps(est.to_dict(), indent=2) if args.json else est)
    return EXIT_OK
