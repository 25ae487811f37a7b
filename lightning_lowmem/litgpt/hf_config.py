"""The litgpt config of an HF checkpoint directory, told from its ``config.json``.

An HF directory downloaded under any name (``~/models/my-llama``) holds a
``config.json`` but no ``model_config.yaml``. Its litgpt config is found, in order:

1. by name: ``_name_or_path`` (``"meta-llama/Llama-3.2-1B"``, which older transformers
   versions write) through ``litgpt.Config.from_name``, which knows each config's HF
   ``org/name``;
2. by shape: the litgpt configs whose layers, width, heads, key-value groups, vocabulary,
   MLP width, head size and RoPE settings equal what ``config.json`` says of them. Configs that differ only by
   name (a base model and its instruct version) are one architecture: the first is
   taken, with a warning naming the others, since the name picks the prompt style.

Nothing matching is a ``ValueError`` that lists what was tried.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning_lowmem.errors import CheckpointFormatError, format_names
from lightning_lowmem.litgpt.requirement import import_litgpt

# litgpt Config field -> the config.json keys that say it (first found wins; RoPE settings may sit under
# "rope_parameters", where transformers 5 writes them).
_SHAPE_KEYS: dict[str, tuple[str, ...]] = {
    "n_layer": ("num_hidden_layers", "n_layer", "num_layers"),
    "n_embd": ("hidden_size", "n_embd", "d_model"),
    "n_head": ("num_attention_heads", "n_head"),
    "n_query_groups": ("num_key_value_heads", "num_kv_heads"),
    "padded_vocab_size": ("vocab_size",),
    "intermediate_size": ("intermediate_size",),
    "head_size": ("head_dim",),
    "rope_base": ("rope_theta",),
    "rotary_percentage": ("rotary_pct", "partial_rotary_factor"),
}


def read_hf_config(path: Path) -> dict[str, Any]:
    """``config.json`` as a dict.

    Raises:
        CheckpointFormatError: not a JSON object.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointFormatError(f"{path} is not readable JSON ({type(e).__name__}: {e}). Download it again, "
                                    "or pass the litgpt config (config=...).") from e
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{path} holds a {type(data).__name__}, not a JSON object of model settings. "
                                    "Download it again, or pass the litgpt config (config=...).")
    return data


def hf_shape(hf: dict[str, Any]) -> dict[str, int]:
    """What ``config.json`` says of the litgpt fields that fix the weights' shapes and the RoPE.

    Example::

        >>> hf_shape({"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 128})
        {'n_layer': 2, 'n_embd': 32, 'n_head': 4, 'n_query_groups': 4, 'padded_vocab_size': 128}
    """
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    shape = {}
    for field, keys in _SHAPE_KEYS.items():
        values = [source[k] for k in keys for source in (hf, rope) if _is_number(source.get(k))]
        if values:
            shape[field] = values[0]
    if "n_query_groups" not in shape and "n_head" in shape:
        shape["n_query_groups"] = 1 if hf.get("multi_query") is True else shape["n_head"]
    return dict(sorted(shape.items(), key=lambda item: list(_SHAPE_KEYS).index(item[0])))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def config_from_hf_json(path: Path) -> tuple[Any, str]:
    """The litgpt ``Config`` that ``config.json`` at ``path`` describes, and how it was found.

    Raises:
        CheckpointFormatError: the file is not a JSON object.
        ValueError: no litgpt config has its name or its shapes, or configs of different architectures do.
    """
    Config = import_litgpt(needed_by="Finding an HF checkpoint's litgpt config").Config

    hf = read_hf_config(path)
    names = _names(hf)
    for name in names:
        try:
            return Config.from_name(name), f"{path.name}'s _name_or_path {name!r}"
        except ValueError:
            continue
    shape = hf_shape(hf)
    described = ", ".join(f"{k}={v}" for k, v in shape.items())
    tried = (f"the names {format_names(names)}, " if names else "") + f"the shapes ({described})"
    if not {"n_layer", "n_embd", "n_head", "padded_vocab_size"} <= set(shape):
        raise ValueError(f"{path} does not say the model's layers, width, heads and vocabulary ({described or 'none'}), "
                         f"so no litgpt config can be matched to it. Pass the litgpt config (config=... or --config).")
    return _by_shape(shape, path, tried), f"{path.name}'s shapes ({described})"


def _names(hf: dict[str, Any]) -> list[str]:
    """``_name_or_path`` as ``org/name`` and as ``name``, when it is a hub name rather than a local path."""
    value = hf.get("_name_or_path")
    if not isinstance(value, str) or not value.strip() or value.startswith((".", "/", "~")):
        return []
    return list(dict.fromkeys([value, value.rstrip("/").rsplit("/", 1)[-1]]))


def _by_shape(shape: dict[str, int], path: Path, tried: str) -> Any:
    """The litgpt config of ``shape``; several of one architecture: the first, with a warning."""
    litgpt_config = import_litgpt("litgpt.config", needed_by="Finding an HF checkpoint's litgpt config")
    Config, configs = litgpt_config.Config, litgpt_config.configs

    matches = [c for c in (Config(**d) for d in configs) if all(getattr(c, k) == v for k, v in shape.items())]
    groups: dict[str, list[Any]] = {}
    for config in matches:
        groups.setdefault(repr(_architecture(config)), []).append(config)
    if not groups:
        raise ValueError(f"No litgpt config matches {path}: tried {tried}. Pass the litgpt config of the model "
                         "(config=... or --config NAME), or write model_config.yaml beside the weights.")
    if len(groups) > 1:
        raise ValueError(f"{path} matches litgpt configs of different architectures: "
                         f"{format_names(_names_of(matches))}. Pass the one it is (config=... or --config NAME).")
    chosen, *others = next(iter(groups.values()))
    if others:
        warnings.warn(f"{path} matches the litgpt configs {format_names(_names_of([chosen, *others]))}, which differ "
                      f"only by name; using {chosen.name!r}. The name picks the prompt style: pass config=... "
                      "(or --config NAME) to choose another.", stacklevel=3)
    return chosen


def _architecture(config: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(config).items() if k not in ("name", "hf_config")}


def _names_of(configs: Iterable[Any]) -> list[str]:
    return [c.name for c in configs]
