"""A GGUF file for litgpt's ``GPT``: config, tokenizer and chat template from the file, tensors converted as they stream in.

Two conversions, each the owner's own code, chained per tensor::

    GGUF names, llama.cpp layouts --(transformers: name map, tensor processor)--> HF names and layouts
                                  --(litgpt: copy_weights_*, learned on meta; hf.py)--> litgpt's GPT

* config: transformers' config of the file's metadata (``plan/gguf_config.py``, its counts checked
  against the tensors first); litgpt has no converter from a transformers config, so
  :func:`litgpt_config` fills litgpt's ``Config`` field by field for the families whose HF
  checkpoints litgpt converts as Llama's (llama, mistral, qwen2, qwen3), then looks for litgpt's own
  named config with the same fields (shapes, norms, RoPE): the one whose name shares the most words
  with the file's names (``general.name``, ``general.basename``, ...), or the only one;
* tokenizer: the file's vocabulary through transformers' GGUF converter (``gguf_tokenizer.py``);
* chat template: the file's ``tokenizer.chat_template`` (``chat_template.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.litgpt.hf import HFConversion, hf_to_litgpt
from lightning_lowmem.litgpt.requirement import import_litgpt
from lightning_lowmem.plan import Combine, RowTransform
from lightning_lowmem.plan.gguf import GGUFConversion, gguf_to_transformers
from lightning_lowmem.plan.gguf_config import GROUPS, config_from_parsed, gguf_file_of, gguf_parsed

log = logging.getLogger(__name__)

# transformers model_type -> (litgpt name prefix, which picks litgpt's conversion; fields beyond Llama's)
_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama-gguf", {}),
    "mistral": ("Mistral-gguf", {}),
    "qwen2": ("Qwen2.5-gguf", {"attn_bias": True}),
    "qwen3": ("Qwen3-gguf", {"norm_qk": True}),
}
_NOT_COMPARED = ("name", "hf_config", "padding_multiple", "vocab_size")
"""litgpt config fields a named config may differ in from the file's: names, and the vocabulary before padding
(the model holds ``padded_vocab_size`` rows)."""


@dataclass
class GGUFSource:
    """What a GGUF file says about its model beyond its tensors.

    Attributes:
        hf_config: transformers' config of the file.
        tokenizer: a litgpt ``Tokenizer`` of its vocabulary (a ``GGUFTokenizer``), or None (prompts are then
            token ids).
        names: the model names the file's metadata gives (``general.name``, ...), for litgpt's named configs.
        chat_template: the file's chat template (``tokenizer.chat_template``), or None.
    """

    hf_config: Any
    tokenizer: Any | None
    names: list[str]
    chat_template: str | None = None


def read_gguf_source(checkpoint: Checkpoint, tokenizer: bool = True) -> GGUFSource:
    """Config, names, chat template and (with ``tokenizer``) tokenizer of a GGUF checkpoint, from its header.

    Raises:
        CheckpointFormatError: an architecture transformers does not read, or counts (layers, heads, widths) that
            disagree with the file's tensors.
    """
    file = gguf_file_of(checkpoint)
    parsed = gguf_parsed(checkpoint, GROUPS if tokenizer else ("config",))
    meta = file.fields
    names = [str(meta[k]) for k in ("general.name", "general.basename") if isinstance(meta.get(k), str)]
    parts = [meta.get(k) for k in ("general.basename", "general.size_label", "general.finetune")]
    if all(isinstance(p, str) for p in parts[:2]):
        names.append("-".join(p for p in parts if isinstance(p, str)))
    vocab = None
    if tokenizer:
        from lightning_lowmem.litgpt.gguf_tokenizer import gguf_tokenizer

        vocab = gguf_tokenizer(parsed, meta, file.path)
    template = meta.get("tokenizer.chat_template")
    return GGUFSource(config_from_parsed(parsed), vocab, names, template if isinstance(template, str) else None)


def litgpt_config(hf_config: Any, names: list[str] | tuple[str, ...] = ()) -> Any:
    """litgpt's ``Config`` for a GGUF file's transformers config.

    For llama, mistral, qwen2 and qwen3 files: built field by field, then litgpt's own named config with the
    same fields when there is one (see the module's docstring). For other families: litgpt's config of a name
    in ``names``.

    Raises:
        ValueError: another family and no litgpt name in ``names``, or RoPE scaling litgpt's fields are not filled
            for: pass ``config=``.
    """
    built = _built_config(hf_config)
    if built is None:
        named = next((c for c in map(_config_named, names) if c is not None), None)
        if named is None:
            raise ValueError(
                f"lightning_lowmem builds litgpt configs from GGUF files of {sorted(_FAMILIES)} models; this one is "
                f"{getattr(hf_config, 'model_type', '?')!r} (names in the file: {names or 'none'}). Pass "
                "config=NAME, its litgpt model name such as 'Llama-3.2-1B' (--config NAME).")
        return named
    named = recognised_config(built, names)
    if named is not None:
        log.info("GGUF file: litgpt config %r", named.name)
        return named
    return built


def _config_named(name: str) -> Any | None:
    Config = import_litgpt(needed_by="A GGUF file's litgpt config").Config

    for candidate in (name, name.replace(" ", "-")):
        try:
            return Config.from_name(candidate)
        except ValueError:
            continue
    return None


def recognised_config(built: Any, names: list[str] | tuple[str, ...] = ()) -> Any | None:
    """litgpt's named config that equals ``built`` in every field but the name (norm epsilons to float32
    precision): of several, the one whose name shares the most words with ``names`` (then the fewest others);
    None when none matches, or several do and no name tells them apart."""
    Config = import_litgpt(needed_by="A GGUF file's litgpt config").Config
    configs = import_litgpt("litgpt.config", needed_by="A GGUF file's litgpt config").configs

    same = [c for c in (Config(**d) for d in configs) if _same_fields(c, built)]
    words = {w for name in names for w in _words(name)}
    scored = sorted(((len(_words(c.name) & words), -len(_words(c.name) - words), c.name), c) for c in same)
    if not scored or (scored[-1][0][0] == 0 and len(scored) > 1):
        return None
    return scored[-1][1]


def _words(name: str) -> set[str]:
    return {w for w in re.split(r"[-_ .]+", name.lower()) if w}


def _same_fields(named: Any, built: Any) -> bool:
    for f in dataclasses.fields(built):
        if f.name in _NOT_COMPARED:
            continue
        a, b = getattr(named, f.name), getattr(built, f.name)
        if isinstance(a, float) and isinstance(b, float):
            if not math.isclose(a, b, rel_tol=1e-6):
                return False
        elif a != b:
            return False
    return True


def _built_config(hf: Any) -> Any | None:
    """litgpt's ``Config`` filled from a Llama-like transformers config, or None for another family."""
    Config = import_litgpt(needed_by="A GGUF file's litgpt config").Config

    family = _FAMILIES.get(getattr(hf, "model_type", ""))
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if family is None or rope.get("rope_type", "default") != "default":
        return None
    prefix, extra = family
    head_size = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return Config(
        name=f"{prefix}-{hf.num_hidden_layers}x{hf.hidden_size}", block_size=hf.max_position_embeddings,
        vocab_size=hf.vocab_size, padded_vocab_size=hf.vocab_size, n_layer=hf.num_hidden_layers,
        n_embd=hf.hidden_size, n_head=hf.num_attention_heads, n_query_groups=hf.num_key_value_heads,
        head_size=head_size, intermediate_size=hf.intermediate_size, rotary_percentage=1.0, parallel_residual=False,
        bias=False, norm_class_name="RMSNorm", norm_eps=hf.rms_norm_eps, mlp_class_name="LLaMAMLP",
        rope_base=int(rope.get("rope_theta", getattr(hf, "rope_theta", 10000))), **extra)


@dataclass
class GGUFLitgptConversion:
    """GGUF tensors into litgpt's ``GPT``: transformers' names and processors, then litgpt's own conversion.

    The same faces as :class:`~lightning_lowmem.litgpt.hf.HFConversion` (``key_map``, ``combine``, ``tie``),
    plus ``transform`` for tensors litgpt takes as they are.
    """

    to_hf: GGUFConversion
    to_litgpt: HFConversion

    def __post_init__(self) -> None:
        self._gguf_of = {hf: key for key, hf in self.to_hf.names.items()}
        self._hf_of = self.to_hf.names
        self._renamed = {lit: self._gguf_of[hf] for hf, lit in self.to_litgpt.renames.items() if lit is not None}

    def key_map(self, key: str) -> str | None:
        hf = self.to_hf.key_map(key)
        return None if hf is None else self.to_litgpt.key_map(hf)

    @property
    def combine(self) -> Combine:
        sources = {name: tuple(self._gguf_of[k] for k in keys) for name, keys in self.to_litgpt.sources.items()}
        return Combine(sources, self._combine)

    def _combine(self, name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        hf_parts = {self._hf_of[key]: t if t.is_meta else self.to_hf.process(key, t) for key, t in parts.items()}
        return self.to_litgpt.combine.fn(name, hf_parts)

    @property
    def transform(self) -> RowTransform | None:
        """For the tensors litgpt takes as they are (a block of rows at a time where transformers' processor
        allows); None when the processor changes nothing."""
        return None if self.to_hf.transform is None else RowTransform(self._transform, self._row_block)

    def _transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        key = self._renamed.get(name)
        return tensor if key is None else self.to_hf.process(key, tensor)

    def _row_block(self, name: str) -> int | None:
        key = self._renamed.get(name)
        return 0 if key is None else self.to_hf.key_rows(key)

    def tie(self, module: nn.Module) -> None:
        self.to_litgpt.tie(module)


GGUF_IMPORT_BYTES = 28 * 2**20
"""What learning the conversion imports beyond torch, litgpt and Lightning: transformers' GGUF code and model classes
(and torchao, which those import when it is installed), measured 26.2-26.5 MiB (transformers 5.3, torchao 0.18)."""


def gguf_to_litgpt(config: Any, checkpoint: Checkpoint, hf_config: Any) -> GGUFLitgptConversion:
    """Learn the conversion of a GGUF checkpoint for litgpt ``config``: transformers' GGUF map on a meta-built
    transformers model of ``hf_config``, then litgpt's conversion of the renamed records (headers only)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    to_hf = gguf_to_transformers(checkpoint, hf_model)
    records = {hf: replace(checkpoint.records[key], key=hf) for key, hf in to_hf.names.items()}
    return GGUFLitgptConversion(to_hf, hf_to_litgpt(config, records))
