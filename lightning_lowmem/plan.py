"""Matching a module to a checkpoint from headers alone, before any weight is read.

The plan lists, in module order, every tensor to load: the module names it goes
to (several when weights are tied), the checkpoint record it comes from (or the
records a :class:`Combine` builds it from), and the dtype and device it will
have. Missing keys, unexpected keys and shape mismatches are found here, so a
bad checkpoint fails before a byte is read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_lowmem.errors import CheckpointMismatchError, format_names
from lightning_lowmem.records import TensorRecord

log = logging.getLogger(__name__)

KeyMap = Mapping[str, str] | Callable[[str], str | None]


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
    """

    sources: Mapping[str, Sequence[str]]
    fn: Callable[[str, dict[str, torch.Tensor]], torch.Tensor]


@dataclass
class Target:
    """One tensor of the module and where its data comes from.

    Attributes:
        names: every module name of this tensor (tied weights share one target).
        record: the checkpoint record that fills it; for a combined tensor, a record of the result
            (named after the module tensor, shape and dtype from :attr:`Combine.fn` on meta).
        is_parameter: parameter (True) or persistent buffer (False).
        dtype: the dtype it gets.
        device: the device it goes to.
        parts: the checkpoint records a :class:`Combine` builds it from; empty: ``record`` is read.
    """

    names: list[str]
    record: TensorRecord
    is_parameter: bool
    dtype: torch.dtype
    device: torch.device
    parts: tuple[TensorRecord, ...] = ()

    @property
    def read_nbytes(self) -> int:
        """Bytes read from the checkpoint for this tensor."""
        return sum(r.nbytes for r in self.parts) if self.parts else self.record.nbytes


@dataclass
class LoadPlan:
    """What a load will do. Built by :func:`make_plan`."""

    targets: list[Target]
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    prefix_note: str = ""
    absent: dict[str, str] = field(default_factory=dict)  # a combined tensor's part not in the checkpoint -> the tensor

    @property
    def nbytes(self) -> int:
        """Bytes read from the checkpoint."""
        return sum(t.read_nbytes for t in self.targets)

    @property
    def final_nbytes(self) -> int:
        """Bytes of the loaded tensors in their target dtypes (before quantization)."""
        return sum(t.record.numel * t.dtype.itemsize for t in self.targets)


def apply_key_map(key: str, key_map: KeyMap | None) -> str | None:
    """The module name for checkpoint key ``key`` (None drops the key)."""
    if key_map is None:
        return key
    if callable(key_map):
        return key_map(key)
    for old, new in key_map.items():  # prefix renames, first match wins
        if key.startswith(old):
            return new + key[len(old):]
    return key


def _module_tensors(module: nn.Module) -> dict[int, tuple[list[str], torch.Tensor, bool]]:
    """Parameters and persistent buffers in module order, grouped by identity (ties)."""
    groups: dict[int, tuple[list[str], torch.Tensor, bool]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        own = [(n, p, True) for n, p in mod._parameters.items() if p is not None]
        own += [(n, b, False) for n, b in mod._buffers.items()
                if b is not None and n not in mod._non_persistent_buffers_set]
        for name, tensor, is_param in own:
            groups.setdefault(id(tensor), ([], tensor, is_param))[0].append(prefix + name)
    return groups


def _guess_prefix(module_keys: set[str], ckpt_keys: list[str]) -> tuple[KeyMap | None, str]:
    """A prefix rename when the checkpoint's keys sit one level above or below the module's.

    A Lightning ``.ckpt`` of a LightningModule holding ``self.model`` has keys
    ``model.transformer...`` where the bare model wants ``transformer...``, and
    the other way round when a plain model file is loaded into the LightningModule.
    """
    def hits(key_map: KeyMap) -> int:
        return sum(apply_key_map(k, key_map) in module_keys for k in ckpt_keys)

    best: tuple[int, KeyMap | None, str] = (sum(k in module_keys for k in ckpt_keys), None, "")
    if best[0] == len(ckpt_keys):
        return None, ""
    ckpt_heads = {k.split(".", 1)[0] + "." for k in ckpt_keys if "." in k}
    module_heads = {k.split(".", 1)[0] + "." for k in module_keys if "." in k}
    candidates = [({head: ""}, f"stripped {head!r} from checkpoint keys") for head in ckpt_heads]
    candidates += [({"": head}, f"added {head!r} to checkpoint keys") for head in module_heads]
    for key_map, note in candidates:
        n = hits(key_map)
        if n > best[0]:
            best = (n, key_map, note)
    return best[1], best[2]


def make_plan(
    module: nn.Module,
    records: Mapping[str, TensorRecord],
    *,
    key_map: KeyMap | None = None,
    strict: bool = True,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    files: str = "the checkpoint",
    combine: Combine | None = None,
) -> LoadPlan:
    """Match ``module`` with the checkpoint ``records`` and decide dtype and device of each tensor.

    A module tensor that no checkpoint key maps to is built by ``combine`` when it names it.

    Raises:
        CheckpointMismatchError: a shape differs, or (``strict=True``) keys are missing or unexpected.
    """
    groups = _module_tensors(module)
    by_name = {name: gid for gid, (names, _, _) in groups.items() for name in names}
    prefix_note = ""
    if key_map is None:
        key_map, prefix_note = _guess_prefix(set(by_name), list(records))
        if prefix_note:
            log.info("Checkpoint keys do not match the module's; %s", prefix_note)

    source, unexpected = _match_keys(records, key_map, by_name)
    targets, missing, bad_shapes, absent, used = [], [], [], {}, set()
    for gid, (names, tensor, is_param) in groups.items():
        rec, parts = source.get(gid), ()
        if rec is None and combine is not None:
            rec, parts, absent_keys = _combined(names, combine, records, bad_shapes)
            absent.update(dict.fromkeys(absent_keys, names[0]))
            used.update(p.key for p in parts)
        if rec is None:
            missing.append(names[0])
            continue
        if rec.shape != tuple(tensor.shape):
            origin = f"built from {format_names([p.key for p in parts])}" if parts else f"in {rec.file.name}"
            bad_shapes.append(f"{rec.key!r} {origin}: checkpoint {list(rec.shape)}, "
                              f"module {names[0]!r} {list(tensor.shape)}")
            continue
        targets.append(Target(names, rec, is_param, _target_dtype(tensor, rec, dtype),
                              _target_device(tensor, device), parts))
    unexpected = [key for key in unexpected if key not in used]

    if bad_shapes:
        raise CheckpointMismatchError(
            f"{len(bad_shapes)} tensors of {files} do not have the module's shape: {'; '.join(bad_shapes[:10])}"
            + (f" ... and {len(bad_shapes) - 10} more" if len(bad_shapes) > 10 else "")
            + ". The checkpoint is for a different model configuration: build the module with the config the "
            "checkpoint was saved with."
        )
    plan = LoadPlan(targets, missing, unexpected, prefix_note, absent)
    if strict and (missing or unexpected):
        raise CheckpointMismatchError(mismatch_message(plan, files))
    return plan


def _match_keys(records: Mapping[str, TensorRecord], key_map: KeyMap | None,
                by_name: dict[str, int]) -> tuple[dict[int, TensorRecord], list[str]]:
    """Module tensor (by group id) -> the record that fills it, and the keys that fill none.

    A key the key map sends to None is dropped on purpose: it is neither loaded nor unexpected.
    """
    source: dict[int, TensorRecord] = {}
    unexpected: list[str] = []
    for key, rec in records.items():
        name = apply_key_map(key, key_map)
        if name is None:
            continue
        gid = by_name.get(name)
        if gid is None:
            unexpected.append(key)
        elif gid not in source:  # tied names saved twice: load once
            source[gid] = rec
    return source, unexpected


def _combined(names: list[str], combine: Combine, records: Mapping[str, TensorRecord],
              bad_shapes: list[str]) -> tuple[TensorRecord | None, tuple[TensorRecord, ...], list[str]]:
    """What ``combine`` builds for the module tensor ``names``: its record (None: it cannot be built),
    the parts it is built from that the checkpoint holds, and those it does not."""
    name = next((n for n in names if n in combine.sources), None)
    if name is None:
        return None, (), []
    keys = list(combine.sources[name])
    parts = tuple(records[key] for key in keys if key in records)
    absent = [key for key in keys if key not in records]
    if absent:
        return None, parts, absent
    try:
        out = combine.fn(name, {p.key: torch.empty(p.shape, dtype=p.dtype, device="meta") for p in parts})
    except (RuntimeError, ValueError, IndexError) as e:  # e.g. torch.cat of parts whose widths differ
        bad_shapes.append(f"{name!r} cannot be built from {format_names(keys)} "
                          f"({', '.join(str(list(p.shape)) for p in parts)}): {e}")
        return None, parts, []
    return TensorRecord(name, tuple(out.shape), out.dtype, parts[0].file), parts, []


def mismatch_message(plan: LoadPlan, files: str, missing: list[str] | None = None) -> str:
    """What does not fit: ``missing`` (default: the plan's) and unexpected keys, and what to do."""
    missing = plan.missing if missing is None else missing
    unexpected, prefix_note = plan.unexpected, plan.prefix_note
    absent = {key: name for key, name in plan.absent.items() if name in missing}
    parts = [f"{files} does not match the module:"]
    if missing:
        parts.append(f"{len(missing)} module tensors are missing from it ({format_names(missing)});")
    if absent:
        parts.append(f"{len(absent)} keys they are built from are not in it ("
                     + ", ".join(f"{key!r} for {name!r}" for key, name in list(absent.items())[:10])
                     + (f" ... and {len(absent) - 10} more" if len(absent) > 10 else "")
                     + "): the checkpoint is incomplete (fetch the missing files again) or of another model;")
    if unexpected:
        parts.append(f"{len(unexpected)} checkpoint keys have no place in the module ({format_names(unexpected)}).")
    if prefix_note:
        parts.append(f"(A key prefix was guessed: {prefix_note}.)")
    parts.append("Pass key_map= to rename checkpoint keys (e.g. {'model.': ''}), or strict=False to load what "
                 "matches and list the rest in the report.")
    return " ".join(parts)


def _target_dtype(tensor: torch.Tensor, rec: TensorRecord, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype`` for floating tensors when given, else the module tensor's own dtype."""
    if not rec.dtype.is_floating_point or not tensor.dtype.is_floating_point:
        return tensor.dtype
    return dtype if dtype is not None else tensor.dtype


def _target_device(tensor: torch.Tensor, device: torch.device | None) -> torch.device:
    if device is not None:
        return device
    return torch.device("cpu") if tensor.is_meta else tensor.device
