"""A GGUF file's transformers config and tokenizer fields, from lightning_lowmem's own parse of its header.

transformers reads a GGUF header with gguf's ``GGUFReader`` (``load_gguf_checkpoint``), which maps
the whole file and costs about 700 bytes per array element (a vocabulary). The same answers are
built here from the header that ``formats/gguf_header.py`` parsed in one bounded pass, through
transformers' own tables, imported:

* every field is renamed by ``GGUF_TO_TRANSFORMERS_MAPPING`` (``GGUF_CONFIG_MAPPING`` for the config,
  ``GGUF_TOKENIZER_MAPPING`` for the tokenizer and its settings), with the architecture renamed
  as transformers renames it (Mistral files say ``llama``, MoE Qwens ``qwen2moe``, ...);
* then the adjustments ``load_gguf_checkpoint`` makes: Mistral, T5 and UMT5, StableLM's biases and
  residual (from the tensor names), tied embeddings (no ``output.weight``), the defaults of
  ``GGUF_CONFIG_DEFAULTS_MAPPING``, Gemma 3 as ``gemma3_text``, LFM2's key-value heads, and the
  vocabulary size from the token list when the file gives none.

Arrays are turned into Python lists only for the groups asked for: a config needs none (the
vocabulary's size is the length of its array), a tokenizer needs the vocabulary. Before a config is
built, its counts are checked against the file's tensors (``gguf_counts.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_lowmem.errors import CheckpointFormatError
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.formats.gguf_file import GGUFFile
from lightning_lowmem.formats.gguf_metadata import MetadataArray
from lightning_lowmem.plan.gguf_counts import check_counts

GROUPS = ("config", "tokenizer", "tokenizer_config")
"""What transformers' GGUF parser returns besides tensors: the config, the vocabulary, the tokenizer's settings."""
_TIED_ANYWAY = ("falcon", "bloom")  # load_gguf_checkpoint: tied whatever the tensors say


def gguf_file_of(checkpoint: Checkpoint) -> GGUFFile:
    """The checkpoint's GGUF file.

    Raises:
        ValueError: the checkpoint is not a GGUF file.
    """
    file = checkpoint.gguf
    if file is None:
        raise ValueError(f"{checkpoint.description} is not a GGUF file; pass a .gguf file.")
    return file


def gguf_fields(file: GGUFFile, groups: tuple[str, ...] = ("config",)) -> dict[str, dict[str, Any]]:
    """The file's header as transformers' ``load_gguf_checkpoint(return_tensors=False)`` gives it, for ``groups``
    (of :data:`GROUPS`; ``"config"`` is always there).

    Raises:
        CheckpointFormatError: no ``general.architecture``, or one transformers does not read from GGUF.
    """
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    architecture = file.fields.get("general.architecture")
    if not isinstance(architecture, str):
        raise CheckpointFormatError(f"{file.path}: its GGUF header has no general.architecture string (got "
                                    f"{architecture!r}). The file is damaged: download or convert it again.")
    parsed: dict[str, dict[str, Any]] = {group: {} for group in ("config", *groups)}
    renamed = _renamed_architecture(file, architecture, parsed["config"])
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES and renamed not in GGUF_SUPPORTED_ARCHITECTURES:
        raise CheckpointFormatError(
            f"{file.path} is a {architecture!r} GGUF file; transformers reads the configs of "
            f"{sorted(set(GGUF_SUPPORTED_ARCHITECTURES))} from GGUF files, not this one.")
    _columns(file, architecture, renamed, parsed)
    _adjust(file, architecture, renamed, parsed["config"])
    return parsed


def _renamed_architecture(file: GGUFFile, architecture: str, config: dict[str, Any]) -> str:
    """The architecture as transformers names it, and the config fields that come with the renaming."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING

    name = file.fields.get("general.name")
    names = [name] if isinstance(name, str) else []
    renamed = architecture
    if "llama" in architecture and "mistral" in names:  # transformers tests the list, so only the exact name
        renamed = "mistral"
    elif "t5" in architecture:
        config["is_gated_act"] = True
        renamed = "umt5" if names and "umt5" in names[0].lower() else "t5"
        if "t5encoder" in architecture:
            config["architectures"] = ["UMT5EncoderModel" if renamed == "umt5" else "T5EncoderModel"]
    renamed = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}.get(architecture, renamed)
    tensors = [t.name for t in file.layout.tensors]
    if "stablelm" in architecture:
        config["use_qkv_bias"] = any(b in t for t in tensors for b in ("attn_q.bias", "attn_k.bias", "attn_v.bias"))
        config["use_parallel_residual"] = not any("ffn_norm" in t for t in tensors)
    config["tie_word_embeddings"] = "output.weight" not in tensors or architecture in _TIED_ANYWAY
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(renamed, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {})
    for key, value in defaults.items():
        config.setdefault(key, value)
    return renamed


def _columns(file: GGUFFile, architecture: str, renamed: str, parsed: dict[str, dict[str, Any]]) -> None:
    """Every field that transformers' tables rename into one of ``parsed``'s groups, put there."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    fields: dict[str, Any] = {**file.fields, **file.layout.arrays}
    for gguf_key, value in fields.items():
        prefix, _, rest = gguf_key.replace(architecture, renamed).partition(".")
        targets = [(group, GGUF_TO_TRANSFORMERS_MAPPING[group][prefix][rest]) for group in parsed
                   if rest in GGUF_TO_TRANSFORMERS_MAPPING[group].get(prefix, {})]
        targets = [(group, name) for group, name in targets if name not in (None, -1)]
        if not targets:
            continue
        value = _python_value(file, gguf_key, value)
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, renamed)
        for group, name in targets:
            parsed[group][name] = value


def _python_value(file: GGUFFile, key: str, value: Any) -> Any:
    """A field's value as transformers' parser gives it: scalars as they are, arrays as lists (one element: the
    element)."""
    if not isinstance(value, MetadataArray):
        return value
    try:
        values = value.tolist()
    except ValueError as e:
        raise CheckpointFormatError(f"{file.path}: metadata {key!r} is an array of arrays, which lightning_lowmem "
                                    "does not read.") from e
    return values[0] if len(values) == 1 else values


def _adjust(file: GGUFFile, architecture: str, renamed: str, config: dict[str, Any]) -> None:
    """What ``load_gguf_checkpoint`` changes after renaming: Gemma 3's text model, LFM2's heads, the vocab size."""
    if config.get("model_type") == "gemma3":  # the file holds the text backbone only
        config["model_type"] = "gemma3_text"
    if config.get("model_type") == "lfm2":
        heads = config.get("num_key_value_heads")
        heads = heads if isinstance(heads, list) else [heads]
        config["num_key_value_heads"] = max(heads)
        config["block_auto_adjust_ff_dim"] = False
        config["full_attn_idxs"] = [i for i, n in enumerate(heads) if n > 0]
    tokens = file.layout.arrays.get("tokenizer.ggml.tokens")
    if "vocab_size" not in config and tokens is not None:
        config["vocab_size"] = len(tokens)


def gguf_parsed(checkpoint: Checkpoint, groups: tuple[str, ...] = GROUPS) -> dict[str, Any]:
    """The ``config``, ``tokenizer`` and ``tokenizer_config`` dicts of a GGUF file (those of ``groups``), as
    transformers' ``load_gguf_checkpoint(return_tensors=False)`` builds them (the vocabulary as lists), from this
    library's own parse of the header, once the config's counts were checked against the file's tensors.

    Raises:
        CheckpointFormatError: see :func:`gguf_config`.
    """
    file = gguf_file_of(checkpoint)
    parsed = gguf_fields(file, groups)
    check_counts(file)
    return parsed


def gguf_config(checkpoint: str | Path | Checkpoint) -> Any:
    """The transformers config of a GGUF file, built from its metadata as ``from_pretrained(gguf_file=...)``
    builds it, once its counts were checked against its tensors. Reads the header only; decodes no vocabulary.

    Raises:
        CheckpointFormatError: transformers does not know the file's architecture, or the metadata's counts
            (layers, heads, widths) are not numbers or disagree with the file's tensors.
    """
    if not isinstance(checkpoint, Checkpoint):
        with Checkpoint.open(checkpoint) as ckpt:
            return gguf_config(ckpt)
    return config_from_parsed(gguf_parsed(checkpoint, ("config",)))


def config_from_parsed(parsed: dict[str, Any]) -> Any:
    """A transformers config from :func:`gguf_fields`' ``config`` dict (``CONFIG_MAPPING[model_type].from_dict``).

    Raises:
        CheckpointFormatError: transformers has no config class for the model type.
    """
    from transformers import CONFIG_MAPPING

    config = dict(parsed["config"])
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise CheckpointFormatError(f"transformers has no config class for GGUF model type {model_type!r}.")
    return CONFIG_MAPPING[model_type].from_dict(config)
