"""``lightning-lowmem quantize``: a pre-quantized copy of a checkpoint, made once, loaded as stored after.

The checkpoint is found and streamed in exactly as ``generate`` loads it (litgpt, HF or
GGUF; quantized on load), then written by :func:`~lightning_lowmem.save_checkpoint`: one
tensor at a time, in litgpt's names, with ``model_config.yaml``. The tokenizer and prompt
files beside the checkpoint are copied, so ``generate`` and ``chat`` take the copy as
they took the original, without ``--quantize``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from lightning_lowmem.cli.exits import EXIT_CODES, EXIT_OK
from lightning_lowmem.cli.options import add_checkpoint, add_config, add_subcommand, config_argument, default_device
from lightning_lowmem.quantize import SCHEMES

COPIED = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
          "generation_config.json", "prompt_style.yaml")
"""Files beside the weights that litgpt's tokenizer and prompt styles read, copied as they are."""

EPILOG = """example:
  lightning-lowmem quantize checkpoints/EleutherAI/pythia-1b --quantize bnb.nf4 --out pythia-1b-nf4
  lightning-lowmem generate pythia-1b-nf4 --prompt "What do llamas eat?"    # loads as stored: no --quantize

""" + EXIT_CODES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_subcommand(
        subparsers, "quantize", summary="write a pre-quantized copy of a checkpoint, streamed",
        description="Load a checkpoint as generate does (litgpt, HF or .gguf), quantizing each Linear as it is "
                    "read, and write what the model holds to --out as safetensors, one tensor at a time, "
                    "quantized layers in the layout transformers saves for their library, with model_config.yaml "
                    "and the tokenizer and prompt-style files. Loading the copy reads the quantized weights as "
                    "they are: no full-precision weight is read or quantized again. Without --quantize, the copy "
                    "is in --precision (a conversion to litgpt's names and safetensors).",
        epilog=EPILOG)
    add_checkpoint(parser, "the checkpoint directory or file")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="the directory to write (made if missing)")
    parser.add_argument("--quantize", default=None, metavar="SCHEME", help=f"one of {', '.join(SCHEMES)}")
    parser.add_argument("--skip_quantize", default=None, metavar="NAMES",
                        help="comma-separated module names or patterns kept in full precision (default: lm_head)")
    parser.add_argument("--precision", default=None, metavar="PRECISION",
                        help="bf16-true (default), 16-true or 32-true: the dtype of what is not quantized")
    parser.add_argument("--max_shard_size", default="5GB", metavar="SIZE",
                        help="bytes per file (5GB, 500MiB); past it, files and an index as save_pretrained writes")
    add_config(parser)
    parser.add_argument("--device", default=None,
                        help="where weights are quantized: cpu, cuda; default: cuda when there is one, else cpu")
    parser.set_defaults(run=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    """Load (quantizing), save, copy the tokenizer files; what was done to stderr, the files written to stdout."""
    from lightning_lowmem.engine import LoadOptions, save_checkpoint
    from lightning_lowmem.litgpt.checkpoint_dir import LitgptCheckpoint
    from lightning_lowmem.litgpt.generation import load_for_generation
    from lightning_lowmem.memory import format_bytes, parse_bytes

    found = LitgptCheckpoint.find(Path(args.checkpoint), config_argument(args.config), args.weights)
    out = args.out.expanduser()
    if out.resolve() == found.directory.resolve():
        args.parser.error(f"--out {str(args.out)!r} is the checkpoint's own directory: write the copy elsewhere")
    parse_bytes(args.max_shard_size)  # a bad size fails before the load, not after it
    skip = tuple(args.skip_quantize.split(",")) if args.skip_quantize else None
    model, _, report = load_for_generation(found, options=LoadOptions(skip_quantize=skip, prefer=args.weights), quantize=args.quantize,
                                           precision=args.precision, device=default_device(args.device))
    print(report, file=sys.stderr)
    files = save_checkpoint(model, out, max_shard_size=args.max_shard_size)
    copied = [name for name in COPIED if (found.directory / name).is_file()]
    for name in copied:
        shutil.copyfile(found.directory / name, out / name)
    for path in [*files, out / "model_config.yaml", *(out / name for name in copied)]:
        print(f"{path}  {format_bytes(path.stat().st_size)}")
    if found.gguf is not None and found.tokenizer is not None:
        print("The GGUF file's vocabulary is not written: give generate the token ids, or put the model's "
              "tokenizer.json beside the copy.", file=sys.stderr)
    return EXIT_OK
