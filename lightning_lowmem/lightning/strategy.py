"""``LowMemStrategy``: a single-device Fabric strategy that builds on meta and streams checkpoints in.

::

    fabric = L.Fabric(strategy="lowmem", precision="bf16-true")   # or strategy=LowMemStrategy(quantize="bnb.nf4")
    with fabric.init_module():                 # parameters on meta: zero bytes
        model = GPT(config)
    fabric.load_raw("lit_model.pth", model)    # read, cast, (quantize) one tensor at a time
    model = fabric.setup(model)

Where Lightning's single-device strategy would allocate the model in ``init_module``,
``torch.load`` the whole file and copy it with ``load_state_dict``, this one holds the
final model plus one tensor in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import SingleDeviceStrategy
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _DEVICE, _PATH
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_lowmem.devices import indexed
from lightning_lowmem.engine import LoadOptions, LoadReport, opened
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.saving import module_state
from lightning_lowmem.saving.atomic_file import replace_file
from lightning_lowmem.lightning.load import FABRIC_LOG, LightningLoader, LoaderOwner
from lightning_lowmem.lightning.state import (
    module_to_device_skipping_meta,
    other_entries,
    restore_entries,
    weights_key,
)
from lightning_lowmem.meta import check_meta_at_first_forward, init_empty
from lightning_lowmem.quantize import QuantScheme, scheme_of


_META_ADVICE = ("Load its weights before the first forward (fabric.load_raw(path, model) or fabric.load), or, for "
                "a fresh run without a checkpoint, build it with fabric.init_module(empty_init=False): "
                "strategy='lowmem' builds parameters on the meta device by default.")


class LowMemStrategy(LoaderOwner, SingleDeviceStrategy):
    """Fabric on one device, with models built on meta and checkpoints streamed (and quantized) in.

    * ``fabric.init_module()`` (and ``empty_init=True``) builds parameters on the meta device; buffers computed
      in ``__init__`` (RoPE tables, masks) stay real. ``fabric.init_module(empty_init=False)`` builds real,
      initialised parameters as Lightning does, for a fresh run. ``fabric.init_tensor()`` is unchanged.
    * A model still on meta at its first forward raises :class:`~lightning_lowmem.MetaTensorError` naming the
      tensors and what to do.
    * ``fabric.setup(model)`` accepts a model still on meta; the weights can be loaded before or after.
    * ``fabric.load_raw(path, model)`` and ``fabric.load(path, {"model": model, ...})`` stream the model's
      tensors through :func:`~lightning_lowmem.load_checkpoint`; the other entries (optimizer state, counters)
      load as in Lightning, and optimizers set up on the meta parameters are pointed at the loaded ones.
    * Trainable parameters the model adds beyond the checkpoint (LoRA adapters, new heads) are
      initialized, even with ``strict=True`` (see :mod:`lightning_lowmem.lightning.load`); anything else
      missing or unexpected fails under ``strict=True`` before a byte of weights is read.
    * The checkpoint is opened once: its headers give the plan and, for ``fabric.load``, the other
      entries (optimizer state, counters) without reading the weights; then the weights are read.
      The weights' entry is not returned in ``fabric.load``'s remainder.
    * ``fabric.save(path, {"model": model, ...})`` of a model holding quantized layers writes the model's entry
      as :func:`~lightning_lowmem.save_checkpoint` writes its tensors (the layout transformers saves, not
      dequantized) and the safetensors metadata as a dict under ``"__metadata__"``, in one ``torch.save``
      file as Lightning writes it; ``fabric.load`` reads the quantized weights back as stored.
    * ``fabric.save(path, ...)`` writes the file whole: a new file beside ``path`` (never through a link),
      fsynced, then renamed over it (see :meth:`save_checkpoint`).

    Args:
        device: the device; default: ``options.device``, else the one Fabric's ``accelerator``/``devices``
            flags choose.
        accelerator, checkpoint_io, precision: as for Lightning's ``SingleDeviceStrategy``.
        options: :class:`~lightning_lowmem.LoadOptions`; the keyword arguments below override its fields.
        dtype: what weights are cast to; default: the precision plugin's dtype for
            ``"bf16-true"``/``"16-true"``/``"64-true"``, else the dtype the model was built with.
        quantize: a scheme (``"bnb.nf4"``); works on CPU and CUDA, unlike ``BitsandbytesPrecision``.
        init_added: initialize trainable parameters the checkpoint lacks (LoRA adapters); False for
            inference, where anything the checkpoint lacks is an error.
        load_options: any other :class:`~lightning_lowmem.LoadOptions` field as a keyword: see its attributes.
            ``strict`` None (the default) lets each ``load``/``load_raw`` call's ``strict`` decide. With
            ``disk_offload``, the layers left in the checkpoint file are read for each forward (inference only:
            setting up an optimizer raises; run forwards under ``torch.no_grad()``); ``strategy.reports[-1].disk``
            holds them and the open file.

    Example::

        >>> import lightning as L
        >>> import lightning_lowmem  # registers strategy="lowmem"
        >>> fabric = L.Fabric(accelerator="cpu", strategy="lowmem", precision="bf16-true")
        >>> with fabric.init_module():
        ...     layer = torch.nn.Linear(4096, 4096)
        >>> layer.weight.device
        device(type='meta')
    """

    strategy_name = "lowmem"

    def __init__(
        self,
        device: _DEVICE | None = None,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        *,
        options: LoadOptions | None = None,
        dtype: torch.dtype | None = None,
        quantize: str | QuantScheme | None = None,
        init_added: bool = True,
        **load_options: Any,
    ) -> None:
        options = LoadOptions.merge(options, type(self), dtype=dtype, quantize=quantize, **load_options)
        device = device if device is not None else options.device
        device = indexed(device) if device is not None else None
        super().__init__(device=device or "cpu", accelerator=accelerator, checkpoint_io=checkpoint_io,
                         precision=precision)
        self.loader = LightningLoader(options, init_added=init_added, logger=FABRIC_LOG, face=type(self).__name__)
        self._parallel_devices: list[torch.device] | None = [torch.device(device)] if device is not None else None

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The device list Fabric's connector fills in when the strategy comes from the registry."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if devices and len(devices) > 1:
            raise ValueError(
                f"LowMemStrategy runs on one device, but Fabric was asked for {len(devices)}: {devices}. "
                "Pass devices=1 (and e.g. accelerator='cuda' or devices=[2] to pick one)."
            )
        self._parallel_devices = devices

    @property
    @override
    def root_device(self) -> torch.device:
        return self._parallel_devices[0] if self._parallel_devices else self._root_device

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        if empty_init is False:  # real, initialised parameters, as Lightning builds them (a fresh run)
            return super().module_init_context(empty_init=False)
        # None (the default) and True: parameters on meta, no memory and no init; they come from a checkpoint
        stack = ExitStack()
        stack.enter_context(self.root_device)  # buffers built in __init__ go straight to the device
        stack.enter_context(self.precision.module_init_context())
        stack.enter_context(init_empty())
        return stack

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        check_meta_at_first_forward(module, _META_ADVICE)
        return super().setup_module(module)

    @override
    def module_to_device(self, module: nn.Module) -> None:
        module_to_device_skipping_meta(module, self.root_device)

    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """A model holding quantized layers: the tensors :func:`~lightning_lowmem.save_checkpoint` writes, and its
        metadata (str -> str) under ``"__metadata__"``; any other model: Lightning's ``state_dict()``."""
        if not any(scheme_of(m) is not None for m in module.modules()):
            return super().get_module_state_dict(module)
        state = module_state(module)
        return {**state.materialized(), "__metadata__": state.metadata}

    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, nn.Module | Optimizer | Any],
                        storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """``fabric.save``: the checkpoint Lightning makes, written as a new temporary file beside ``path``
        (``O_EXCL | O_NOFOLLOW``), fsynced, renamed over ``path`` and the directory fsynced: a kill leaves the old
        file or the new one, a link at ``path`` is replaced (its target is left as it was), and a full disk is a
        :class:`~lightning_lowmem.SaveError` naming the file. Lightning's own writer puts its temporary file in
        the system's temporary directory and, when that is another file system, copies it over ``path``
        through any link there. Another ``CheckpointIO``, ``storage_options`` or a URL: Lightning's writer."""
        if storage_options is not None or type(self.checkpoint_io) is not TorchCheckpointIO or "://" in str(path):
            super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)
            return
        state = self._convert_stateful_objects_in_state(state, filter=filter or {})
        if self.is_global_zero:
            replace_file(Path(path), lambda f: torch.save(state, f))

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self.loader.track(optimizer)  # re-pointed at the loaded parameters by load_checkpoint; refused with disk_offload
        return super().setup_optimizer(optimizer)

    @override
    def load_checkpoint(
        self,
        path: str | Path | Checkpoint,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if isinstance(state, nn.Module):
            self._stream(path, state, strict=strict)
            return {}
        if not state or isinstance(state, Optimizer):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        return self._load_state(path, state, strict=strict, weights_only=weights_only)

    def _load_state(self, path: str | Path | Checkpoint, state: dict[str, Any], strict: bool,
                    weights_only: bool | None) -> dict[str, Any]:
        """``fabric.load(path, {...})``: stream the model's entry, restore the others as Lightning does."""
        with ExitStack() as stack:  # opened once: headers, other entries, then the weights
            module = next((v for v in state.values() if isinstance(v, nn.Module)), None)  # the entry that fits it
            ckpt = stack.enter_context(opened(path, module, prefer=self.options.prefer, entry=self.options.entry,
                                              verify=self.options.verify_weight_sets))
            rest = other_entries(ckpt, state, weights_only)
            key = weights_key(ckpt, state)
            _validate_keys_for_strict_loading(state.keys(), [*rest, *([key] if key else [])], strict=strict)
            if key is not None:
                report = self._stream(ckpt, state[key], strict=strict,
                                      optimizers=[v for v in state.values() if isinstance(v, Optimizer)])
                if report.disk is not None:
                    report.disk.own(stack.pop_all())  # layers on disk read from it while the model lives
        return restore_entries(state, rest, key, strict)

    def _stream(self, path: str | Path | Checkpoint, module: nn.Module, strict: bool,
                optimizers: list[Optimizer] = ()) -> LoadReport:
        return self.loader.load(module, path, device=self.root_device, precision=self.precision, strict=strict,
                                optimizers=optimizers)
