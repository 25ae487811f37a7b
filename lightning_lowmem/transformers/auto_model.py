"""The transformers model a directory's ``config.json`` describes, built on meta: any model transformers knows, not
only the causal language models litgpt converts (BERT, T5, ViT, ...).

transformers reads the config (``AutoConfig``), the class is the one the config names (``architectures``, as
``save_pretrained`` writes it), else ``AutoModel``'s for the config, and the model is built under the meta device as
``from_pretrained`` builds it before loading: no memory, no random init. ``inspect`` and ``estimate`` plan a load
into it from the checkpoint's headers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lowmem.errors import CheckpointFormatError

log = logging.getLogger(__name__)


def meta_model(directory: Path) -> tuple[nn.Module, str] | None:
    """The model of ``directory/config.json`` on the meta device, and its class name; None without a ``config.json``
    that names a ``model_type`` (a transformers config), or without transformers.

    Raises:
        CheckpointFormatError: ``config.json`` is not a transformers config (no ``model_type`` transformers knows,
            or a value its config class refuses).

    Example::

        >>> import tempfile, transformers
        >>> directory = Path(tempfile.mkdtemp())
        >>> transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        ...                         architectures=["BertModel"]).save_pretrained(directory)
        >>> model, name = meta_model(directory)
        >>> name, next(model.parameters()).device
        ('BertModel', device(type='meta'))
    """
    if not _names_a_model_type(directory / "config.json"):
        return None
    try:
        import transformers
    except ImportError:
        log.info("transformers is not installed: %s/config.json is not read", directory)
        return None
    config = _config(transformers, directory)
    cls = _model_class(transformers, config)
    with torch.device("meta"):
        model = cls._from_config(config)
    return model.eval(), type(model).__name__


def _names_a_model_type(path: Path) -> bool:
    """Whether ``path`` is a JSON object with a ``model_type``, as every config ``save_pretrained`` writes."""
    try:
        with open(path, "rb") as f:
            config = json.loads(f.read(1 << 22))  # a config is a few KiB; a larger file is no config
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("model_type"), str)


def _config(transformers: Any, directory: Path) -> Any:
    """transformers' config of ``directory``, read by ``AutoConfig`` (no remote code is run)."""
    try:
        return transformers.AutoConfig.from_pretrained(directory, trust_remote_code=False)
    except (ValueError, KeyError, TypeError, OSError, json.JSONDecodeError) as e:
        raise CheckpointFormatError(
            f"{directory / 'config.json'} is not a config transformers can read ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:300]}). Fix it, or pass the litgpt config of the model (config=...)."
        ) from e


def _model_class(transformers: Any, config: Any) -> type[nn.Module]:
    """The class the config names (``architectures``, as ``save_pretrained`` writes it), else ``AutoModel``'s."""
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            return cls
    try:
        return transformers.AutoModel._model_mapping[type(config)]
    except KeyError as e:
        raise CheckpointFormatError(
            f"transformers has no model class for {type(config).__name__} (architectures "
            f"{getattr(config, 'architectures', None)!r}). Pass the model's config another way (config=...)."
        ) from e
