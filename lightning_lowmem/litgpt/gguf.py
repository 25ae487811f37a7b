"""A GGUF file for litgpt's ``GPT``: config and tokenizer from the file, tensors converted as they stream in.

Two conversions, each the owner's own code, chained per tensor::

    GGUF names, llama.cpp layouts --(transformers: name map, tensor processor)--> HF names and layouts
                                  --(litgpt: copy_weights_*, learned on meta; hf.py)--> litgpt's GPT

* config: transformers builds its config from the file's metadata (``gguf_parsed``); litgpt has no
  converter from a transformers config, so :func:`litgpt_config` takes litgpt's own named config when
  the file names one whose shapes match, else fills litgpt's ``Config`` field by field for the
  families whose HF checkpoints litgpt converts as Llama's (llama, mistral, qwen2, qwen3);
* tokenizer: transformers' GGUF tokenizer converter (``convert_gguf_tokenizer``) builds a ``tokenizers``
  tokenizer from the vocabulary; it is saved, with the file's BOS/EOS tokens, into a temporary
  directory that litgpt's ``Tokenizer`` reads (litgpt's tokenizer is only built from a directory).
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.litgpt.hf import HFConversion, hf_to_litgpt
from lightning_lowmem.litgpt.requirement import import_litgpt
from lightning_lowmem.plan import Combine
from lightning_lowmem.plan.gguf import GGUFConversion, config_from_parsed, gguf_file_of, gguf_parsed, gguf_to_transformers

log = logging.getLogger(__name__)

# transformers model_type -> (litgpt name prefix, which picks litgpt's conversion; fields beyond Llama's)
_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama-gguf", {}),
    "mistral": ("Mistral-gguf", {}),
    "qwen2": ("Qwen2.5-gguf", {"attn_bias": True}),
    "qwen3": ("Qwen3-gguf", {"norm_qk": True}),
}
_SHAPE_FIELDS = ("n_layer", "n_embd", "n_head", "n_query_groups", "head_size", "intermediate_size", "padded_vocab_size")


@dataclass
class GGUFSource:
    """What a GGUF file says about its model beyond its tensors.

    Attributes:
        hf_config: transformers' config of the file.
        tokenizer: a litgpt ``Tokenizer`` of its vocabulary, or None (prompts are then token ids).
        names: the model names the file's metadata gives (``general.name``, ...), for litgpt's named configs.
    """

    hf_config: Any
    tokenizer: Any | None
    names: list[str]


def read_gguf_source(checkpoint: Checkpoint, tokenizer: bool = True) -> GGUFSource:
    """Config and (with ``tokenizer``) tokenizer of a GGUF checkpoint: transformers' parse of its header."""
    file = gguf_file_of(checkpoint)
    parsed = gguf_parsed(checkpoint)
    meta = file.fields
    names = [str(meta[k]) for k in ("general.name", "general.basename") if isinstance(meta.get(k), str)]
    parts = [meta.get(k) for k in ("general.basename", "general.size_label", "general.finetune")]
    if all(isinstance(p, str) for p in parts[:2]):
        names.append("-".join(p for p in parts if isinstance(p, str)))
    vocab = gguf_tokenizer(parsed, meta, file.path) if tokenizer else None
    return GGUFSource(config_from_parsed(parsed), vocab, names)


def litgpt_config(hf_config: Any, names: list[str] | tuple[str, ...] = ()) -> Any:
    """litgpt's ``Config`` for a GGUF file's transformers config.

    litgpt's own config when one of ``names`` is a litgpt model name with the same shapes; else built
    field by field for llama, mistral, qwen2 and qwen3 files.

    Raises:
        ValueError: another family, or RoPE scaling litgpt's fields are not filled for: pass ``config=``.
    """
    Config = import_litgpt(needed_by="A GGUF file's litgpt config").Config

    built = _built_config(hf_config)
    for name in names:
        for candidate in (name, name.replace(" ", "-")):
            try:
                named = Config.from_name(candidate)
            except ValueError:
                continue
            if built is None or all(getattr(named, f) == getattr(built, f) for f in _SHAPE_FIELDS):
                log.info("GGUF file: litgpt config %r", named.name)
                return named
    if built is None:
        raise ValueError(
            f"lightning_lowmem builds litgpt configs from GGUF files of {sorted(_FAMILIES)} models; this one is "
            f"{getattr(hf_config, 'model_type', '?')!r} (names in the file: {names or 'none'}). Pass "
            "config=litgpt.Config.from_name('<litgpt model name>').")
    return built


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


def gguf_tokenizer(parsed: Mapping[str, Any], metadata: Mapping[str, Any], path: Path) -> Any | None:
    """litgpt's ``Tokenizer`` of the file's vocabulary, built by transformers' GGUF converter; None when the file
    has no vocabulary or transformers has no converter for it (a warning says so: prompts are then token ids)."""
    from transformers.integrations.ggml import GGUF_TO_FAST_CONVERTERS, convert_gguf_tokenizer

    vocab = dict(parsed.get("tokenizer") or {})
    model_type = parsed["config"].get("model_type")
    if "tokens" not in vocab or model_type not in GGUF_TO_FAST_CONVERTERS:
        log.warning("%s: no tokenizer (%s); give prompts as token ids.", path,
                    "no vocabulary in the file" if "tokens" not in vocab else f"transformers has none for {model_type!r}")
        return None
    fast, _ = convert_gguf_tokenizer(model_type, vocab)
    spm = vocab.get("tokenizer_type", "llama") == "llama"
    tokens = vocab["tokens"]
    special = {name: tokens[i] for name in ("bos", "eos")
               if isinstance(i := vocab.get(f"{name}_token_id"), int) and 0 <= i < len(tokens)}
    settings = {f"{name}_token": token for name, token in special.items()}
    settings["add_bos_token"] = bool(metadata.get("tokenizer.ggml.add_bos_token", spm))
    settings["tokenizer_class"] = "LlamaTokenizerFast" if spm else "PreTrainedTokenizerFast"
    return _litgpt_tokenizer(fast, settings, path.stem)


def _litgpt_tokenizer(fast: Any, settings: dict[str, Any], name: str) -> Any:
    """litgpt's ``Tokenizer`` over ``fast`` (a ``tokenizers.Tokenizer``), read from a temporary directory."""
    Tokenizer = import_litgpt("litgpt.tokenizer", needed_by="A GGUF file's tokenizer").Tokenizer

    with tempfile.TemporaryDirectory(prefix="lowmem-gguf-tokenizer-") as directory:
        fast.save(str(Path(directory) / "tokenizer.json"))
        (Path(directory) / "tokenizer_config.json").write_text(json.dumps(settings))
        tokenizer = Tokenizer(directory)
    tokenizer.model_name = name
    return tokenizer


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
    def transform(self) -> Any:
        """For the tensors litgpt takes as they are; None when transformers' processor changes nothing."""
        return None if self.to_hf.transform is None else self._transform

    def _transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        key = self._renamed.get(name)
        return tensor if key is None else self.to_hf.process(key, tensor)

    def tie(self, module: nn.Module) -> None:
        self.to_litgpt.tie(module)


def gguf_to_litgpt(config: Any, checkpoint: Checkpoint, hf_config: Any) -> GGUFLitgptConversion:
    """Learn the conversion of a GGUF checkpoint for litgpt ``config``: transformers' GGUF map on a meta-built
    transformers model of ``hf_config``, then litgpt's conversion of the renamed records (headers only)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    to_hf = gguf_to_transformers(checkpoint, hf_model)
    records = {hf: replace(checkpoint.records[key], key=hf) for key, hf in to_hf.names.items()}
    return GGUFLitgptConversion(to_hf, hf_to_litgpt(config, records))
