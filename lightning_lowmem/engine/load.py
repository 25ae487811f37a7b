"""``load_checkpoint``: open the checkpoint once, decide the load from its headers, stream it in, finish.

::

    resolved (which weights, their headers, the conversion) -> prepare_load (plan, quantization, placement)
        -> nothing left on meta?
        -> stream (one tensor at a time) -> buffers and checks -> LoadReport

A module is loaded whole or left as it was: any error after the plan puts it back.

A module whose parameters are DTensors (sharded by ``fully_shard``) is loaded the same way on each
rank: the plan is the same on every rank, the ranks agree that it holds before any of them reads
(``ranks.py``), then each rank allocates and reads only its own part of each tensor (``shard_fill.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Container, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lowmem.building import after_fill, cast_buffer, forget_origins
from lightning_lowmem.devices import check_device_available, cuda_or_none
from lightning_lowmem.dtypes import supports_bf16
from lightning_lowmem.request.defaults import execution_device
from lightning_lowmem.engine.disk_reads import on_disk_targets, open_disk_tier
from lightning_lowmem.request.options import LoadOptions
from lightning_lowmem.engine.prepare import PreparedLoad, prepare_load
from lightning_lowmem.sources.resolve import resolved
from lightning_lowmem.sources.weight_sets import Chosen
from lightning_lowmem.ranks.agreement import agreement, from_first_rank, rank
from lightning_lowmem.engine.report import LoadReport
from lightning_lowmem.ranks.shard_fill import allocate_shards, shard_nbytes, sharded_parameters
from lightning_lowmem.engine.shard_checks import check_sharded
from lightning_lowmem.routes.route import Traits
from lightning_lowmem.engine.stream import stream
from lightning_lowmem.routes.whole_reads import whole_reads
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.formats.checkpoint import headers_shared
from lightning_lowmem.formats.crc_pieces import check_unchecked
from lightning_lowmem.errors import MetaTensorError, format_names
from lightning_lowmem.memory import MemoryMonitor, collector_paused
from lightning_lowmem.meta import Snapshot, check_no_meta, meta_tensor_names
from lightning_lowmem.placement import Architecture, architecture_of
from lightning_lowmem.runtime import dispatch
from lightning_lowmem.plan import LoadPlan
from lightning_lowmem.plan.plan import deferred_advice
from lightning_lowmem.quantize import QuantScheme, Quantizer, module_nbytes, prepare_quantization
from lightning_lowmem.quiet import quietly

log = logging.getLogger(__name__)


def load_checkpoint(
    module: nn.Module,
    checkpoint: str | Path | Checkpoint,
    *,
    options: LoadOptions | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    quantize: str | QuantScheme | None = None,
    **load_options: Any,
) -> LoadReport:
    """Stream ``checkpoint`` into ``module``, one tensor at a time.

    Args:
        module: any module; parameters may be on meta (see :func:`init_empty`), real, or mixed.
        checkpoint: a ``.safetensors`` file, a torch zip file (``.pt``/``.pth``/``.bin``/``.ckpt``:
            a Lightning ``state_dict`` or Fabric ``model`` entry is found by itself), a sharded
            set's ``*.index.json``, a ``.gguf`` file, a directory holding them (several weight sets in one
            directory: see ``docs/loading.md``, "Which weights a path stands for"), or a
            :class:`Checkpoint` already open. HF and GGUF names are converted to the module's when the
            module is litgpt's ``GPT`` or a transformers model (the report's ``conversion`` says how).
        options: :class:`~lightning_lowmem.LoadOptions`, whose attributes describe every option; the keyword
            arguments override the fields they name (None leaves a field as it is).
        device: where the tensors go; default: where each tensor already is, or CPU for meta.
        dtype: floating-point tensors are cast to it; default: each module tensor's dtype.
        quantize: a scheme (``"bnb.nf4"``, ``BnbNF4(blocksize=128)``): each chosen Linear quantized as it is read.
        load_options: any other :class:`~lightning_lowmem.LoadOptions` field as a keyword (``skip_quantize=``,
            ``strict=``, ``key_map=``, ``max_memory=``, ``prefer=``, ...): see its attributes.

    Returns:
        A :class:`LoadReport`.

    Raises:
        CheckpointError: the checkpoint is missing, truncated, unsafe or of an unknown format.
        AmbiguousCheckpointError: a directory holds different weight sets (pass ``prefer=`` or the file).
        CheckpointMismatchError: keys or shapes do not fit the module (raised before reading data).
        MemoryBudgetError: ``max_memory`` cannot hold the model (raised before reading data).
        UnsupportedQuantizationError: unknown scheme, or no kernel for it on ``device``.
        DeviceUnavailableError: ``device`` does not exist here (raised before opening anything).

    Warns:
        UnverifiedWeightsWarning: a directory holds weight sets that agree by headers and sampled bytes, and one was
            read without every byte compared (``prefer=`` picks one; ``verify_weight_sets=True`` compares them).

    Example::

        >>> import tempfile, safetensors.torch
        >>> from lightning_lowmem import init_empty
        >>> path = tempfile.mkdtemp() + "/model.safetensors"
        >>> safetensors.torch.save_file(torch.nn.Linear(4, 2).state_dict(), path)
        >>> with init_empty():
        ...     layer = torch.nn.Linear(4, 2)
        >>> report = load_checkpoint(layer, path, dtype=torch.bfloat16, progress=False)
        >>> layer.weight.dtype, report.tensors, report.bytes_loaded
        (torch.bfloat16, 2, 20)
    """
    options = LoadOptions.merge(options, load_checkpoint, device=device, dtype=dtype, quantize=quantize,
                                **load_options)
    return run_load(module, checkpoint, options)


@quietly
def run_load(module: nn.Module, checkpoint: str | Path | Checkpoint | Chosen, options: LoadOptions, *,
             on_plan: Callable[[PreparedLoad], None] | None = None, family_dtypes: bool = True) -> LoadReport:
    """The whole load under one memory monitor: open once, prepare from the headers, stream.

    The module is loaded whole or left as it was: on any error after the plan, every module,
    parameter and buffer is put back as it was before (:class:`~lightning_lowmem.meta.Snapshot`).
    With DTensor parameters, every rank raises if the plan failed on any rank, before any read.

    Args:
        module, checkpoint: as :func:`load_checkpoint`.
        options: the load options.
        on_plan: called with the prepared load before any weight is read (a face's own checks and
            initializations). With it, missing and unexpected keys are left for it to check
            (``prepared.plan.check_keys``); without it, ``options.strict`` decides here.
        family_dtypes: the dtypes the model family's own loader gives (see :func:`prepare_load`); False for a face
            whose precision casts the whole module (Lightning's).
    """
    check_device_available(options.device)  # before any I/O, and before the monitor touches torch.cuda
    with MemoryMonitor(device=cuda_or_none(execution_device(options))) as monitor, contextlib.ExitStack() as stack:
        def open_and_prepare() -> tuple[PreparedLoad, Checkpoint]:
            source = stack.enter_context(resolved(checkpoint, module, options))
            with collector_paused():  # a record and a target per tensor, no garbage: see memory/collector.py
                prepared = prepare_load(module, source, options, check_keys=on_plan is None,
                                        family_dtypes=family_dtypes)
            if on_plan is not None:
                on_plan(prepared)
            return prepared, source.checkpoint

        report = _load_whole_or_not_at_all(module, open_and_prepare)
        if report.disk is not None:
            report.disk.own(stack.pop_all())  # the checkpoint stays open while the model reads layers from it
    return _finish_report(report, monitor)


@quietly
def load_prepared(prepared: PreparedLoad, monitor: MemoryMonitor | None = None) -> LoadReport:
    """Stream a load :func:`prepare_load` decided from a resolved checkpoint's headers, and finish the module.

    Before anything is read, a tensor of the module on meta that nothing would fill is a
    :class:`MetaTensorError`; after that, any error puts the module back as it was.

    Args:
        prepared: the decided load (its source's checkpoint still open; with layers left on disk, keep it open
            while the model runs: ``report.disk`` reads from it and does not close it).
        monitor: a running monitor whose block covers this load; without one, the load gets its own.
    """
    if monitor is None:
        with MemoryMonitor(device=cuda_or_none(prepared.device)) as own:
            report = load_prepared(prepared, own)
        return _finish_report(report, own)
    return _load_whole_or_not_at_all(prepared.module, lambda: (prepared, prepared.source.checkpoint))


def _load_whole_or_not_at_all(module: nn.Module,
                              prepare: Callable[[], tuple[PreparedLoad, Checkpoint]]) -> LoadReport:
    """``prepare`` and check the load, then stream it; on any error the module is put back as it was
    (:class:`~lightning_lowmem.meta.Snapshot`): never a half-loaded model that looks loaded.

    With DTensor parameters each stage ends with the ranks agreeing (``ranks.py``): every rank raises if any rank
    failed before reading, and again if any failed while reading (a read error, a changed file, a damaged tensor).
    """
    snapshot = Snapshot(module)
    sharded = bool(sharded_parameters(module))
    try:
        with agreement(sharded), headers_shared(from_first_rank if sharded else None):  # rank 0 parses headers
            prepared, ckpt = prepare()
            architecture = _check_before_reading(prepared)
        report = _load(prepared, ckpt, architecture, sharded)
    except BaseException:
        snapshot.restore()
        raise
    after_fill(module)  # buffers final, parts filled
    return report


def _check_before_reading(prepared: PreparedLoad) -> Architecture:
    """The checks that need no weight: nothing left on meta, sharded tensors that can be filled; returns the
    module's architecture."""
    architecture = architecture_of(prepared.module)
    check_complete(prepared.module, prepared.plan, architecture.fills(prepared.module))
    check_sharded(prepared)
    return architecture


def _load(prepared: PreparedLoad, ckpt: Checkpoint, architecture: Architecture, sharded: bool) -> LoadReport:
    """Stream the prepared load. Sharded, the ranks then agree that every rank read its part, and check together
    the CRC-32s of torch records each rank read only part of (``formats/crc_pieces.py``)."""
    module, plan = prepared.module, prepared.plan
    allocation = None
    try:
        with agreement(sharded, "while reading its shard", share=True) as agreed:
            prepared.execution.apply(plan)  # bf16 -> fp16 where a tensor computes on a device without bf16
            quantizer = prepare_quantization(module, prepared.selection, plan, prepared.device) \
                if prepared.selection else None
            report = LoadReport(files=ckpt.paths, entry=ckpt.entry, skipped=plan.unexpected, missing=plan.missing,
                                key_note=plan.prefix_note, placement=prepared.placement, rank=rank(),
                                source=prepared.source.why, conversion=_conversion_name(prepared))
            allocation = allocate_shards(module, prepared.options.device)  # this rank's parts of meta DTensors
            _fill(prepared, ckpt, architecture, quantizer, report)
            agreed.share = ckpt.unchecked() if sharded else None
        check_unchecked(agreed.shared)  # the same pieces on every rank: the same outcome on every rank
    except BaseException:
        if allocation is not None:
            allocation.undo()
        raise
    return report


def _fill(prepared: PreparedLoad, ckpt: Checkpoint, architecture: Architecture, quantizer: Quantizer | None,
          report: LoadReport) -> None:
    """Stream the plan into the module (the layers left on disk: placeholders and the disk tier), rebuild and place its
    buffers, check it, and fill ``report``."""
    module, plan, options, device = prepared.module, prepared.plan, prepared.options, prepared.device
    on_disk = {id(t) for t in on_disk_targets(prepared)}
    resident = dataclasses.replace(plan, targets=[t for t in plan.targets if id(t) not in on_disk]) if on_disk else plan
    if supports_bf16(device):  # no fp16 fallback: only the buffers the family computes wider use their origins
        forget_origins(module, keep=prepared.dtypes)
    architecture.before_load(module, device)  # e.g. litgpt's RoPE tables: sized when first used
    report.read_whole = whole_reads(plan, Traits.of(plan, ckpt, transform=prepared.transform))
    if report.read_whole:
        log.info("This rank reads %d sharded tensors whole and keeps its part: %s", len(report.read_whole),
                 format_names((f"{n} ({why})" for n, why in report.read_whole.items()), quote=False, sep="; "))
    report.tensors, report.bytes_read, report.mapped = stream(
        module, ckpt, resident, quantizer, transform=prepared.transform, combine=prepared.combine,
        progress=options.progress, mmap=options.mmap)
    ckpt.check_unchanged()  # a file rewritten during the last read
    final = {name: prepared.dtype_of(name, b) for name, b in module.named_buffers(remove_duplicate=False)}
    report.recomputed = architecture.after_load(module, device, final)
    _finish_buffers(module, options.device or (device if prepared.placement else None), final, prepared.dtypes)
    report.bytes_loaded = module_nbytes(module)  # after buffers took their final dtype; the layers on disk hold none
    report.disk = open_disk_tier(prepared, ckpt)  # placeholders for the layers on disk
    try:
        _finish(prepared, quantizer, report)
    except BaseException:
        if report.disk is not None:
            report.disk.close()
        raise


def _finish(prepared: PreparedLoad, quantizer: Quantizer | None, report: LoadReport) -> None:
    """Check nothing is left on meta, dispatch the offloaded layers, and fill the report's numbers."""
    module = prepared.module
    report.shard_bytes = shard_nbytes(module)
    check_no_meta(module, f"After loading {prepared.plan.files}")
    if prepared.placement is not None:
        report.offload = dispatch(module, prepared.execution)
    if quantizer is not None:
        if report.disk is not None:  # weights stored quantized in modules on disk: loaded as stored at each forward
            stored = report.disk.stored_modules()
            quantizer.quantized.update(stored)
            quantizer.prequantized.update(stored)
        report.quantized, report.left_out = quantizer.quantized, quantizer.left_out
        report.prequantized, report.requantized = quantizer.prequantized, quantizer.requantized
        report.quantized_bytes_before, report.quantized_bytes_after = quantizer.bytes_before, quantizer.bytes_after


def _conversion_name(prepared: PreparedLoad) -> str:
    conversion = prepared.source.conversion
    return conversion.name if conversion is not None else ""


def check_complete(module: nn.Module, plan: LoadPlan, filled: set[str]) -> None:
    """Raise :class:`MetaTensorError`, before anything is read, when a tensor of ``module`` on meta would stay
    there: neither a target of ``plan`` nor in ``filled`` (what the module's architecture rebuilds)."""
    filled = filled | {name for target in plan.targets for name in target.names}
    left = [name for name in meta_tensor_names(module) if name not in filled]
    if not left:
        return
    missing = set(plan.missing)
    absent = [n for n in left if n in missing]
    derived = [n for n in left if n not in missing]
    parts = [f"{plan.files} cannot fill {len(left)} tensors of the module that are on the meta device:"]
    if absent:
        parts.append(f"{format_names(absent)} {'is' if len(absent) == 1 else 'are'} not in the checkpoint;")
    if derived:
        parts.append(f"{format_names(derived)} {'is a buffer' if len(derived) == 1 else 'are buffers'} computed in "
                     "__init__ (not saved in checkpoints, or saved with another shape or dtype) that nothing rebuilds;")
    if plan.deferred:
        parts.append(deferred_advice(plan.deferred))
    raise MetaTensorError(
        " ".join(parts) + " nothing was read. Load a checkpoint that has them, pass key_map= if they are there under "
        "other names, or build the module inside lightning_lowmem.init_empty() so that buffers computed in "
        "__init__ stay real.")


def _finish_report(report: LoadReport, monitor: MemoryMonitor) -> LoadReport:
    report.memory = monitor.usage
    report.seconds = monitor.usage.seconds
    log.info("%s", report)
    return report


def _finish_buffers(module: nn.Module, device: torch.device | None, dtypes: Mapping[str, torch.dtype],
                    computed: Container[str] = ()) -> None:
    """Buffers the checkpoint did not hold (RoPE, masks) go to ``device`` in the dtype ``dtypes`` gives them (the load's
    dtype, as ``model.to(device, dtype)`` would cast them, or the one the model family's own loader keeps). What the
    architecture released (litgpt's zero-row RoPE tables) is cast too: the tables built later take its dtype.

    bf16 becomes fp16 on a device without bf16, as the loaded tensors did
    (:func:`~lightning_lowmem.building.cast_buffer`: a buffer its constructor cast to bf16 inside ``init_empty()`` is
    then cast once from the constructor's own values, as the same constructor run with fp16 gives it; so is one the
    model family computes wider, named in ``computed``: transformers' RoPE ``inv_freq`` in float32).
    """
    for prefix, mod in module.named_modules():
        for name, buf in mod._buffers.items():
            if buf is None or buf.is_meta:
                continue
            where = device or buf.device
            own = f"{prefix}.{name}" if prefix else name
            mod._buffers[name] = cast_buffer(buf, where, dtypes.get(own, buf.dtype), computed=own in computed)
