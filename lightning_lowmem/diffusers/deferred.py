"""diffusers' ``from_pretrained`` inside ``init_empty()``: the model built from its config, its weights not read.

A pipeline wrapper whose constructor loads its parts (Pyramid-Flow's DiT: ``PyramidDiffusionMMDiT.from_pretrained(
path, torch_dtype=...)``) would otherwise read every weight only for ``init_empty`` to drop it. Inside the block,
``ModelMixin.from_pretrained`` builds the model as its own ``from_pretrained`` does before reading (the config read
from ``path``/``subfolder``, the model built from it under ``torch_dtype`` as the default dtype, its
``_keep_in_fp32_modules`` in float32, evaluation mode), with its parameters on meta, and reads nothing more;
``load_checkpoint(part, path/subfolder)`` then fills it. The part remembers that directory
(:func:`~lightning_lowmem.building.deferred_parts`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from lightning_lowmem.building import SOURCE
from lightning_lowmem.library_hooks import from_pretrained_replaced, refuse_reading_options, register_building_hook

log = logging.getLogger(__name__)

_LOCATING = ("cache_dir", "force_download", "local_files_only", "token", "revision", "proxies", "subfolder")
_READING = ("ignore_mismatched_sizes", "from_flax", "output_loading_info", "device_map", "max_memory",
            "offload_folder", "offload_state_dict", "low_cpu_mem_usage", "variant", "use_safetensors", "disable_mmap")
_REFUSED = ("quantization_config", "dduf_entries", "parallel_config")


def _from_pretrained_on_meta(cls: type[nn.Module], path: Any, **kwargs: Any) -> nn.Module:
    refuse_reading_options(cls, path, kwargs, _REFUSED)
    dtype = kwargs.pop("torch_dtype", None)
    dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32  # diffusers' default, as its own
    locating = {k: kwargs.pop(k) for k in _LOCATING if k in kwargs}
    for name in _READING:
        kwargs.pop(name, None)
    config, unused = cls.load_config(path, return_unused_kwargs=True, **locating, **kwargs)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as diffusers' _set_default_torch_dtype
    try:
        model = cls.from_config(config, **unused)
    finally:
        torch.set_default_dtype(saved)
    _as_loaded(model, dtype, cls._keep_in_fp32_modules or [])
    model.register_to_config(_name_or_path=str(path))
    source = os.path.join(str(path), locating["subfolder"]) if locating.get("subfolder") else str(path)
    setattr(model, SOURCE, source)
    log.info("%s.from_pretrained(%r) inside init_empty(): built on meta in %s without reading its weights; fill it "
             "with load_checkpoint(<this part>, %r).", cls.__name__, str(path), dtype, source)
    return model.eval()


def _as_loaded(model: nn.Module, dtype: torch.dtype, keep: str | list[str]) -> None:
    """Each floating parameter and persistent buffer in the dtype diffusers' loader gives what it reads: ``dtype``, or
    float32 for its ``_keep_in_fp32_modules``; a buffer computed in the constructor and not saved stays as computed."""
    keep = [keep] if isinstance(keep, str) else list(keep)

    def wanted(name: str) -> torch.dtype:
        return torch.float32 if any(k in name.split(".") for k in keep) else dtype

    for name, param in model.named_parameters():
        if param.is_floating_point() and wanted(name) != param.dtype:
            param.data = param.data.to(wanted(name))
    for prefix, mod in model.named_modules():
        for leaf, buffer in mod._buffers.items():
            name = f"{prefix}.{leaf}" if prefix else leaf
            if buffer is not None and buffer.is_floating_point() and leaf not in mod._non_persistent_buffers_set:
                mod._buffers[leaf] = buffer.to(wanted(name))


register_building_hook("diffusers.models.modeling_utils",
                       lambda modeling: from_pretrained_replaced(modeling.ModelMixin, _from_pretrained_on_meta))
