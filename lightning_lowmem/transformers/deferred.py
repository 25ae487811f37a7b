"""``from_pretrained`` inside ``init_empty()``: the part is built from its config, its weights are not read.

A wrapper whose constructor loads its parts (Pyramid-Flow's text encoders: ``CLIPTextModelWithProjection.
from_pretrained(path, torch_dtype=...)``) would otherwise read every weight only for ``init_empty`` to drop it.
Inside the block, transformers' ``from_pretrained`` builds the model as its own ``from_pretrained`` does before
reading (the config read from ``path``, ``dtype`` set on it and its sub-configs, the model built under that default
dtype, its keep-in-fp32 tensors in float32, evaluation mode), with its parameters on meta, and reads nothing more;
``load_checkpoint(part, path)`` then fills it. The part remembers ``path``
(:func:`~lightning_lowmem.building.deferred_parts`), so that a load of the wrapper that lacks the part's weights says
which call fills them.
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

_READING = ("cache_dir", "force_download", "local_files_only", "token", "revision", "use_safetensors",
            "weights_only", "ignore_mismatched_sizes", "low_cpu_mem_usage", "device_map", "max_memory",
            "offload_folder", "offload_buffers", "offload_state_dict", "variant", "output_loading_info", "proxies",
            "trust_remote_code", "use_auth_token", "resume_download", "_fast_init", "mirror")
"""``from_pretrained`` keywords about how and where weights are read: without a read, they change nothing (the
config is still read with those that locate it)."""
_LOCATING = ("cache_dir", "force_download", "local_files_only", "token", "revision", "proxies", "subfolder")
_REFUSED = ("quantization_config", "state_dict", "gguf_file", "tp_plan", "device_mesh", "adapter_kwargs")


def _from_pretrained_on_meta(cls: type[nn.Module], path: Any, *model_args: Any, config: Any = None,
                             **kwargs: Any) -> nn.Module:
    refuse_reading_options(cls, path, kwargs, _REFUSED)
    dtype = kwargs.pop("dtype", None)
    torch_dtype = kwargs.pop("torch_dtype", None)
    dtype = dtype if dtype is not None else torch_dtype
    locating = {k: kwargs.pop(k) for k in _LOCATING if k in kwargs}
    for name in _READING:
        kwargs.pop(name, None)
    attn = kwargs.pop("attn_implementation", None)
    if config is None or isinstance(config, (str, bytes)) or hasattr(config, "__fspath__"):
        config, kwargs = cls.config_class.from_pretrained(config or path, return_unused_kwargs=True, **locating,
                                                          **kwargs)
    if attn is not None:
        config._attn_implementation = attn
    dtype = _dtype_asked(dtype, config)
    source = os.path.join(str(path), locating["subfolder"]) if locating.get("subfolder") else path
    return build_deferred(cls, config, dtype, source, model_args, kwargs)


def build_deferred(cls: type[nn.Module], config: Any, dtype: torch.dtype, path: Any, model_args: tuple = (),
                   model_kwargs: dict | None = None) -> nn.Module:
    """``cls`` built as ``from_pretrained(path, dtype=dtype)`` builds it before reading (parameters on meta inside
    ``init_empty()``), its keep-in-fp32 tensors in float32, in evaluation mode, remembering ``path``."""
    from lightning_lowmem.transformers.architecture import config_as_loaded, default_dtype, pretrained_dtypes

    config = config_as_loaded(config, dtype)
    config.name_or_path = str(path)
    with default_dtype(dtype):
        model = cls(config, *model_args, **(model_kwargs or {}))
    kept = pretrained_dtypes(model, dtype)
    for name, param in model.named_parameters():
        wanted = kept.get(name, param.dtype)
        if param.is_meta and wanted != param.dtype:
            param.data = param.data.to(wanted)
    setattr(model, SOURCE, str(path))
    log.info("%s.from_pretrained(%r) inside init_empty(): built on meta in %s without reading its weights; fill it "
             "with load_checkpoint(<this part>, %r).", cls.__name__, str(path), dtype, str(path))
    return model.eval()


def _dtype_asked(dtype: Any, config: Any) -> torch.dtype:
    """The dtype ``from_pretrained`` would load in: the one asked (a ``torch.dtype`` or its name), ``"auto"`` (and
    transformers 5's default) the config's, else torch's default dtype."""
    import transformers

    if dtype is None and int(transformers.__version__.split(".")[0]) >= 5:
        dtype = "auto"
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype):
        return torch.get_default_dtype()
    return dtype


register_building_hook("transformers.modeling_utils",
                       lambda modeling: from_pretrained_replaced(modeling.PreTrainedModel, _from_pretrained_on_meta))
