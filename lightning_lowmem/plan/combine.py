"""Module tensors built from several checkpoint tensors, such as separate q, k and v into one qkv.

A combined tensor whose parts are its own blocks of rows (one expert's weight after another in transformers'
fused MoE experts; q, then k, then v; GPT-NeoX's fused ``query_key_value`` reordered head by head into litgpt's
q, k, v) is a *stack*: :class:`Stack` says where each part's rows go, so that the loader can read each run of
rows straight into its place in the result instead of holding the parts and the result together.
:func:`with_stacks` finds the stacks of a :class:`Combine` by running its own ``fn`` on a probe of its parts at their
real shapes (a distinct number in every position), unless the conversion declares them.
""" 
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

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
    stacks: Mapping[str, Stack] = field(default_factory=dict)
    """Module name -> where its parts lie in it, for the tensors ``fn`` builds by laying its parts one after
    another as blocks of rows (see :func:`with_stacks`); the others are built by ``fn``."""


MAX_RUNS = 4096
"""The most runs of rows a stack is read in; a finer reordering is built by the conversion's ``fn`` instead."""


@dataclass(frozen=True)
class Stack:
    """A combined tensor made of its parts' rows laid out as blocks: seen as rows of the parts' own trailing
    shape (``result.view(-1, *tail)``), part ``i`` (in the order of ``Combine.sources``) fills rows
    ``starts[i]:starts[i] + len(part)``, and the parts together fill every row once. A part whose rows are
    reordered (``runs``) fills its rows a run at a time.

    Attributes:
        starts: the first row of each part (of its first run, when it has ``runs``).
        tail: the shape of one row (every part's shape but its first dimension; ``()`` for 1-D parts).
        runs: ``(part, its first row, rows, first row in the result)`` for every run of consecutive rows, in part
            order, when some part is not laid out whole and in order; empty otherwise.

    Example::

        >>> stack = Stack((0, 4, 2, 6), (8,))  # gates of experts 0, 1 and ups of 0, 1: rows gate0 up0 gate1 up1
        >>> stack.pieces([2, 2, 2, 2], 3, 7)  # (part, its first row, its stop row, where it goes in rows 3:7)
        [(2, 1, 2, 0), (1, 0, 2, 1), (3, 0, 1, 3)]
        >>> heads = Stack((0,), (8,), runs=((0, 0, 2, 0), (0, 2, 2, 4), (0, 4, 2, 2)))  # rows q0 k0 q1 -> q0 q1 k0
        >>> heads.pieces([6], 0, 6)
        [(0, 0, 2, 0), (0, 4, 6, 2), (0, 2, 4, 4)]
    """

    starts: tuple[int, ...]
    tail: tuple[int, ...]
    runs: tuple[tuple[int, int, int, int], ...] = ()

    def runs_of(self, lengths: Sequence[int]) -> tuple[tuple[int, int, int, int], ...]:
        """Every run ``(part, its first row, rows, first row in the result)``, for parts of ``lengths`` rows."""
        if self.runs:
            return self.runs
        return tuple((i, 0, n, first) for i, (first, n) in enumerate(zip(self.starts, lengths, strict=True)))

    def pieces(self, lengths: Sequence[int], start: int, stop: int) -> list[tuple[int, int, int, int]]:
        """``(part index, first row of the part, stop row of the part, row in the window)`` for each run that
        overlaps rows ``start:stop`` of the result, in the order of the result's rows."""
        found = []
        for i, first_in_part, n, first in self.runs_of(lengths):
            lo, hi = max(first, start), min(first + n, stop)
            if lo < hi:
                found.append((i, first_in_part + lo - first, first_in_part + hi - first, lo - start))
        return sorted(found, key=lambda piece: piece[3])

    def fits(self, shapes: Sequence[tuple[int, ...]], result: tuple[int, ...]) -> bool:
        """Whether parts of ``shapes`` tile a result of shape ``result`` as this stack says."""
        if len(shapes) != len(self.starts) or any(len(s) == 0 or s[1:] != self.tail for s in shapes):
            return False
        if len(result) < len(self.tail) or result[len(result) - len(self.tail):] != self.tail:
            return False
        lengths = [s[0] for s in shapes]
        runs = self.runs_of(lengths)
        if any(not 0 <= i < len(lengths) or n <= 0 for i, _, n, _ in runs):
            return False
        if not _tiles([(first, n) for _, _, n, first in runs], sum(lengths)):  # every row of the result once
            return False
        if not all(_tiles([(at, n) for j, at, n, _ in runs if j == i], length)  # every row of each part once
                   for i, length in enumerate(lengths)):
            return False
        return sum(lengths) * math.prod(self.tail) == math.prod(result)


def _tiles(spans: Sequence[tuple[int, int]], total: int) -> bool:
    """Whether ``(first, n)`` spans cover rows ``0:total`` once each."""
    edge = 0
    for first, n in sorted(spans):
        if first != edge:
            return False
        edge += n
    return edge == total


@dataclass(frozen=True)
class Combined:
    """What :func:`combined_record` found for one module tensor.

    Attributes:
        record: a record of the result (named after the module tensor), or None when it cannot be built.
        parts: the records of the parts the checkpoint holds.
        absent: the parts' keys the checkpoint lacks.
        error: why the parts do not combine (their shapes), or ``""``.
        stack: where the parts lie in the result, when it is a stack of them (checked against their shapes).
    """

    record: TensorRecord | None
    parts: tuple[TensorRecord, ...] = ()
    absent: tuple[str, ...] = ()
    error: str = ""
    stack: Stack | None = None


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
    stack = combine.stacks.get(name)
    if stack is not None and not stack.fits([p.shape for p in parts], tuple(out.shape)):
        stack = None  # the parts are not laid out as it says: built by fn
    return Combined(TensorRecord(name, tuple(out.shape), out.dtype, parts[0].file), parts, stack=stack)


def with_stacks(combine: Combine, records: Mapping[str, TensorRecord]) -> Combine:
    """``combine`` with each tensor its ``fn`` builds by laying its parts one after another as blocks of rows
    marked as a :class:`Stack` (so each part can be read straight into its place).

    A stack the conversion declares (``combine.stacks``) is kept as it is. Any other is found by running ``fn``
    itself on a probe: each part at its real shape, every position holding a number no other position holds. A
    stack is a result whose every row is one part's row, whole and unchanged, each row of every part exactly once.
    A ``fn`` that computes on the values (``abs``), moves them within a row (``flip(-1)``, a column permutation) or
    repeats a part gives other numbers and is left to build its tensor itself; so is a combined tensor of more than
    :data:`PROBE_ELEMENTS` elements (the probe would cost 8 bytes an element), unless its conversion declares it.

    Example::

        >>> from pathlib import Path
        >>> records = {k: TensorRecord(k, (4, 8), torch.float32, Path("m.safetensors")) for k in ("q", "k")}
        >>> fused = with_stacks(Combine({"qk": ("q", "k")}, lambda name, got: torch.cat([got["q"], got["k"]])), records)
        >>> fused.stacks["qk"]
        Stack(starts=(0, 4), tail=(8,), runs=())
        >>> flipped = lambda name, got: torch.cat([got["q"], got["k"]]).flip(-1)  # not a stack: fn builds it
        >>> with_stacks(Combine({"qk": ("q", "k")}, flipped), records).stacks
        {}
    """
    stacks = dict(combine.stacks)
    for name, keys in combine.sources.items():
        if name not in stacks and all(key in records for key in keys):
            found = _stack_of(combine.fn, name, [records[key] for key in keys])
            if found is not None:
                stacks[name] = found
    return replace(combine, stacks=stacks)


PROBE_ELEMENTS = 2**25
"""The most elements a combined tensor's parts may hold together for :func:`with_stacks` to probe it (an int32
probe and its result: 256 MiB at most, for the plan only); a larger one is a stack only when its conversion
declares it."""

_CHECK_ELEMENTS = 2**20
"""How many elements of a probe's result :func:`_source_rows` compares at a time."""


def _stack_of(fn: Callable[[str, dict[str, torch.Tensor]], torch.Tensor], name: str,
              parts: Sequence[TensorRecord]) -> Stack | None:
    """The :class:`Stack` ``fn`` lays ``parts`` out as, or None (see :func:`with_stacks`)."""
    if not parts or any(len(p.shape) == 0 for p in parts) or len({p.key for p in parts}) != len(parts):
        return None
    tail = parts[0].shape[1:]
    if any(p.shape[1:] != tail for p in parts):
        return None
    width, rows = math.prod(tail), sum(p.shape[0] for p in parts)
    total = rows * width
    if total == 0 or total > PROBE_ELEMENTS:
        return None
    # every position a distinct negative number (abs, relu or a sign change shows): -total + row * width + column
    flat = torch.arange(-total, 0, dtype=torch.int32)
    probes, firsts, first = {}, [], 0
    for p in parts:
        probes[p.key] = flat[first * width:(first + p.shape[0]) * width].view(p.shape)
        firsts.append(first)
        first += p.shape[0]
    try:
        out = fn(name, probes)
    except (RuntimeError, ValueError, IndexError, KeyError, TypeError):
        return None
    source = _source_rows(out, tail, width, total)
    if source is None:
        return None
    return _stack_from(source, parts, firsts, tail)


def _source_rows(out: object, tail: tuple[int, ...], width: int, total: int) -> torch.Tensor | None:
    """For each row of ``out`` (rows of shape ``tail``), the probe row it is, whole and unchanged; None when a row is
    none, or some probe row is not there exactly once."""
    lead = len(out.shape) - len(tail) if isinstance(out, torch.Tensor) else -1
    if (lead < 0 or tuple(out.shape[lead:]) != tail or out.dtype != torch.int32 or out.numel() != total
            or out.device.type != "cpu"):
        return None
    rows = out.reshape(-1, width)
    source = (rows[:, 0].to(torch.int64) + total) // width
    columns = torch.arange(width, dtype=torch.int32)
    step = max(1, _CHECK_ELEMENTS // width)  # a block of rows at a time: the check adds little to the probe
    for lo in range(0, len(source), step):
        expected = (source[lo:lo + step] * width - total).to(torch.int32).view(-1, 1) + columns
        if not torch.equal(rows[lo:lo + step], expected):
            return None
    if not torch.equal(source.sort().values, torch.arange(len(source), dtype=torch.int64)):
        return None
    return source


def _stack_from(source: torch.Tensor, parts: Sequence[TensorRecord], firsts: Sequence[int],
                tail: tuple[int, ...]) -> Stack | None:
    """The :class:`Stack` whose result row ``r`` is probe row ``source[r]``; None past :data:`MAX_RUNS` runs."""
    total = len(source)
    where = torch.empty(total, dtype=torch.int64)
    where[source] = torch.arange(total, dtype=torch.int64)
    starts, runs, whole = [], [], True
    for i, (p, first) in enumerate(zip(parts, firsts, strict=True)):
        places = where[first:first + p.shape[0]]
        breaks = (torch.nonzero(places[1:] != places[:-1] + 1).view(-1) + 1).tolist()
        for lo, hi in zip([0, *breaks], [*breaks, p.shape[0]]):
            runs.append((i, lo, hi - lo, int(places[lo])))
        whole = whole and not breaks
        starts.append(int(places[0]))
    if len(runs) > MAX_RUNS:
        return None
    return Stack(tuple(starts), tail, () if whole else tuple(runs))
