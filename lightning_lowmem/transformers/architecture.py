"""What the engine asks of a transformers ``PreTrainedModel``: its buffers rebuilt as ``from_pretrained`` does.

A transformers model built under plain ``torch.device("meta")`` has every buffer on meta,
the non-persistent ones (``position_ids``, ``token_type_ids``, rotary ``inv_freq``) included,
and checkpoints usually do not hold them. They are rebuilt after a load as ``from_pretrained`` of the
installed release makes them:

* transformers 5 builds its model on meta, allocates those buffers and runs the model's own initialisation
  (``initialize_weights``) with every loaded tensor marked ``_is_hf_initialized``, so that only what was not
  loaded is initialised; the same is done here.
* transformers 4 builds its model with real buffers, computed by the model's ``__init__`` (its initialisation
  does not compute them: run on meta buffers, it leaves them uninitialised memory); here the model's class is
  built again with its parameters on meta and its buffers taken from it.

transformers itself is not imported: a module is recognised by the methods its initialisation uses.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lowmem.dtypes import model_dtype
from lightning_lowmem.placement import Architecture, register_architecture
from lightning_lowmem.transformers.keep_fp32 import float32_rule
from lightning_lowmem.transformers.release import at_least, spelled

log = logging.getLogger(__name__)


def is_pretrained_model(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (duck-typed: transformers is not imported; what
    every release from 4.46 has: ``post_init``, ``_init_weights`` and a config with a ``model_type``)."""
    return (callable(getattr(module, "post_init", None)) and callable(getattr(module, "_init_weights", None))
            and hasattr(getattr(module, "config", None), "model_type"))


class TransformersArchitecture(Architecture):
    """transformers' ``PreTrainedModel`` (or a module holding one): meta buffers from the model's own init."""

    name = "transformers"

    def matches(self, module: nn.Module) -> bool:
        return any(is_pretrained_model(m) for m in module.modules())

    def fills(self, module: nn.Module) -> set[str]:
        return {name for name, buffer in _meta_buffers(module)} | super().fills(module)

    def after_load(self, module: nn.Module, device: torch.device, dtypes: Mapping[str, torch.dtype] | None = None) \
            -> list[str]:
        """Allocate the buffers still on meta, each in the dtype it ends in (``dtypes``; the model's init computes
        into it, as ``from_pretrained``'s does), then let each model initialise what was not loaded."""
        rebuilt = []
        for prefix, model in _models(module):
            meta = [(_joined(prefix, name), owner, leaf) for name, owner, leaf in _meta_in(model)]
            if not meta:
                continue
            wanted = [(owner, leaf, (dtypes or {}).get(name, owner._buffers[leaf].dtype)) for name, owner, leaf in meta]
            if at_least(5):
                _initialized(model, wanted, device)
            else:
                _constructed(model, wanted, device)
            rebuilt += [name for name, _, _ in meta]
        return rebuilt + super().after_load(module, device, dtypes)

    def load_dtypes(self, module: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
        """What ``from_pretrained(dtype=dtype)`` keeps in another dtype: the tensors its model class builds in another
        dtype under that default dtype (RoPE ``inv_freq``: float32) and those its keep-in-fp32 rules name
        (``_keep_in_fp32_modules`` under float16, ``_keep_in_fp32_modules_strict`` under float16 and bfloat16)."""
        found: dict[str, torch.dtype] = {}
        for prefix, model in _models(module):
            found.update({_joined(prefix, name): kept for name, kept in pretrained_dtypes(model, dtype).items()
                          if kept != dtype})
        return found

    def save_config(self, module: nn.Module, directory: Path, quantization_config: dict[str, Any] | None) -> list[Path]:
        """``config.json`` as ``save_pretrained`` writes it (dtype, architectures and ``quantization_config``
        filled in), for a ``PreTrainedModel`` saved as itself; the model's own config is left as it is."""
        if not is_pretrained_model(module):
            return []
        config = copy.deepcopy(module.config)
        # transformers < 4.56 keeps the dtype as ``torch_dtype``; later releases as ``dtype``
        setattr(config, "torch_dtype" if "torch_dtype" in vars(config) else "dtype",
                str(model_dtype(module)).removeprefix("torch."))
        config.architectures = [type(module).__name__]
        if quantization_config is not None:
            config.quantization_config = quantization_config
            _warn_unreadable(quantization_config)
        config.save_pretrained(directory)
        return [directory / "config.json"]

    def build_meta(self, directory: Path) -> tuple[nn.Module, str] | None:
        """The transformers model ``directory/config.json`` describes, built on meta by transformers' own classes
        (:func:`~lightning_lowmem.transformers.auto_model.meta_model`); None without a ``config.json``."""
        from lightning_lowmem.transformers.auto_model import meta_model

        return meta_model(directory)


def _warn_unreadable(quantization_config: Mapping[str, Any]) -> None:
    """Warn when the installed transformers cannot read a save of this quantization: transformers 4 reads torchao's
    int8 weights only from a pickle (``pytorch_model.bin``), never from safetensors."""
    if quantization_config.get("quant_method") == "torchao" and not at_least(5):
        warnings.warn(
            f"transformers {spelled()} (installed) reads torchao weights only from a pickled pytorch_model.bin, so its "
            "from_pretrained cannot load this save (safetensors, as transformers >= 5 writes torchao weights): it "
            "fails, or leaves the quantized Linears initialised at random with a warning (4.53). "
            "lightning_lowmem's load_checkpoint and transformers >= 5 load it; with transformers 4, quantize the "
            "full-precision checkpoint as you load it instead (TorchAoConfig, or load_checkpoint(quantize=...)).",
            UserWarning, stacklevel=4)


def pretrained_dtypes(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype of each floating tensor of ``model`` (a ``PreTrainedModel``) after ``type(model).from_pretrained(...,
    dtype=dtype)``, as its loader decides it, from a model of the same class and config built on meta:

    * built under ``dtype`` as the default dtype, with ``dtype`` set on its config and sub-configs (``from_pretrained``
      builds it so, whatever ``torch_dtype`` the config held): a tensor its ``__init__`` makes in another dtype keeps
      it (loaded into it, or computed into it by its init);
    * a parameter or persistent buffer the model's dtype plan names (its keep-in-fp32 modules, matched as
      transformers matches them) is float32.

    A model that cannot be built again from its config alone: every tensor in ``dtype`` (logged).
    """
    try:
        with torch.device("meta"), default_dtype(dtype):
            built = type(model)(config_as_loaded(model.config, dtype))
    except Exception as e:  # noqa: BLE001  (any model's __init__: its own errors)
        log.warning("%s could not be built again on meta to learn the dtypes from_pretrained gives its tensors "
                    "(%s: %s); every floating tensor is loaded in %s.", type(model).__name__, type(e).__name__, e,
                    dtype)
        return {}
    planned = float32_rule(built, dtype)
    loaded = set(built.state_dict(keep_vars=True))
    tensors = [*built.named_parameters(remove_duplicate=False), *built.named_buffers(remove_duplicate=False)]
    return {name: (planned(name) if name in loaded else None) or tensor.dtype
            for name, tensor in tensors if tensor.is_floating_point()}


def config_as_loaded(config: Any, dtype: torch.dtype) -> Any:
    """A copy of ``config`` as ``from_pretrained(..., dtype=dtype)`` hands it to the model's ``__init__``: ``dtype`` set
    on it and on each of its sub-configs (transformers' ``_get_dtype``), so that a sub-model built from a sub-config
    that said ``torch_dtype="float32"`` is built in ``dtype``, as it is there."""
    config = copy.deepcopy(config)
    field = "dtype" if at_least(5) else "torch_dtype"  # 4.x reads torch_dtype
    for part in [config, *(getattr(config, key, None) for key in getattr(config, "sub_configs", {}))]:
        if part is not None:
            setattr(part, field, dtype)
    return config


def _initialized(model: nn.Module, wanted: list[tuple[nn.Module, str, torch.dtype]], device: torch.device) -> None:
    """transformers 5: each wanted buffer allocated in its dtype, then computed by the model's own initialisation,
    which leaves every loaded tensor alone."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if not tensor.is_meta:
            tensor._is_hf_initialized = True  # loaded: initialize_weights leaves it alone
    for owner, leaf, dtype in wanted:
        owner._buffers[leaf] = torch.empty_like(owner._buffers[leaf], device=device, dtype=dtype)
    model.initialize_weights()


def _constructed(model: nn.Module, wanted: list[tuple[nn.Module, str, torch.dtype]], device: torch.device) -> None:
    """transformers 4: each wanted buffer as the model's ``__init__`` computes it, under the model's dtype as the
    default dtype (``from_pretrained`` builds its model so), from the same class built again with its parameters
    on meta, then moved and cast as ``wanted`` says."""
    from lightning_lowmem.meta import init_empty

    computed_in = model_dtype(model)
    try:
        with init_empty(), default_dtype(computed_in):
            built = type(model)(config_as_loaded(model.config, computed_in))
    except Exception as e:  # noqa: BLE001  (any model's __init__: its own errors)
        log.warning("%s could not be built again from its config to compute its buffers (%s: %s); they stay on meta.",
                    type(model).__name__, type(e).__name__, e)
        return  # the load's check names what is left on meta
    modules = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    for owner, leaf, dtype in wanted:
        value = built.get_buffer(_joined(modules[id(owner)], leaf))
        owner._buffers[leaf] = value.to(device=device, dtype=dtype)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``torch.get_default_dtype()`` is ``dtype`` in the block (as ``from_pretrained`` builds its model)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost ``PreTrainedModel`` s in ``module`` (a composite model initialises its sub-models)."""
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if is_pretrained_model(sub) and not any(name.startswith(f"{outer}.") or not outer for outer, _ in found):
            found.append((name, sub))
    return found


def _meta_in(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(name, owner, leaf)`` of each buffer of ``model`` on meta."""
    return [(f"{mod_name}.{leaf}" if mod_name else leaf, mod, leaf)
            for mod_name, mod in model.named_modules() for leaf, b in mod._buffers.items()
            if b is not None and b.is_meta]


def _meta_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The meta buffers of the transformers models in ``module``, under their names in ``module``."""
    return [(f"{prefix}.{name}" if prefix else name, owner._buffers[leaf])
            for prefix, model in _models(module) for name, owner, leaf in _meta_in(model)]


TRANSFORMERS = register_architecture(TransformersArchitecture())
