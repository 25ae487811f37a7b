"""bitsandbytes weights as transformers saves them, and read back as they are.

transformers' ``save_pretrained`` writes what bitsandbytes' own ``state_dict`` gives, one module at a time:

=================================================  ==========================================================
4-bit (``Linear4bit``), module ``P``               8-bit (``Linear8bitLt``), module ``P``
=================================================  ==========================================================
``P.weight``: the packed 4-bit pairs, ``(n/2, 1)``  ``P.weight``: int8 codes, ``(out, in)``
uint8 (or the ``quant_storage`` dtype)
``P.weight.absmax``: a scale per block (fp32; uint8  ``P.SCB``: an fp32 scale per row, ``(out,)``
with double quantization)
``P.weight.quant_map``: the 16-value code (fp32)     ``P.weight_format``: uint8 ``0`` ("row", kept by bitsandbytes
                                                    for older readers)
``P.weight.nested_absmax``, ``nested_quant_map``:
the scales' own scales and code (double quant.)
``P.weight.quant_state.bitsandbytes__nf4`` (or
``__fp4``): uint8 bytes of the JSON of the rest of
``QuantState.as_dict(packed=True)``: quant_type,
blocksize, dtype, shape (and nested_blocksize,
nested_dtype, nested_offset)
=================================================  ==========================================================

:class:`Bnb4bitLayout` and :class:`BnbInt8Layout` are these layouts, filed for bitsandbytes' scheme configs
(``bnb.py``). Loading takes these tensors as they are: ``Params4bit.from_prequantized`` (what transformers calls) and
``Int8Params``, nothing quantized again. The JSON of each 4-bit weight (a few hundred bytes) is read
and checked with the headers, before any weight: it is the only place the weight's own shape and dtype are.
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_lowmem.errors import CheckpointFormatError, CheckpointMismatchError
from lightning_lowmem.formats import TensorRecord
from lightning_lowmem.quantize.bnb import BLOCKSIZES, Bnb4bit, BnbInt8
from lightning_lowmem.quantize.layouts import StoredLayout, StoredWeight, register_layout
from lightning_lowmem.quantize.schemes import SCHEMES, QuantScheme

_STATE = ".quant_state.bitsandbytes__"
MAX_STATE_BYTES = 64 * 2**10
"""The largest quant-state JSON read (bitsandbytes writes 80-200 bytes): it is read with the headers."""
_FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_RESAVE = "The checkpoint is damaged or was not written by bitsandbytes/transformers: download or save it again."


# ---------------------------------------------------------------- 4-bit

@register_layout(Bnb4bit)
class Bnb4bitLayout(StoredLayout):
    """``Linear4bit`` (nf4, fp4, with or without double quantization) as transformers saves it."""

    def holding(self, module: nn.Module) -> QuantScheme | None:
        if not _is_bnb(module, "Linear4bit", "LinearNF4", "LinearFP4"):
            return None
        state = getattr(module.weight, "quant_state", None)
        if state is None:
            return None
        nested = state.original_nested if getattr(state, "packing_format_for_cpu", False) else state.nested
        cls = _4bit_class(state.quant_type, nested)
        if cls is None:
            return None
        return cls(blocksize=state.blocksize, quant_storage=getattr(module.weight, "quant_storage", torch.uint8))

    def state_dict_of(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """What bitsandbytes' ``Linear4bit`` saves (weight, bias, then the packed quant state), without changing the
        module: a weight bitsandbytes repacked for its CPU kernel is converted back on a copy."""
        weight, state = module.weight.data, module.weight.quant_state
        if getattr(state, "packing_format_for_cpu", False):
            weight, state = _unpacked_for_cpu(module, weight, state)
        out = {"weight": weight}
        if module.bias is not None:
            out["bias"] = module.bias.data
        out |= {f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}
        return out

    def transformers_config(self, scheme: QuantScheme, skip: list[str],
                            compute_dtype: torch.dtype) -> dict[str, Any] | None:
        return {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
                "bnb_4bit_quant_type": scheme.quant_type, "bnb_4bit_use_double_quant": scheme.double_quant,
                "bnb_4bit_compute_dtype": str(compute_dtype).removeprefix("torch."),
                "bnb_4bit_quant_storage": str(scheme.quant_storage).removeprefix("torch."),
                "llm_int8_skip_modules": skip or None}

    def find_stored(self, records: Mapping[str, TensorRecord], metadata: Mapping[str, str],
                    files: str) -> dict[str, StoredWeight]:
        """Every 4-bit weight of ``records``, known by its ``quant_state.bitsandbytes__*`` key; headers only."""
        found = {}
        for key in records:
            head, sep, quant_type = key.rpartition(_STATE)
            if not sep or not head.endswith(".weight") and head != "weight":
                continue
            roles = {"weight": head, "absmax": f"{head}.absmax", "quant_map": f"{head}.quant_map"}
            nested = f"{head}.nested_absmax" in records
            if nested:
                roles |= {"nested_absmax": f"{head}.nested_absmax", "nested_quant_map": f"{head}.nested_quant_map"}
            roles["quant_state"] = key
            absent = [k for k in roles.values() if k not in records]
            if absent:
                raise CheckpointFormatError(
                    f"{files}: the 4-bit weight {head!r} ({key!r}) lacks {', '.join(map(repr, absent))}, which "
                    f"bitsandbytes stores beside it. {_RESAVE}")
            if quant_type not in ("nf4", "fp4"):
                raise CheckpointFormatError(f"{files}: {key!r} names the 4-bit type {quant_type!r}; bitsandbytes "
                                            f"writes 'nf4' or 'fp4'. {_RESAVE}")
            if records[key].nbytes > MAX_STATE_BYTES:  # read before any weight: bounded
                raise CheckpointFormatError(f"{files}: {key!r} holds {records[key].nbytes} bytes; the JSON "
                                            f"bitsandbytes writes there is a few hundred (at most {MAX_STATE_BYTES}). "
                                            f"{_RESAVE}")
            found[head] = StoredWeight(head, _4bit_class(quant_type, nested).name,
                                       {r: records[k] for r, k in roles.items()})
        return found

    def resolve_stored(self, stored: StoredWeight, read: Callable[[str], torch.Tensor],
                       requested: QuantScheme | None) -> None:
        state = _resolve_4bit(stored, read)
        try:
            scheme = SCHEMES[stored.scheme_name](blocksize=state["blocksize"],
                                                 quant_storage=stored.roles["weight"].dtype)
        except ValueError as e:
            raise CheckpointFormatError(f"{stored.where('quant_state')}: {e}") from e
        _check_requested(stored, requested, scheme)
        stored.scheme = scheme

    def load_stored(self, module: nn.Module, stored: StoredWeight, tensors: Mapping[str, torch.Tensor],
                    device: torch.device) -> None:
        """The ``Params4bit`` and quant state ``Params4bit.from_prequantized`` makes of the stored tensors (what
        transformers calls), built from the quant state parsed with the headers (``stored.info``): the JSON is not
        read again from the tensors, and tensors already on ``device`` (the disk tier's copies) stay as they are, so
        a layer read for each forward costs no copy back to the host and no blocking one to the device (the
        double-quantization offset is filled on the device)."""
        from bitsandbytes.nn import Params4bit

        try:
            state = _quant_state(stored, {role: t.to(device) for role, t in tensors.items() if role != "quant_state"},
                                 device)
            weight = Params4bit(tensors["weight"].to(device), requires_grad=False, quant_state=state,
                                blocksize=state.blocksize, compress_statistics=state.nested,
                                quant_type=state.quant_type, quant_storage=tensors["weight"].dtype, module=module,
                                bnb_quantized=True)
        except (ValueError, KeyError, TypeError, AssertionError) as e:
            raise CheckpointFormatError(f"{stored.where('quant_state')}: bitsandbytes cannot rebuild the quant "
                                        f"state ({type(e).__name__}: {e}). {_RESAVE}") from e
        module.weight = weight
        module.quant_state = weight.quant_state

    def dequantize_stored(self, stored: StoredWeight, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        import bitsandbytes.functional as F

        packed = tensors["weight"]
        if packed.is_meta:
            return torch.empty(stored.shape, dtype=stored.dtype, device="meta")
        state = F.QuantState.from_dict(_stats(stored, tensors), device=packed.device)
        return F.dequantize_4bit(packed, state)


def _4bit_class(quant_type: str, nested: bool) -> type[Bnb4bit] | None:
    """The registered 4-bit scheme of ``quant_type`` (``"nf4"``, ``"fp4"``), with double quantization or not."""
    return next((c for c in SCHEMES.values()
                 if issubclass(c, Bnb4bit) and (c.quant_type, c.double_quant) == (quant_type, nested)), None)


def _resolve_4bit(stored: StoredWeight, read: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    """The weight's quant state (JSON), read and checked against its tensors' headers; sets shape and dtype."""
    where = stored.where("quant_state")
    state = _parse_state(read(stored.roles["quant_state"].key), where)
    nested = "nested_absmax" in stored.roles
    _check_fields(state, nested, where)
    shape, dtype = _shape(state, where), _dtype(state.get("dtype"), where, "dtype")
    blocksize = state.get("blocksize")
    quant_type = stored.roles["quant_state"].key.rpartition("__")[2]
    if state.get("quant_type") != quant_type or blocksize not in BLOCKSIZES or type(blocksize) is not int:
        raise CheckpointFormatError(f"{where}: quant_type {state.get('quant_type')!r} and blocksize {blocksize!r} do "
                                    f"not describe a {quant_type} weight (the key says {quant_type!r}; a blocksize "
                                    f"is one of {BLOCKSIZES}). {_RESAVE}")
    n = math.prod(shape)
    weight, blocks = stored.roles["weight"], math.ceil(n / blocksize)
    packed = math.ceil(n / 2)
    expect = {"weight": (weight.dtype, weight.numel * weight.dtype.itemsize == packed, f"{packed} bytes"),
              "absmax": (torch.uint8 if nested else torch.float32, stored.roles["absmax"].numel == blocks, f"{blocks} elements"),
              "quant_map": (torch.float32, stored.roles["quant_map"].numel == 16, "16 elements")}
    if nested:
        nested_blocksize = state.get("nested_blocksize")
        if nested_blocksize not in BLOCKSIZES or type(nested_blocksize) is not int:
            raise CheckpointFormatError(f"{where}: nested_blocksize is {nested_blocksize!r}, not one of "
                                        f"{BLOCKSIZES}. {_RESAVE}")
        nested_blocks = math.ceil(blocks / nested_blocksize)
        _dtype(state.get("nested_dtype"), where, "nested_dtype")
        offset = state.get("nested_offset")
        if type(offset) not in (int, float) or not math.isfinite(offset):
            raise CheckpointFormatError(f"{where}: nested_offset is {offset!r}, not a finite number. {_RESAVE}")
        expect |= {"nested_absmax": (torch.float32, stored.roles["nested_absmax"].numel == nested_blocks,
                                     f"{nested_blocks} elements"),
                   "nested_quant_map": (torch.float32, stored.roles["nested_quant_map"].numel == 256, "256 elements")}
    for role, (want_dtype, size_ok, size) in expect.items():
        rec = stored.roles[role]
        if rec.dtype != want_dtype or not size_ok:
            raise CheckpointFormatError(
                f"{stored.where(role)} is {rec.dtype} {list(rec.shape)}, but the quant state {where} (shape "
                f"{list(shape)}, blocksize {blocksize}) needs {want_dtype} holding {size}. {_RESAVE}")
    stored.shape, stored.dtype, stored.info = shape, dtype, state
    return state


_FIELDS = ("quant_type", "blocksize", "dtype", "shape")
_NESTED_FIELDS = ("nested_blocksize", "nested_dtype", "nested_offset")
"""The fields of the quant state JSON bitsandbytes writes (``QuantState.as_dict(packed=True)``), and those it adds
with double quantization."""


def _check_fields(state: dict[str, Any], nested: bool, where: str) -> None:
    """Raise for a field bitsandbytes does not write, or one missing: the nested ones with double quantization only
    (its ``nested_absmax`` beside the weight)."""
    written = _FIELDS + (_NESTED_FIELDS if nested else ())
    unknown = [field for field in state if field not in written]
    missing = [field for field in written if field not in state]
    if unknown or missing:
        field = (unknown or missing)[0]
        what = f"holds {field} ({json.dumps(state[field])[:100]})" if unknown else f"lacks {field}"
        raise CheckpointFormatError(
            f"{where} {what}: bitsandbytes writes {', '.join(written)} for a weight "
            f"{'with' if nested else 'without'} double quantization (nested_absmax beside it). {_RESAVE}")


def _unpacked_for_cpu(module: nn.Module, weight: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
    """The weight and quant state as they were before bitsandbytes repacked them for its CPU kernel (a
    layer's first forward on a CPU with AVX512-bf16): the codes exactly, the scales rounded to bf16 there."""
    import bitsandbytes.functional as F

    warnings.warn(f"A {type(module).__name__} has run a forward on CPU, where bitsandbytes repacked its weight and "
                  "rounded its scales to bf16; it is saved with those rounded scales (its codes are exact). Save "
                  "before the first forward to keep the scales bit for bit.", UserWarning, stacklevel=4)
    nested = state.original_nested
    weight, state = F._convert_weight_packed_for_cpu_inverse(weight, copy.copy(state))
    if not nested:  # bitsandbytes' inverse leaves these scales in its CPU layout: (in / blocksize, out) bf16
        state.absmax = state.absmax.T.reshape(-1).to(torch.float32).contiguous()
    return weight, state


def _quant_state(stored: StoredWeight, tensors: Mapping[str, torch.Tensor], device: torch.device) -> Any:
    """The ``QuantState`` ``QuantState.from_dict`` makes of the stored tensors (by role, on ``device``) and the
    parsed JSON (``stored.info``), without reading the JSON tensor: the nested offset is a fill on ``device``."""
    import bitsandbytes.functional as F

    info = stored.info
    offset = state2 = None
    if "nested_absmax" in tensors:
        offset = torch.full((), float(info["nested_offset"]), dtype=torch.float32, device=device)
        state2 = F.QuantState(absmax=tensors["nested_absmax"], code=tensors["nested_quant_map"],
                              blocksize=info["nested_blocksize"], dtype=_FLOATS[info["nested_dtype"]])
    return F.QuantState(absmax=tensors["absmax"], shape=torch.Size(info["shape"]), code=tensors["quant_map"],
                        blocksize=info["blocksize"], quant_type=info["quant_type"], dtype=_FLOATS[info["dtype"]],
                        offset=offset, state2=state2)


def _stats(stored: StoredWeight, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors ``Params4bit.from_prequantized`` and ``QuantState.from_dict`` take, under their keys."""
    start = len(stored.key) + 1  # "<module>.weight.absmax" -> "absmax"
    return {stored.roles[role].key[start:]: tensor for role, tensor in tensors.items() if role != "weight"}


def _parse_state(blob: torch.Tensor, where: str) -> dict[str, Any]:
    try:
        state = json.loads(bytes(blob.reshape(-1).view(torch.uint8).numpy()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointFormatError(f"{where} is not the JSON bitsandbytes writes ({type(e).__name__}: "
                                    f"{str(e)[:200]}). {_RESAVE}") from e
    if not isinstance(state, dict):
        raise CheckpointFormatError(f"{where} holds a JSON {type(state).__name__}, not the object of a quant state. "
                                    f"{_RESAVE}")
    return state


def _shape(state: dict[str, Any], where: str) -> tuple[int, int]:
    shape = state.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(s) is int and s > 0 for s in shape)):
        raise CheckpointFormatError(f"{where}: shape {shape!r} is not the (out_features, in_features) of a Linear "
                                    f"weight. {_RESAVE}")
    return tuple(shape)


def _dtype(name: Any, where: str, field: str) -> torch.dtype:
    if name not in _FLOATS:
        raise CheckpointFormatError(f"{where}: {field} {name!r} is not one of {', '.join(_FLOATS)}. {_RESAVE}")
    return _FLOATS[name]


# ---------------------------------------------------------------- 8-bit

@register_layout(BnbInt8)
class BnbInt8Layout(StoredLayout):
    """``Linear8bitLt`` (LLM.int8()) as transformers saves it."""

    def holding(self, module: nn.Module) -> QuantScheme | None:
        if not _is_bnb(module, "Linear8bitLt") or module.state.has_fp16_weights:
            return None
        return BnbInt8(threshold=module.state.threshold) if module.weight.dtype == torch.int8 else None

    def state_dict_of(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """What bitsandbytes' ``Linear8bitLt`` saves: weight, bias, row scales (kept in ``module.state`` after its
        first forward) and the row-major format flag."""
        scales = getattr(module.weight, "SCB", None)
        scales = scales if scales is not None else module.state.SCB
        out = {"weight": module.weight.data}
        if module.bias is not None:
            out["bias"] = module.bias.data
        return out | {"SCB": scales, "weight_format": torch.tensor(0, dtype=torch.uint8, device=scales.device)}

    def transformers_config(self, scheme: QuantScheme, skip: list[str],
                            compute_dtype: torch.dtype) -> dict[str, Any] | None:
        return {"quant_method": "bitsandbytes", "load_in_4bit": False, "load_in_8bit": True,
                "llm_int8_threshold": scheme.threshold, "llm_int8_skip_modules": skip or None}

    def find_stored(self, records: Mapping[str, TensorRecord], metadata: Mapping[str, str],
                    files: str) -> dict[str, StoredWeight]:
        """Every int8 weight of ``records``: an int8 ``P.weight`` with a ``P.SCB`` beside it; headers only."""
        found = {}
        for key, rec in records.items():
            if not (key == "SCB" or key.endswith(".SCB")):
                continue
            prefix = key[: -len("SCB")]
            weight = records.get(f"{prefix}weight")
            if weight is None or weight.dtype != torch.int8:
                raise CheckpointFormatError(
                    f"{files}: {key!r} is the row scales of an int8 weight, but {prefix + 'weight'!r} is "
                    f"{'not in the checkpoint' if weight is None else f'{weight.dtype}, not int8'}. {_RESAVE}")
            roles = {"weight": weight, "SCB": rec}
            if f"{prefix}weight_format" in records:
                roles["weight_format"] = records[f"{prefix}weight_format"]
            found[weight.key] = StoredWeight(weight.key, BnbInt8.name, roles)
        return found

    def resolve_stored(self, stored: StoredWeight, read: Callable[[str], torch.Tensor],
                       requested: QuantScheme | None) -> None:
        """Check the int8 weight's row scales (and format flag) against it; sets shape and dtype."""
        weight, scales = stored.roles["weight"], stored.roles["SCB"]
        if len(weight.shape) != 2 or scales.shape != weight.shape[:1] or scales.dtype != torch.float32:
            raise CheckpointFormatError(
                f"{stored.where('SCB')} is {scales.dtype} {list(scales.shape)}, but the int8 weight "
                f"{stored.where('weight')} of shape {list(weight.shape)} needs float32 [{weight.shape[0]}] (one "
                f"scale per row). {_RESAVE}")
        flag = stored.roles.get("weight_format")
        if flag is not None and (flag.numel != 1 or flag.dtype not in (torch.uint8, torch.int64, torch.int32)):
            raise CheckpointFormatError(f"{stored.where('weight_format')} is {flag.dtype} {list(flag.shape)}, not "
                                        f"the one-element format flag bitsandbytes writes. {_RESAVE}")
        if flag is not None:  # one element, read before any weight
            self.check_read(stored, {"weight_format": read(flag.key)})
        stored.shape, stored.dtype = tuple(weight.shape), torch.float32
        # the threshold is not stored: it is a run option, the one asked for is used
        stored.scheme = requested if isinstance(requested, BnbInt8) else BnbInt8()

    def load_stored(self, module: nn.Module, stored: StoredWeight, tensors: Mapping[str, torch.Tensor],
                    device: torch.device) -> None:
        """An ``Int8Params`` around the stored codes and row scales; the format flag is checked where it is on the
        host (the disk tier checks it as read: :meth:`check_read`), never read back from a device."""
        from bitsandbytes.nn import Int8Params

        weight = tensors["weight"].to(device)  # its weight_format was checked to be 0 (row-major) by resolve_stored
        module.weight = Int8Params(weight, requires_grad=False, has_fp16_weights=False, CB=weight,
                                   SCB=tensors["SCB"].to(device))

    def check_read(self, stored: StoredWeight, tensors: Mapping[str, torch.Tensor]) -> None:
        """The format flag as read (on the host): bitsandbytes reads row-major int8 weights only (and writes 0)."""
        flag = tensors.get("weight_format")
        if flag is not None and (value := int(flag.reshape(-1)[0])) != 0:
            raise CheckpointFormatError(f"{stored.where('weight_format')} is {value}; bitsandbytes reads only "
                                        "row-major int8 weights (0), and writes 0. Save it again with bitsandbytes "
                                        ">= 0.45.")

    def dequantize_stored(self, stored: StoredWeight, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        import bitsandbytes.functional as F

        if tensors["weight"].is_meta:
            return torch.empty(stored.shape, dtype=stored.dtype, device="meta")
        return F.int8_vectorwise_dequant(tensors["weight"], tensors["SCB"])


def _is_bnb(module: nn.Module, *names: str) -> bool:
    """Whether ``module`` is one of bitsandbytes' module classes ``names`` (bitsandbytes is not imported)."""
    return type(module).__name__ in names and type(module).__module__.startswith("bitsandbytes")


def _check_requested(stored: StoredWeight, requested: QuantScheme | None, scheme: QuantScheme) -> None:
    """A ``quantize=`` scheme object of the same name whose storage options differ from the file's is a mismatch."""
    if requested is not None and requested.name == scheme.name and requested != scheme:
        raise CheckpointMismatchError(
            f"{stored.where('weight')} is stored as {scheme!r}, but quantize={requested!r} asks for other options. "
            f"Pass quantize={scheme.name!r} (or None) to load it as stored.")
