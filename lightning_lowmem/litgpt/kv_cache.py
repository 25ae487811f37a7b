"""KV caches sized to the request: k/v, mask and RoPE tables for ``prompt + max_new_tokens``.

litgpt's ``GPT`` (and any model with the same protocol: a settable
``max_seq_length``, ``set_kv_cache(batch_size, max_seq_length, device=, dtype=)``
and ``clear_kv_cache()``) keeps three kinds of generation state::

    k, v       per layer  (B, n_query_groups, L, head_size)  # L = min(L, window) on sliding-window layers
    mask_cache            (1, 1, L, L) bool
    cos, sin              (L, rope_n_elem)

litgpt 0.5.13 allocates the k/v caches in fp32 when no dtype is passed (its
Python API never passes one) and leaves ``max_seq_length`` -- and with it the
RoPE tables -- at the model's whole context. :func:`setup_kv_cache` sizes all
three to the request, k/v in the model's dtype and the RoPE tables in the dtype
they have, on the model's device.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lightning_lowmem.arguments import check_int
from lightning_lowmem.devices import as_device, check_device_available
from lightning_lowmem.dtypes import model_dtype
from lightning_lowmem.errors import MetaTensorError, format_names
from lightning_lowmem.litgpt.guard import install_cache_guard
from lightning_lowmem.litgpt.rope import generation_rope_dtype_of, is_litgpt_like, resize_rope
from lightning_lowmem.meta import fabric_unwrapped
from lightning_lowmem.placement import CacheBytes
from lightning_lowmem.runtime import streamers_in
from lightning_lowmem.runtime.execution import forward_device


def setup_kv_cache(
    model: nn.Module,
    batch_size: int,
    max_seq_length: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    rope_dtype: torch.dtype | None = None,
) -> int:
    """Size the k/v caches, the mask and the RoPE tables of ``model`` to ``max_seq_length`` positions.

    A request that fits the caches already there (as long, as large a batch,
    same dtype and device) reuses them, zeroed; a longer one frees them first
    and allocates new ones, so the peak is the new size, not old + new.

    Args:
        model: litgpt's ``GPT`` or a model with its protocol; a Fabric-wrapped
            model or litgpt's ``LLM`` is unwrapped.
        batch_size: sequences generated at once.
        max_seq_length: positions to hold: prompt + max_new_tokens.
        device: where the caches go; default: where the model's parameters are.
        dtype: the k/v dtype; default: the model's floating-point dtype (never fp32 unless the model is fp32).
        rope_dtype: the RoPE tables' dtype; default: the dtype they have (only their length changes: a model loaded
            in bf16 or converted by Lightning's ``bf16-true`` has bf16 tables, as litgpt's generate has them; one
            whose tables litgpt computed again, as its ``max_seq_length`` setter and ``reset_parameters()`` do,
            float32), else ``dtype``.

    Returns:
        The bytes this call allocated for caches (0 when the existing ones were reused).
        See :func:`cache_bytes` for what the caches occupy.

    Raises:
        TypeError: a size that is not an int, a dtype that is not a floating-point ``torch.dtype``.
        ValueError: ``max_seq_length`` past the model's block size, a size below 1, or a device torch does not read.
        MetaTensorError: the model's parameters are still on the meta device.

    Example::

        >>> from litgpt import GPT, Config
        >>> model = GPT(Config.from_name("pythia-14m")).to(torch.bfloat16)
        >>> setup_kv_cache(model, batch_size=1, max_seq_length=64 + 50)
        366852
        >>> print(cache_bytes(model))
        KV cache 342.00 KiB (1 x 114 positions, torch.bfloat16), mask 12.69 KiB, RoPE 3.56 KiB
    """
    return size_caches(model, batch_size, max_seq_length, device=device, dtype=dtype, rope_dtype=rope_dtype)


def size_caches(model: nn.Module, batch_size: int, max_seq_length: int, *, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None, rope_dtype: torch.dtype | None = None, reuse: bool = True,
                keep_max_seq_length: bool = False) -> int:
    """:func:`setup_kv_cache`, and what :func:`~lightning_lowmem.patch_litgpt`'s ``set_kv_cache`` does.

    Args:
        reuse: a request that fits the caches there reuses them; False: caches of exactly ``batch_size`` x
            ``max_seq_length``, as litgpt's ``set_kv_cache`` builds them (smaller ones too).
        keep_max_seq_length: leave ``model.max_seq_length`` as it is (litgpt's ``set_kv_cache`` does not set it);
            the RoPE tables still hold ``max_seq_length`` rows and grow when a forward needs more.
    """
    model = unwrap_model(model)
    _check_request(model, batch_size, max_seq_length)
    for name, value in (("dtype", dtype), ("rope_dtype", rope_dtype)):
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise TypeError(f"{name} must be a floating-point torch.dtype such as torch.bfloat16, or None; got "
                            f"{value!r}.")
    device = as_device(device) if device is not None else model_device(model)
    check_device_available(device)
    dtype = dtype or model_dtype(model)
    current = cache_bytes(model)
    with torch.inference_mode(False), torch.no_grad():
        if reuse and _fits(model, current, batch_size, max_seq_length, device, dtype):
            for cache in kv_caches(model):
                cache.k.zero_()
                cache.v.zero_()
            return 0
        model.clear_kv_cache()  # free the old caches before allocating the new ones
        resize_rope(model, max_seq_length, device, rope_dtype or _rope_dtype(model) or dtype,
                    set_length=not keep_max_seq_length)
        _build_mask(model, max_seq_length, device)
        kept = _storages(model)
        _raw_set_kv_cache(model)(model, batch_size, max_seq_length=max_seq_length, device=device, dtype=dtype)
    install_cache_guard(model)
    if is_litgpt_like(model):  # k/v, mask and RoPE were all rebuilt
        return cache_bytes(model).total
    return sum(nbytes for ptr, nbytes in _storages(model).items() if ptr not in kept)


def cache_bytes(model: nn.Module) -> CacheBytes:
    """The bytes ``model``'s k/v caches, mask and RoPE tables occupy now."""
    model = unwrap_model(model)
    caches = list(kv_caches(model))
    mask = getattr(model, "mask_cache", None)
    rope = sum(_nbytes(getattr(model, name, None)) for name in ("cos", "sin"))
    if not caches:
        return CacheBytes(mask=_nbytes(mask), rope=rope)
    first = caches[0].k
    length = mask.size(-1) if isinstance(mask, torch.Tensor) else max(c.k.size(2) for c in caches)
    return CacheBytes(kv=sum(_nbytes(c.k) + _nbytes(c.v) for c in caches), mask=_nbytes(mask), rope=rope,
                      length=length, batch_size=first.size(0), dtype=first.dtype)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module under Fabric's wrapper (``_FabricModule``) or litgpt's ``LLM``."""
    for _ in range(8):
        inner = fabric_unwrapped(model)
        if inner is model:
            inner = getattr(model, "model", None) if type(model).__name__ == "LLM" else None
        if not isinstance(inner, nn.Module):
            return model
        model = inner
    return model


def model_device(model: nn.Module) -> torch.device:
    """Where the model's forward computes (``runtime.execution.forward_device``: the device its offloaded or on-disk
    layers are brought to, else its parameters'); raises if a parameter is still on meta and nothing streams it."""
    if streamers_in(model):
        return forward_device(model)
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise MetaTensorError(
            f"Cannot set up KV caches: {len(meta)} parameters are still on the meta device: {format_names(meta)}. "
            "Load the weights first (lightning_lowmem.load_checkpoint) or pass device= explicitly."
        )
    return forward_device(model) or torch.device("cpu")


def kv_caches(model: nn.Module) -> Iterator[nn.Module]:
    """Every layer's KV cache module (an object with ``k`` and ``v`` tensors) under ``model``."""
    for module in model.modules():
        cache = getattr(module, "kv_cache", None)
        if isinstance(getattr(cache, "k", None), torch.Tensor) and isinstance(getattr(cache, "v", None), torch.Tensor):
            yield cache


def _check_request(model: nn.Module, batch_size: int, max_seq_length: int) -> None:
    missing = [name for name in ("set_kv_cache", "clear_kv_cache") if not callable(getattr(model, name, None))]
    if missing or not hasattr(model, "max_seq_length"):
        raise TypeError(
            f"{type(model).__name__} does not have the KV-cache protocol (max_seq_length, set_kv_cache, "
            f"clear_kv_cache); missing: {missing or ['max_seq_length']}. Pass litgpt's GPT or a model with them."
        )
    check_int("batch_size", batch_size)
    check_int("max_seq_length", max_seq_length)
    check_length(max_seq_length, getattr(getattr(model, "config", None), "block_size", None))


def check_length(max_seq_length: int, block_size: int | None) -> None:
    """Raise ``ValueError`` when ``max_seq_length`` positions (prompt + max_new_tokens) are past ``block_size``."""
    if block_size is not None and max_seq_length > block_size:
        raise ValueError(
            f"Cannot size the KV cache to {max_seq_length} positions: the model's block size (context length) "
            f"is {block_size}. Shorten the prompt or ask for fewer new tokens so that prompt + max_new_tokens "
            f"<= {block_size}."
        )


def _fits(model: nn.Module, current: CacheBytes, batch_size: int, length: int, device: torch.device,
          dtype: torch.dtype) -> bool:
    if current.length < length or current.batch_size < batch_size or current.dtype != dtype:
        return False
    cache = next(kv_caches(model))
    if cache.k.device != device:
        return False
    rope = getattr(model, "cos", None)
    return not isinstance(rope, torch.Tensor) or rope.size(0) >= length and model.max_seq_length >= length


def _rope_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype a model loaded for generation computes RoPE in, else that of its RoPE tables now (None without
    floating tables)."""
    if pinned := generation_rope_dtype_of(model):
        return pinned
    table = getattr(model, "cos", None)
    return table.dtype if isinstance(table, torch.Tensor) and table.is_floating_point() else None


def _build_mask(model: nn.Module, length: int, device: torch.device) -> None:
    """litgpt's causal mask, built in place: ``ones().tril_()`` holds one L x L copy where ``tril(ones())``
    holds two."""
    if hasattr(model, "mask_cache"):
        model.mask_cache = torch.ones((length, length), dtype=torch.bool, device=device).tril_()[None, None]


def _raw_set_kv_cache(model: nn.Module):
    """The model class's own ``set_kv_cache``, under :func:`patch_litgpt`'s wrapper if there is one."""
    method = type(model).set_kv_cache
    return getattr(method, "__lowmem_original__", method)


def _storages(model: nn.Module) -> dict[int, int]:
    tensors = [b for b in model.buffers()] + [getattr(model, "mask_cache", None)]
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_meta and t.numel():
            storage = t.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


def _nbytes(t: object) -> int:
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return 0
    return t.numel() * t.element_size()
