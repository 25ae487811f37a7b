"""Matching a module to a checkpoint from headers alone, before any weight is read.

The plan lists, in module order, every tensor to load: the module names it goes
to (several when weights are tied), the checkpoint record it comes from (or the
records a :class:`~lightning_lowmem.plan.combine.Combine` builds it from), the
dtype and device it will have, and the scheme it is stored in once quantized.
Missing keys, unexpected keys and shape mismatches are found here, so a bad
checkpoint fails before a byte is read. A non-persistent buffer (RoPE tables, position ids) is
never missing; the checkpoint fills it only when it is still on meta and the checkpoint holds it
with the same shape and dtype. Later stages fill in what they decide:
quantization (:attr:`Target.scheme`), placement (:attr:`Target.device`).

A module tensor that is a DTensor (a model sharded by ``fully_shard``) is planned whole, as the
checkpoint holds it, with this rank's part of it (:attr:`Target.shard`): the bytes this rank reads
and holds are that part's, and its dtype is the DTensor's own (a shard is filled in place).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
from torch import nn

from lightning_lowmem.building import deferred_parts
from lightning_lowmem.errors import CheckpointMismatchError, format_names
from lightning_lowmem.formats.records import TensorRecord
from lightning_lowmem.plan.combine import Combine, Stack, combined_record
from lightning_lowmem.plan.keys import KeyMap, apply_key_map, guess_prefix
from lightning_lowmem.plan.dtensor_part import Shard, shard_of

log = logging.getLogger(__name__)


class StoredSize(Protocol):
    """What a quantization scheme tells the plan: the bytes it stores for a weight of a given shape."""

    def stored_nbytes(self, shape: tuple[int, ...]) -> int: ...


class StoredForm(Protocol):
    """A tensor a checkpoint holds in another form than itself (a weight stored quantized): the records it
    is stored in, and a record of the tensor itself, whose shape the plan checks against the module's."""

    @property
    def record(self) -> TensorRecord: ...

    @property
    def parts(self) -> tuple[TensorRecord, ...]: ...


@dataclass
class Target:
    """One tensor of the module and where its data comes from.

    Attributes:
        names: every module name of this tensor (tied weights share one target).
        record: the checkpoint record that fills it; for a combined tensor, a record of the result
            (named after the module tensor, shape and dtype from ``Combine.fn`` on meta).
        is_parameter: parameter (True) or persistent buffer (False).
        dtype: the dtype it gets (before quantization).
        device: the device it goes to.
        parts: the checkpoint records a ``Combine`` builds it from, or those its stored form is made of;
            empty: ``record`` is read.
        scheme: the quantization scheme its weight is stored in, or None (full precision).
        stored: the form the checkpoint stores it in, when not as itself: its ``parts`` are read as they
            are and handed to ``scheme`` together, never combined.
        shard: this rank's part of it, when the module's tensor is a DTensor; None: the whole tensor.
        stack: where each of ``parts`` lies in it, when it is its parts laid out as blocks of rows (transformers'
            fused MoE experts): each part can be read straight into its rows.
    """

    names: list[str]
    record: TensorRecord
    is_parameter: bool
    dtype: torch.dtype
    device: torch.device
    parts: tuple[TensorRecord, ...] = ()
    scheme: StoredSize | None = None
    stored: StoredForm | None = None
    shard: Shard | None = None
    stack: Stack | None = None

    @property
    def own_rows(self) -> tuple[int, int] | None:
        """The block of rows this rank reads on its own (a row shard, read as stored or from a stack's parts, or
        quantized on its own by a scheme that can: ``shards_by_rows``), else None."""
        if self.shard is None or (self.parts and self.stack is None):
            return None
        if self.scheme is not None and (self.parts or not getattr(self.scheme, "shards_by_rows", False)):
            return None  # read whole, quantized, and this rank's rows kept
        return self.shard.rows

    @property
    def stack_rows(self) -> tuple[int, int]:
        """The rows of a stacked tensor this rank holds, counted as rows of its parts (``Stack.tail``)."""
        per = math.prod(self.record.shape[1:]) // max(math.prod(self.stack.tail), 1)  # stack rows per dim-0 row
        own = self.own_rows
        start, stop = own if own is not None else (0, self.record.shape[0])
        return start * per, stop * per

    def pieces(self) -> list[tuple[TensorRecord, int, int, int]]:
        """``(part, its first row, its stop row, where it goes in this rank's rows)`` for each part of a stacked
        tensor that this rank holds rows of (all of them without a shard)."""
        start, stop = self.stack_rows
        lengths = [p.shape[0] for p in self.parts]
        return [(self.parts[i], lo, hi, at) for i, lo, hi, at in self.stack.pieces(lengths, start, stop)]

    @property
    def read_nbytes(self) -> int:
        """Bytes read from the checkpoint for this tensor (only this rank's rows of a row shard)."""
        if self.shard is None and not self.parts:  # the common case, asked several times per tensor
            return self.record.nbytes
        rows = self.own_rows
        if rows is not None and self.stack is not None:
            return sum(p.nbytes // max(p.shape[0], 1) * (hi - lo) for p, lo, hi, _ in self.pieces())
        if rows is not None:
            return self.record.nbytes // max(self.record.shape[0], 1) * (rows[1] - rows[0])
        return sum(r.nbytes for r in self.parts) if self.parts else self.record.nbytes

    @property
    def cast_nbytes(self) -> int:
        """Bytes of the tensor (this rank's part of it) in its target dtype, before quantization."""
        numel = self.record.numel if self.shard is None else math.prod(self.shard.local_shape)
        return numel * self.dtype.itemsize

    @property
    def final_nbytes(self) -> int:
        """Bytes the tensor (this rank's part of it) holds once loaded: quantized when it has a scheme."""
        if self.scheme is None:
            return self.cast_nbytes
        return self.scheme.stored_nbytes(self.record.shape if self.shard is None else self.shard.local_shape)


@dataclass
class LoadPlan:
    """What a load will do. Built by :func:`make_plan`.

    Attributes:
        targets: every tensor to load, in module order.
        missing: module tensors the checkpoint does not fill.
        unexpected: checkpoint keys with no place in the module.
        prefix_note: the key prefix that was guessed, if any.
        absent: a combined tensor's part that is not in the checkpoint -> that tensor.
        files: the checkpoint's files, for messages.
        deferred: parts of the module a ``from_pretrained`` built inside ``init_empty()`` without reading, whose
            tensors are missing: module name -> the path it named (the load that fills them, for messages).
    """

    targets: list[Target]
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    prefix_note: str = ""
    absent: dict[str, str] = field(default_factory=dict)
    files: str = "the checkpoint"
    deferred: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes read from the checkpoint."""
        return sum(t.read_nbytes for t in self.targets)

    @property
    def final_nbytes(self) -> int:
        """Bytes of the loaded tensors: target dtypes, quantized where a target has a scheme."""
        return sum(t.final_nbytes for t in self.targets)

    def target_of(self, name: str) -> Target | None:
        """The target that fills module tensor ``name`` (any of its tied names), or None."""
        return next((t for t in self.targets if name in t.names), None)

    def check_keys(self, strict: bool, allowed_missing: frozenset[str] = frozenset()) -> None:
        """With ``strict``, raise :class:`CheckpointMismatchError` for missing (beyond ``allowed_missing``)
        or unexpected keys."""
        missing = [name for name in self.missing if name not in allowed_missing]
        if strict and (missing or self.unexpected):
            raise CheckpointMismatchError(mismatch_message(self, missing))


def make_plan(
    module: nn.Module,
    records: Mapping[str, TensorRecord],
    *,
    key_map: KeyMap | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    combine: Combine | None = None,
    stored: Mapping[str, StoredForm] | None = None,
    files: str = "the checkpoint",
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> LoadPlan:
    """Match ``module`` with the checkpoint ``records`` and decide dtype and device of each tensor.

    A floating tensor gets ``dtype`` (default: its own), or the dtype ``dtypes`` names for it (what the model
    family's own loader gives it: transformers' keep-in-fp32 modules).

    A module tensor that no checkpoint key maps to is built by ``combine`` when it names it.
    A key of ``stored`` stands for a tensor held in several records (its parts): it is matched by its
    form's own record, and its parts are neither matched nor unexpected (a ``combine`` may name them).
    Missing and unexpected keys are listed in the plan (:meth:`LoadPlan.check_keys` decides).

    Raises:
        CheckpointMismatchError: a tensor's shape differs from the module's.
    """
    groups = _module_tensors(module)
    by_name = {name: gid for gid, group in groups.items() for name in group.names}
    stored, prefix_note = stored or {}, ""
    view = records_as_themselves(records, stored)
    if key_map is None:
        key_map, prefix_note = guess_prefix(set(by_name), list(view))
        if prefix_note:
            log.info("Checkpoint keys do not match the module's; %s", prefix_note)
    source, unexpected = _match_keys(view, key_map, by_name, files)
    plan = LoadPlan([], prefix_note=prefix_note, files=files)
    bad_shapes: list[str] = []
    used: set[str] = set()
    for gid, (names, tensor, is_param, optional) in groups.items():
        rec, parts, stack = source.get(gid), (), None
        if optional:  # a non-persistent buffer: taken from the checkpoint only to fill a meta one exactly
            if rec is not None and tensor.is_meta and (rec.shape, rec.dtype) == (tuple(tensor.shape), tensor.dtype):
                plan.targets.append(Target(names, rec, False, tensor.dtype, _target_device(tensor, device)))
            continue
        if rec is None and combine is not None:
            rec, parts, stack = _combined(plan, names, combine, records, bad_shapes)
            used.update(p.key for p in parts)
        if rec is None:
            plan.missing.append(names[0])
        elif rec.shape != tuple(tensor.shape):
            origin = f" built from {format_names([p.key for p in parts])}" if parts else ""
            module_name = "" if names[0] == rec.key else f" {names[0]!r}"
            bad_shapes.append(f"{rec.key!r}{origin}: checkpoint {list(rec.shape)}, "
                              f"module{module_name} {list(tensor.shape)}")
        else:
            form = stored.get(rec.key) if not parts else None
            shard = shard_of(tensor)
            own = next((dtypes[n] for n in names if n in dtypes), dtype) if dtypes else dtype
            cast = tensor.dtype if shard is not None else _target_dtype(tensor, rec, own)  # filled in place
            plan.targets.append(Target(names, rec, is_param, cast, _target_device(tensor, device),
                                       form.parts if form else parts, stored=form, shard=shard, stack=stack))
    plan.deferred = {name: path for name, path in deferred_parts(module).items()
                     if any(m == name or m.startswith(f"{name}.") or not name for m in plan.missing)}
    plan.unexpected = [key for key in unexpected if key not in used
                       and not (key in stored and used.intersection(p.key for p in stored[key].parts))]
    if bad_shapes:
        raise CheckpointMismatchError(
            f"{len(bad_shapes)} tensors of {files} do not have the module's shape: the checkpoint is for another "
            f"model configuration. Build the module with the config the checkpoint was saved with.\n"
            + _one_a_line(bad_shapes)
        )
    return plan


def _one_a_line(items: list[str], limit: int = 10) -> str:
    """At most ``limit`` items, one a line and indented, then ``... and N more``: a message's details."""
    lines = [f"  {item}" for item in items[:limit]]
    if len(items) > limit:
        lines.append(f"  ... and {len(items) - limit} more")
    return "\n".join(lines)


def records_as_themselves(records: Mapping[str, TensorRecord], stored: Mapping[str, StoredForm]) -> dict[str, TensorRecord]:
    """``records`` with each stored form's parts replaced by a record of the tensor they stand for (the form's
    own record, under its key)."""
    if not stored:
        return dict(records)
    hidden = {p.key for form in stored.values() for p in form.parts}
    return {**{k: r for k, r in records.items() if k not in hidden}, **{k: f.record for k, f in stored.items()}}


class _Group(NamedTuple):
    """One tensor of the module under all its names (ties)."""

    names: list[str]
    tensor: torch.Tensor
    is_parameter: bool
    optional: bool  # a non-persistent buffer: never missing, loaded only into a meta buffer it fits exactly


def _module_tensors(module: nn.Module) -> dict[int, _Group]:
    """Parameters and buffers in module order, grouped by identity (ties)."""
    groups: dict[int, _Group] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        own = [(n, p, True, False) for n, p in mod._parameters.items() if p is not None]
        own += [(n, b, False, n in mod._non_persistent_buffers_set) for n, b in mod._buffers.items() if b is not None]
        for name, tensor, is_param, optional in own:
            groups.setdefault(id(tensor), _Group([], tensor, is_param, optional)).names.append(prefix + name)
    return groups


def module_records(module: nn.Module) -> dict[str, TensorRecord]:
    """Records of ``module``'s own parameters and persistent buffers, as if it were its own checkpoint."""
    return {name: TensorRecord(name, tuple(t.shape), t.dtype, Path("<module>"))
            for name, t in module.state_dict(keep_vars=True).items()}


def _match_keys(records: Mapping[str, TensorRecord], key_map: KeyMap | None,
                by_name: dict[str, int], files: str = "the checkpoint") -> tuple[dict[int, TensorRecord], list[str]]:
    """Module tensor (by group id) -> the record that fills it, and the keys that fill none.

    A key the key map sends to None is dropped on purpose: it is neither loaded nor unexpected. Two keys of a
    tied tensor under its two names load once; two keys for the same module name are two readings of one
    tensor, and an error.

    Raises:
        CheckpointMismatchError: two checkpoint keys go to the same module name.
    """
    source: dict[int, TensorRecord] = {}
    unexpected: list[str] = []
    seen: dict[str, str] = {}
    collisions: list[str] = []
    for key, rec in records.items():
        name = apply_key_map(key, key_map)
        if name is None:
            continue
        if name in seen:
            collisions.append(f"{seen[name]!r} and {key!r} both go to {name!r}")
            continue
        seen[name] = key
        gid = by_name.get(name)
        if gid is None:
            unexpected.append(key)
        elif gid not in source:  # tied names saved twice: load once
            source[gid] = rec
    if collisions:
        raise CheckpointMismatchError(
            f"{files} holds {len(collisions)} module tensors twice, under two keys each "
            f"({format_names(collisions, quote=False, sep='; ')}): which copy to load would depend on the order of "
            "the keys in the file. Nothing was read. Remove the stray copies from the checkpoint, or pass key_map= "
            "(a callable returning None for the keys to drop) to say which keys to load.")
    return source, unexpected


def _combined(plan: LoadPlan, names: list[str], combine: Combine, records: Mapping[str, TensorRecord],
              bad_shapes: list[str]) -> tuple[TensorRecord | None, tuple[TensorRecord, ...], Stack | None]:
    """The record ``combine`` builds for ``names``, its parts and how they stack; notes absent parts and bad
    shapes."""
    found = combined_record(combine, names, records)
    plan.absent.update(dict.fromkeys(found.absent, names[0]))
    if found.error:
        bad_shapes.append(found.error)
    return found.record, found.parts, found.stack


def mismatch_message(plan: LoadPlan, missing: list[str] | None = None) -> str:
    """What does not fit: ``missing`` (default: the plan's) and unexpected keys, and what to do: a first line that says
    both, then the names, at most ten of each kind, one a line."""
    missing = plan.missing if missing is None else missing
    absent = [f"{key!r} for {name!r}" for key, name in plan.absent.items() if name in missing]
    counts = [f"{len(missing)} module tensors missing"] if missing else []
    counts += [f"{len(plan.unexpected)} checkpoint keys with no place in the module"] if plan.unexpected else []
    lines = [f"{plan.files} does not match the module ({', '.join(counts)}). Pass key_map= to rename checkpoint keys "
             "(e.g. {'model.': ''}), or strict=False to load what matches and list the rest in the report."]
    if missing:
        lines += [f"{len(missing)} module tensors are missing from it:", _one_a_line([repr(n) for n in missing])]
    if absent:
        lines += [f"{len(absent)} keys they are built from are not in it (the checkpoint is incomplete: fetch the "
                  "missing files again; or of another model):", _one_a_line(absent)]
    if plan.unexpected:
        lines += [f"{len(plan.unexpected)} checkpoint keys have no place in the module:",
                  _one_a_line([repr(k) for k in plan.unexpected])]
    if plan.prefix_note:
        lines.append(f"(A key prefix was guessed: {plan.prefix_note}.)")
    if plan.deferred:
        lines.append(deferred_advice(plan.deferred))
    return "\n".join(lines)


def deferred_advice(deferred: Mapping[str, str]) -> str:
    """What fills the parts a ``from_pretrained`` built inside ``init_empty()`` without reading (``LoadPlan.deferred``).

    Example::

        >>> deferred_advice({"text_encoder": "sd3/text_encoder"})
        "'text_encoder' was built by from_pretrained('sd3/text_encoder') inside init_empty(), which reads no weights: load it with load_checkpoint(model.text_encoder, 'sd3/text_encoder')."
    """
    calls = [f"{name!r} was built by from_pretrained({path!r}) inside init_empty(), which reads no weights: load it "
             f"with load_checkpoint(model{'.' + name if name else ''}, {path!r})" for name, path in deferred.items()]
    return format_names(calls, quote=False, sep="; ") + "."


def _target_dtype(tensor: torch.Tensor, rec: TensorRecord, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype`` for floating tensors when given, else the module tensor's own dtype."""
    if not rec.dtype.is_floating_point or not tensor.dtype.is_floating_point:
        return tensor.dtype
    return dtype if dtype is not None else tensor.dtype


_CPU = torch.device("cpu")  # made once: torch.device("cpu") costs microseconds, once per tensor of the plan


def _target_device(tensor: torch.Tensor, device: torch.device | None) -> torch.device:
    if device is not None:
        return device
    return _CPU if tensor.is_meta else tensor.device
