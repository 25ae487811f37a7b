"""litgpt's RoPE tables: built when first needed, at the length asked for, in the dtype the same code without this
library gives them.

litgpt's ``GPT`` builds its RoPE tables for the whole context in ``__init__``
(Llama-3.1-8B: 131072 x 128 x 2 fp32 = 128 MiB). Here they are dropped to zero
rows after a load (:func:`drop_rope`) and built by litgpt's own ``rope_cache()``
at the length a request needs (:func:`resize_rope`, :func:`set_rope`).

The zero-row tables stand in for the whole ones: whatever converts the model converts them too, and the tables built
later take their dtype. So the tables end in the dtype each path gives them without the library: ``rope_cache()``
computes them in float32 (:func:`own_dtype`); ``model.to(dtype)`` and Lightning's one-device ``bf16-true``
(``precision.convert_module``) cast them to bf16; FSDP2's ``reset_parameters()`` and litgpt's ``max_seq_length``
setter compute them again in float32 (:func:`drop_rope` with ``own_dtype``).
"""

from __future__ import annotations

import torch
from torch import nn


def is_litgpt_like(model: nn.Module) -> bool:
    """Whether ``model`` has litgpt ``GPT``'s RoPE and KV-cache internals (``rope_cache``, ``cos``, ``mask_cache``)."""
    return (callable(getattr(model, "rope_cache", None)) and hasattr(model, "_max_seq_length")
            and isinstance(getattr(model, "cos", None), torch.Tensor) and hasattr(model, "mask_cache"))


def own_dtype(model: nn.Module) -> torch.dtype:
    """The dtype litgpt's own ``rope_cache()`` gives the model's RoPE tables (asked once, on the meta device)."""
    dtype = model.__dict__.get("_lowmem_rope_dtype")
    if dtype is None:
        dtype = model.__dict__["_lowmem_rope_dtype"] = rope_tables(model, 1, torch.device("meta"))[0].dtype
    return dtype


def generation_rope_dtype(dtype: torch.dtype, scheme: object | None) -> torch.dtype:
    """The dtype litgpt's own ``litgpt generate`` leaves its RoPE tables in: the precision's (``bf16-true`` converts
    them with the model), float32 when it quantizes with bitsandbytes (Lightning's ``BitsandbytesPrecision`` converts
    no buffer: the tables stay as ``rope_cache()`` computed them).

    Args:
        scheme: the scheme the model's Linears hold, quantized on load or stored so (a saved bitsandbytes copy computes
            as quantizing on load does), as a scheme or its name; None without one.
    """
    name = scheme if isinstance(scheme, str) else str(getattr(scheme, "name", ""))
    return torch.float32 if name.startswith("bnb.") else dtype


def pin_generation_rope_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Mark a model the library loaded for generation with the dtype its RoPE tables take whenever its caches are set up
    (:func:`generation_rope_dtype`), whichever loop sets them up: ``generate()``'s, or litgpt's chat loop, whose
    ``max_seq_length`` setter computes them again in float32 before each first turn. So ``lightning-lowmem chat``
    computes as ``lightning-lowmem generate`` does."""
    model.__dict__["_lowmem_generation_rope_dtype"] = dtype


def generation_rope_dtype_of(model: nn.Module) -> torch.dtype | None:
    """The dtype :func:`pin_generation_rope_dtype` marked ``model`` with, or None (a model litgpt loaded: its tables keep
    the dtype litgpt gave them)."""
    return model.__dict__.get("_lowmem_generation_rope_dtype")


def drop_rope(model: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> None:
    """Drop a litgpt model's RoPE tables to zero rows on ``device``, in ``dtype`` (None: the dtype they have now; the
    cache guard grows them back in the dtype the zero-row tables have then)."""
    for name in ("cos", "sin"):
        table = getattr(model, name)
        setattr(model, name, torch.empty((0, *table.shape[1:]), dtype=dtype or table.dtype, device=device))


def resize_rope(model: nn.Module, length: int, device: torch.device, dtype: torch.dtype,
                set_length: bool = True) -> None:
    """Set ``model.max_seq_length = length`` with RoPE tables of exactly ``length`` rows in ``dtype`` on ``device``
    (``set_length=False``: the tables only, ``max_seq_length`` left as it is)."""
    if not is_litgpt_like(model):
        if set_length:
            model.max_seq_length = length
        for name in ("cos", "sin"):
            table = getattr(model, name, None)
            if isinstance(table, torch.Tensor):
                setattr(model, name, table.to(device=device, dtype=dtype))
        return
    drop_rope(model, device)  # the old tables go before the new ones are computed
    set_rope(model, length, device, dtype)
    if set_length:
        set_max_seq_length(model, length)


def rope_tables(model: nn.Module, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """litgpt's own ``rope_cache()`` at ``rows`` positions (on the meta device: shapes only), the model untouched."""
    saved = model._max_seq_length
    model._max_seq_length = rows  # rope_cache() reads the length from here
    try:
        with torch.inference_mode(False), torch.no_grad():
            return model.rope_cache(device=device)
    finally:
        model._max_seq_length = saved


def set_rope(model: nn.Module, rows: int, device: torch.device, dtype: torch.dtype | None = None) -> None:
    """The model's RoPE tables at ``rows`` positions, computed outside inference mode (so training can use them), in
    ``dtype`` (None: the dtype litgpt's own code gives them)."""
    cos, sin = rope_tables(model, rows, device)
    with torch.inference_mode(False), torch.no_grad():
        model.cos, model.sin = (cos, sin) if dtype is None else (cos.to(dtype), sin.to(dtype))


def set_max_seq_length(model: nn.Module, length: int) -> None:
    """Through litgpt's setter, with the mask hidden so that it does not print a warning about the KV cache."""
    mask, model.mask_cache = model.mask_cache, None
    try:
        model.max_seq_length = length
    finally:
        model.mask_cache = mask
