"""Reading a torch checkpoint's pickle without running anything it asks for.

A ``torch.save`` file's ``data.pkl`` describes the saved object: dicts, lists, numbers,
strings, and tensors as calls to ``torch._utils._rebuild_tensor_v2(storage, offset,
size, stride, ...)`` whose storages are records of the zip file. Unpickling it with
:class:`InertUnpickler` builds only what is data:

* tensors become :class:`TensorRef` s (storage record, dtype, offset, size, stride): no
  storage is read or allocated here;
* plain containers and values (dict, OrderedDict, list, tuple, set, numbers, strings,
  ``torch.Size``, dtypes, devices) are built as usual;
* every other global the pickle names (a LightningModule's hyper-parameters: a
  ``pathlib.Path``, a dataclass, an ``argparse.Namespace``, the user's own class, but
  also ``builtins.bytearray`` or ``os.system``) becomes an :class:`Inert` placeholder
  that records the name and its arguments. Nothing is imported, constructed or called.

The unpickler is Python's own (``pickle._Unpickler``), with its lookup of globals and
its object-building opcodes replaced. It allocates nothing the pickle's own bytes do not
hold, so a pickle can cost no more memory than its size.
"""

from __future__ import annotations

import codecs
import collections
import io
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

_STORAGE_DTYPES: dict[str, torch.dtype | None] = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128, "ComplexFloatStorage": torch.complex64,
    "UntypedStorage": None,  # bytes; the tensor names its dtype (``_rebuild_tensor_v3``)
}
"""Storage classes a torch pickle names -> the dtype of their elements (torch's ``_storage_type_to_dtype_map``
without the quantized ones)."""

_BUILTINS = {name: getattr(__import__("builtins"), name)
             for name in ("set", "frozenset", "list", "dict", "tuple", "slice", "complex", "int", "float", "bool", "str")}


@dataclass(frozen=True)
class StorageRef:
    """A storage the pickle refers to: the zip record ``data/<key>``.

    Attributes:
        key: the record's name under ``data/``.
        dtype: the element dtype (None: an untyped storage of bytes).
        numel: elements (bytes when untyped) the pickle says it holds.
    """

    key: str
    dtype: torch.dtype | None
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * (self.dtype.itemsize if self.dtype is not None else 1)


@dataclass(frozen=True)
class TensorRef:
    """A tensor the pickle describes, not read: a view ``(offset, shape, stride)`` of a storage, in elements."""

    storage: StorageRef
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass
class Inert:
    """What stands in for an object of a global the unpickler does not build: its name and arguments only.

    Attributes:
        name: ``"module.qualname"`` of the global.
        args: the arguments the pickle would have called it with.
        state: what the pickle would have set on it.
    """

    name: str
    args: tuple[Any, ...] = ()
    state: Any = None

    def __setstate__(self, state: Any) -> None:  # pickle's BUILD: keep, never apply
        self.state = state

    def __repr__(self) -> str:
        return f"<not restored: {self.name}>"

    __hash__ = object.__hash__


@dataclass(frozen=True)
class _Global:
    """A global the unpickler does not build; calling it (REDUCE, NEWOBJ) makes an :class:`Inert`."""

    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Inert:
        return Inert(self.name, args + tuple(kwargs.items()))


@dataclass(frozen=True)
class _StorageType:
    name: str
    dtype: torch.dtype | None


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> TensorRef | Inert:
    if not isinstance(storage, StorageRef) or storage.dtype is None:
        return Inert("torch._utils._rebuild_tensor_v2", (storage, offset, size, stride))
    return _tensor(storage, storage.dtype, offset, size, stride)


def _rebuild_tensor_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                       hooks: Any = None, dtype: Any = None, *rest: Any) -> TensorRef | Inert:
    if not isinstance(storage, StorageRef) or not isinstance(dtype, torch.dtype):
        return Inert("torch._utils._rebuild_tensor_v3", (storage, offset, size, stride, dtype))
    return _tensor(storage, dtype, offset, size, stride)


def _tensor(storage: StorageRef, dtype: torch.dtype, offset: Any, size: Any, stride: Any) -> TensorRef | Inert:
    size = tuple(size) if isinstance(size, (tuple, list)) else (None,)
    stride = tuple(stride) if isinstance(stride, (tuple, list)) else (None,)
    if not all(type(v) is int and v >= 0 for v in (offset, *size, *stride)) or len(size) != len(stride):
        return Inert("torch._utils._rebuild_tensor_v2", (storage, offset, size, stride))
    return TensorRef(storage, dtype, offset, size, stride)


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data  # a Parameter's data is what is loaded; requires_grad is the module's business


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """``torch._tensor._rebuild_from_type_v2``: a tensor subclass; only plain tensors and Parameters are data."""
    if new_type in (torch.Tensor, torch.nn.Parameter) and callable(func) and isinstance(args, tuple):
        return func(*args)
    return Inert("torch._tensor._rebuild_from_type_v2", (func, new_type))


_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch", "Tensor"): torch.Tensor,  # a marker for _rebuild_from_type_v2, never called
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,  # likewise
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("_codecs", "encode"): codecs.encode,  # bytes, in protocol 2 pickles: no bigger than the text they come from
    **{("builtins", name): value for name, value in _BUILTINS.items()},
    **{("__builtin__", name): value for name, value in _BUILTINS.items()},
}
_CONSTRUCTIBLE = (collections.OrderedDict, torch.Size, torch.device, *_BUILTINS.values())
"""The types a pickle may build: containers and values whose construction runs no user code and
allocates no more than their arguments."""
_REBUILDERS = (_rebuild_tensor_v2, _rebuild_tensor_v3, _rebuild_parameter, _rebuild_from_type_v2, codecs.encode)


class InertUnpickler(pickle._Unpickler):  # the pure-Python unpickler: its opcodes can be overridden one by one
    """Unpickles a torch pickle into data, :class:`TensorRef` s and :class:`Inert` placeholders.

    Args:
        file: the pickle's bytes, as a binary file.
        storage: ``storage(key, dtype, numel)`` checks that the storage a tensor refers to exists
            and returns its :class:`StorageRef` (raising a typed error when it does not).
    """

    def __init__(self, file: io.BufferedIOBase, storage: Any) -> None:
        super().__init__(file, encoding="utf-8")
        self._storage = storage
        self.inert: set[str] = set()  # the globals that were not built

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in ("torch", "torch.storage") and name in _STORAGE_DTYPES:
            return _StorageType(name, _STORAGE_DTYPES[name])
        self.inert.add(f"{module}.{name}")
        return _Global(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unknown persistent id {str(pid)[:80]}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"storage {key!r} has the type {storage_type!r}, which holds no plain data "
                                         "(quantized storages are not supported)")
        if type(key) not in (str, int) or type(numel) is not int or numel < 0:  # litgpt's incremental saves: int keys
            raise pickle.UnpicklingError(f"storage reference {str(pid)[:80]} is malformed")
        return self._storage(str(key), storage_type.dtype, numel)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(_build(cls, args, {}, new=True))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(_build(cls, args, kwargs, new=True))

    def load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = _build(self.stack[-1], args, {})

    def _instantiate(self, klass: Any, args: Any) -> None:  # INST and OBJ (protocols 0 and 1)
        self.append(_build(klass, tuple(args), {}))

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.REDUCE[0]] = load_reduce


def _build(func: Any, args: Any, kwargs: Any, new: bool = False) -> Any:
    """What the pickle asks ``func`` to make of ``args``: the allowed containers and values, tensor references,
    and an :class:`Inert` for everything else (the global is never called)."""
    if func in _REBUILDERS:
        return func(*args, **kwargs)
    if isinstance(func, type) and func in _CONSTRUCTIBLE:
        return func.__new__(func, *args, **kwargs) if new else func(*args, **kwargs)
    name = func.name if isinstance(func, _Global) else getattr(func, "__qualname__", type(func).__name__)
    return Inert(name, tuple(args) + tuple(dict(kwargs).items()))


def inert_paths(obj: Any, prefix: str = "") -> list[str]:
    """Where in ``obj`` the :class:`Inert` placeholders are (``"hyper_parameters.path"``), outermost first."""
    found: list[str] = []
    stack: list[tuple[str, Any]] = [(prefix, obj)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, Inert):
            found.append(where or "(the whole object)")
        elif isinstance(value, dict):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in value.items())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
    return sorted(found)
