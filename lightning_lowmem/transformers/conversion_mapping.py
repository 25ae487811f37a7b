"""A checkpoint into a transformers model through transformers' own conversion mapping for the model.

transformers 5 builds MoE models with fused experts (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``:
one 3-D parameter for all experts of a layer), while Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints, and
transformers' own ``save_pretrained``, store one tensor per expert; ``from_pretrained`` converts them with
the conversion mapping transformers registers per model family (``conversion_mapping.py``). The same
mapping is read here, so every family transformers converts converts here too, with no line per family::

    get_model_conversion_mapping(model)      transformers' renamings and converters for the model's family
    each checkpoint key: rename_source_key   transformers' own renaming (base-model prefix added or stripped)
        renamed only       -> the key map
        by a converter     -> a part of the module tensor the converter targets; the parts in transformers'
                              order (each source pattern's keys in natural order), built by the converter's own
                              operations (MergeModulelist, Concatenate, ...)
                              laid out whole, as blocks of rows (MergeModulelist then Concatenate: the experts'
                              gate and up weights one after the other) -> a stack: each expert's tensor is read
                              once, straight into its rows of the fused parameter

A converter that makes several module tensors from the same checkpoint tensors (``Chunk``, Ernie's
text/vision split) is refused, naming the family and the operation. The mapping is used only when the
checkpoint needs it: when its names, converted, fill more of the module than as they are (a checkpoint
that already holds fused experts, as :func:`~lightning_lowmem.save_checkpoint` writes them, is read as it is).

transformers 4 has no conversion mapping; its ``from_pretrained`` renames the keys itself, and so does
:mod:`~lightning_lowmem.transformers.key_renaming` when transformers 4 is installed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_lowmem.errors import CheckpointMismatchError, format_names
from lightning_lowmem.formats import TensorRecord
from lightning_lowmem.plan import Combine
from lightning_lowmem.plan.combine import Stack, with_stacks
from lightning_lowmem.plan.conversions import Conversion, Converter, register_converter, tensors_filled, under
from lightning_lowmem.transformers.conversions import pretrained_in
from lightning_lowmem.transformers.key_renaming import renaming_conversion
from lightning_lowmem.transformers.release import at_least


class TransformersMapping(Converter):
    """A checkpoint into a transformers model by transformers' conversion mapping for its family."""

    name = "transformers conversion mapping"

    def convert(self, module: nn.Module, records: Mapping[str, TensorRecord], checkpoint: Any) -> Conversion | None:
        found = pretrained_in(module)
        if found is None or getattr(checkpoint, "gguf", None) is not None:
            return None
        prefix, model = found
        if not at_least(5):  # no conversion mapping yet: from_pretrained renames the keys itself
            conversion = renaming_conversion(model, records)
        else:
            mapping = _mapping_of(model)
            conversion = mapping_conversion(model, mapping, records) if mapping else None
        return None if conversion is None else under(conversion, prefix)


def _mapping_of(model: nn.Module) -> list[Any]:
    """transformers' renamings and converters for ``model`` (transformers 5)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return list(get_model_conversion_mapping(model))


def mapping_conversion(model: nn.Module, mapping: list[Any], records: Mapping[str, TensorRecord]) -> Conversion | None:
    """The conversion ``mapping`` (transformers' ``WeightRenaming`` s and ``WeightConverter`` s) makes of ``records``
    for ``model``, or None when the checkpoint's names need none of it.

    Raises:
        CheckpointMismatchError: a converter the checkpoint needs makes several module tensors from one group of
            checkpoint tensors.
    """
    module_tensors = model.state_dict(keep_vars=True)
    names, groups = _renamed(model, mapping, records, module_tensors)
    family = getattr(model.config, "model_type", type(model).__name__)
    _refuse_many_targets(family, groups)
    _refuse_held_twice(names, groups, records)
    fns = {target: _operations_fn(model, converter, by_pattern) for target, (converter, by_pattern) in groups.items()}
    sources = {target: tuple(key for keys in by_pattern.values() for key in keys)
               for target, (_, by_pattern) in groups.items()}
    declared = {target: stack for target, (converter, by_pattern) in groups.items()
                if (stack := _declared_stack(converter, by_pattern, sources[target], records)) is not None}
    combine = with_stacks(Combine(sources, lambda name, tensors: fns[name](name, tensors), declared), records) \
        if sources else None
    renamed = {key: (None if name in groups else name) for key, name in names.items()}

    def key_map(key: str) -> str | None:
        return renamed.get(key, key)

    if tensors_filled(module_tensors, records, key_map, combine) <= tensors_filled(module_tensors, records, None, None):
        return None
    operations = sorted({type(op).__name__ for converter, _ in groups.values() for op in converter.operations})
    built = f": {len(groups)} tensors built by {', '.join(operations)}" if groups else ""
    return Conversion(f"transformers' conversion mapping ({family}, {type(model).__name__}){built}",
                      key_map=key_map, combine=combine)


def _renamed(model: nn.Module, mapping: list[Any], records: Mapping[str, TensorRecord],
             module_tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, str], dict[str, tuple[Any, dict]]]:
    """Each key's name after transformers' renaming, and for each module tensor a converter builds: the converter
    and its parts (source pattern -> keys, in transformers' natural order), as ``convert_and_load_state_dict_in_model``
    collects them."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    prefix = getattr(model, "base_model_prefix", None) or None
    names: dict[str, str] = {}
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in sorted(records, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, module_tensors)
        if name not in module_tensors and key in module_tensors:  # as transformers: the key was right as it was
            name, pattern = rename_source_key(key, [], [], prefix, module_tensors)
        names[key] = name
        if pattern is not None and name in module_tensors:
            converter = by_pattern[pattern]
            groups.setdefault(name, (converter, defaultdict(list)))[1][pattern].append(key)
    return names, groups


def _refuse_many_targets(family: str, groups: Mapping[str, tuple[Any, dict]]) -> None:
    """Raise for a converter that makes several module tensors from one group of checkpoint tensors."""
    refused = {name: converter for name, (converter, _) in groups.items() if len(converter.target_patterns) > 1}
    if not refused:
        return
    converter = next(iter(refused.values()))
    operations = ", ".join(type(op).__name__ for op in converter.operations)
    raise CheckpointMismatchError(
        f"transformers converts the {family!r} checkpoint's {format_names(converter.source_patterns)} into "
        f"{format_names(converter.target_patterns)} with {operations}, which makes several module tensors "
        f"({format_names(refused)}) from the same checkpoint tensors; lightning_lowmem builds each module tensor "
        "from its own keys and does not stream this operation. Load this checkpoint with transformers' "
        "from_pretrained, or pass key_map= and combine= that build each tensor; nothing was read.")


def _refuse_held_twice(names: Mapping[str, str], groups: Mapping[str, tuple[Any, dict]],
                       records: Mapping[str, TensorRecord]) -> None:
    """Raise for a module tensor the checkpoint holds both as it is (fused experts) and as the parts a converter builds
    it from (one tensor per expert): which copy loads must never depend on which reading wins."""
    parts = {key for _, by_pattern in groups.values() for keys in by_pattern.values() for key in keys}
    twice = {key: names[key] for key in records if key not in parts and names.get(key) in groups}
    if not twice:
        return
    pairs = [f"{key!r} and {format_names(_keys_of(groups[name][1]), 2)} (both give {name!r})"
             for key, name in twice.items()]
    raise CheckpointMismatchError(
        f"The checkpoint holds {len(twice)} module tensors twice, whole and as the parts transformers builds them "
        f"from: {format_names(pairs, quote=False, sep='; ')}. Which copy to load would be a guess (the two may differ); "
        "nothing was read. Remove one of the copies from the checkpoint (e.g. save the model again with "
        "save_checkpoint or save_pretrained), or pass key_map= (a callable returning None for the keys to drop).")


def _keys_of(by_pattern: Mapping[str, list[str]]) -> list[str]:
    return [key for keys in by_pattern.values() for key in keys]


def _operations_fn(model: nn.Module, converter: Any,
                   by_pattern: Mapping[str, list[str]]) -> Callable[[str, dict[str, torch.Tensor]], torch.Tensor]:
    """``Combine.fn`` for one module tensor: the converter's own operations on its parts, as transformers runs them."""
    patterns, targets = list(converter.source_patterns), list(converter.target_patterns)

    def build(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        counts = {pattern: len(by_pattern.get(pattern, ())) for pattern in patterns}
        if len(set(counts.values())) != 1:
            raise ValueError(f"transformers' converter needs as many tensors for each of its patterns, found {counts}")
        collected: dict[str, Any] = {pattern: [tensors[key] for key in by_pattern[pattern]] for pattern in patterns}
        for op in converter.operations:
            collected = op.convert(collected, source_patterns=patterns, target_patterns=targets,
                                   full_layer_name=name, model=model, config=model.config, missing_keys=None)
        (out,) = collected.values()
        return out[0] if isinstance(out, list) else out

    return build


def _declared_stack(converter: Any, by_pattern: Mapping[str, list[str]], keys: tuple[str, ...],
                    records: Mapping[str, TensorRecord]) -> Stack | None:
    """Where each part lies in what the converter's operations build, when they only lay whole parts out as rows:
    ``MergeModulelist(dim=0)`` (the experts one after another), then, with several patterns, ``Concatenate`` along
    dimension 0 (pattern after pattern) or 1 (each expert's parts after one another: gate, then up); else None."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    patterns = list(converter.source_patterns)
    if ops[:1] != [("MergeModulelist", 0)] or any(key not in records for key in keys):
        return None
    joined = ops[1:]
    if (joined and joined not in ([("Concatenate", 0)], [("Concatenate", 1)])) or (not joined and len(patterns) != 1):
        return None
    shapes = {records[key].shape for key in keys}
    counts = {len(by_pattern.get(pattern, ())) for pattern in patterns}
    if len(shapes) != 1 or len(counts) != 1 or not next(iter(shapes)):
        return None
    (rows, *tail), (experts,) = next(iter(shapes)), counts
    start = {}
    for p, pattern in enumerate(patterns):
        for e, key in enumerate(by_pattern[pattern]):
            by_expert = joined == [("Concatenate", 1)]
            start[key] = (e * len(patterns) + p) * rows if by_expert else (p * experts + e) * rows
    return Stack(tuple(start[key] for key in keys), tuple(tail))


TRANSFORMERS_MAPPING = register_converter(TransformersMapping())
