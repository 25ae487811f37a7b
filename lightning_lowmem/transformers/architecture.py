"""What the engine asks of a transformers ``PreTrainedModel``: its buffers rebuilt as ``from_pretrained`` does.

A transformers model built under plain ``torch.device("meta")`` has every buffer on meta,
the non-persistent ones (``position_ids``, ``token_type_ids``, rotary ``inv_freq``) included,
and checkpoints usually do not hold them. ``from_pretrained`` allocates them and runs the
model's own initialisation (``initialize_weights``) with every loaded tensor marked
``_is_hf_initialized``, so that only what was not loaded is initialised. After a load this
does the same. transformers itself is not imported: a module is recognised by the methods
that initialisation uses.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lowmem.dtypes import model_dtype
from lightning_lowmem.placement import Architecture, register_architecture


def is_pretrained_model(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (duck-typed: transformers is not imported)."""
    return (callable(getattr(module, "initialize_weights", None)) and callable(getattr(module, "_init_weights", None))
            and hasattr(getattr(module, "config", None), "model_type"))


class TransformersArchitecture(Architecture):
    """transformers' ``PreTrainedModel`` (or a module holding one): meta buffers from the model's own init."""

    name = "transformers"

    def matches(self, module: nn.Module) -> bool:
        return any(is_pretrained_model(m) for m in module.modules())

    def fills(self, module: nn.Module) -> set[str]:
        return {name for name, buffer in _meta_buffers(module)} | super().fills(module)

    def after_load(self, module: nn.Module, device: torch.device) -> list[str]:
        """Allocate the buffers still on meta, then let each model initialise what was not loaded."""
        rebuilt = []
        for prefix, model in _models(module):
            meta = [(name, owner, leaf) for name, owner, leaf in _meta_in(model)]
            if not meta:
                continue
            for tensor in [*model.parameters(), *model.buffers()]:
                if not tensor.is_meta:
                    tensor._is_hf_initialized = True  # loaded: initialize_weights leaves it alone
            for _, owner, leaf in meta:
                owner._buffers[leaf] = torch.empty_like(owner._buffers[leaf], device=device)
            model.initialize_weights()
            rebuilt += [f"{prefix}.{name}" if prefix else name for name, _, _ in meta]
        return rebuilt + super().after_load(module, device)

    def save_config(self, module: nn.Module, directory: Path, quantization_config: dict[str, Any] | None) -> list[Path]:
        """``config.json`` as ``save_pretrained`` writes it (dtype, architectures and ``quantization_config``
        filled in), for a ``PreTrainedModel`` saved as itself; the model's own config is left as it is."""
        if not is_pretrained_model(module):
            return []
        config = copy.deepcopy(module.config)
        config.dtype = str(model_dtype(module)).removeprefix("torch.")
        config.architectures = [type(module).__name__]
        if quantization_config is not None:
            config.quantization_config = quantization_config
        config.save_pretrained(directory)
        return [directory / "config.json"]

    def build_meta(self, directory: Path) -> tuple[nn.Module, str] | None:
        """The transformers model ``directory/config.json`` describes, built on meta by transformers' own classes
        (:func:`~lightning_lowmem.transformers.auto_model.meta_model`); None without a ``config.json``."""
        from lightning_lowmem.transformers.auto_model import meta_model

        return meta_model(directory)


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
