"""Loading a checkpoint into a module that adds parameters of its own (adapters, heads).

The Fabric strategy and the Trainer callback both load through :func:`load_for_finetuning`:
it plans the load from the checkpoint's headers, initializes the parameters the
module *adds* beyond the checkpoint, and streams the rest with
:func:`~lightning_lowmem.load_checkpoint`. A parameter counts as added when it is

* missing from the checkpoint,
* still on the meta device (built inside :func:`~lightning_lowmem.init_empty`),
* trainable (``requires_grad``), and
* owned by a module that has ``reset_parameters()`` and none of whose own
  parameters are in the checkpoint (litgpt's ``LoRALinear``: ``lora_A``/``lora_B``,
  a new ``nn.Linear`` head),

so it can be allocated and initialized the way the module's own ``__init__`` would
have. Anything else that is missing is an error under ``strict=True``, raised
before a byte of weights is read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lightning_lowmem.checkpoint import Checkpoint
from lightning_lowmem.errors import CheckpointMismatchError, MetaTensorError, format_names
from lightning_lowmem.loader import LoadReport, load_checkpoint
from lightning_lowmem.materialize import owner_of
from lightning_lowmem.placement import MaxMemory
from lightning_lowmem.plan import Combine, KeyMap, LoadPlan, make_plan, mismatch_message
from lightning_lowmem.quantize import QuantizeSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadOptions:
    """How the Lightning integrations call :func:`~lightning_lowmem.load_checkpoint`.

    Attributes:
        quantize: quantization scheme (``"bnb.nf4"``, ``"torchao.int8wo"``, ...) or None.
        skip_quantize: module-name globs left in full precision.
        dtype: floating-point tensors are cast to it; None: the precision plugin's, else the module's.
        strict: None: each call's own ``strict`` decides; a bool overrides it.
        key_map: checkpoint-to-module renames (see :func:`~lightning_lowmem.load_checkpoint`).
        progress: progress bar; None: when stderr is a terminal.
        transform: ``transform(module_name, tensor)`` on each tensor as read (see :func:`load_checkpoint`).
        combine: module tensors built from several checkpoint keys (see :func:`load_checkpoint`).
        max_memory: device budgets (``{"cuda:0": "6GiB", "cpu": "20GiB"}``): a placement plan decides each
            layer's device instead of the strategy's device (see :func:`~lightning_lowmem.placement_plan`).
        context: tokens of KV cache the placement plan reserves room for.
        init_added: initialize trainable parameters the checkpoint lacks (LoRA adapters, new heads); False
            for inference, where a tensor the checkpoint lacks is an error, not a random initialization.
    """

    quantize: str | None = None
    skip_quantize: Sequence[str] | None = None
    dtype: torch.dtype | None = None
    strict: bool | None = None
    key_map: KeyMap | None = None
    progress: bool | None = None
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    combine: Combine | None = None
    max_memory: MaxMemory | None = None
    context: int | None = None
    init_added: bool = True

    def __post_init__(self) -> None:
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating-point torch.dtype such as torch.bfloat16, got {self.dtype!r}.")
        # Unknown schemes fail here, when the strategy or callback is built, not in the middle of a run.
        QuantizeSpec.parse(self.quantize, list(self.skip_quantize) if self.skip_quantize is not None else None)


def load_for_finetuning(
    module: nn.Module,
    checkpoint: str | Path,
    options: LoadOptions,
    *,
    device: torch.device,
    dtype: torch.dtype | None = None,
    strict: bool = True,
) -> LoadReport:
    """Stream ``checkpoint`` into ``module`` and initialize the parameters the module adds.

    Args:
        module: the module, usually built inside :func:`~lightning_lowmem.init_empty`.
        checkpoint: anything :func:`~lightning_lowmem.load_checkpoint` reads.
        options: the integration's options; ``options.dtype`` wins over ``dtype``.
        device: where every tensor goes.
        dtype: fallback cast (the precision plugin's dtype).
        strict: the call's own strictness (``options.strict`` overrides it when set).

    Returns:
        The loader's report; ``report.missing`` lists the added parameters that were initialized.

    Raises:
        CheckpointMismatchError: keys do not fit (strict), or shapes differ. Raised before reading data.
        MetaTensorError: a parameter is in neither the checkpoint nor initializable.
    """
    strict = options.strict if options.strict is not None else strict
    dtype = options.dtype or dtype
    with Checkpoint.open(checkpoint) as ckpt:  # headers only
        files = ", ".join(str(p) for p in ckpt.paths[:3])
        plan = make_plan(module, ckpt.records, key_map=options.key_map, strict=False, dtype=dtype,
                         device=device, files=files, combine=options.combine)
    added = _added_parameters(module, plan) if options.init_added else {}
    _check(module, plan, added, strict, files)
    initialized = _initialize(module, added, device, dtype)
    if initialized:
        log.info("Initialized %d parameters that are not in %s: %s", len(initialized), files,
                 format_names(initialized))
    return load_checkpoint(module, checkpoint, device=None if options.max_memory else device, dtype=dtype,
                           quantize=options.quantize, max_memory=options.max_memory, context=options.context,
                           skip_quantize=list(options.skip_quantize) if options.skip_quantize is not None else None,
                           strict=strict and not plan.missing, key_map=options.key_map, progress=options.progress,
                           transform=options.transform, combine=options.combine)


def _added_parameters(module: nn.Module, plan: LoadPlan) -> dict[str, nn.Module]:
    """Missing, meta, trainable parameters whose owner can initialize them: name -> owner.

    Not those the checkpoint should build from parts it lacks (an HF checkpoint's k_proj for qkv).
    """
    missing = set(plan.missing) - set(plan.absent.values())
    added: dict[str, nn.Module] = {}
    for name, param in module.named_parameters():
        if name not in missing or not param.is_meta or not param.requires_grad:
            continue
        owner, _ = owner_of(module, name)
        prefix = name.rpartition(".")[0]
        own = [(f"{prefix}.{n}" if prefix else n, p) for n, p in owner._parameters.items() if p is not None]
        if callable(getattr(owner, "reset_parameters", None)) and all(n in missing and p.is_meta for n, p in own):
            added[name] = owner
    return added


def _check(module: nn.Module, plan: LoadPlan, added: dict[str, nn.Module], strict: bool, files: str) -> None:
    """Fail before any read: keys that do not fit (strict), or meta tensors nothing will fill."""
    missing = [n for n in plan.missing if n not in added]
    if strict and (missing or plan.unexpected):
        raise CheckpointMismatchError(mismatch_message(plan, files, missing))
    meta = {n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta}
    stuck = [n for n in plan.missing if n in meta and n not in added]
    if stuck:
        raise MetaTensorError(
            f"{len(stuck)} tensors of the module are on the meta device and not in {files}: {format_names(stuck)}. "
            "A parameter the module adds is initialized only when it is trainable (requires_grad) and its module "
            "has reset_parameters() and no weights in the checkpoint. Put it in such a module, load a checkpoint "
            "that has it, or pass key_map= if it is there under another name."
        )


def _initialize(module: nn.Module, added: dict[str, nn.Module], device: torch.device,
                dtype: torch.dtype | None) -> list[str]:
    """Allocate the added parameters on ``device`` and let their owners initialize them."""
    owners: dict[int, nn.Module] = {}
    for name, owner in added.items():
        _, leaf = owner_of(module, name)
        old = owner._parameters[leaf]
        assert old is not None
        cast = dtype if dtype is not None and old.dtype.is_floating_point else old.dtype
        owner._parameters[leaf] = nn.Parameter(torch.empty_like(old, device=device, dtype=cast),
                                               requires_grad=old.requires_grad)
        owners[id(owner)] = owner
    with torch.no_grad():
        for owner in owners.values():
            owner.reset_parameters()
    return list(added)
