"""``lightning-lowmem inspect``: what a checkpoint holds, and whether it fits its litgpt config, from headers alone.

The fit is the engine's own plan (:func:`~lightning_lowmem.engine.prepare_load`, with
litgpt's HF conversion when the keys are HF's), made on a model built on meta: missing
and unexpected keys and shape mismatches are the errors a load would raise, found
without reading a weight.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_lowmem.cli.exits import EXIT_CHECKPOINT, EXIT_CODES, EXIT_OK
from lightning_lowmem.cli.options import add_checkpoint, add_config, add_subcommand
from lightning_lowmem.errors import LowMemError
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.memory import format_bytes

EPILOG = """example:
  lightning-lowmem inspect checkpoints/EleutherAI/pythia-1b
  lightning-lowmem inspect model.safetensors --config pythia-1b --json

""" + EXIT_CODES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_subcommand(
        subparsers, "inspect", summary="what a checkpoint holds, and whether it fits its litgpt config, without reading a weight",
        description="Print a checkpoint's format, files, tensors, dtypes and bytes, and whether it fits its litgpt "
                    "config: the missing and unexpected keys and the shape mismatches a load would raise. Reads "
                    "headers only. In a directory, lit_model.pth is inspected when there is one (what generate "
                    "and chat load). Exits 1 when the checkpoint cannot be read or does not fit.",
        epilog=EPILOG)
    add_checkpoint(parser, "a checkpoint file or directory")
    add_config(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    parser.set_defaults(run=run, parser=parser)


@dataclass
class Fit:
    """Whether a checkpoint fits a litgpt config, as the load's plan says."""

    name: str
    source: str
    matches: bool = False
    tensors: int = 0
    error: str | None = None
    error_type: str | None = None


@dataclass
class Summary:
    """What a checkpoint holds, from its headers."""

    path: str
    format: str
    entry: str
    files: list[dict[str, Any]]
    tensors: int
    bytes: int
    dtypes: dict[str, dict[str, int]]
    config: Fit | None = None
    config_note: str = ""


def run(args: argparse.Namespace) -> int:
    """Inspect, print; exit 1 when the checkpoint does not fit its config."""
    from lightning_lowmem.litgpt.checkpoint_dir import litgpt_weights

    path = Path(args.checkpoint).expanduser()
    with Checkpoint.open(litgpt_weights(path)) as ckpt:
        summary = summarize(path, ckpt)
        config, source, note = _config(path, args.config, ckpt)
        summary.config_note = note
        if config is not None:
            summary.config = fit(ckpt, config, source)
    print(json.dumps(asdict(summary), indent=2) if args.json else render(summary))
    if summary.config is not None and not summary.config.matches:
        print(f"error: {summary.config.error_type}: {summary.config.error}", file=sys.stderr)
        return EXIT_CHECKPOINT
    return EXIT_OK


def summarize(path: Path, ckpt: Checkpoint) -> Summary:
    """Format, files, tensors, dtypes and bytes of an opened checkpoint."""
    files = [{"path": str(f.path), "format": _format_of(f), "bytes": f.path.stat().st_size} for f in ckpt.files]
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for record in ckpt.records.values():
        dtype = str(record.dtype).removeprefix("torch.")
        counts[dtype] += 1
        nbytes[dtype] += record.nbytes
    dtypes = {d: {"tensors": counts[d], "bytes": nbytes[d]} for d in sorted(counts, key=lambda d: -nbytes[d])}
    kinds = sorted({f["format"] for f in files})
    return Summary(path=str(path), format=", ".join(kinds) + (f" ({len(files)} shards)" if len(files) > 1 else ""),
                   entry=ckpt.entry, files=files, tensors=len(ckpt.records), bytes=sum(nbytes.values()), dtypes=dtypes)


def fit(ckpt: Checkpoint, config: Any, source: str) -> Fit:
    """The load's plan of ``ckpt`` into litgpt's ``GPT(config)`` built on meta; its error, if any, as a ``Fit``."""
    from lightning_lowmem.engine import LoadOptions, prepare_load
    from lightning_lowmem.litgpt.checkpoint_dir import build_meta_gpt
    from lightning_lowmem.litgpt.config_check import check_config_fits
    from lightning_lowmem.litgpt.hf import hf_to_litgpt, looks_hf

    result = Fit(name=config.name, source=source)
    try:
        check_config_fits(config, ckpt.records, ckpt.description)
        model, options = build_meta_gpt(config), LoadOptions()
        conversion = None
        if ckpt.gguf is not None:
            from lightning_lowmem.litgpt.gguf import gguf_to_litgpt, read_gguf_source

            conversion = gguf_to_litgpt(config, ckpt, read_gguf_source(ckpt, tokenizer=False).hf_config)
        elif looks_hf(ckpt.records):
            conversion = hf_to_litgpt(config, ckpt.records)
        if conversion is not None:
            conversion.tie(model)  # as the load does
            options = LoadOptions(key_map=conversion.key_map, combine=conversion.combine,
                                  transform=getattr(conversion, "transform", None))
        prepared = prepare_load(model, ckpt.records, options, files=ckpt.description)
    except LowMemError as e:
        result.error, result.error_type = str(e), type(e).__name__
        return result
    result.matches, result.tensors = True, len(prepared.plan.targets)
    return result


def render(summary: Summary) -> str:
    """The summary as lines of text."""
    files = "; ".join(f"{Path(f['path']).name} ({format_bytes(f['bytes'])})" for f in summary.files)
    dtypes = "; ".join(f"{d}: {v['tensors']} tensors, {format_bytes(v['bytes'])}" for d, v in summary.dtypes.items())
    entry = f", weights under {summary.entry!r}" if summary.entry else ""
    lines = [f"checkpoint  {summary.path}", f"format      {summary.format}{entry}", f"files       {files}",
             f"tensors     {summary.tensors}", f"dtypes      {dtypes}", f"total       {format_bytes(summary.bytes)}"]
    found = summary.config
    if found is None:
        lines.append(f"config      none found: {summary.config_note}")
    elif found.matches:
        lines.append(f"config      litgpt {found.name!r} (from {found.source}): matches, {found.tensors} tensors "
                     "planned, none missing or unexpected")
    else:
        lines.append(f"config      litgpt {found.name!r} (from {found.source}): does not match ({found.error_type}, "
                     "on stderr)")
    return "\n".join(lines)


def _config(path: Path, name_or_yaml: str | None, ckpt: Checkpoint) -> tuple[Any | None, str, str]:
    """``(config, where it came from, why there is none)``: ``--config``, else a GGUF file's metadata, else what
    the directory says."""
    from lightning_lowmem.cli.options import config_argument
    from lightning_lowmem.litgpt.checkpoint_dir import find_config

    if name_or_yaml is not None:
        return config_argument(name_or_yaml), f"--config {name_or_yaml}", ""
    if ckpt.gguf is not None:
        from lightning_lowmem.litgpt.gguf import litgpt_config, read_gguf_source

        found = read_gguf_source(ckpt, tokenizer=False)
        try:
            return litgpt_config(found.hf_config, found.names), "the GGUF file's metadata", ""
        except ValueError as e:
            return None, "", f"{e} (pass --config NAME to check the fit)"
    try:  # a config file that is there but cannot be read is an error (CheckpointFormatError), not "none found"
        config, source = find_config(path if path.is_dir() else path.parent)
    except ValueError as e:
        return None, "", f"{e} (pass --config NAME to check the fit)"
    return config, source, ""


def _format_of(file: Any) -> str:
    from lightning_lowmem.formats.gguf_file import GGUFFile
    from lightning_lowmem.formats.torch_zip import TorchZipFile

    return "torch zip" if isinstance(file, TorchZipFile) else "GGUF" if isinstance(file, GGUFFile) else "safetensors"
