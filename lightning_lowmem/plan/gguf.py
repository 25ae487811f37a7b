"""A GGUF file's tensor names and layouts -> transformers', with transformers' own GGUF name map and processors.

llama.cpp's converter renames every tensor (``model.layers.0.self_attn.q_proj.weight`` becomes
``blk.0.attn_q.weight``) and, for some families, rewrites it (Llama's q and k rows permuted for its
RoPE kernel, Gemma's norms stored as ``1 + w``). transformers undoes both when it loads a GGUF file
(``transformers.modeling_gguf_pytorch_utils``); :func:`gguf_to_transformers` asks the same code for
the same answers, once, from the model built on meta:

* names: ``get_gguf_hf_weights_map(model, processor)`` (gguf's tensor-name tables, matched against the
  model's own state-dict keys) gives the key map;
* layouts: the family's entry in ``TENSOR_PROCESSORS`` (``LlamaTensorProcessor`` reverses the Q/K
  permutation), configured from the file's metadata through transformers' ``GGUF_CONFIG_MAPPING``,
  gives the transform, run on each tensor as it is read.

A processor that merges tensors or changes their shapes (Qwen2/3-MoE's experts, GPT-2's transposes and
output head, Mamba, LFM2) cannot run one tensor at a time: those files are refused, naming the family.
Tensors transformers leaves out (``rope_freqs.weight``) are left out too (:attr:`GGUFConversion.skipped`).
The full config and the vocabulary come from transformers' own parser (:func:`gguf_parsed`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_lowmem.errors import CheckpointFormatError, CheckpointMismatchError, format_names
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.formats.gguf_file import GGUFFile

log = logging.getLogger(__name__)

STREAMED_PROCESSORS = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor",
                       "NemotronTensorProcessor", "BloomTensorProcessor")
"""transformers' GGUF tensor processors that rewrite each tensor on its own, keeping its name and shape."""


@dataclass
class GGUFConversion:
    """How a GGUF file's tensors become a transformers model's: names (:meth:`key_map`) and layouts
    (:meth:`transform`), for :func:`~lightning_lowmem.load_checkpoint`.

    Attributes:
        names: GGUF key -> module name.
        processor: transformers' tensor processor for the file's architecture.
        architecture: the file's ``general.architecture``.
        skipped: GGUF keys transformers does not load (left out here too).

    Example (one head of 4 rows, stored in llama.cpp's RoPE order)::

        >>> from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
        >>> heads = LlamaTensorProcessor({"num_attention_heads": 1, "num_key_value_heads": 1})
        >>> conversion = GGUFConversion({"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight"}, heads, "llama")
        >>> conversion.key_map("blk.0.attn_q.weight"), conversion.key_map("rope_freqs.weight")
        ('model.layers.0.self_attn.q_proj.weight', None)
        >>> conversion.transform("model.layers.0.self_attn.q_proj.weight", torch.arange(4.0).reshape(4, 1)).flatten()
        tensor([0., 2., 1., 3.])
    """

    names: dict[str, str]
    processor: Any
    architecture: str
    skipped: list[str] = field(default_factory=list)
    _keys: dict[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._keys = {name: key for key, name in self.names.items()}

    def key_map(self, key: str) -> str | None:
        """For ``load_checkpoint(key_map=...)``: the module name of GGUF key ``key`` (None: left out)."""
        return self.names.get(key)

    @property
    def transform(self) -> Callable[[str, torch.Tensor], torch.Tensor] | None:
        """For ``load_checkpoint(transform=...)``: module tensor ``name`` as read -> as transformers loads it; None
        when transformers' processor for this family changes nothing (then weights can be read by blocks of rows)."""
        return None if type(self.processor).__name__ == "TensorProcessor" else self._transform

    def _transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        key = self._keys.get(name)
        return tensor if key is None else self.process(key, tensor)

    def process(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """GGUF tensor ``key`` through transformers' processor (in float32, as transformers dequantizes);
        the tensor itself when the processor leaves it as it is."""
        weights = tensor.float().numpy()
        try:
            result = self.processor.process(weights=weights, name=key)
        except Exception as e:  # noqa: BLE001  (a processor's own failure, e.g. heads that do not divide the rows)
            raise CheckpointFormatError(
                f"transformers' {type(self.processor).__name__} failed on GGUF tensor {key!r} {list(tensor.shape)}: "
                f"{type(e).__name__}: {e}. The file's metadata does not fit its tensors: convert it again.") from e
        if result.weights is weights:
            return tensor
        if result.name != key or tuple(result.weights.shape) != tuple(tensor.shape):
            raise CheckpointFormatError(
                f"transformers' {type(self.processor).__name__} turns GGUF tensor {key!r} {list(tensor.shape)} into "
                f"{result.name!r} {list(result.weights.shape)}; lightning_lowmem streams only processing that keeps "
                "each tensor's name and shape. Load this file with transformers' from_pretrained(gguf_file=...).")
        return torch.from_numpy(np.ascontiguousarray(result.weights, dtype=np.float32))


def gguf_file_of(checkpoint: Checkpoint) -> GGUFFile:
    """The checkpoint's GGUF file.

    Raises:
        ValueError: the checkpoint is not a GGUF file.
    """
    file = checkpoint.gguf
    if file is None:
        raise ValueError(f"{checkpoint.description} is not a GGUF file; pass a .gguf file.")
    return file


def gguf_to_transformers(checkpoint: str | Path | Checkpoint, model: nn.Module) -> GGUFConversion:
    """transformers' own GGUF name map and tensor processor for loading ``checkpoint`` into ``model``.

    Reads the header only. ``model`` is a transformers ``PreTrainedModel``, usually on meta.

    Usage (``docs/loading.md`` has the whole example)::

        conversion = gguf_to_transformers("model.Q4_0.gguf", model)
        load_checkpoint(model, "model.Q4_0.gguf", key_map=conversion.key_map, transform=conversion.transform)

    Raises:
        TypeError: ``model`` is not a transformers model.
        CheckpointFormatError: transformers processes this family's tensors beyond one at a time.
        CheckpointMismatchError: two GGUF tensors map to one module tensor.
    """
    if not hasattr(getattr(model, "config", None), "model_type"):
        raise TypeError(f"model must be a transformers PreTrainedModel (with .config.model_type), got "
                        f"{type(model).__name__}.")
    if not isinstance(checkpoint, Checkpoint):
        with Checkpoint.open(checkpoint) as ckpt:
            return gguf_to_transformers(ckpt, model)
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    file = gguf_file_of(checkpoint)
    architecture = str(file.fields.get("general.architecture", ""))
    processor = tensor_processor(file)
    records = checkpoint.records
    names = {key: name for key, name in get_gguf_hf_weights_map(model, processor).items() if key in records}
    _check_one_to_one(file, names)
    skipped = [key for key in records if key not in names]
    if skipped:
        log.info("%s: transformers does not load %d GGUF tensors: %s", file.path, len(skipped), format_names(skipped))
    return GGUFConversion(names, processor, architecture, skipped)


def tensor_processor(file: GGUFFile) -> Any:
    """transformers' tensor processor for ``file``'s architecture, configured from the file's metadata as
    transformers configures it (its ``GGUF_CONFIG_MAPPING``).

    Raises:
        CheckpointFormatError: the processor cannot run one tensor at a time (see the module docstring).
    """
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    architecture = str(file.fields.get("general.architecture", ""))
    cls = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    if cls.__name__ not in STREAMED_PROCESSORS:
        raise CheckpointFormatError(
            f"{file.path} is a {architecture!r} GGUF file, whose tensors transformers rebuilds with {cls.__name__} "
            "(merging, transposing or reshaping them), which lightning_lowmem cannot do one tensor at a time. "
            "Load it with transformers' from_pretrained(gguf_file=...).")
    config = {hf: file.fields[f"{architecture}.{key}"] for key, hf in GGUF_CONFIG_MAPPING.get(architecture, {}).items()
              if hf and f"{architecture}.{key}" in file.fields}
    return cls(config=config)


def _check_one_to_one(file: GGUFFile, names: Mapping[str, str]) -> None:
    targets: dict[str, list[str]] = {}
    for key, name in names.items():
        targets.setdefault(name, []).append(key)
    merged = {name: keys for name, keys in targets.items() if len(keys) > 1}
    if merged:
        shown = [f"{name!r} from {format_names(keys)}" for name, keys in merged.items()]
        raise CheckpointMismatchError(
            f"{file.path}: transformers builds {len(merged)} module tensors from several GGUF tensors each "
            f"({format_names(shown, quote=False, sep='; ')}), which lightning_lowmem cannot stream. Load it with "
            "transformers' from_pretrained(gguf_file=...).")


def gguf_parsed(checkpoint: Checkpoint) -> dict[str, Any]:
    """transformers' parse of the GGUF header (``load_gguf_checkpoint(return_tensors=False)``): the ``config``,
    ``tokenizer`` and ``tokenizer_config`` dicts, as ``from_pretrained(gguf_file=...)`` builds them.

    The parse goes through the file's own descriptor, after the header was bounded; it builds Python
    objects for the whole vocabulary (about 1 KB per token or merge: seconds for a 128k vocabulary).
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    file = gguf_file_of(checkpoint)
    with file.handle() as handle:
        try:
            return load_gguf_checkpoint(handle, return_tensors=False)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise CheckpointFormatError(
                f"transformers cannot read the configuration of {file.path} ({type(e).__name__}: {e}). "
                "Check that the model family is one transformers loads from GGUF.") from e


def gguf_config(checkpoint: str | Path | Checkpoint) -> Any:
    """The transformers config of a GGUF file, built from its metadata as ``from_pretrained(gguf_file=...)`` does.

    Raises:
        CheckpointFormatError: transformers does not know the file's architecture.
    """
    if not isinstance(checkpoint, Checkpoint):
        with Checkpoint.open(checkpoint) as ckpt:
            return gguf_config(ckpt)
    return config_from_parsed(gguf_parsed(checkpoint))


def config_from_parsed(parsed: Mapping[str, Any]) -> Any:
    """A transformers config from :func:`gguf_parsed`'s ``config`` dict (``CONFIG_MAPPING[model_type].from_dict``)."""
    from transformers import CONFIG_MAPPING

    config = dict(parsed["config"])
    return CONFIG_MAPPING[config["model_type"]].from_dict(config)
