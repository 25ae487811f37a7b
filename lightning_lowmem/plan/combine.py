"""Module tensors built from several checkpoint tensors, such as separate q, k and v into one qkv."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_lowmem.errors import format_names
from lightning_lowmem.formats.records import TensorRecord


@dataclass(frozen=True)
class Combine:
    """Module tensors built from several checkpoint tensors, such as separate q, k and v into one qkv.

    Attributes:
        sources: module name -> the checkpoint keys it is built from, read one after the other.
        fn: ``fn(module_name, {key: tensor})`` returns the module tensor. The plan also runs it on
            meta tensors, so the result's shape is checked before any data is read.

    Example::

        >>> combine = Combine({"attn.qkv.weight": ("q.weight", "k.weight", "v.weight")},
        ...                   lambda name, parts: torch.cat(list(parts.values())))
        >>> from pathlib import Path
        >>> records = {k: TensorRecord(k, (4, 8), torch.float32, Path("m.safetensors"))
        ...            for k in ("q.weight", "k.weight", "v.weight")}
        >>> combined_record(combine, ["attn.qkv.weight"], records).record.shape
        (12, 8)
    """

    sources: Mapping[str, Sequence[str]]
    fn: Callable[[str, dict[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class Combined:
    """What :func:`combined_record` found for one module tensor.

    Attributes:
        record: a record of the result (named after the module tensor), or None when it cannot be built.
        parts: the records of the parts the checkpoint holds.
        absent: the parts' keys the checkpoint lacks.
        error: why the parts do not combine (their shapes), or ``""``.
    """

    record: TensorRecord | None
    parts: tuple[TensorRecord, ...] = ()
    absent: tuple[str, ...] = ()
    error: str = ""


def combined_record(combine: Combine, names: Sequence[str], records: Mapping[str, TensorRecord]) -> Combined:
    """What ``combine`` builds for the module tensor known by ``names`` (tied names), from headers alone."""
    name = next((n for n in names if n in combine.sources), None)
    if name is None:
        return Combined(None)
    keys = list(combine.sources[name])
    parts = tuple(records[key] for key in keys if key in records)
    absent = tuple(key for key in keys if key not in records)
    if absent:
        return Combined(None, parts, absent)
    try:
        out = combine.fn(name, {p.key: torch.empty(p.shape, dtype=p.dtype, device="meta") for p in parts})
    except (RuntimeError, ValueError, IndexError) as e:  # e.g. torch.cat of parts whose widths differ
        shapes = ", ".join(str(list(p.shape)) for p in parts)
        return Combined(None, parts, error=f"{name!r} cannot be built from {format_names(keys)} ({shapes}): {e}")
    return Combined(TensorRecord(name, tuple(out.shape), out.dtype, parts[0].file), parts)
