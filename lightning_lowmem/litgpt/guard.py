"""A clear error for a request past a fixed KV cache, and RoPE tables that grow to what a forward needs.

litgpt's ``GPT`` answers a position past its KV cache with a bare
``IndexError: index out of range in self`` from the mask lookup.
:func:`install_cache_guard` adds a forward pre-hook to one model instance that

* grows the RoPE tables to the length a forward needs (the KV cache's length,
  or the sequence length without a cache) when they are shorter, in the dtype
  the tables have (a precision plugin's conversion, ``model.to(dtype)``, converted
  the short ones too: see :mod:`lightning_lowmem.litgpt.rope`), and
* raises :class:`KVCacheTooShortError`, with the lengths, for positions or a
  batch the KV cache cannot hold: a :class:`KVCachePositionError` (an ``IndexError``, as litgpt's own) or a
  :class:`KVCacheBatchError` (a ``RuntimeError``, as torch's ``index_copy_`` raises it under litgpt).

Inside a compiled forward (``generate(compile=True)``'s decode step) it does nothing: its checks read tensor
values, which would split the graph, and the caches were sized to the request before the loop.

:func:`release_rope` drops a model's RoPE tables to zero rows and installs the
guard, so that nothing the size of the whole context is held after a load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_lowmem.errors import KVCacheBatchError, KVCachePositionError
from lightning_lowmem.litgpt.rope import drop_rope, is_litgpt_like, own_dtype, set_max_seq_length, set_rope


def install_cache_guard(model: nn.Module) -> None:
    """Add the guard pre-hook to ``model`` (once; a no-op for models without litgpt's internals)."""
    if is_litgpt_like(model) and not any(h is _guard for h in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(_guard, with_kwargs=True)


def release_rope(model: nn.Module, device: torch.device, own: bool = False) -> bool:
    """Drop a litgpt model's RoPE tables to zero rows on ``device``; they grow back when a forward needs them.

    Args:
        own: in the dtype litgpt's ``rope_cache()`` gives them (float32: what ``reset_parameters()`` rebuilds);
            False: in the dtype they have now.

    Returns:
        Whether the model had litgpt's RoPE tables to release.
    """
    if not is_litgpt_like(model):
        return False
    drop_rope(model, device, own_dtype(model) if own else None)
    install_cache_guard(model)
    return True


def release_all_rope(module: nn.Module, device: torch.device, own: bool = False) -> list[str]:
    """:func:`release_rope` on ``module`` and every submodule with litgpt's internals; returns their names."""
    return [name for name, sub in module.named_modules() if release_rope(sub, device, own)]


def _guard(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    idx = args[0] if args else kwargs.get("idx")
    input_pos = args[1] if len(args) > 1 else kwargs.get("input_pos")
    maxp1 = args[2] if len(args) > 2 else kwargs.get("input_pos_maxp1")
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or torch.compiler.is_compiling():
        return
    if input_pos is None:
        _check_plain(model, idx.size(1))
    else:
        _check_cached(model, idx.size(0), input_pos, maxp1)


def _check_plain(model: nn.Module, length: int) -> None:
    """A forward without the KV cache: RoPE must cover ``length`` (litgpt raises past the block size)."""
    if model.cos.size(0) >= length or length > model.config.block_size:
        return
    set_rope(model, length, model.cos.device, model.cos.dtype)
    if length > model.max_seq_length:
        set_max_seq_length(model, length)


def _check_cached(model: nn.Module, batch: int, input_pos: torch.Tensor, maxp1: int | None) -> None:
    mask = model.mask_cache
    if mask is None:
        return  # litgpt's own error says to call set_kv_cache
    capacity = mask.size(-1)
    needed = int(maxp1) if maxp1 is not None else int(input_pos.max()) + 1
    if needed > capacity:
        raise KVCachePositionError(
            f"This forward writes KV-cache position {needed - 1}, but the KV cache holds {capacity} positions "
            f"(it was set up for {capacity} = prompt + max_new_tokens, or fixed at that size). Set the caches up "
            f"for at least {needed} positions (lightning_lowmem.setup_kv_cache(model, batch_size, {needed})), "
            f"or ask for at most {capacity} positions in all.",
            needed=needed, available=capacity,
        )
    cache = next((b.attn.kv_cache for b in getattr(model.transformer, "h", []) if b.attn.kv_cache is not None), None)
    if cache is not None and batch > cache.k.size(0):
        raise KVCacheBatchError(
            f"This forward has a batch of {batch} sequences, but the KV cache holds {cache.k.size(0)}. "
            f"Set the caches up for batch_size={batch}.",
            needed=batch, available=cache.k.size(0),
        )
    if model.cos.size(0) < needed:
        set_rope(model, capacity, model.cos.device, model.cos.dtype)
