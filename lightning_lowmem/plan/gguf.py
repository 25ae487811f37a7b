"""A GGUF file's tensor names and layouts -> transformers', with transformers' own GGUF name map and processors.

llama.cpp's converter renames every tensor (``model.layers.0.self_attn.q_proj.weight`` becomes
``blk.0.attn_q.weight``) and, for some families, rewrites it (Llama's q and k rows permuted for its
RoPE kernel, Gemma's norms stored as ``1 + w``). transformers undoes both when it loads a GGUF file
(``transformers.modeling_gguf_pytorch_utils``); :func:`gguf_to_transformers` asks the same code for
the same answers, once, from the model built on meta:

* names: ``get_gguf_hf_weights_map(model, processor)`` (gguf's tensor-name tables, matched against the
  model's own state-dict keys) gives the key map. It walks every submodule and builds gguf's
  ``TensorNameMap`` again for each (397 times, 5.5 s, for a 30-layer Llama): the walk is made with
  that table built once per (architecture, layers);
* layouts: the family's entry in ``TENSOR_PROCESSORS`` (``LlamaTensorProcessor`` reverses the Q/K
  permutation), configured from the file's metadata through transformers' ``GGUF_CONFIG_MAPPING``,
  gives the transform, run on each tensor as it is read. A tensor the processor leaves as it is is
  not given to it; Llama's q and k go to it a block of whole heads at a time (the permutation
  stays inside each head), so they are read, un-permuted and cast by blocks of rows.

A processor that merges tensors or changes their shapes (Qwen2/3-MoE's experts, GPT-2's transposes and
output head, Mamba, LFM2) cannot run one tensor at a time: those files are refused, naming the family.
Tensors transformers leaves out (``rope_freqs.weight``) are left out too (:attr:`GGUFConversion.skipped`).
The config comes from the file's metadata through transformers' tables (``gguf_config.py``).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_lowmem.errors import CheckpointFormatError, CheckpointMismatchError, format_names
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.formats.gguf_file import GGUFFile
from lightning_lowmem.plan.gguf_config import config_from_parsed, gguf_config, gguf_file_of, gguf_parsed
from lightning_lowmem.plan.transform import RowTransform

log = logging.getLogger(__name__)

__all__ = ["GGUFConversion", "config_from_parsed", "gguf_config", "gguf_file_of", "gguf_parsed",
           "gguf_to_transformers", "tensor_processor"]

STREAMED_PROCESSORS = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor",
                       "NemotronTensorProcessor", "BloomTensorProcessor")
"""transformers' GGUF tensor processors that rewrite each tensor on its own, keeping its name and shape."""
HEAD_PERMUTED = {"LlamaTensorProcessor": ((".attn_q.", "num_attention_heads"), (".attn_k.", "num_key_value_heads"))}
"""Processors that permute rows within each head, the tensors they do it to (as the processor tests their names)
and the config field that counts those tensors' heads (for k, transformers uses the key-value heads when they
differ from the query heads)."""
_NAME_MAP_LOCK = threading.Lock()


@dataclass
class GGUFConversion:
    """How a GGUF file's tensors become a transformers model's: names (:meth:`key_map`) and layouts
    (:meth:`transform`), for :func:`~lightning_lowmem.load_checkpoint`.

    Attributes:
        names: GGUF key -> module name.
        processor: transformers' tensor processor for the file's architecture.
        architecture: the file's ``general.architecture``.
        skipped: GGUF keys transformers does not load (left out here too).
        rows: GGUF key -> its rows (dim 0), for the tensors the processor rewrites a head at a time.

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
    rows: dict[str, int] = field(default_factory=dict)
    _keys: dict[str, str] = field(default_factory=dict, repr=False)
    _blocks: dict[str, int | None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._keys = {name: key for key, name in self.names.items()}

    def key_map(self, key: str) -> str | None:
        """For ``load_checkpoint(key_map=...)``: the module name of GGUF key ``key`` (None: left out)."""
        return self.names.get(key)

    @property
    def transform(self) -> RowTransform | None:
        """For ``load_checkpoint(transform=...)``: module tensor ``name`` as read (or a block of its rows, see
        :meth:`row_block`) -> as transformers loads it; None when transformers' processor for this family changes
        nothing."""
        if type(self.processor).__name__ == "TensorProcessor":
            return None
        return RowTransform(self._transform, self.row_block)

    def _transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        key = self._keys.get(name)
        return tensor if key is None else self.process(key, tensor)

    def row_block(self, name: str) -> int | None:
        """For module tensor ``name``: 0 when the processor leaves it as it is, the rows of one head when the
        processor permutes rows within heads, None when it must see the whole tensor."""
        key = self._keys.get(name)
        return 0 if key is None else self.key_rows(key)

    def key_rows(self, key: str) -> int | None:
        """:meth:`row_block` of GGUF tensor ``key`` (asked once per key: the processor is run on an empty tensor)."""
        if key not in self._blocks:
            self._blocks[key] = self._probe(key)
        return self._blocks[key]

    def _probe(self, key: str) -> int | None:
        empty = np.empty((0,), np.float32)
        try:
            if self.processor.process(weights=empty, name=key).weights is empty:
                return 0
        except Exception:  # noqa: BLE001  (a processor that cannot take an empty tensor rewrites across it)
            return None
        heads = self._heads(key)
        return self.rows[key] // heads if heads and key in self.rows and self.rows[key] % heads == 0 else None

    def _heads(self, key: str) -> int | None:
        """The heads the processor permutes ``key``'s rows in (None: not a head-permuting processor or tensor)."""
        for infix, field_name in HEAD_PERMUTED.get(type(self.processor).__name__, ()):
            if infix in key:
                heads = self.processor.config.get(field_name)
                return heads if isinstance(heads, int) and heads > 0 else None
        return None

    def process(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """GGUF tensor ``key`` (or a block of whole heads of its rows) through transformers' processor (in float32,
        as transformers dequantizes); the tensor itself when the processor leaves it as it is."""
        weights = tensor.float().numpy()
        processor = self._processor_for(key, tensor.shape[0] if tensor.dim() else 0)
        try:
            result = processor.process(weights=weights, name=key)
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

    def _processor_for(self, key: str, rows: int) -> Any:
        """The processor, or for a block of ``rows`` rows of a head-permuted tensor, one configured for the heads
        of the block (transformers' own class: a block of whole heads is un-permuted as the whole tensor is)."""
        if rows == self.rows.get(key) or not self.key_rows(key):
            return self.processor
        heads = rows // self.key_rows(key)
        return type(self.processor)(config={"num_attention_heads": heads, "num_key_value_heads": heads})


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
    with _name_map_built_once():
        names = {key: name for key, name in get_gguf_hf_weights_map(model, processor).items() if key in records}
    _check_one_to_one(file, names)
    skipped = [key for key in records if key not in names]
    if skipped:
        log.info("%s: transformers does not load %d GGUF tensors: %s", file.path, len(skipped), format_names(skipped))
    rows = {key: records[key].shape[0] for key in names if records[key].shape}
    return GGUFConversion(names, processor, architecture, skipped, rows)


@contextmanager
def _name_map_built_once() -> Iterator[None]:
    """gguf's ``get_tensor_name_map`` remembered per (architecture, layers) while transformers' name map walks a
    model: it asks for the same table at every submodule. One walk at a time (the function is swapped in gguf's
    namespace, where transformers looks it up), put back after."""
    import gguf

    with _NAME_MAP_LOCK:
        original = gguf.get_tensor_name_map
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
        try:
            yield
        finally:
            gguf.get_tensor_name_map = original


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
