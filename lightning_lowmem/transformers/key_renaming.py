"""A checkpoint's keys renamed as ``from_pretrained`` of transformers 4 renames them (transformers 4.46-4.57).

transformers 5 converts a checkpoint through its conversion mapping (``conversion_mapping.py``). transformers 4 has
none: its ``from_pretrained`` renames each key in three steps, and the same steps are taken here, with the installed
release's own code where it has one::

    1. legacy names        the model's ``_fix_state_dict_key_on_load`` (4.48+; 4.46-4.47 do the same inline):
                           LayerNorm ``gamma``/``beta`` -> ``weight``/``bias``, weight norm's ``weight_g``/``weight_v``
                           -> ``parametrizations.weight.original0/1`` (a model class may override it)
    2. the class's map     ``_checkpoint_conversion_mapping`` (4.52+) of the vision-language classes transformers lists
                           in ``VLMS`` (their own name in 4.52, the name of any class they derive from since 4.53):
                           regex -> replacement, the first pattern that matches. Since 4.52 these models hold their
                           language model at ``model.language_model``, and ``save_pretrained`` writes the names they
                           had before (PaliGemma: ``language_model.model.*``)
    3. the base prefix     the base model's prefix (``model``, ``bert``) added when the checkpoint has none of it and
                           the model holds that submodule, stripped the other way round (as 4.50-4.57 decide it)

The renaming is used only when it fills more of the module than the names as they are (a prefix guessed): a
checkpoint already named as the model is read as it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from torch import nn

from lightning_lowmem.formats import TensorRecord
from lightning_lowmem.plan.conversions import Conversion, tensors_filled
from lightning_lowmem.transformers.release import at_least, spelled


def renaming_conversion(model: nn.Module, records: Mapping[str, TensorRecord]) -> Conversion | None:
    """The conversion transformers 4's ``from_pretrained`` makes of ``records``' names for ``model`` (a
    ``PreTrainedModel``), or None when the names need none of it."""
    fix, mapping = _legacy_fix(model), class_mapping(model)
    prefix = _prefix_step(model, list(records))
    names = {key: prefix(_mapped(fix(key), mapping)) for key in records}
    if all(name == key for key, name in names.items()):
        return None

    def key_map(key: str) -> str:
        return names.get(key, key)

    module_tensors = model.state_dict(keep_vars=True)
    if tensors_filled(module_tensors, records, key_map, None) <= tensors_filled(module_tensors, records, None, None):
        return None
    family = getattr(model.config, "model_type", type(model).__name__)
    return Conversion(f"transformers {spelled()} key renaming ({family}, {type(model).__name__})", key_map=key_map)


def class_mapping(model: nn.Module) -> dict[str, str]:
    """``regex -> replacement``: the ``_checkpoint_conversion_mapping`` transformers 4's ``from_pretrained`` applies
    to ``model``'s checkpoint keys ({} for a class transformers does not list, and before 4.52)."""
    from transformers import modeling_utils

    vlms = getattr(modeling_utils, "VLMS", ())
    classes = type(model).__mro__[:-1] if at_least(4, 53) else (type(model),)  # 4.52: the class's own name
    if not any(name in cls.__name__.lower() for cls in classes for name in vlms):
        return {}
    return dict(getattr(model, "_checkpoint_conversion_mapping", None) or {})


def _mapped(key: str, mapping: Mapping[str, str]) -> str:
    """``key`` through the first pattern of ``mapping`` that matches it, as transformers 4 applies it."""
    for pattern, replacement in mapping.items():
        key, n = re.subn(pattern, replacement, key)
        if n:
            break
    return key


def _legacy_fix(model: nn.Module) -> Callable[[str], str]:
    """``key`` -> its modern name: the model's ``_fix_state_dict_key_on_load`` (a name in 4.48-4.49, a name and
    whether it changed since 4.50), else the renaming 4.46-4.47 do inline."""
    fix = getattr(model, "_fix_state_dict_key_on_load", None)
    if fix is None:
        return _fix_key_4_46

    def fixed(key: str) -> str:
        out = fix(key)
        return out[0] if isinstance(out, tuple) else out

    return fixed


def _fix_key_4_46(key: str) -> str:
    """transformers 4.46-4.47's ``_fix_key`` (inside ``_load_pretrained_model``, so not callable from here), as it
    is written there: any ``beta``/``gamma`` in a key, then weight norm's names for the installed torch."""
    from torch.nn.utils import parametrizations

    if "beta" in key:
        return key.replace("beta", "bias")
    if "gamma" in key:
        return key.replace("gamma", "weight")
    if hasattr(parametrizations, "weight_norm"):
        if "weight_g" in key:
            return key.replace("weight_g", "parametrizations.weight.original0")
        if "weight_v" in key:
            return key.replace("weight_v", "parametrizations.weight.original1")
    return key


def _prefix_step(model: nn.Module, keys: list[str]) -> Callable[[str], str]:
    """The base model's prefix added to or stripped from each name, as ``_load_pretrained_model`` decides it from
    the checkpoint's keys and the model."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix:
        return lambda name: name
    has_prefix = any(key.startswith(prefix) for key in keys)
    expects_prefix = hasattr(model, prefix)
    if expects_prefix and not has_prefix:
        return lambda name: f"{prefix}.{name}"
    if has_prefix and not expects_prefix:
        return lambda name: name[len(prefix) + 1:] if name.startswith(f"{prefix}.") else name
    return lambda name: name
