"""``LowMemCallback``: the Trainer builds the model on meta and streams a checkpoint in before the optimizer exists.

The Trainer runs ``Callback.setup`` -> ``LightningModule.configure_model`` -> checkpoint
restore -> ``strategy.setup`` (precision, device, optimizers). The callback wraps
``configure_model`` from ``setup``: the user's hook runs inside
:func:`~lightning_lowmem.init_empty`, and the weights are streamed (and quantized)
into the LightningModule right after it, on the strategy's device.

QLoRA-style fine-tuning works as users expect: quantized weights are frozen, the
parameters the module adds (adapters, heads; see :mod:`lightning_lowmem.lightning.load`)
are initialized and train, and Lightning checkpoints hold only what trains
(``save_frozen=False``): the frozen base comes from ``checkpoint`` again on reload.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_lowmem.arguments import check_flag
from lightning_lowmem.engine import LoadOptions, LoadReport
from lightning_lowmem.errors import CheckpointMismatchError, CheckpointNotFoundError, format_names
from lightning_lowmem.lightning.load import TRAINER_LOG, LightningLoader
from lightning_lowmem.lightning.state import module_to_device_skipping_meta
from lightning_lowmem.memory import format_bytes
from lightning_lowmem.meta import has_meta, init_empty
from lightning_lowmem.quantize import QuantScheme
from lightning_lowmem.runtime import Offload, move_except_offloaded


class LowMemCallback(pl.Callback):
    """Build the LightningModule's model on meta in ``configure_model`` and stream ``checkpoint`` into it.

    Works for ``fit``, ``validate``, ``test`` and ``predict``. Checkpoint keys may be relative to the
    LightningModule (a Lightning ``.ckpt``: ``model.transformer...``) or to the one model it wraps
    (``lit_model.pth``, ``model.safetensors``); ``key_map`` covers the rest.

    Args:
        checkpoint: anything :func:`~lightning_lowmem.load_checkpoint` reads.
        options: :class:`~lightning_lowmem.LoadOptions`; the keyword arguments below override its fields.
            Its ``device`` must be None: the Trainer picks the device (``ValueError`` otherwise).
        dtype: what weights are cast to; default: the Trainer's ``"bf16-true"``/``"16-true"`` dtype, else the
            dtype the model was built with.
        quantize: a scheme (``"bnb.nf4"`` for QLoRA); works on CPU and CUDA.
        load_options: any other :class:`~lightning_lowmem.LoadOptions` field as a keyword: see its attributes.
            ``strict`` (default True) fails on checkpoint keys with no place in the module and on module tensors
            missing from the checkpoint, except the trainable parameters the module adds (they are initialized).
        save_frozen: keep the frozen weights loaded from ``checkpoint`` in Lightning checkpoints.
            Default False: checkpoints hold what trains, and a run restored from one
            (``ckpt_path=...``) gets the frozen weights from ``checkpoint`` again.

    Example (``examples/trainer_finetune.py`` runs one in full)::

        trainer = L.Trainer(callbacks=[LowMemCallback("lit_model.pth", quantize="bnb.nf4")])
        trainer.fit(LitModel())  # LitModel builds self.model in configure_model()
    """

    def __init__(
        self,
        checkpoint: str | Path,
        *,
        options: LoadOptions | None = None,
        dtype: torch.dtype | None = None,
        quantize: str | QuantScheme | None = None,
        save_frozen: bool = False,
        **load_options: Any,
    ) -> None:
        options = LoadOptions.merge(options, type(self), dtype=dtype, quantize=quantize, **load_options)
        check_flag("save_frozen", save_frozen)
        if options.device is not None:
            raise ValueError(
                f"{type(self).__name__} loads onto the Trainer's device (trainer.strategy.root_device), which "
                f"L.Trainer(accelerator=..., devices=...) picks; device={str(options.device)!r} cannot be honoured "
                "here. Drop device= (from the options too), and pick the device on the Trainer.")
        self.checkpoint = checkpoint
        self.loader = LightningLoader(options, logger=TRAINER_LOG, face=type(self).__name__)
        self.save_frozen = save_frozen
        self._loaded: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._frozen: set[str] = set()  # frozen parameters (and quantized modules) that came from `checkpoint`
        self._user_strict_loading = True

    @property
    def options(self) -> LoadOptions:
        """The callback's load options."""
        return self.loader.options

    @property
    def report(self) -> LoadReport | None:
        """The latest load's :class:`~lightning_lowmem.LoadReport` (None before the first)."""
        return self.loader.reports[-1] if self.loader.reports else None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not Path(self.checkpoint).expanduser().exists():  # a wrong path fails now, before anything is built
            raise CheckpointNotFoundError(f"Checkpoint {str(self.checkpoint)!r} does not exist. Check the path.")
        if stage == "fit" and self.options.disk_offload:
            raise ValueError("LowMemCallback(disk_offload=True) reads the layers left in the checkpoint file for each "
                             "forward: that is for trainer.predict, validate and test. trainer.fit cannot train "
                             "through them: raise max_memory so that the model stays in memory (quantize='bnb.nf4' "
                             "makes it 4x smaller), or drop disk_offload.")
        if getattr(pl_module.__dict__.get("configure_model"), "lowmem_callback", None) is self:
            return
        original = pl_module.configure_model

        def configure_model() -> None:
            self._configure_and_load(trainer, pl_module, original)

        configure_model.lowmem_callback = self  # type: ignore[attr-defined]
        pl_module.configure_model = configure_model  # type: ignore[method-assign]
        if not self.save_frozen:
            # Our checkpoints leave out the frozen base; on_load_checkpoint checks the rest strictly.
            self._user_strict_loading = pl_module.strict_loading
            pl_module.strict_loading = False

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if getattr(pl_module.__dict__.get("configure_model"), "lowmem_callback", None) is self:
            del pl_module.configure_model  # back to the class's own hook
            if not self.save_frozen:
                pl_module.strict_loading = self._user_strict_loading

    def _configure_and_load(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                            configure: Callable[[], None]) -> None:
        with init_empty():
            configure()
        if pl_module in self._loaded and not has_meta(pl_module):
            return  # a later stage in the same process: keep what was loaded (and trained)
        if not has_meta(pl_module):
            _warn_allocated(pl_module, self.checkpoint)
        report = self.loader.load(pl_module, self.checkpoint, device=trainer.strategy.root_device,
                                  precision=trainer.precision_plugin)
        self._loaded.add(pl_module)
        if report.offload is not None:
            _keep_offloaded_on_host(trainer.strategy, report.offload)
        missing = set(report.missing)
        self._frozen = {n for n, p in pl_module.named_parameters() if not p.requires_grad and n not in missing}
        self._frozen |= set(report.quantized)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if pl_module is None or not has_meta(pl_module):
            return
        # A load that failed leaves the model on meta, and the Trainer's teardown would now call
        # pl_module.cpu(), which fails on meta and hides the real error. Do the move it wanted for the
        # tensors that have data, and take the module out of the strategy's teardown.
        module_to_device_skipping_meta(pl_module, torch.device("cpu"))
        trainer.strategy._lightning_module = None

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if self.save_frozen or not self._frozen:
            return
        state = checkpoint.get("state_dict", {})
        trainable = {n for n, p in pl_module.named_parameters() if p.requires_grad}
        for key in [k for k in state if k not in trainable and self._is_frozen(k)]:
            del state[key]

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Lightning loaded ``state_dict`` non-strictly; be strict about everything but the frozen base."""
        if self.save_frozen or not self._user_strict_loading or "state_dict" not in checkpoint:
            return
        saved = set(checkpoint["state_dict"])
        expected = set(pl_module.state_dict())
        missing = sorted(k for k in expected - saved if not self._is_frozen(k))
        unexpected = sorted(saved - expected)
        if missing or unexpected:
            raise CheckpointMismatchError(
                f"The Lightning checkpoint being restored does not fit {type(pl_module).__name__} beyond the frozen "
                f"weights LowMemCallback loads from {self.checkpoint}: missing {format_names(missing)}; "
                f"unexpected {format_names(unexpected)}. Restore a checkpoint of this model, or set "
                "strict_loading = False on the LightningModule to load what matches."
            )

    def _is_frozen(self, key: str) -> bool:
        return key in self._frozen or any(key.startswith(name + ".") for name in self._frozen)


def _keep_offloaded_on_host(strategy: pl.strategies.Strategy, offload: Offload) -> None:
    """Make this Trainer's ``strategy.model_to_device()`` (called in its ``setup``) skip the offloaded layers."""
    def model_to_device() -> None:
        assert strategy.model is not None, "model_to_device before the strategy has a model"
        move_except_offloaded(strategy.model, strategy.root_device, offload)

    strategy.model_to_device = model_to_device  # type: ignore[method-assign]  # this instance only


def _warn_allocated(pl_module: pl.LightningModule, checkpoint: str | Path) -> None:
    nbytes = sum(p.numel() * p.element_size() for p in pl_module.parameters())
    rank_zero_warn(
        f"LowMemCallback: {type(pl_module).__name__} already holds {format_bytes(nbytes)} of allocated parameters "
        "when configure_model() ends: the model was built in __init__ (or outside configure_model), so it was "
        f"allocated in full before {checkpoint} is streamed into it. Build it in configure_model() to build it "
        "on the meta device and hold only the loaded weights."
    )
