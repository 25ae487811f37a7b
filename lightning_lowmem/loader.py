"""``load_checkpoint``: stream a checkpoint into a module, one tensor at a time.

::

    meta-built module -> plan (headers only) -> for each tensor, in module order:
        read it alone [or read its parts and combine them] -> cast -> to device -> [quantize]
        -> assign -> drop the rest

Peak memory is the final model plus about one tensor in flight (a combined tensor: its parts
and the result).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from lightning_lowmem.cache_guard import release_all_rope
from lightning_lowmem.checkpoint import Checkpoint
from lightning_lowmem.devices import check_device_available
from lightning_lowmem.dtype_fallback import apply_dtype_fallback, supports_bf16
from lightning_lowmem.materialize import assign, check_no_meta, owner_of, recompute_meta_buffers
from lightning_lowmem.memory import MemoryMonitor, MemoryUsage, format_bytes
from lightning_lowmem.offload import Offload, dispatch
from lightning_lowmem.placement import MaxMemory, PlacementPlan, apply_placement, parse_max_memory, plan_placement
from lightning_lowmem.plan import Combine, KeyMap, LoadPlan, Target, make_plan
from lightning_lowmem.quantize import QuantizeSpec, module_nbytes, prepare_quantization
from lightning_lowmem.quantize.chunks import RowSource
from lightning_lowmem.readahead import ScratchBuffer, read_ahead

log = logging.getLogger(__name__)

# Bytes read ahead of the tensor being handled (see readahead.py): only where what is read
# becomes the final tensor as it is (no cast, no move, no quantization), so it costs nothing.
READ_AHEAD_FINAL = 512 * 2**20


@dataclass
class LoadReport:
    """What :func:`load_checkpoint` did.

    Attributes:
        files: the checkpoint files read.
        entry: where a torch file's state dict was (``'state_dict'``, ``'model'`` or ``''``).
        tensors: checkpoint tensors read.
        bytes_read: bytes read from the checkpoint.
        bytes_loaded: bytes of the loaded tensors in the module (after casting and quantization).
        seconds: wall time of the load.
        memory: peak host RSS (and device memory) during the load.
        skipped: checkpoint keys not loaded (``strict=False``).
        missing: module tensors not in the checkpoint (``strict=False``).
        recomputed: non-persistent buffers rebuilt after the load.
        key_note: the key prefix that was guessed, if any.
        quantized: quantized module name -> scheme.
        left_out: ``nn.Linear`` module name -> why it stayed in full precision (``quantize`` only).
        quantized_bytes_before / quantized_bytes_after: those modules' weight bytes.
    """

    files: list[Path]
    entry: str = ""
    tensors: int = 0
    bytes_read: int = 0
    bytes_loaded: int = 0
    seconds: float = 0.0
    memory: MemoryUsage = field(default_factory=MemoryUsage)
    skipped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)
    key_note: str = ""
    quantized: dict[str, str] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    quantized_bytes_before: int = 0
    quantized_bytes_after: int = 0
    placement: PlacementPlan | None = None
    offload: Offload | None = None

    def __str__(self) -> str:
        where = ", ".join(p.name for p in self.files[:3]) + (f" +{len(self.files) - 3}" if len(self.files) > 3 else "")
        lines = [
            f"Loaded {self.tensors} tensors ({format_bytes(self.bytes_read)} read, "
            f"{format_bytes(self.bytes_loaded)} in the model) from {where} in {self.seconds:.2f} s",
            f"  memory: {self.memory.summary()}",
        ]
        if self.quantized:
            schemes = sorted(set(self.quantized.values()))
            lines.append(f"  quantized {len(self.quantized)} modules with {', '.join(schemes)}: "
                         f"{format_bytes(self.quantized_bytes_before)} -> {format_bytes(self.quantized_bytes_after)}")
        if self.left_out:
            lines.append(f"  kept in full precision: " + ", ".join(
                f"{name} ({why})" for name, why in list(self.left_out.items())[:5])
                + (f" and {len(self.left_out) - 5} more" if len(self.left_out) > 5 else ""))
        if self.placement is not None:
            per_device = self.placement.weights_per_device()
            lines.append("  placement: " + ", ".join(f"{format_bytes(n)} on {d}" for d, n in per_device.items())
                         + f" ({len(self.placement.offloaded)} layers offloaded)")
        if self.key_note:
            lines.append(f"  keys: {self.key_note}")
        if self.skipped:
            lines.append(f"  skipped {len(self.skipped)} checkpoint keys: {', '.join(self.skipped[:5])}"
                         + (" ..." if len(self.skipped) > 5 else ""))
        if self.missing:
            lines.append(f"  missing {len(self.missing)} module tensors: {', '.join(self.missing[:5])}"
                         + (" ..." if len(self.missing) > 5 else ""))
        return "\n".join(lines)


def load_checkpoint(
    module: nn.Module,
    checkpoint: str | Path,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    quantize: str | None = None,
    skip_quantize: list[str] | None = None,
    strict: bool = True,
    key_map: KeyMap | None = None,
    progress: bool | None = None,
    max_memory: MaxMemory | None = None,
    context: int | None = None,
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    combine: Combine | None = None,
) -> LoadReport:
    """Stream ``checkpoint`` into ``module``, one tensor at a time.

    Args:
        module: any module; parameters may be on meta (see :func:`init_empty`), real, or mixed.
        checkpoint: a ``.safetensors`` file, a torch zip file (``.pt``/``.pth``/``.bin``/``.ckpt``:
            a Lightning ``state_dict`` or Fabric ``model`` entry is found by itself), a sharded
            set's ``*.index.json``, or a directory holding one of these (litgpt's ``lit_model.pth``
            and HF's ``model.safetensors`` included).
        device: where the tensors go; default: where each tensor already is, or CPU for meta.
        dtype: floating-point tensors are cast to it; default: each module tensor's dtype.
        quantize: a scheme, in litgpt's spelling: ``"bnb.nf4"``, ``"bnb.nf4-dq"``, ``"bnb.fp4"``,
            ``"bnb.fp4-dq"``, ``"bnb.int8"``, ``"torchao.int8wo"``, ``"torchao.int8dq"``,
            ``"torchao.int4wo"``. Each ``nn.Linear`` weight is quantized as it is read.
        skip_quantize: glob patterns of module names left in full precision; default: the
            output head (``lm_head``) and anything tied to the input embedding.
        strict: raise on missing or unexpected keys; with ``False``, skip them and list them in
            the report. Tensors left on meta are an error either way.
        key_map: checkpoint-to-module renames: a dict of prefixes (``{"model.": ""}``) or a
            callable returning the module name (or None to skip the key). Without it, a
            single missing or extra top-level prefix is detected.
        progress: show a progress bar by bytes; default: when stderr is a terminal.
        max_memory: device budgets, e.g. ``{"cuda:0": "6GiB", "cpu": "20GiB"}``, instead of
            ``device``: a placement plan (:func:`lightning_lowmem.placement.placement_plan`) decides
            each layer's device before any weight is read; layers on the CPU are then streamed to
            the accelerator for their forward (``report.offload``, see :mod:`lightning_lowmem.offload`).
        context: tokens of KV cache (prompt + max_new_tokens) the plan reserves room for.
        transform: called as ``transform(module_name, tensor)`` on each tensor as read, before the
            cast and quantization; returns the tensor to load (same shape as the module's). The
            tensor passed in may live in a buffer reused for the next read: do not keep it.
        combine: module tensors built from several checkpoint keys (:class:`~lightning_lowmem.plan.Combine`),
            e.g. an HF checkpoint's q, k and v projections into litgpt's ``qkv``. The parts of one
            tensor are read one after the other and combined at once; shapes are checked from the
            headers first.

    Returns:
        A :class:`LoadReport`.

    Raises:
        CheckpointError: the checkpoint is missing, truncated, unsafe or of an unknown format.
        CheckpointMismatchError: keys or shapes do not fit the module (raised before reading data).
        MemoryBudgetError: ``max_memory`` cannot hold the model (raised before reading data).
        UnsupportedQuantizationError: unknown scheme, or no kernel for it on ``device``.

    Example::

        >>> from litgpt import GPT, Config  # doctest: +SKIP
        >>> with init_empty():
        ...     model = GPT(Config.from_name("pythia-160m"))
        >>> report = load_checkpoint(model, "checkpoints/pythia-160m/lit_model.pth", dtype=torch.bfloat16)
        >>> print(report)
    """
    if max_memory is not None and device is not None:
        raise ValueError(f"Pass device={device!r} or max_memory=, not both: with max_memory the placement "
                         "plan decides each layer's device.")
    device = torch.device(device) if device is not None else None
    check_device_available(device)  # before any I/O, and before the monitor touches torch.cuda
    spec = QuantizeSpec.parse(quantize, skip_quantize)  # bad names fail before any I/O
    # with max_memory, the plan may name devices this machine lacks (it is arithmetic): _cuda_or_none drops them
    watched = torch.device(parse_max_memory(max_memory)[1]) if max_memory is not None else device
    with Checkpoint.open(checkpoint) as ckpt, MemoryMonitor(device=_cuda_or_none(watched)) as monitor:
        files = ", ".join(str(p) for p in ckpt.paths[:3]) + (" ..." if len(ckpt.paths) > 3 else "")
        plan = make_plan(module, ckpt.records, key_map=key_map, strict=strict, dtype=dtype,
                         device=device, files=files, combine=combine)
        placement = None
        if max_memory is not None:  # the plan decides each target's device, before any data is read
            placement = plan_placement(module, plan, max_memory, context=context, dtype=dtype,
                                       quantize=quantize, skip_quantize=skip_quantize)
            apply_placement(plan, placement)
            device = torch.device(placement.execution_device)  # buffers and caches go there
        apply_dtype_fallback(plan)  # bf16 -> fp16 per tensor on devices without bf16
        quantizer = prepare_quantization(module, spec, plan, device or torch.device("cpu"))
        report = LoadReport(files=ckpt.paths, entry=ckpt.entry, skipped=plan.unexpected,
                            missing=plan.missing, key_note=plan.prefix_note)
        release_all_rope(module, device or torch.device("cpu"))  # litgpt's RoPE tables: sized when first used
        _stream(module, ckpt, plan, quantizer, report, progress, transform, combine)
        report.recomputed = recompute_meta_buffers(module, device or torch.device("cpu"))
        _finish_buffers(module, device, dtype)
        report.bytes_loaded = module_nbytes(module)  # after buffers took their final dtype
        check_no_meta(module, f"After loading {files}")
        if placement is not None:
            report.placement, report.offload = placement, dispatch(module, placement)
        if quantizer is not None:
            report.quantized, report.left_out = quantizer.quantized, dict(quantizer.left_out)
            report.quantized_bytes_before, report.quantized_bytes_after = quantizer.bytes_before, quantizer.bytes_after
    report.memory = monitor.usage
    report.seconds = monitor.usage.seconds
    log.info("%s", report)
    return report


def _stream(module: nn.Module, ckpt: Checkpoint, plan: LoadPlan, quantizer, report: LoadReport,
            progress: bool | None, transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
            combine: Combine | None = None) -> None:
    show = progress if progress is not None else sys.stderr.isatty()
    bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, unit_divisor=1024, desc="Loading",
               disable=not show, leave=False)
    loaded: list[list[str]] = []
    window = _window(plan, quantizer, transform)

    def by_rows(t: Target) -> bool:
        """Quantized a block of rows at a time, each read on its own: the whole weight is never read."""
        return (quantizer is not None and transform is None and not t.parts and len(t.record.shape) == 2
                and quantizer.by_rows(t.names[0]) and ckpt.reads_rows(t.record.key))

    size = _scratch_size(plan, lambda t: _copied_after_read(t, quantizer) and not by_rows(t)) if window == 0 else 0
    scratch = ScratchBuffer(size) if size else None

    parts = _SharedParts(ckpt, plan)

    def read(t: Target) -> torch.Tensor | RowSource:
        if t.parts:
            return _read_combined(parts, t, combine)
        if by_rows(t):
            return _row_source(ckpt, t)
        if scratch is not None and t.record.nbytes <= size and _copied_after_read(t, quantizer):
            return ckpt.read(t.record.key, out=scratch.view(t.record.shape, t.record.dtype))
        return ckpt.read(t.record.key)

    try:
        with torch.no_grad():
            for target, tensor in read_ahead(plan.targets, read, lambda t: t.read_nbytes, window):
                if isinstance(tensor, RowSource):
                    quantizer.load(module, target.names[0], tensor)
                else:
                    if transform is not None:
                        tensor = transform(target.names[0], tensor)
                    tensor = tensor.to(dtype=target.dtype).to(device=target.device)
                    if quantizer is None or not quantizer.load(module, target.names[0], tensor):
                        assign(module, target.names, tensor, target.is_parameter)
                report.tensors += len(target.parts) or 1
                report.bytes_read += target.read_nbytes
                loaded.append(target.names)
                del tensor
                bar.update(target.read_nbytes)
    except BaseException:
        _back_to_meta(module, loaded)  # never hand back a half-loaded model that looks loaded
        raise
    finally:
        bar.close()


def _row_source(ckpt: Checkpoint, target: Target) -> RowSource:
    """``target``'s weight as blocks of rows, each read from the file into one reused buffer, cast and moved."""
    rec = target.record
    row_elements = math.prod(rec.shape[1:])
    buffer = torch.empty(0, dtype=rec.dtype)

    def rows(start: int, stop: int) -> torch.Tensor:
        nonlocal buffer
        if start == 0 and stop == rec.shape[0]:  # the whole weight: its own memory, nothing shared
            block = ckpt.read(rec.key)
        else:
            n = (stop - start) * row_elements
            if buffer.numel() < n:
                buffer = torch.empty(n, dtype=rec.dtype)
            block = ckpt.read_rows(rec.key, start, stop, out=buffer[:n].view(stop - start, *rec.shape[1:]))
        return block.to(dtype=target.dtype).to(device=target.device)

    return RowSource(rec.shape, target.dtype, target.device, rows)


class _SharedParts:
    """Reads the parts of combined targets; a part that a later target also needs is read once and held till then.

    litgpt splits Phi-3's ``gate_up_proj`` into ``fc_1`` and ``fc_2``: without this it was read twice.
    """

    def __init__(self, ckpt: Checkpoint, plan: LoadPlan) -> None:
        self._ckpt = ckpt
        self._uses: dict[str, int] = {}
        for target in plan.targets:
            for part in target.parts:
                self._uses[part.key] = self._uses.get(part.key, 0) + 1
        self._held: dict[str, torch.Tensor] = {}

    def take(self, key: str) -> torch.Tensor:
        tensor = self._held.pop(key, None)
        if tensor is None:
            tensor = self._ckpt.read(key)
        self._uses[key] -= 1
        if self._uses[key] > 0:
            self._held[key] = tensor
        return tensor


def _read_combined(parts: _SharedParts, target: Target, combine: Combine) -> torch.Tensor:
    """The target's parts read one after the other (fresh memory each) and combined; the parts are then dropped."""
    tensor = combine.fn(target.record.key, {p.key: parts.take(p.key) for p in target.parts})
    if tensor.untyped_storage().nbytes() > tensor.nbytes:  # a slice of a part would keep the whole part alive
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _window(plan: LoadPlan, quantizer: object, transform: object) -> int:
    """Bytes to read ahead: none when what is read is a transient copy, else READ_AHEAD_FINAL."""
    transient = quantizer is not None or transform is not None or any(
        t.parts or t.dtype != t.record.dtype or t.device.type != "cpu" for t in plan.targets)
    return 0 if transient else READ_AHEAD_FINAL


def _copied_after_read(target: Target, quantizer) -> bool:
    """Whether what is read for ``target`` is copied before the next read (so it may be read into scratch)."""
    return not target.parts and (target.dtype != target.record.dtype or target.device.type != "cpu"
                                 or (quantizer is not None and quantizer.owns(target.names[0])))


def _scratch_size(plan: LoadPlan, copied: Callable[[Target], bool]) -> int:
    """Bytes of the reused read buffer: the largest ``copied`` tensor read in the second half of the load.

    The buffer is held to the end, when the model is nearly complete, so it is sized to the transients
    of that part of the load; a larger tensor read early (litgpt reads ``lm_head`` first) gets fresh
    memory, freed at once, as without the buffer.
    """
    total, done, size = plan.nbytes, 0, 0
    for target in plan.targets:
        if done >= total / 2 and copied(target):
            size = max(size, target.record.nbytes)
        done += target.read_nbytes
    return size


def _back_to_meta(module: nn.Module, loaded: list[list[str]]) -> None:
    for names in loaded:
        for name in names:
            owner, leaf = owner_of(module, name)
            table = owner._parameters if leaf in owner._parameters else owner._buffers
            old = table[leaf]
            if old is not None:
                meta = old.detach().to("meta")
                table[leaf] = nn.Parameter(meta, requires_grad=old.requires_grad) if leaf in owner._parameters else meta


def _finish_buffers(module: nn.Module, device: torch.device | None, dtype: torch.dtype | None) -> None:
    """Buffers the checkpoint did not hold (RoPE, masks) go where ``model.to(device, dtype)`` would put them.

    bf16 becomes fp16 on a device without bf16, as the loaded tensors did (:mod:`.dtype_fallback`).
    """
    for mod in module.modules():
        for name, buf in mod._buffers.items():
            if buf is None or buf.is_meta:
                continue
            where = device or buf.device
            cast = dtype if dtype is not None and buf.is_floating_point() else buf.dtype
            if cast == torch.bfloat16 and not supports_bf16(where):
                cast = torch.float16
            mod._buffers[name] = buf.to(device=where, dtype=cast)


def _cuda_or_none(device: torch.device | None) -> torch.device | None:
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        return device
    return None
