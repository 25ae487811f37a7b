"""What a model family needs at run time beyond its weights, asked by the load, the placement plan and the estimate.

A checkpoint's headers give the weights' bytes; they do not say what a forward
keeps beside them (KV caches, a causal mask, RoPE tables), what its activations
take, which buffers computed in ``__init__`` a load should release first, or how
buffers left on meta are rebuilt after it.
An :class:`Architecture` answers those for one model family; :func:`architecture_of`
gives the registered one that recognises a module, else :data:`GENERIC`.

The engine knows no model family by name: the litgpt face registers litgpt's
``GPT`` (:mod:`lightning_lowmem.litgpt.architecture`) when it is imported, as
``import lightning_lowmem`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lowmem.memory.units import format_bytes
from lightning_lowmem.meta import recomputable_buffers, recompute_meta_buffers
from lightning_lowmem.placement.layers import find_blocks, layer_name


@dataclass(frozen=True)
class CacheBytes:
    """What a model's generation caches occupy (or will). Sizes in bytes.

    Attributes:
        kv: every layer's k and v caches.
        mask: the causal mask cache.
        rope: the RoPE ``cos`` and ``sin`` tables.
        length: positions the caches hold (0 without a cache).
        batch_size: sequences the k/v caches hold (0 without a cache).
        dtype: the k/v dtype, or None without a cache.
    """

    kv: int = 0
    mask: int = 0
    rope: int = 0
    length: int = 0
    batch_size: int = 0
    dtype: torch.dtype | None = None

    @property
    def total(self) -> int:
        return self.kv + self.mask + self.rope

    def __str__(self) -> str:
        return (f"KV cache {format_bytes(self.kv)} ({self.batch_size} x {self.length} positions, {self.dtype}), "
                f"mask {format_bytes(self.mask)}, RoPE {format_bytes(self.rope)}")


class Architecture:
    """The answers for any ``nn.Module``; a model family overrides what it knows better.

    Example::

        >>> model = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 16))
        >>> GENERIC.activation_bytes(model, batch_size=1, tokens=8, dtype=torch.float32)  # the widest: 64 features
        2048
    """

    name = "generic"

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` (the root being loaded or placed) is of this family."""
        return True

    def cache_bytes(self, module: nn.Module, batch_size: int, length: int, dtype: torch.dtype,
                    rope_dtype: torch.dtype | None = None) -> CacheBytes:
        """The caches a generation of ``length`` positions keeps (RoPE tables in ``rope_dtype``, default ``dtype``);
        none are known for a generic module."""
        return CacheBytes()

    def activation_bytes(self, module: nn.Module, batch_size: int, tokens: int, dtype: torch.dtype,
                         length: int | None = None) -> int:
        """A conservative estimate of the activations of a forward of ``tokens`` tokens (``length``, the positions a
        model with a cache attends over, is not used for a generic module).

        Per layer (a block of the model's first ``nn.ModuleList``, or another top-level module):
        every output of its ``nn.Linear`` / ``nn.Embedding`` modules alive at once
        (``batch x tokens x width x itemsize``), plus, for a block of a model whose config has
        ``n_head``, the attention scores ``batch x n_head x tokens^2`` in fp32 (the math attention
        kernel materializes them). The widest layer counts.
        """
        blocks = find_blocks(module)
        layers: dict[str, bool] = {}
        for name, _ in module.named_parameters():
            layer, is_block, _ = layer_name(name, blocks)
            layers[layer] = is_block
        n_head = getattr(getattr(module, "config", None), "n_head", None)
        widest = 0
        for layer, is_block in layers.items():
            scores = batch_size * n_head * tokens * tokens * 4 if is_block and isinstance(n_head, int) else 0
            width = _width(module.get_submodule(layer) if layer else module)
            widest = max(widest, batch_size * tokens * width * dtype.itemsize + scores)
        return widest

    def before_load(self, module: nn.Module, device: torch.device) -> list[str]:
        """Release buffers that are rebuilt when first used (none for a generic module); returns their names. The load
        casts what stands in for them as it casts every buffer (``module.to(dtype)``)."""
        return []

    def reset_buffers(self, module: nn.Module, device: torch.device) -> list[str]:
        """The buffers the module's own ``reset_parameters()`` rebuilds, left as it leaves them, for a face whose path
        without the library calls it after the precision plugin's conversion (FSDP2's materialization); returns
        their names. None for a generic module."""
        return []

    def fills(self, module: nn.Module) -> set[str]:
        """The meta tensors of ``module`` that :meth:`before_load` and :meth:`after_load` make real without the
        checkpoint: for a generic module, the non-persistent buffers its modules can recompute."""
        return recomputable_buffers(module)

    def after_load(self, module: nn.Module, device: torch.device, dtypes: Mapping[str, torch.dtype] | None = None) \
            -> list[str]:
        """Make real on ``device`` what :meth:`fills` names; returns their names. ``dtypes``: the dtype each floating
        buffer ends in (by name), for a family whose init computes into the buffer as allocated; a generic module's
        buffers are computed as built and cast after, as ``module.to(dtype)`` casts them."""
        return recompute_meta_buffers(module, device)

    def load_dtypes(self, module: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
        """The floating tensors of ``module`` (by name) that the family's own loader, asked for ``dtype``, leaves in
        another dtype, and that dtype (transformers' ``from_pretrained`` keeps RoPE inverse frequencies and its
        keep-in-fp32 modules in float32). None for a generic module: ``module.to(dtype)`` casts every one."""
        return {}

    def save_config(self, module: nn.Module, directory: Path, quantization_config: dict[str, Any] | None) -> list[Path]:
        """Write what the family needs beside the weights to build ``module`` again from ``directory`` (its config,
        with ``quantization_config`` where the family's loader reads one); returns the files written. Nothing
        for a generic module."""
        return []

    def build_meta(self, directory: Path) -> tuple[nn.Module, str] | None:
        """The model the files in ``directory`` describe (its family's config beside the weights), built on meta,
        and a name for it; None when the family finds no config of its own there (a generic module: never)."""
        return None


def _width(module: nn.Module) -> int:
    """Output features of every ``nn.Linear`` and ``nn.Embedding`` under ``module``."""
    width = 0
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            width += sub.out_features
        elif isinstance(sub, nn.Embedding):
            width += sub.embedding_dim
    return width


GENERIC = Architecture()
_REGISTERED: list[Architecture] = []


def register_architecture(architecture: Architecture) -> Architecture:
    """Ask ``architecture`` first about the modules it matches (registering the same type again replaces it)."""
    _REGISTERED[:] = [a for a in _REGISTERED if type(a) is not type(architecture)]
    _REGISTERED.insert(0, architecture)
    return architecture


def architecture_of(module: nn.Module) -> Architecture:
    """The registered architecture that matches ``module``, else :data:`GENERIC`."""
    return next((a for a in _REGISTERED if a.matches(module)), GENERIC)


def build_meta_model(directory: Path) -> tuple[nn.Module, str] | None:
    """The model a checkpoint directory describes, built on meta by the first registered family that finds its
    config there (transformers: ``config.json``), and its name; None when none does."""
    return next(filter(None, (a.build_meta(directory) for a in _REGISTERED)), None)
