"""torchao weights as safetensors holds them (torchao's own flattening, which transformers writes), and read back.

torchao's ``torchao.prototype.safetensors`` (torchao >= 0.15; transformers' ``save_pretrained`` uses it)
stores a quantized weight ``P.weight`` as its inner tensors (``__tensor_flatten__``), each under
``P._weight_<name>``, and the rest of the tensor subclass as JSON in the file's metadata:

* ``P._weight_qdata`` int8 ``(out, in)``, ``P._weight_scale`` ``(out, 1)``, ``P._weight_zero_point``
  int8 ``(out, 1)`` for an ``Int8Tensor`` (``torchao.int8wo`` and ``torchao.int8dq``);
* metadata ``P.weight``: ``{"_type": "Int8Tensor", "_data": {block_size, dtype, act_quant_kwargs, ...},
  "_tensor_data_names": [...]}``, written by torchao's ``TensorSubclassAttributeJSONEncoder``;
* metadata ``tensor_names``: the JSON list of those weights, the same in every file of a sharded set.

:class:`TorchaoLayout` is this layout, filed for ``torchao.int8wo`` and ``torchao.int8dq`` (``torchao.py``).
Loading rebuilds the tensor subclass with torchao's ``object_from_dict`` (which builds only the classes
torchao allows) around the inner tensors as read; nothing is quantized again.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_lowmem.errors import CheckpointFormatError, UnsupportedQuantizationError
from lightning_lowmem.formats import TensorRecord
from lightning_lowmem.quantize.layouts import StoredLayout, StoredWeight, register_layout
from lightning_lowmem.quantize.schemes import SCHEMES, QuantScheme
from lightning_lowmem.quantize.torchao import TorchaoInt8Dynamic, TorchaoInt8WeightOnly, TorchaoScheme

_FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_RESAVE = "The checkpoint is damaged or was not written by torchao/transformers: download or save it again."
_STORED: dict[tuple[str, bool], type[TorchaoScheme]] = {
    ("Int8Tensor", False): TorchaoInt8WeightOnly,
    ("Int8Tensor", True): TorchaoInt8Dynamic,
}
"""(torchao tensor subclass, activations quantized) -> the scheme whose weights it is; the others are not read."""


@register_layout(*_STORED.values())
class TorchaoLayout(StoredLayout):
    """torchao's tensor subclasses flattened into safetensors, as transformers saves them."""

    def holding(self, module: nn.Module) -> QuantScheme | None:
        weight = getattr(module, "weight", None)
        if not type(weight).__module__.startswith("torchao"):
            return None
        cls = _STORED.get((type(weight).__name__, getattr(weight, "act_quant_kwargs", None) is not None))
        return cls() if cls is not None else None

    def state_dict_of(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return state_dict_torchao(module)

    def file_metadata(self, modules: Mapping[str, nn.Module]) -> dict[str, str]:
        return file_metadata({f"{name}.weight": module.weight for name, module in modules.items()})

    def transformers_config(self, scheme: QuantScheme, skip: list[str],
                            compute_dtype: torch.dtype) -> dict[str, Any] | None:
        from torchao.core.config import config_to_dict

        config = config_to_dict(scheme.torchao_config(torch.device("cpu")))
        return {"quant_method": "torchao", "quant_type": {"default": config}, "quant_type_kwargs": {},
                "modules_to_not_convert": skip or None, "include_input_output_embeddings": False,
                "untie_embedding_weights": False}

    def find_stored(self, records: Mapping[str, TensorRecord], metadata: Mapping[str, str],
                    files: str) -> dict[str, StoredWeight]:
        return find_torchao(records, metadata, files)

    def resolve_stored(self, stored: StoredWeight, read: Callable[[str], torch.Tensor],
                       requested: QuantScheme | None) -> None:
        resolve_torchao(stored)
        stored.scheme = SCHEMES[stored.scheme_name]()

    def load_stored(self, module: nn.Module, stored: StoredWeight, tensors: Mapping[str, torch.Tensor],
                    device: torch.device) -> None:
        module.weight = nn.Parameter(build(stored, tensors, device), requires_grad=False)

    def dequantize_stored(self, stored: StoredWeight, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        first = next(iter(tensors.values()))
        if first.is_meta:
            return torch.empty(stored.shape, dtype=stored.dtype, device="meta")
        return build(stored, tensors, first.device).dequantize()


def find_torchao(records: Mapping[str, TensorRecord], metadata: Mapping[str, str],
                 files: str) -> dict[str, StoredWeight]:
    """The torchao weights the metadata's ``tensor_names`` lists, with their inner tensors' records; headers only."""
    if "tensor_names" not in metadata:
        return {}
    found = {}
    for name in _json(metadata["tensor_names"], f"{files}: metadata 'tensor_names'", list):
        info = _json(metadata.get(name), f"{files}: metadata {name!r}", dict)
        kind = info.get("_type")
        if kind in ("Tensor", "torch.Tensor"):
            continue  # a full-precision tensor, stored as itself
        if kind != "Int8Tensor":
            raise UnsupportedQuantizationError(
                f"{files} holds {name!r} as a torchao {kind!r}; lightning_lowmem loads torchao's Int8Tensor "
                "(torchao.int8wo, torchao.int8dq) as stored. Load it with transformers, or save it as one of those.")
        check_int8_fields(info, f"{files}: metadata {name!r}")
        scheme = _STORED[kind, info["_data"].get("act_quant_kwargs") is not None]
        found[name] = StoredWeight(name, scheme.name, _roles(name, info, records, files), info=info)
    return found


_INT8_DATA = ("block_size", "dtype", "act_quant_kwargs", "reduce_range")
"""The fields of an Int8Tensor's ``_data`` a save writes (torchao 0.18); ``block_size`` and ``dtype`` always."""
_INT8_NAMES = ["qdata", "scale", "zero_point"]
INT8DQ_ACTIVATIONS = {"_type": "QuantizeTensorToInt8Kwargs", "_data": {
    "granularity": {"_type": "PerRow", "_data": {"dim": -1}},
    "mapping_type": {"_type": "MappingType", "_data": "SYMMETRIC"}, "reduce_range": False}}
"""``act_quant_kwargs`` as ``torchao.int8dq`` (``Int8DynamicActivationInt8WeightConfig()``) writes it; int8wo: null."""


def check_int8_fields(info: dict[str, Any], where: str) -> None:
    """Raise unless every field of an Int8Tensor's metadata is one a save writes: its keys, ``_tensor_data_names``,
    and each field of ``_data`` (the activations' quantization, ``reduce_range``, the dtype's form). torchao builds
    the weight from these as they are, so a field a save never writes (``act_quant_kwargs`` a dtype, ``{}`` or ``5``)
    would load and fail at the first forward, or compute something else.

    Raises:
        CheckpointFormatError: naming the field, the value and what a save writes.
    """
    def refuse(field: str, value: Any, written: str) -> None:
        raise CheckpointFormatError(f"{where}: {field} is {json.dumps(value, default=repr)[:200]}, where a save of "
                                    f"torchao.int8wo or torchao.int8dq writes {written}. {_RESAVE}")

    extra = sorted(set(info) - {"_type", "_data", "_tensor_data_names"})
    if extra:
        refuse(extra[0], info[extra[0]], "only _type, _data and _tensor_data_names")
    data = info.get("_data")
    if not isinstance(data, dict):
        refuse("_data", data, "a JSON object of the tensor's attributes")
    names = info.get("_tensor_data_names")
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names) and sorted(names) == _INT8_NAMES):
        refuse("_tensor_data_names", names, f"{_INT8_NAMES} (in any order)")
    unknown = sorted(set(data) - set(_INT8_DATA))
    if unknown:
        refuse(f"_data.{unknown[0]}", data[unknown[0]], f"only {', '.join(_INT8_DATA)}")
    if data.get("act_quant_kwargs") not in (None, INT8DQ_ACTIVATIONS):
        refuse("act_quant_kwargs", data["act_quant_kwargs"],
               f"null (int8wo) or {json.dumps(INT8DQ_ACTIVATIONS)} (int8dq)")
    if data.get("reduce_range", False) is not False:
        refuse("reduce_range", data["reduce_range"], "false")
    dtype = data.get("dtype")
    if not (isinstance(dtype, dict) and set(dtype) == {"_type", "_data"} and dtype["_type"] == "torch.dtype"
            and isinstance(dtype["_data"], str) and dtype["_data"] in _FLOATS):
        refuse("dtype", dtype, f'{{"_type": "torch.dtype", "_data": one of {", ".join(_FLOATS)}}}')


def resolve_torchao(stored: StoredWeight) -> None:
    """Check the inner tensors against each other and the metadata; sets shape and dtype."""
    where = f"metadata {stored.key!r} of {stored.roles['qdata'].file}"
    data = stored.info.get("_data")
    dtype = data.get("dtype") if isinstance(data, dict) else None
    dtype = dtype.get("_data") if isinstance(dtype, dict) else None
    if dtype not in _FLOATS:
        raise CheckpointFormatError(f"{where}: the weight's dtype {dtype!r} is not one of {', '.join(_FLOATS)}. "
                                    f"{_RESAVE}")
    qdata = stored.roles["qdata"]
    out = qdata.shape[0] if len(qdata.shape) == 2 else -1
    wrong = [f"{stored.where(role)} is {rec.dtype} {list(rec.shape)}" for role, rec in stored.roles.items()
             if not _fits(role, rec, out)]
    if out < 0 or wrong or data.get("block_size") != [1, qdata.shape[1]]:
        raise CheckpointFormatError(
            f"{where} (block_size {data.get('block_size')!r}) does not fit its tensors: "
            f"{'; '.join(wrong) or f'qdata {list(qdata.shape)}'}. An Int8Tensor holds int8 qdata (out, in), "
            f"and a scale and an int8 zero point per row, block_size [1, in]. {_RESAVE}")
    stored.shape, stored.dtype = tuple(qdata.shape), _FLOATS[dtype]


def build(stored: StoredWeight, tensors: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensor subclass the metadata describes, around the inner ``tensors`` (by name) moved to ``device``."""
    from torchao.prototype.safetensors.safetensors_utils import object_from_dict

    info = copy.deepcopy(stored.info)
    info["_data"].update({name: tensor.to(device) for name, tensor in tensors.items()})
    try:
        weight = object_from_dict(info)
    except (ValueError, TypeError, KeyError, AttributeError, NotImplementedError) as e:
        raise CheckpointFormatError(f"metadata {stored.key!r} of {stored.roles['qdata'].file}: torchao cannot build "
                                    f"the weight from it ({type(e).__name__}: {e}). {_RESAVE}") from e
    if type(weight).__name__ != info["_type"] or tuple(weight.shape) != stored.shape:
        raise CheckpointFormatError(f"metadata {stored.key!r}: torchao built a {type(weight).__name__} of shape "
                                    f"{list(weight.shape)}, not a {info['_type']} {list(stored.shape)}. {_RESAVE}")
    return weight


def state_dict_torchao(module: nn.Module) -> dict[str, torch.Tensor]:
    """The weight's inner tensors as torchao's flattening names them (``_weight_<name>``), then the bias."""
    weight = module.weight
    names = list(weight.tensor_data_names) + [n for n in getattr(weight, "optional_tensor_data_names", [])
                                              if getattr(weight, n) is not None]
    out = {f"_weight_{name}": getattr(weight, name) for name in names}
    if getattr(module, "bias", None) is not None:
        out["bias"] = module.bias.data
    return out


def file_metadata(weights: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The metadata torchao's flattening writes for ``weights`` (name -> tensor subclass), in every file."""
    from torchao.prototype.safetensors.safetensors_utils import TensorSubclassAttributeJSONEncoder

    if not weights:
        return {}
    out = {name: json.dumps(weight, cls=TensorSubclassAttributeJSONEncoder) for name, weight in weights.items()}
    return out | {"tensor_names": json.dumps(list(weights))}


def _roles(name: str, info: dict[str, Any], records: Mapping[str, TensorRecord], files: str) -> dict[str, TensorRecord]:
    module, dot, leaf = name.rpartition(".")
    names = info.get("_tensor_data_names")
    if not dot or not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise CheckpointFormatError(f"{files}: metadata {name!r} names no inner tensors (_tensor_data_names "
                                    f"{names!r}) of a module's weight. {_RESAVE}")
    keys = {n: f"{module}._{leaf}_{n}" for n in names}
    absent = [key for key in keys.values() if key not in records]
    if absent or "qdata" not in keys:
        raise CheckpointFormatError(f"{files}: the torchao weight {name!r} lacks {', '.join(map(repr, absent))} "
                                    f"(its metadata names {names!r}). {_RESAVE}")
    return {"qdata": records[keys.pop("qdata")], **{n: records[key] for n, key in keys.items()}}


_FITS: dict[str, Callable[[TensorRecord, int], bool]] = {  # an Int8Tensor's inner tensors, for out rows
    "qdata": lambda rec, out: rec.dtype == torch.int8 and len(rec.shape) == 2,
    "scale": lambda rec, out: rec.dtype.is_floating_point and rec.numel == out,
    "zero_point": lambda rec, out: rec.dtype == torch.int8 and rec.numel == out,
}


def _fits(role: str, rec: TensorRecord, out: int) -> bool:
    check = _FITS.get(role)
    return check is not None and check(rec, out)


def _json(text: Any, where: str, kind: type) -> Any:
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except (json.JSONDecodeError, RecursionError) as e:
        raise CheckpointFormatError(f"{where} is not valid JSON ({e}). {_RESAVE}") from e
    if not isinstance(value, kind):
        raise CheckpointFormatError(f"{where} is {text!r:.100}, not the JSON {kind.__name__} torchao writes. {_RESAVE}")
    return value
