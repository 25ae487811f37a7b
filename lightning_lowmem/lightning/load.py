"""How the Lightning faces load: one loader, one prepared load, and the parameters a module adds initialized.

``LowMemStrategy``, ``LowMemFSDPStrategy`` and ``LowMemCallback`` each hold one
:class:`LightningLoader`: the face's load options (built once), its reports, and
the optimizers it re-points at the loaded parameters. Each load goes through
:func:`load_into`: it resolves and opens the checkpoint once, plans the load from
its headers (:func:`~lightning_lowmem.engine.run_load`), initializes the parameters
the module *adds* beyond the checkpoint, and streams the rest with the same plan.
A parameter counts as added when it is

* missing from the checkpoint,
* still on the meta device (built inside :func:`~lightning_lowmem.init_empty`),
* trainable (``requires_grad``), and
* owned by a module that has ``reset_parameters()`` and none of whose own
  parameters are in the checkpoint (litgpt's ``LoRALinear``: ``lora_A``/``lora_B``,
  a new ``nn.Linear`` head),

so it can be allocated and initialized the way the module's own ``__init__`` would
have. Anything else that is missing is an error under ``strict=True``, and a tensor
left on meta is an error either way, raised before a byte of weights is read.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_lowmem.arguments import check_flag
from lightning_lowmem.dtypes import load_dtype
from lightning_lowmem.engine import LoadOptions, LoadReport, PreparedLoad, allocate_shards, run_load
from lightning_lowmem.request.defaults import compute_dtype, execution_device
from lightning_lowmem.errors import format_names
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.lightning.state import plugin_dtype, remap_optimizer_params
from lightning_lowmem.meta import owner_of
from lightning_lowmem.plan import LoadPlan
from lightning_lowmem.plan.dtensor_part import is_dtensor

log = logging.getLogger(__name__)
TRAINER_LOG = logging.getLogger("lightning.pytorch.callbacks.lowmem")
"""The callback's line: under ``lightning.pytorch``, shown as the Trainer's own lines ("GPU available: ...") and quieted
with them, ``logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)``."""
FABRIC_LOG = logging.getLogger("lightning.fabric.strategies.lowmem")
"""The strategies' line: under ``lightning.fabric``, shown as Fabric's own lines and quieted with them,
``logging.getLogger("lightning.fabric").setLevel(logging.WARNING)``."""


class LightningLoader:
    """The load of one Lightning face: its options, its reports, the optimizers it re-points after a load.

    Args:
        options: the face's :class:`~lightning_lowmem.LoadOptions`, built once from its keyword arguments.
        init_added: initialize trainable parameters the checkpoint lacks (adapters); False: an error.
        logger: where each load's line goes (:meth:`~lightning_lowmem.LoadReport.summary`, on rank 0): a logger
            under Lightning's own (:data:`TRAINER_LOG`, :data:`FABRIC_LOG`), so that it shows as Lightning's lines
            show and the switch that quiets those quiets it; None: no line.
        face: the name the line starts with (``"LowMemCallback"``).
    """

    def __init__(self, options: LoadOptions, init_added: bool = True, logger: logging.Logger | None = None,
                 face: str = "") -> None:
        check_flag("init_added", init_added)
        self.options = options
        self.init_added = init_added
        self.logger, self.face = logger, face
        self.reports: list[LoadReport] = []
        self._optimizers: weakref.WeakSet[Optimizer] = weakref.WeakSet()

    def track(self, optimizer: Optimizer) -> None:
        """Re-point ``optimizer`` at the loaded parameters after each load (it was set up on the meta ones).

        Raises:
            ValueError: the loads leave layers on disk (``disk_offload``), which cannot be trained.
        """
        self._refuse_training("an optimizer was set up")
        self._optimizers.add(optimizer)

    def _refuse_training(self, why: str) -> None:
        if self.options.disk_offload:
            raise ValueError(
                f"{why}, but the load options have disk_offload=True: layers left in the checkpoint file are read "
                "for each forward, for inference (predict, validate, test, generation). Training through them is not "
                "supported: raise max_memory so that the model stays in memory (quantize='bnb.nf4' makes it 4x "
                "smaller), or drop disk_offload.")

    def dtype(self, precision: object) -> torch.dtype | None:
        """What weights are cast to: the ``dtype`` option, else the precision plugin's
        (:func:`~lightning_lowmem.dtypes.load_dtype`)."""
        return load_dtype(self.options.dtype, plugin_dtype(precision))

    def load(self, module: nn.Module, checkpoint: str | Path | Checkpoint, *, device: torch.device,
             precision: object, strict: bool = True, unfilled: frozenset[str] = frozenset(),
             optimizers: Iterable[Optimizer] = ()) -> LoadReport:
        """Load ``checkpoint`` into ``module`` on ``device`` (:func:`load_into`), keep the report, and point the
        tracked ``optimizers`` (and those given) at the loaded parameters."""
        if optimizers:
            self._refuse_training("optimizers are restored with the weights")
        before = dict(module.named_parameters(remove_duplicate=False))
        options = LoadOptions.merge(self.options, dtype=self.dtype(precision),
                                    device=None if self.options.max_memory else device)
        report = load_into(module, checkpoint, options, device=device, strict=strict, init_added=self.init_added,
                           unfilled=unfilled)
        follow_fp16_fallback(precision, options)
        self.reports.append(report)
        if self.logger is not None and report.rank == 0:
            self.logger.info("%s: %s", self.face, report.summary())
        remap_optimizer_params([*self._optimizers, *optimizers], before,
                               dict(module.named_parameters(remove_duplicate=False)))
        return report


def follow_fp16_fallback(precision: object, options: LoadOptions) -> bool:
    """Lightning's ``"bf16-true"`` plugin (Fabric's or the Trainer's ``HalfPrecision``) made ``"16-true"`` in place
    where the load with ``options`` computes in fp16 (its execution device lacks bf16: ``compute_dtype``), so that
    what the plugin does after the load (cast the inputs, the forward's default dtype, the Trainer's conversion of the
    module at setup, after the callback loaded it) agrees with the fp16 weights instead of casting them back or
    feeding them bf16. The plugin's own ``__init__`` sets it, on the object Fabric, the strategy and the Trainer
    share. True when it changed."""
    if type(precision).__name__ != "HalfPrecision" or not type(precision).__module__.startswith("lightning."):
        return False
    if plugin_dtype(precision) is not torch.bfloat16 or options.dtype is not torch.bfloat16:
        return False
    if compute_dtype(options) is not torch.float16:
        return False
    type(precision).__init__(precision, "16-true")
    log.info("bf16 is not supported on %s: the precision plugin is now \"16-true\", as the fp16 weights are",
             execution_device(options, "cpu"))
    return True


class LoaderOwner:
    """What a Lightning strategy holding a :class:`LightningLoader` (as ``self.loader``) shows of it."""

    loader: LightningLoader
    precision: object

    @property
    def options(self) -> LoadOptions:
        """The strategy's load options."""
        return self.loader.options

    @property
    def reports(self) -> list[LoadReport]:
        """Every load's :class:`~lightning_lowmem.LoadReport` (on this rank), the latest last."""
        return self.loader.reports

    @property
    def load_dtype(self) -> torch.dtype | None:
        """The dtype weights are cast to: the ``dtype`` option, else the precision plugin's."""
        return self.loader.dtype(self.precision)


def load_into(
    module: nn.Module,
    checkpoint: str | Path | Checkpoint,
    options: LoadOptions,
    *,
    device: torch.device,
    strict: bool = True,
    init_added: bool = True,
    unfilled: frozenset[str] = frozenset(),
) -> LoadReport:
    """Stream ``checkpoint`` into ``module`` and initialize the parameters the module adds.

    Args:
        module: the module, usually built inside :func:`~lightning_lowmem.init_empty`.
        checkpoint: anything :func:`~lightning_lowmem.load_checkpoint` reads, or an open ``Checkpoint``.
        options: the load's options, dtype and device decided; ``options.strict`` (when set) wins over
            ``strict``; with ``options.max_memory`` the placement decides the devices.
        device: where added parameters are allocated (the strategy's device).
        strict: the call's own strictness.
        init_added: initialize trainable parameters the checkpoint lacks (adapters); False: an error.
        unfilled: parameters that hold memory but no values yet (DTensor shards a strategy allocated):
            counted as on meta.

    Returns:
        The loader's report; ``report.missing`` lists the added parameters that were initialized.

    Raises:
        CheckpointMismatchError: keys do not fit (strict), or shapes differ. Raised before reading data.
        MetaTensorError: a parameter is in neither the checkpoint nor initializable.
    """
    strict = options.strict if options.strict is not None else strict

    def initialize_added(prepared: PreparedLoad) -> None:
        added = _added_parameters(module, prepared.plan, unfilled) if init_added else {}
        prepared.plan.check_keys(strict, allowed_missing=frozenset(added))
        initialized = _initialize(module, added, device, options.dtype)
        if initialized:
            log.info("Initialized %d parameters that are not in %s: %s", len(initialized), prepared.plan.files,
                     format_names(initialized))

    # Lightning's precision plugin casts the whole module (`module.to(dtype)`), so every floating tensor takes the
    # load's dtype: no family's own dtypes (transformers' float32 inv_freq stays for load_checkpoint's face)
    return run_load(module, checkpoint, options, on_plan=initialize_added, family_dtypes=False)


def _added_parameters(module: nn.Module, plan: LoadPlan,
                      unfilled: frozenset[str] = frozenset()) -> dict[str, nn.Module]:
    """Missing, meta (or ``unfilled``), trainable parameters whose owner can initialize them: name -> owner.

    Not those the checkpoint should build from parts it lacks (an HF checkpoint's k_proj for qkv).
    """
    missing = set(plan.missing) - set(plan.absent.values())
    added: dict[str, nn.Module] = {}
    for name, param in module.named_parameters():
        if name not in missing or not (param.is_meta or name in unfilled) or not param.requires_grad:
            continue
        owner, _ = owner_of(module, name)
        prefix = name.rpartition(".")[0]
        own = [(f"{prefix}.{n}" if prefix else n, p) for n, p in owner._parameters.items() if p is not None]
        if callable(getattr(owner, "reset_parameters", None)) and \
                all(n in missing and (p.is_meta or n in unfilled) for n, p in own):
            added[name] = owner
    return added


def _initialize(module: nn.Module, added: dict[str, nn.Module], device: torch.device,
                dtype: torch.dtype | None) -> list[str]:
    """Allocate the added parameters on ``device`` and let their owners initialize them.

    A DTensor parameter (a sharded model) gets this rank's part allocated in place (``allocate_shards``);
    its owner's ``reset_parameters`` then initializes that part.
    """
    owners: dict[int, nn.Module] = {}
    allocate_shards(module, device, names=set(added))
    for name, owner in added.items():
        _, leaf = owner_of(module, name)
        old = owner._parameters[leaf]
        assert old is not None
        owners[id(owner)] = owner
        if is_dtensor(old):
            continue
        cast = dtype if dtype is not None and old.dtype.is_floating_point else old.dtype
        owner._parameters[leaf] = nn.Parameter(torch.empty_like(old, device=device, dtype=cast),
                                               requires_grad=old.requires_grad)
    with torch.no_grad():
        for owner in owners.values():
            owner.reset_parameters()
    return list(added)
