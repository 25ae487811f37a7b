"""A sharded model's load, decided before any weight is read: what its shards can take, and its quantized
modules built before it is sharded.

Under FSDP2 a shard is filled in place, so it keeps the dtype and the tensor type its DTensor was
built with. A quantized weight must therefore exist, on the meta device, before ``fully_shard`` runs:
:func:`quantize_for_sharding` puts the scheme's modules in place of the chosen Linears (only a scheme
that shards, ``torchao.nf4``), and a load then quantizes this rank's rows of each weight.
:func:`check_sharded` refuses, before any read, a load these shards cannot take.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_lowmem.request.options import LoadOptions
from lightning_lowmem.engine.prepare import PreparedLoad
from lightning_lowmem.errors import UnsupportedQuantizationError, format_names
from lightning_lowmem.meta import owner_of
from lightning_lowmem.plan import Target, make_plan, module_records
from lightning_lowmem.plan.dtensor_part import is_dtensor
from lightning_lowmem.quantize import Selection, check_shardable, prepare_quantization, select_linears


def quantize_for_sharding(module: nn.Module, options: LoadOptions, count: int,
                          device: torch.device | None = None, *, dtype: torch.dtype | None = None) -> Selection:
    """Put ``options.quantize``'s modules, weights on meta, in place of the Linears it chooses in ``module``,
    before ``module`` is split by rows into ``count`` shards (``fully_shard``); a later load fills them.

    Linears whose weights do not split into ``count`` shards stay in full precision
    (``selection.left_out`` says why).

    Args:
        module: the model, its weights on the meta device (built by ``init_empty`` / ``fabric.init_module()``).
        options: the load options (``quantize``, ``skip_quantize``, ``dtype``).
        count: the number of shards each weight is split into (the data-parallel world size).
        device: where the kernels will run (checked now); default CPU.
        dtype: the dtype the weights load in, when the face decided it (default: ``options.dtype``).

    Raises:
        UnsupportedQuantizationError: the scheme cannot be sharded (anything but ``torchao.nf4``), or has
            no kernel on ``device``.
        ValueError: a chosen Linear already holds real weights (quantizing needs them from a checkpoint).

    Example::

        >>> from lightning_lowmem import init_empty
        >>> with init_empty():
        ...     model = nn.Sequential(nn.Linear(256, 128), nn.Linear(128, 2))
        >>> selection = quantize_for_sharding(model, LoadOptions(quantize="torchao.nf4"), count=2)
        >>> type(model[0]).__name__, selection.left_out["1"][:25]
        ('NF4Linear', 'its 256 weights are not a')
    """
    scheme = options.scheme
    check_shardable(scheme, f"the model is to be sharded in {count} shards")
    plan = make_plan(module, module_records(module), dtype=dtype or options.dtype)
    selection = select_linears(module, plan, scheme, options.skip_quantize, options.linear_filter)
    for name, weight in list(selection.chosen.items()):
        target = plan.target_of(weight)
        reason = scheme.shard_reason(target.record.shape, count)
        if reason is not None:
            selection.left_out[name] = reason
            del selection.chosen[name]
            target.scheme = None
    real = [n for n, w in selection.chosen.items() if not _tensor(module, w).is_meta and
            not scheme.transform.built(module.get_submodule(n))]
    if real:
        raise ValueError(f"quantize={scheme.name!r} builds quantized weights before the model is sharded, from a "
                         f"checkpoint loaded after; {format_names(real)} already hold real weights. Build the model "
                         "on the meta device (fabric.init_module() or lightning_lowmem.init_empty()).")
    prepare_quantization(module, selection, plan, device or torch.device("cpu"))
    return selection


def check_sharded(prepared: PreparedLoad) -> None:
    """Refuse, before any read, a load that DTensor shards cannot take.

    Raises:
        UnsupportedQuantizationError: the scheme cannot be sharded; or a chosen Linear was sharded in full
            precision (its quantized module must be built before sharding: :func:`quantize_for_sharding`);
            or quantized shards would be filled without ``quantize``.
        ValueError: ``dtype`` differs from the shards' dtype (a shard keeps its DTensor's dtype).
    """
    shards = [t for t in prepared.plan.targets if t.shard is not None]
    if not shards:
        return
    options, module = prepared.options, prepared.module
    stored = [t.names[0] for t in shards if t.stored is not None]
    if stored:
        raise UnsupportedQuantizationError(
            f"{prepared.plan.files} holds {format_names(stored)} already quantized, and "
            "these tensors of the module are DTensors: weights stored quantized cannot be sharded (only "
            "'torchao.nf4' shards, and it is made on load). Load this checkpoint into an unsharded model, or "
            "load a full-precision checkpoint with quantize='torchao.nf4'; nothing was read.")
    if options.scheme is not None:
        check_shardable(options.scheme, f"{len(shards)} tensors of the module are DTensors")
    other_dtype = [t.names[0] for t in shards if options.dtype is not None and t.record.dtype.is_floating_point
                   and t.dtype != options.dtype]
    if other_dtype:
        raise ValueError(
            f"dtype={options.dtype} was asked for, but the sharded tensors {format_names(other_dtype)} are "
            f"{prepared.plan.target_of(other_dtype[0]).dtype}: a shard is filled in place, in its DTensor's dtype. "
            "Build the model in that dtype before sharding it (Fabric's precision='bf16-true', or "
            "torch.set_default_dtype), or leave dtype unset.")
    _check_quantized_shards(prepared, shards)


def _check_quantized_shards(prepared: PreparedLoad, shards: list[Target]) -> None:
    """Each quantized shard was built so before sharding, and each shard built quantized is quantized."""
    scheme, module = prepared.options.scheme, prepared.module
    chosen = prepared.selection.chosen if prepared.selection is not None else {}
    unbuilt = [name for name, weight in chosen.items()
               if is_dtensor(_tensor(module, weight)) and not scheme.transform.built(module.get_submodule(name))]
    if unbuilt:
        raise UnsupportedQuantizationError(
            f"quantize={scheme.name!r} chose {format_names(unbuilt)}, which were sharded as full-precision "
            "Linears: a quantized weight must be built before the model is sharded. Call "
            "lightning_lowmem.engine.quantize_for_sharding(model, LoadOptions(quantize=...), count) before "
            "fully_shard, or use Fabric(strategy='lowmem_fsdp', quantize=...), which does; nothing was read.")
    quantized = [t.names[0] for t in shards if t.scheme is None and
                 type(_tensor(module, t.names[0])._local_tensor) is not torch.Tensor]
    if quantized:
        raise UnsupportedQuantizationError(
            f"{format_names(quantized)} were built quantized before sharding, but this load does not quantize "
            f"them (quantize={scheme.name if scheme is not None else None!r}, skip_quantize="
            f"{prepared.options.skip_quantize!r}). Pass the quantize= and skip_quantize= they were built with; "
            "nothing was read.")


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    owner, leaf = owner_of(module, name)
    return getattr(owner, leaf)
