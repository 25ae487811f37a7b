"""The tensors ``from_pretrained(dtype=...)`` keeps in float32 whatever the dtype asked, by the installed release.

A model class names modules whose weights lose too much in a 16-bit dtype (T5's ``wo``). Which ones, under which
dtype, and how a name is matched changed between releases::

    transformers 5     the model's dtype plan (``_get_dtype_plan(dtype)``), matched by transformers' own globs
    4.53-4.57          ``_keep_in_fp32_modules`` under float16, ``_keep_in_fp32_modules_strict`` under float16 and
                       bfloat16; a module matches a whole part of the name: ``(^|\\.)<module>($|\\.)``
    4.51-4.52          ``_keep_in_fp32_modules`` under float16, matched as above
    4.50               ``_keep_in_fp32_modules`` under float16, matched anywhere in the name (``re.escape``)
    4.46-4.49          ``_keep_in_fp32_modules`` under float16, equal to one of the dot-separated parts of the name

Example::

    >>> from torch import nn
    >>> class T5Like(nn.Module):
    ...     _keep_in_fp32_modules = ["wo"]
    >>> kept = float32_rule(T5Like(), torch.float16)
    >>> kept("block.0.layer.1.DenseReluDense.wo.weight"), kept("block.0.layer.1.DenseReluDense.wi.weight")
    (torch.float32, None)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch
from torch import nn

from lightning_lowmem.transformers.release import at_least

Rule = Callable[[str], "torch.dtype | None"]


def float32_rule(model: nn.Module, dtype: torch.dtype) -> Rule:
    """``name`` -> the dtype ``from_pretrained(dtype=dtype)`` keeps the tensor ``name`` of ``model`` in against
    ``dtype`` (float32), or None where it follows ``dtype``."""
    if callable(getattr(model, "_get_dtype_plan", None)):
        return _plan_rule(model._get_dtype_plan(dtype))
    return _module_list_rule(model, dtype)


def _plan_rule(plan: Mapping[str, torch.dtype]) -> Rule:
    """A transformers 5 dtype plan, matched by transformers' own globs."""
    if not plan:
        return lambda name: None
    from transformers.core_model_loading import build_glob_alternation

    alternation, group_glob, _ = build_glob_alternation(list(plan))

    def planned(name: str) -> torch.dtype | None:
        found = alternation.search(name)
        return plan[group_glob[found.lastgroup]] if found else None

    return planned


def _module_list_rule(model: nn.Module, dtype: torch.dtype) -> Rule:
    """transformers 4's keep-in-fp32 module lists, under the dtypes and with the matching of the installed release."""
    modules = list(getattr(model, "_keep_in_fp32_modules", None) or []) if dtype == torch.float16 else []
    if dtype in (torch.float16, torch.bfloat16):
        modules += list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])  # 4.53+ (None before)
    if not modules:
        return lambda name: None
    if at_least(4, 51):
        pattern = re.compile("|".join(rf"((^|\.){module}($|\.))" for module in modules))
        return lambda name: torch.float32 if pattern.search(name) else None
    if at_least(4, 50):
        pattern = re.compile("|".join(re.escape(module) for module in modules))
        return lambda name: torch.float32 if pattern.search(name) else None
    return lambda name: torch.float32 if any(module in name.split(".") for module in modules) else None
