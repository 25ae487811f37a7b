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

from lightning_lowmem.cli.exits import EXIT_CHECKPOINT, EXIT_OK, exit_codes
from lightning_lowmem.cli.options import add_checkpoint, add_config, add_subcommand, config_argument
from lightning_lowmem.engine import Source
from lightning_lowmem.errors import LowMemError
from lightning_lowmem.memory import format_bytes

EPILOG = """example:
  lightning-lowmem inspect checkpoints/EleutherAI/pythia-1b
  lightning-lowmem inspect model.safetensors --config pythia-1b --json

""" + exit_codes("inspect")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = add_subcommand(
        subparsers, "inspect", summary="what a checkpoint holds, and whether it fits its litgpt config, without reading a weight",
        description="Print a checkpoint's format, files, tensors, dtypes and bytes, and whether it fits its litgpt "
                    "config: the missing and unexpected keys and the shape mismatches a load would raise. Reads "
                    "headers only. In a directory, the weights inspected are those every other command reads "
                    "(which, and why, is printed). Exits 1 when the checkpoint cannot be read or does not fit.",
        epilog=EPILOG)
    add_checkpoint(parser, "a checkpoint file or directory")
    add_config(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    parser.set_defaults(run=run, parser=parser)


@dataclass
class Fit:
    """Whether a checkpoint fits a model's config (litgpt's, else its transformers ``config.json``), as the load's
    plan says."""

    name: str
    source: str
    family: str = "litgpt"
    conversion: str = ""
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
    chosen: str = ""
    stored: str = ""
    config: Fit | None = None
    config_note: str = ""


def run(args: argparse.Namespace) -> int:
    """Inspect, print; exit 1 when the checkpoint does not fit its config."""
    from lightning_lowmem.engine import LoadOptions, resolved
    from lightning_lowmem.litgpt.checkpoint_dir import LitgptCheckpoint, build_meta_gpt
    from lightning_lowmem.placement import build_meta_model

    path = Path(args.checkpoint).expanduser()
    found = LitgptCheckpoint.find(path, config_argument(args.config), args.weights, require_config=False,
                                  tokenizer=False, verify=args.verify_weight_sets, entry=args.entry)
    family, name, origin = "litgpt", getattr(found.config, "name", ""), found.config_source
    model = build_meta_gpt(found.config) if found.config is not None else None
    if model is None and (built := build_meta_model(found.directory)) is not None:  # BERT, T5: not litgpt models
        (model, name), family, origin = built, "transformers", "config.json"
    with resolved(found.chosen, model, LoadOptions()) as source:
        summary = summarize(path, source)
        if model is None:
            summary.config_note = f"{found.config_source} (pass --config NAME to check the fit)"
        else:
            summary.config = fit(model, source, name, origin, family)
    print(json.dumps(asdict(summary), indent=2) if args.json else render(summary))
    if summary.config is not None and not summary.config.matches:
        print(f"error: {summary.config.error_type}: {summary.config.error}", file=sys.stderr)
        return EXIT_CHECKPOINT
    return EXIT_OK


def summarize(path: Path, source: Source) -> Summary:
    """Format, files, tensors, dtypes and bytes of a resolved checkpoint, and which weights were chosen and why:
    dtypes and bytes as stored (a GGUF file's ggml types, ``Q4_1``, ``F16``, ..., with the bytes the file holds
    for them)."""
    ckpt = source.checkpoint
    files = [{"path": str(f.path), "format": _format_of(f), "bytes": f.path.stat().st_size} for f in ckpt.files]
    as_stored = ckpt.gguf.stored_types() if ckpt.gguf is not None else {}
    counts: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for record in ckpt.records.values():
        dtype = as_stored.get(record.key) or str(record.dtype).removeprefix("torch.")
        counts[dtype] += 1
        nbytes[dtype] += record.nbytes
    dtypes = {d: {"tensors": counts[d], "bytes": nbytes[d]} for d in sorted(counts, key=lambda d: -nbytes[d])}
    kinds = sorted({f["format"] for f in files})
    stored = f"{len(source.stored)} weights stored quantized ({', '.join(source.stored.schemes)})" \
        if source.stored else ""
    return Summary(path=str(path), format=", ".join(kinds) + (f" ({len(files)} shards)" if len(files) > 1 else ""),
                   entry=ckpt.entry, files=files, tensors=len(ckpt.records), bytes=sum(nbytes.values()), dtypes=dtypes,
                   chosen=source.why, stored=stored)


def fit(model: Any, source: Source, name: str, config_source: str, family: str = "litgpt") -> Fit:
    """The load's plan of ``source`` into the meta-built ``model`` (of ``family``: litgpt or transformers); its error,
    if any, as a ``Fit``."""
    from lightning_lowmem.engine import LoadOptions, prepare_load

    own = {"litgpt": "litgpt's", "transformers": "transformers'"}.get(family, family)
    conversion = source.conversion.name if source.conversion is not None else f"none: {own} own names"
    result = Fit(name=name, source=config_source, conversion=conversion, family=family)
    try:
        prepared = prepare_load(model, source, LoadOptions())
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
    lines = [f"checkpoint  {summary.path}", f"weights     {summary.chosen}", f"format      {summary.format}{entry}",
             f"files       {files}", f"tensors     {summary.tensors}", f"dtypes      {dtypes}",
             f"total       {format_bytes(summary.bytes)}"]
    if summary.stored:
        lines.append(f"quantized   {summary.stored}")
    found = summary.config
    if found is None:
        lines.append(f"config      none found: {summary.config_note}")
    elif found.matches:
        lines.append(f"config      {found.family} {found.name!r} (from {found.source}): matches, {found.tensors} "
                     "tensors planned, none missing or unexpected")
        lines.append(f"names       {found.conversion}")
    else:
        lines.append(f"config      {found.family} {found.name!r} (from {found.source}): does not match "
                     f"({found.error_type}, on stderr)")
    return "\n".join(lines)


def _format_of(file: Any) -> str:
    from lightning_lowmem.formats.gguf_file import GGUFFile
    from lightning_lowmem.formats.torch_zip import TorchZipFile

    return "torch zip" if isinstance(file, TorchZipFile) else "GGUF" if isinstance(file, GGUFFile) else "safetensors"
