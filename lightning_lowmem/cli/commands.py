"""The top-level parser: one subcommand per module, run, and errors turned into exit codes."""

from __future__ import annotations

import argparse
import sys

from lightning_lowmem.cli import chat, estimate, generate, inspect_checkpoint, quantize
from lightning_lowmem.cli.exits import (
    EXIT_ARGUMENT,
    EXIT_CHECKPOINT,
    EXIT_CODES,
    EXIT_INTERRUPTED,
    exit_code,
    print_error,
    print_interrupted,
)
from lightning_lowmem.cli.options import resolve_checkpoint
from lightning_lowmem.interrupts import interrupted, running
from lightning_lowmem.litgpt.requirement import import_litgpt
from lightning_lowmem.quiet import quiet

SUBCOMMANDS = (estimate, generate, chat, inspect_checkpoint, quantize)

EPILOG = """examples:
  lightning-lowmem estimate pythia-1b --quantize bnb.nf4 --max_seq_length 2048
  lightning-lowmem inspect checkpoints/EleutherAI/pythia-1b
  lightning-lowmem generate checkpoints/EleutherAI/pythia-1b --prompt "What do llamas eat?" --quantize bnb.nf4
  lightning-lowmem chat checkpoints/meta-llama/Llama-3.2-1B-Instruct --quantize bnb.nf4
  lightning-lowmem quantize checkpoints/EleutherAI/pythia-1b --quantize bnb.nf4 --out pythia-1b-nf4

`lightning-lowmem SUBCOMMAND --help` tells more. The same runs as `python -m lightning_lowmem`.
""" + EXIT_CODES


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``lightning-lowmem`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="lightning-lowmem",
        description="Load, quantize and run litgpt models in the memory of the final model. The flags of generate "
                    "and chat are litgpt's.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(title="subcommands", metavar="SUBCOMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``lightning-lowmem`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code. Ctrl-C is one line
    on stderr and exit code 130, never a traceback.

    Example::

        >>> main(["estimate", "pythia-14m", "--max_seq_length", "64", "--json"])  # doctest: +ELLIPSIS
        {
          "model": "pythia-14m",
        ...
        0
    """
    try:
        with quiet():  # third-party import noise (lightning_lowmem/quiet.py)
            return _main(argv)
    except KeyboardInterrupt:
        print_interrupted()
        return EXIT_INTERRUPTED
    except Exception:
        if interrupted():  # an error an interrupted import made of the KeyboardInterrupt (numpy: RecursionError)
            print_interrupted()
            return EXIT_INTERRUPTED
        raise


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a flag argparse refused (it printed why)
        return e.code if isinstance(e.code, int) else EXIT_ARGUMENT
    if not hasattr(args, "run"):
        parser.print_help(sys.stderr)
        return EXIT_ARGUMENT
    try:  # every subcommand builds litgpt's GPT; --help and --version answer without it
        import_litgpt(needed_by="The lightning-lowmem command")
    except ImportError as e:
        print_error(e)
        return EXIT_CHECKPOINT
    running()  # Ctrl-C from here on: KeyboardInterrupt, so that a save cleans up (lightning_lowmem/interrupts.py)
    try:
        if hasattr(args, "checkpoint_flag"):  # a subcommand taking CHECKPOINT or --checkpoint_dir
            resolve_checkpoint(args, args.parser)
        return args.run(args)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_ARGUMENT
    except Exception as e:  # noqa: BLE001  (each known error is one line and an exit code; others are bugs)
        code = exit_code(e)
        if code is None or interrupted():
            raise
        print_error(e, flags_of(args.parser))
        return code


def flags_of(parser: argparse.ArgumentParser) -> dict[str, tuple[str, str]]:
    """The Python keyword each of a subcommand's flags stands for -> ``(flag, metavar)``: ``max_memory`` ->
    ``("--max_memory", "DEVICE=SIZE,...")``; the API's ``prefer=`` is ``--weights``."""
    flags = {}
    for action in parser._actions:  # argparse keeps no public list of a parser's arguments
        long = [option for option in action.option_strings if option.startswith("--")]
        if long and action.dest not in ("help", "checkpoint_flag"):
            flags[action.dest] = (long[0], action.metavar or action.dest.upper())
    if "weights" in flags:
        flags["prefer"] = flags["weights"]
    return flags


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightning-lowmem")
    except PackageNotFoundError:
        return "unknown"
