"""The checkpoints litgpt's ``GPT`` reads through a conversion, registered with the engine's resolver.

* an HF checkpoint (``model.safetensors``, ``pytorch_model.bin``, sharded or not, saved quantized or not):
  litgpt's own ``convert_hf_checkpoint`` function for the model, learned on meta (:mod:`.hf`);
* a GGUF file: transformers' GGUF names and tensor processors, then litgpt's conversion (:mod:`.gguf`).

A ``GPT`` held inside another module (a LightningModule's ``self.model``) is converted under its prefix. A
checkpoint that already names its tensors as litgpt does (``lit_model.pth``, a Lightning ``.ckpt`` of the
LightningModule, adapters) needs no conversion: the resolver takes its names as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_lowmem.formats import TensorRecord
from lightning_lowmem.litgpt.gguf import gguf_to_litgpt, read_gguf_source
from lightning_lowmem.litgpt.hf import hf_to_litgpt
from lightning_lowmem.litgpt.rope import is_litgpt_like
from lightning_lowmem.plan.conversions import Conversion, Converter, register_converter, submodule_of, under
from lightning_lowmem.plan.keys import names_fit


def _gpt_in(module: nn.Module) -> tuple[str, nn.Module] | None:
    """``(prefix, gpt)``: the first litgpt ``GPT`` in ``module`` and the prefix of its names, or None."""
    return submodule_of(module, lambda sub: is_litgpt_like(sub) and hasattr(sub, "config"))


class HFToLitgpt(Converter):
    """An HF checkpoint into litgpt's ``GPT``: litgpt's own conversion for the model's config."""

    name = "HF -> litgpt"

    def convert(self, module: nn.Module, records: Mapping[str, TensorRecord], checkpoint: Any) -> Conversion | None:
        found = _gpt_in(module)
        if found is None or getattr(checkpoint, "gguf", None) is not None:
            return None
        prefix, gpt = found
        if names_fit(set(module.state_dict(keep_vars=True)), list(records)):
            return None
        conversion = hf_to_litgpt(gpt.config, records)
        name = f"{self.name} ({conversion.function_name}, litgpt config {gpt.config.name!r})"
        return under(Conversion(name, conversion.key_map, conversion.combine, tie=conversion.tie), prefix)


class GGUFToLitgpt(Converter):
    """A GGUF file into litgpt's ``GPT``: transformers' GGUF names and processors, then litgpt's conversion."""

    name = "GGUF -> transformers -> litgpt"

    def convert(self, module: nn.Module, records: Mapping[str, TensorRecord], checkpoint: Any) -> Conversion | None:
        found = _gpt_in(module)
        if found is None or getattr(checkpoint, "gguf", None) is None:
            return None
        prefix, gpt = found
        conversion = gguf_to_litgpt(gpt.config, checkpoint, read_gguf_source(checkpoint, tokenizer=False).hf_config)
        name = f"{self.name} ({conversion.to_hf.architecture}, litgpt config {gpt.config.name!r})"
        return under(Conversion(name, conversion.key_map, conversion.combine, conversion.transform, conversion.tie),
                     prefix)


HF_TO_LITGPT = register_converter(HFToLitgpt())
GGUF_TO_LITGPT = register_converter(GGUFToLitgpt())
