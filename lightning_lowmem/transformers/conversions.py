"""The checkpoints a transformers model reads through a conversion, registered with the engine's resolver.

* a GGUF file: transformers' own GGUF name map and tensor processor for the model
  (:func:`~lightning_lowmem.plan.gguf.gguf_to_transformers`), as ``from_pretrained(gguf_file=...)`` applies them.

A transformers model held inside another module is converted under its prefix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_lowmem.formats import TensorRecord
from lightning_lowmem.plan.conversions import Conversion, Converter, register_converter, submodule_of, under
from lightning_lowmem.plan.gguf import gguf_to_transformers
from lightning_lowmem.transformers.architecture import is_pretrained_model


def pretrained_in(module: nn.Module) -> tuple[str, nn.Module] | None:
    """``(prefix, model)``: the outermost transformers ``PreTrainedModel`` in ``module`` and its names' prefix."""
    return submodule_of(module, is_pretrained_model)


class GGUFToTransformers(Converter):
    """A GGUF file into a transformers model: transformers' GGUF name map and tensor processor."""

    name = "GGUF -> transformers"

    def convert(self, module: nn.Module, records: Mapping[str, TensorRecord], checkpoint: Any) -> Conversion | None:
        found = pretrained_in(module)
        if found is None or getattr(checkpoint, "gguf", None) is None:
            return None
        prefix, model = found
        conversion = gguf_to_transformers(checkpoint, model)
        name = f"{self.name} ({conversion.architecture}, {type(model).__name__})"
        return under(Conversion(name, conversion.key_map, transform=conversion.transform), prefix)


GGUF_TO_TRANSFORMERS = register_converter(GGUFToTransformers())
