"""A litgpt config's counts and widths checked against a checkpoint's tensors, before a model is built from it.

A model is built on meta from the config before the load's plan compares it with the file, and building
costs Python objects per layer and per expert: a ``model_config.yaml`` saying ``n_layer: 100000000``
beside a one-layer checkpoint made ``inspect`` run for minutes past 1.9 GiB. The counts are therefore
compared first, from the records alone (in well under a second): the number of blocks (distinct ``N`` in
litgpt's ``transformer.h.N.`` or HF's ``model.layers.N.`` / ``gpt_neox.layers.N.``; in any layout, at most
one block per tensor), the experts per block, the embedding's shape, and the attention widths that follow
from ``n_head``, ``n_query_groups`` and ``head_size``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from lightning_lowmem.errors import CheckpointMismatchError, UnsafeCheckpointError, format_names
from lightning_lowmem.formats import TensorRecord

_BLOCK = re.compile(r"^(transformer\.h|model\.layers|gpt_neox\.layers)\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_EMBEDDINGS = ("transformer.wte.weight", "model.embed_tokens.weight", "gpt_neox.embed_in.weight")
NORM_CLASSES = ("LayerNorm", "RMSNorm")
"""The ``norm_class_name`` values litgpt's configs use (litgpt's ``RMSNorm``, ``torch.nn.LayerNorm``)."""


def check_class_names(config: Any, path: Any) -> None:
    """Raise unless the class names of ``config``, read from the file ``path``, are among litgpt's own: an MLP class
    of ``litgpt.model`` (``LLaMAMLP``, ``GptNeoxMLP``, ``GemmaMLP``, ``LLaMAMoE``) and a norm of :data:`NORM_CLASSES`.

    Raises:
        UnsafeCheckpointError: naming the file, the key and the value; nothing it names was looked up or called.

    Example::

        >>> from litgpt import Config
        >>> check_class_names(Config(mlp_class_name="LLaMAMLP", intermediate_size=64), "model_config.yaml")
        >>> try:
        ...     check_class_names(Config(mlp_class_name="GPT", intermediate_size=64), "model_config.yaml")
        ... except UnsafeCheckpointError as e:
        ...     print(str(e).partition(",")[0])
        model_config.yaml names mlp_class_name: 'GPT'
    """
    known = {"mlp_class_name": mlp_classes(), "norm_class_name": NORM_CLASSES}
    for key, names in known.items():
        value = getattr(config, key)
        if value not in names:
            raise UnsafeCheckpointError(
                f"{path} names {key}: {value!r}, which is none of litgpt's classes for it ({format_names(names)}); "
                "litgpt would look that name up and call it while building the model, so no model was built. Use "
                "the config the checkpoint was saved with, or pass the config another way (--config NAME, or "
                "config=litgpt.Config.from_name(NAME)).")


def mlp_classes() -> tuple[str, ...]:
    """The MLP classes of ``litgpt.model`` a config may name (its ``nn.Module`` classes named ``...MLP``/``...MoE``)."""
    from torch import nn

    from lightning_lowmem.litgpt.requirement import import_litgpt

    model = import_litgpt("litgpt.model", needed_by="Checking a litgpt config's class names")
    return tuple(sorted(name for name, value in vars(model).items()
                        if isinstance(value, type) and issubclass(value, nn.Module)
                        and value.__module__ == model.__name__ and name.endswith(("MLP", "MoE"))))


def check_config_fits(config: Any, records: Mapping[str, TensorRecord], files: str = "the checkpoint") -> None:
    """Raise when litgpt's ``config`` contradicts the tensors ``records`` describe, before a model is built.

    Args:
        config: a litgpt ``Config``.
        records: the checkpoint's tensor records (litgpt's or HF's names).
        files: the checkpoint's files, for the message.

    Raises:
        CheckpointMismatchError: naming the config key, its value and what the tensors say.

    Example::

        >>> import torch
        >>> from pathlib import Path
        >>> from litgpt import Config
        >>> records = {"transformer.h.0.attn.proj.weight": TensorRecord("transformer.h.0.attn.proj.weight",
        ...            (32, 32), torch.float32, Path("lit_model.pth"))}
        >>> check_config_fits(Config(n_layer=1, n_embd=32, n_head=4), records)
        >>> try:
        ...     check_config_fits(Config(n_layer=100_000_000, n_embd=32, n_head=4), records)
        ... except CheckpointMismatchError as e:
        ...     print(str(e).partition(";")[0])
        The litgpt config says n_layer: 100000000, but the checkpoint's tensors hold 1 block (transformer.h.0)
    """
    seen: list[tuple[str, str, object, str]] = []  # (config key, value, what the tensors say)
    blocks: dict[str, set[int]] = {}
    experts: set[int] = set()
    for key in records:
        found = _BLOCK.match(key)
        if found:
            blocks.setdefault(found.group(1), set()).add(int(found.group(2)))
            expert = _EXPERT.search(key, found.end() - 1)
            if expert:
                experts.add(int(expert.group(1)))
    seen += _layer_counts(config, blocks, len(records))
    if experts and getattr(config, "n_expert", 0) != len(experts):
        seen.append(("n_expert", getattr(config, "n_expert", 0), f"{len(experts)} experts per block"))
    seen += _widths(config, records)
    if seen:
        key, value, says = seen[0]
        others = list(dict.fromkeys(k for k, _, _ in seen[1:] if k != key))  # each key once
        more = f" (the tensors contradict {', '.join(others)} too)" if others else ""
        raise CheckpointMismatchError(
            f"The litgpt config says {key}: {value}, but the checkpoint's tensors hold {says}{more}; {files} is for "
            "another model configuration, and no model was built. Use the config the checkpoint was saved with "
            "(its model_config.yaml, or --config NAME).")


def _layer_counts(config: Any, blocks: dict[str, set[int]], tensors: int) -> list[tuple[str, object, str]]:
    n_layer = config.n_layer
    if blocks:
        prefix, indices = max(blocks.items(), key=lambda item: len(item[1]))
        if n_layer != len(indices) or max(indices) != len(indices) - 1:
            span = f"{prefix}.{min(indices)}" + (f" ... {prefix}.{max(indices)}" if len(indices) > 1 else "")
            return [("n_layer", n_layer, f"{len(indices)} block{'s' * (len(indices) != 1)} ({span})")]
    elif n_layer > tensors:  # every block holds at least one tensor, whatever the names
        return [("n_layer", n_layer, f"{tensors} tensors in all, fewer than one per block")]
    return []


def _widths(config: Any, records: Mapping[str, TensorRecord]) -> list[tuple[str, object, str]]:
    """The embedding's and the first block's attention shapes, where the file holds them in full precision."""
    found: list[tuple[str, object, str]] = []
    embedding = next((records[k] for k in _EMBEDDINGS if k in records and _plain(records[k])), None)
    if embedding is not None and len(embedding.shape) == 2:
        rows, cols = embedding.shape
        if cols != config.n_embd:
            found.append(("n_embd", config.n_embd, f"{embedding.key} of shape {list(embedding.shape)}"))
        if rows != config.padded_vocab_size:
            found.append(("padded_vocab_size", config.padded_vocab_size, f"{embedding.key} of shape "
                          f"{list(embedding.shape)}"))
    heads, groups, size = config.n_head, config.n_query_groups, config.head_size
    expected = {  # the first block's attention weights: rows (dim 0) or columns (dim 1), from the config
        "transformer.h.0.attn.qkv.weight": (0, (heads + 2 * groups) * size,
                                            "(n_head + 2 * n_query_groups) * head_size"),
        "transformer.h.0.attn.proj.weight": (1, heads * size, "n_head * head_size"),
        "model.layers.0.self_attn.q_proj.weight": (0, heads * size, "n_head * head_size"),
        "model.layers.0.self_attn.k_proj.weight": (0, groups * size, "n_query_groups * head_size"),
        "gpt_neox.layers.0.attention.query_key_value.weight": (0, 3 * heads * size, "3 * n_head * head_size"),
    }
    for key, (dim, want, formula) in expected.items():
        rec = records.get(key)
        if rec is not None and _plain(rec) and len(rec.shape) == 2 and rec.shape[dim] != want:
            found.append(("n_head", heads, f"{key} of shape {list(rec.shape)}, where {formula} is {want} "
                          f"(n_query_groups {groups}, head_size {size})"))
    return found


def _plain(record: TensorRecord) -> bool:
    """Stored as itself (a floating tensor, not a quantized or block-encoded form)."""
    return record.encoding is None and record.dtype.is_floating_point
