"""The flags the subcommands share, spelled as litgpt spells them (``--max_new_tokens``, ``--top_k``), and
how their values are read.

Reading a value never imports litgpt or Lightning: ``--help`` and a bad flag answer at once.
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from lightning_lowmem.quantize import SCHEMES

def add_subcommand(subparsers: argparse._SubParsersAction, name: str, *, summary: str, description: str,
                   epilog: str) -> argparse.ArgumentParser:
    """A subcommand's parser: ``summary`` in the top-level list, ``description`` wrapped, ``epilog`` as written."""
    return subparsers.add_parser(name, help=summary, description=textwrap.fill(description, width=100),
                                 epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)


CHECKPOINT_HELP = ("a checkpoint directory (litgpt's lit_model.pth + model_config.yaml, or an HF model.safetensors + "
                   "config.json), or one file: a .gguf file, a lit_model.pth, a .safetensors")


def add_checkpoint(parser: argparse.ArgumentParser, what: str) -> None:
    """The checkpoint as a positional argument, or as ``--checkpoint_dir`` (litgpt's flag)."""
    parser.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT", help=what)
    parser.add_argument("--checkpoint_dir", dest="checkpoint_flag", metavar="PATH",
                        help="the same, as a flag (litgpt's spelling)")
    add_weights(parser)


def add_weights(parser: argparse.ArgumentParser) -> None:
    """``--weights``: which weight set of a directory holding several; ``--verify_weight_sets``: compare them."""
    parser.add_argument("--weights", default=None, metavar="NAME",
                        help="which weights to read when the directory holds several sets: a file name there "
                             "(lit_model.pth, model.safetensors) or a format (safetensors, torch, gguf)")
    parser.add_argument("--entry", default=None, metavar="NAME",
                        help="the entry of a torch checkpoint that holds the weights (model_state_dict, ema, ...); "
                             "default: the only one holding tensors, else the one whose names fit the model")
    parser.add_argument("--verify_weight_sets", action="store_true",
                        help="when the directory holds several sets that agree by names, shapes and dtypes, read "
                             "every byte of each and compare (costs a read of every set); without it the first "
                             "in the documented order is read with a warning that the rest was not compared")


def resolve_checkpoint(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Put the positional or ``--checkpoint_dir`` value in ``args.checkpoint``; exit 2 when none or two differ."""
    given = [value for value in (args.checkpoint, args.checkpoint_flag) if value is not None]
    if not given:
        parser.error("give the checkpoint: as the first argument, or --checkpoint_dir PATH")
    if len(set(given)) > 1:
        parser.error(f"two checkpoints given: {given[0]!r} and --checkpoint_dir {given[1]!r}; give one")
    args.checkpoint = given[0]


def add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="NAME_OR_YAML", default=None,
                        help="the litgpt config: a model name (pythia-1b) or a model_config.yaml; default: the "
                             "directory's model_config.yaml, its name, or its HF config.json")


def add_load(parser: argparse.ArgumentParser, *, device: bool = True) -> None:
    """``--quantize``, ``--precision`` (litgpt's), ``--config`` and ``--device``."""
    add_quantize(parser, "quantize each Linear as it is loaded")
    parser.add_argument("--precision", default=None, metavar="PRECISION",
                        help="bf16-true (default), 16-true or 32-true: the dtype of the weights and caches")
    add_config(parser)
    if device:
        parser.add_argument("--device", default=None,
                            help="where the model runs: cpu, cuda, cuda:1; default: cuda when there is one, "
                                 "else cpu (as litgpt)")
        add_budgets(parser)


def add_quantize(parser: argparse.ArgumentParser, what: str) -> None:
    """``--quantize SCHEME``; ``None`` (any case) or ``null`` is no scheme, as litgpt's ``--quantize`` takes it."""
    parser.add_argument("--quantize", type=scheme_name, default=None, metavar="SCHEME",
                        help=f"{what}: {', '.join(SCHEMES)}; default: None (full precision)")


def scheme_name(text: str) -> str | None:
    """A ``--quantize`` value: None for ``none`` / ``None`` / ``null``, else the scheme's name as given (checked by
    the load, which names the known ones).

    Example::

        >>> scheme_name("None"), scheme_name("bnb.nf4")
        (None, 'bnb.nf4')
    """
    return None if text.strip().lower() in ("none", "null") else text


def add_budgets(parser: argparse.ArgumentParser) -> None:
    """``--max_memory`` and ``--disk_offload``."""
    parser.add_argument("--max_memory", type=max_memory, default=None, metavar="DEVICE=SIZE,...",
                        help="device budgets instead of --device, e.g. cpu=2GiB or cuda:0=6GiB,cpu=20GiB: layers "
                             "that do not fit the first are kept on the cpu and streamed in for their forward")
    parser.add_argument("--disk_offload", action="store_true",
                        help="with --max_memory: leave the layers that fit no budget in the checkpoint file and "
                             "read each for its forward (the next one read meanwhile), at the disk's speed")


def check_budgets(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Exit 2 when ``--disk_offload`` comes without ``--max_memory``, or ``--device`` with it."""
    if getattr(args, "disk_offload", False) and args.max_memory is None:
        parser.error("--disk_offload needs --max_memory (e.g. --max_memory cpu=2GiB): the budgets decide which "
                     "layers stay in memory")
    if getattr(args, "device", None) is not None and getattr(args, "max_memory", None) is not None:
        parser.error("give --device or --max_memory, not both: with --max_memory the budgets decide where layers run")


def bandwidth(text: str) -> float:
    """A read speed in bytes per second: ``2GB/s``, ``500MiB/s`` or a number of bytes.

    Example::

        >>> bandwidth("500MiB/s") == 500 * 2**20, bandwidth("2e9")
        (True, 2000000000.0)
    """
    from lightning_lowmem.memory.units import parse_bytes

    value = text.strip().removesuffix("/s")
    try:
        speed = float(value) if value.replace(".", "", 1).replace("e", "", 1).isdigit() else parse_bytes(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a read speed such as 2GB/s or 500MiB/s, got {text!r}") from None
    if speed <= 0:
        raise argparse.ArgumentTypeError(f"expected a read speed above 0, got {text!r}")
    return float(speed)


def add_compile(parser: argparse.ArgumentParser) -> None:
    """``--compile`` (litgpt's ``--compile true`` is read too)."""
    parser.add_argument("--compile", nargs="?", const=True, default=False, type=boolean, metavar="true|false",
                        help="compile the decode step with torch.compile, as litgpt's --compile (mode "
                             "reduce-overhead on CUDA): the first reply pays the compile, later ones of any length "
                             "reuse it; layers offloaded or on disk decode without it")


def boolean(text: str) -> bool:
    """``true``/``false`` (any case; also ``1``/``0``, ``yes``/``no``), as litgpt's command line reads a bool.

    Example::

        >>> boolean("True"), boolean("0")
        (True, False)
    """
    value = text.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_sampling(parser: argparse.ArgumentParser) -> None:
    """litgpt's sampling flags, with its defaults."""
    parser.add_argument("--max_new_tokens", type=positive_int, default=50, help="tokens to generate (default 50)")
    parser.add_argument("--top_k", type=optional_int, default=50,
                        help="sample among the k most probable tokens (default 50; 'none' for all); 1 is greedy")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling threshold (default 1.0)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="higher is more random (default 0.8); 0 is greedy")


def positive_int(text: str) -> int:
    """An int >= 1.

    Example::

        >>> positive_int("4")
        4
    """
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def optional_int(text: str) -> int | None:
    """An int, or None for ``none``.

    Example::

        >>> optional_int("none"), optional_int("1")
        (None, 1)
    """
    return None if text.lower() == "none" else _int(text)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None


def max_memory(text: str) -> dict[str, str]:
    """``cuda:0=6GiB,cpu=20GiB`` as ``{"cuda:0": "6GiB", "cpu": "20GiB"}`` (sizes are read by the placement).

    Example::

        >>> max_memory("cuda:0=6GiB, cpu=20GiB")
        {'cuda:0': '6GiB', 'cpu': '20GiB'}
    """
    budgets = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        device, sep, size = (s.strip() for s in item.partition("="))
        if not sep or not device or not size:
            raise argparse.ArgumentTypeError(f"expected DEVICE=SIZE[,DEVICE=SIZE], e.g. cuda:0=6GiB,cpu=20GiB; "
                                             f"got {item!r} in {text!r}")
        if device in budgets:
            raise argparse.ArgumentTypeError(f"{device!r} is given twice in {text!r}: give each device one budget")
        budgets[device] = size
    if not budgets:
        raise argparse.ArgumentTypeError(f"expected DEVICE=SIZE[,DEVICE=SIZE], e.g. cuda:0=6GiB,cpu=20GiB; got {text!r}")
    return budgets


def config_argument(value: str | None) -> Any | None:
    """The litgpt ``Config`` that ``--config`` names: a ``model_config.yaml`` path or a litgpt model name, read as
    the Python API reads ``config=`` (:func:`~lightning_lowmem.litgpt.checkpoint_dir.config_of`).

    Raises:
        ValueError: neither an existing file nor a litgpt model name.
        CheckpointFormatError: the file is not a litgpt config.
    """
    from lightning_lowmem.litgpt.checkpoint_dir import config_of

    return config_of(value)


def default_device(value: str | None) -> str:
    """``--device``, or litgpt's default: cuda when there is one, else cpu (the engine's
    :func:`~lightning_lowmem.request.defaults.default_device`)."""
    if value is not None:
        return value
    from lightning_lowmem.request.defaults import default_device as litgpt_default

    return str(litgpt_default())
