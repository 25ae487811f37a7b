"""One load decided from headers alone: the plan, its quantization and its placement, made once.

::

    a resolved source (headers, weights stored quantized, the conversion: ``resolve.py``) -> make_plan
        -> select_linears, or mark_stored for a pre-quantized file (marks quantized targets)
        -> place_layers (with max_memory: each target's device)

The loader streams what :func:`prepare_load` decided; :func:`placement_plan` and
the memory estimate read the same decision without reading a weight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lowmem.arguments import check_int, check_real
from lightning_lowmem.dtypes import model_dtype
from lightning_lowmem.runtime.disk_units import check_streamable
from lightning_lowmem.runtime.execution import ExecutionPlan
from lightning_lowmem.request.defaults import execution_device
from lightning_lowmem.request.options import LoadOptions
from lightning_lowmem.sources.resolve import Source, records_source, resolved
from lightning_lowmem.formats import Checkpoint, TensorRecord
from lightning_lowmem.placement import MaxMemory, PlacementPlan, architecture_of, place_layers
from lightning_lowmem.meta import owner_of
from lightning_lowmem.plan import Combine, LoadPlan, apply_key_map, guess_prefix, make_plan, module_records
from lightning_lowmem.plan.conversions import Transform
from lightning_lowmem.quantize import QuantScheme, Selection, select_linears
from lightning_lowmem.quantize.stored import mark_stored
from lightning_lowmem.quiet import quietly


@dataclass
class PreparedLoad:
    """A load decided before any weight is read.

    Attributes:
        module: the module being loaded.
        options: the load options.
        plan: every tensor to load; ``Target.scheme`` marks the quantized weights and ``Target.device``
            is where each goes (the placement's decision with ``max_memory``).
        selection: which Linears are quantized and why the others are not (None without ``quantize`` and
            without weights stored quantized).
        placement: the placement plan (None without ``max_memory``).
        execution: how each layer runs, made from the placement: its tier, compute device and dtype
            (``runtime/execution.py``).
        device: where buffers and caches go: the execution device, else ``options.device``, else CPU.
        source: the resolved checkpoint the plan was made from (its conversion, its stored weights).
        dtypes: the floating tensors (by name) the model family's own loader keeps in another dtype than
            ``options.dtype`` (see :meth:`~lightning_lowmem.placement.Architecture.load_dtypes`); empty when the face
            casts every tensor to one dtype (Lightning's precision plugins).
    """

    module: nn.Module
    options: LoadOptions
    plan: LoadPlan
    source: Source
    selection: Selection | None = None
    placement: PlacementPlan | None = None
    execution: ExecutionPlan | None = None
    device: torch.device = torch.device("cpu")
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)

    def dtype_of(self, name: str, tensor: torch.Tensor) -> torch.dtype:
        """The dtype the module's tensor ``name`` ends in: its family's (``dtypes``), else ``options.dtype`` for a
        floating one, else its own."""
        if not tensor.is_floating_point():
            return tensor.dtype
        return self.dtypes.get(name) or self.options.dtype or tensor.dtype

    @property
    def combine(self) -> Combine | None:
        """Tensors built from several keys (weights stored quantized read through their parts)."""
        return self.source.combine

    @property
    def transform(self) -> Transform | None:
        """What each tensor goes through as read (the conversion's)."""
        return self.source.transform


@quietly
def prepare_load(module: nn.Module, source: Source, options: LoadOptions, *, check_keys: bool = True,
                 kv_cache_bytes: int | None = None, activation_bytes: int | None = None,
                 family_dtypes: bool = True) -> PreparedLoad:
    """Plan the load of ``source`` into ``module`` under ``options``; reads no weight.

    Args:
        module: the module (usually built on meta).
        source: the resolved checkpoint (:func:`~lightning_lowmem.sources.resolve.resolved`): its records, the
            weights it holds already quantized (they load as stored, and ``options.quantize`` quantizes
            nothing else) and the conversion of its names (its ties are made on ``module`` first).
        options: the load options.
        check_keys: apply ``options.strict`` to missing and unexpected keys now; False leaves that to
            the caller (``plan.check_keys``), which may allow some missing tensors (added adapters).
        kv_cache_bytes, activation_bytes: with ``max_memory``, what the execution device reserves for caches
            and activations instead of the model architecture's estimates.
        family_dtypes: give each tensor the dtype the model family's own loader gives it (transformers'
            ``from_pretrained``: RoPE inverse frequencies and keep-in-fp32 modules in float32); False (the Lightning
            faces, whose precision plugin casts the whole module): every floating tensor in ``options.dtype``.

    Raises:
        CheckpointMismatchError: shapes differ, or (strict) keys are missing or unexpected.
        MemoryBudgetError: ``max_memory`` cannot hold the model (and ``disk_offload`` is off).
        UnsupportedQuantizationError: with ``disk_offload``, weights left on disk would be quantized as read.
    """
    if source.conversion is not None:
        source.conversion.apply_ties(module)
    tie_as_saved(module, source)
    stored = source.stored
    dtypes = architecture_of(module).load_dtypes(module, options.dtype) if family_dtypes and options.dtype else {}
    plan = make_plan(module, source.records, key_map=source.key_map, dtype=options.dtype, device=options.device,
                     combine=source.combine, stored=stored.weights or None, files=source.description, dtypes=dtypes)
    if check_keys:
        plan.check_keys(strict=options.strict is not False)
    prepared = PreparedLoad(module, options, plan, source, device=execution_device(options, "cpu"), dtypes=dtypes)
    if stored:
        prepared.selection = mark_stored(module, plan, stored)
    elif options.scheme is not None:
        prepared.selection = select_linears(module, plan, options.scheme, options.skip_quantize, options.linear_filter)
    if options.budgets is not None:
        prepared.placement = _place(module, plan, options, kv_cache_bytes, activation_bytes)
        if prepared.placement.on_disk:
            check_streamable(plan, prepared.placement, source.description)
    prepared.execution = ExecutionPlan.of(plan, prepared.placement, prepared.device)
    return prepared


def tie_as_saved(module: nn.Module, source: Source) -> None:
    """Tie the module's tensors that a save wrote once for two names (``save_checkpoint`` of a model whose output
    head is its embedding), where the module holds both as separate tensors of the same shape and the checkpoint
    only the written one; names map as the plan maps them (the conversion's key map, else a guessed prefix)."""
    ties = source.ties
    if not ties:
        return
    params = dict(module.named_parameters(remove_duplicate=False))
    key_map = source.key_map if source.key_map is not None else guess_prefix(set(params), list(source.records))[0]
    for missing, written in ties.items():
        name, same = apply_key_map(missing, key_map), apply_key_map(written, key_map)
        if missing in source.records or name not in params or same not in params or params[name] is params[same]:
            continue
        if params[name].shape == params[same].shape:
            owner, leaf = owner_of(module, name)
            setattr(owner, leaf, params[same])


def _place(module: nn.Module, plan: LoadPlan, options: LoadOptions, kv_cache_bytes: int | None = None,
           activation_bytes: int | None = None) -> PlacementPlan:
    """The placement of ``plan`` under ``options.max_memory``; caches and activations from the model's architecture."""
    architecture = architecture_of(module)
    dtype = model_dtype(module, options.dtype)
    batch, context = options.batch_size, options.context
    if kv_cache_bytes is None:
        kv_cache_bytes = architecture.cache_bytes(module, batch, context, dtype).total if context else 0
    if activation_bytes is None:
        activation_bytes = architecture.activation_bytes(module, batch, context or 1, dtype)
    return place_layers(module, plan, options.budgets, cache_bytes=kv_cache_bytes, activation_bytes=activation_bytes,
                        context=context, batch_size=batch, disk=options.disk_offload,
                        quantize=options.scheme.name if options.scheme is not None else None)


def placement_plan(
    module: nn.Module,
    checkpoint: str | Path | Checkpoint | Mapping[str, TensorRecord] | None,
    max_memory: MaxMemory | None = None,
    *,
    options: LoadOptions | None = None,
    dtype: torch.dtype | None = None,
    quantize: str | QuantScheme | None = None,
    kv_cache_bytes: int | None = None,
    activation_bytes: int | None = None,
    read_bandwidth: float | None = None,
    **load_options: Any,
) -> PlacementPlan:
    """Where each layer of ``module`` would go under ``max_memory``, without reading any weights.

    It is the placement :func:`~lightning_lowmem.load_checkpoint` makes with the same options: the same
    plan, the same Linears quantized, the same cache and activation reservations.

    Args:
        module: the model, usually built on meta (see :func:`lightning_lowmem.init_empty`).
        checkpoint: a checkpoint path (only its headers are read), an open :class:`Checkpoint`, its
            records, or None to size the module's own tensors.
        max_memory: device -> budget (int bytes or ``'6GiB'``); at most one accelerator, plus ``'cpu'``
            for the offloaded layers. May come in ``options`` instead.
        options: :class:`~lightning_lowmem.LoadOptions`; the keyword arguments override its fields.
        dtype: the dtype floating tensors are loaded in (default: each tensor's own).
        quantize: as in :func:`lightning_lowmem.load_checkpoint`.
        kv_cache_bytes, activation_bytes: override the model architecture's estimates.
        read_bandwidth: bytes per second the file is read at, for ``plan.seconds_per_token()`` (the plan's
            table shows it); ``estimate_memory`` measures it when not given.
        load_options: any other :class:`~lightning_lowmem.LoadOptions` field as a keyword: see its attributes.
            ``context``: tokens of KV cache to reserve (prompt + max_new_tokens; None reserves none and sizes
            activations for one token); ``batch_size``: sequences per forward; ``disk_offload``: layers that fit no
            budget stay in the checkpoint file (``plan.on_disk``), read for each forward: ``plan.disk_read_bytes``
            per token.

    Raises:
        MemoryBudgetError: the execution device cannot hold one layer plus its cache, or the
            model does not fit in all budgets together; ``.needed`` and ``.available`` are bytes.
        TypeError, ValueError: a byte count that is not an int >= 0, a ``read_bandwidth`` that is not a finite
            number above 0.

    Example::

        >>> from lightning_lowmem import init_empty
        >>> with init_empty():
        ...     model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
        >>> plan = placement_plan(model, None, {"cuda:0": "13MiB", "cpu": "1GiB"})
        >>> [layer.device for layer in plan.layers]
        ['cuda:0', 'cpu', 'cpu', 'cpu']
    """
    options = LoadOptions.merge(options, placement_plan, max_memory=max_memory, dtype=dtype, quantize=quantize,
                                **load_options)
    check_int("kv_cache_bytes", kv_cache_bytes, 0, optional=True)
    check_int("activation_bytes", activation_bytes, 0, optional=True)
    check_real("read_bandwidth", read_bandwidth, 0.0, above=True, optional=True)
    if options.budgets is None:
        raise ValueError("placement_plan needs max_memory (here or in options), "
                         "e.g. {'cuda:0': '6GiB', 'cpu': '20GiB'}.")
    with contextlib.ExitStack() as stack:
        if checkpoint is None:
            source = records_source(module_records(module), options, "the module's own tensors")
        elif isinstance(checkpoint, Mapping):
            source = records_source(dict(checkpoint), options, "the records given")
        else:
            source = stack.enter_context(resolved(checkpoint, module, options))
        prepared = prepare_load(module, source, options, kv_cache_bytes=kv_cache_bytes,
                                activation_bytes=activation_bytes)
    prepared.placement.read_bandwidth = read_bandwidth
    return prepared.placement
