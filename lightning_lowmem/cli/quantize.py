"""``lightning-lowmem quantize``: a pre-quantized copy of a checkpoint, made once, loaded as stored after.

The checkpoint is found and streamed in exactly as ``generate`` loads it (litgpt, HF or
GGUF; quantized on load), then written by :func:`~lightning_lowmem.save_checkpoint`: one
tensor at a time, in litgpt's names, with ``model_config.yaml``. The tokenizer and prompt
files beside the checkpoint are copied; a GGUF file's tokenizer and chat template are
written out (``tokenizer.json``, ``tokenizer_config.json`` with the template,
``generation_config.json``, and ``prompt_style.yaml`` naming the template), so ``generate``
and ``chat`` take the copy as they took the original, without ``--quantize``. The whole
of ``--out`` is switched in at once: a kill or a full disk leaves the old directory or the
new one.

``--out`` is checked before any weight is read: not a file, writable, no weight files
there that this library did not write (unless ``--overwrite``), and free space for the
bytes the load plan says the model will take.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from typing import Any

from lightning_lowmem.cli.exits import EXIT_OK, exit_codes
from lightning_lowmem.cli.options import (
    CHECKPOINT_HELP,
    add_checkpoint,
    add_config,
    add_quantize,
    add_subcommand,
    config_argument,
    default_device,
)

COPIED = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
          "generation_config.json", "chat_template.jinja", "prompt_style.yaml")
"""Files beside the weights that litgpt's tokenizer and prompt styles read, copied as they are."""

EPILOG = """example:
  lightning-lowmem quantize checkpoints/EleutherAI/pythia-1b --quantize bnb.nf4 --out pythia-1b-nf4
  lightning-lowmem generate pythia-1b-nf4 --prompt "What do llamas eat?"    # loads as stored: no --quantize

""" + exit_codes("quantize")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_subcommand(
        subparsers, "quantize", summary="write a pre-quantized copy of a checkpoint, streamed",
        description="Load a checkpoint as generate does (litgpt, HF or .gguf), quantizing each Linear as it is "
                    "read, and write what the model holds to --out as safetensors, one tensor at a time, "
                    "quantized layers in the layout transformers saves for their library, with model_config.yaml "
                    "and the tokenizer and prompt-style files (a .gguf file's own tokenizer and chat template written out). Loading the copy reads the quantized weights as "
                    "they are: no full-precision weight is read or quantized again. Without --quantize, the copy "
                    "is in --precision (a conversion to litgpt's names and safetensors).",
        epilog=EPILOG)
    add_checkpoint(parser, CHECKPOINT_HELP)
    parser.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="the directory to write (made if missing; replaced whole, other files in it kept)")
    parser.add_argument("--overwrite", action="store_true",
                        help="remove weight files in --out that lightning-lowmem did not write (lit_model.pth, "
                             "pytorch_model.bin, *.safetensors, *.gguf); without it they stop the command before "
                             "any weight is read")
    add_quantize(parser, "the scheme of the copy")
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
    """Check --out, load (quantizing), save with the tokenizer files; what was done to stderr, the files to stdout."""
    from lightning_lowmem.engine import LoadOptions
    from lightning_lowmem.saving import save_checkpoint
    from lightning_lowmem.saving.save_target import check_save_target
    from lightning_lowmem.litgpt.checkpoint_dir import LitgptCheckpoint
    from lightning_lowmem.litgpt.generation import load_for_generation
    from lightning_lowmem.memory import format_bytes, parse_bytes

    found = LitgptCheckpoint.find(Path(args.checkpoint), config_argument(args.config), args.weights,
                                  verify=args.verify_weight_sets, entry=args.entry)
    out = args.out.expanduser()
    if out.resolve() == found.directory.resolve():
        args.parser.error(f"--out {str(args.out)!r} is the checkpoint's own directory: write the copy elsewhere")
    if os.path.lexists(out) and not out.is_dir():
        args.parser.error(f"--out {str(args.out)!r} is a file: give a directory to write the copy into")
    parse_bytes(args.max_shard_size, name="max_shard_size")  # a bad size fails before the load, not after it
    skip = tuple(args.skip_quantize.split(",")) if args.skip_quantize else None
    check_save_target(out, sizes=[_model_bytes(found, args, skip)], overwrite=args.overwrite)  # before any read
    model, _, report = load_for_generation(found, options=LoadOptions(skip_quantize=skip, prefer=args.weights),
                                           quantize=args.quantize,
                                           precision=args.precision, device=default_device(args.device))
    print(report, file=sys.stderr, flush=True)  # before the save, not at exit
    with tempfile.TemporaryDirectory(prefix="lowmem-tokenizer-") as scratch:
        copied = _beside(found, Path(scratch))
        files = save_checkpoint(model, out, max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                                copy_files=copied)
    for path in [*files, out / "model_config.yaml", *(out / source.name for source in copied)]:
        print(f"{path}  {format_bytes(path.stat().st_size)}")
    return EXIT_OK


def _beside(found: Any, scratch: Path) -> list[Path]:
    """The files the copy carries beside its weights: the tokenizer and prompt-style files of the directory, or a
    GGUF file's tokenizer and chat template written out into ``scratch`` (a ``prompt_style.yaml`` beside the file,
    which generate prefers to the file's template, is carried over instead of the one naming the template)."""
    own = {name: found.directory / name for name in COPIED if (found.directory / name).is_file()}
    if found.gguf is None:
        return list(own.values())
    written = []
    if found.tokenizer is not None:
        from lightning_lowmem.litgpt.gguf_tokenizer import write_tokenizer
        from lightning_lowmem.litgpt.prompt_style import write_chat_template_style

        written = write_tokenizer(found.tokenizer, scratch, found.gguf.chat_template)
        if found.gguf.chat_template and "prompt_style.yaml" not in own:
            written.append(write_chat_template_style(scratch))
    if "prompt_style.yaml" in own:
        written.append(own["prompt_style.yaml"])
    return written


def _model_bytes(found: Any, args: argparse.Namespace, skip: tuple[str, ...] | None) -> int:
    """The bytes of the model the load will make, from the load plan (headers only): what the copy will take."""
    from lightning_lowmem.request.defaults import generation_dtype
    from lightning_lowmem.litgpt.estimate_memory import estimate_memory

    est = estimate_memory(found.weights, quantize=args.quantize, skip_quantize=skip, config=found.config,
                          dtype=generation_dtype(precision=args.precision))
    return est.weights
