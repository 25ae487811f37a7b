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
its object-building opcodes replaced. What it builds is bounded by the pickle's size: the
containers it may construct copy and hash at most a few times as many items as the pickle
has bytes (``list(x)`` repeated on one large ``x``, or a tuple nested on itself used as a
dict key, would otherwise cost memory or time exponential in the pickle's size), and a
pickle's BUILD (attributes set on an object after it is made) is kept on placeholders,
applied to nothing else but an ``OrderedDict``'s ``_metadata`` (as torch applies it), and
refused on a tensor or a storage: torch.save never writes it, and applied it would move a
tensor outside its storage.
"""

from __future__ import annotations

import codecs
import collections
import io
import math
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

_WORK_PER_BYTE = 8
"""Items the unpickler may copy (``list(x)``, ``set(x)``) or hash through nested tuples (dict keys), per byte of
the pickle: a pickle builds each item from at least one byte of its own, so its own data stays far below."""
_WORK_FLOOR = 2**16
_SCALARS = (type(None), bool, int, float, complex, str, bytes)

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


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
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
        why: why it was not built, when the global is one that is built for valid arguments (a tensor
            whose view has negative numbers); empty for a global that is never built.
    """

    name: str
    args: tuple[Any, ...] = ()
    state: Any = None
    why: str = ""

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
    why = ""
    if not all(type(v) is int and v >= 0 for v in (offset, *size, *stride)) or len(size) != len(stride):
        why = "its offset, shape and stride must be as many non-negative integers as it has dimensions"
    elif math.prod(size) * dtype.itemsize >= 2**63 or max((offset, *size, *stride)) >= 2**63:
        why = "its shape or stride is larger than any tensor can be"
    if why:
        return Inert("torch._utils._rebuild_tensor_v2", (storage, offset, size, stride),
                     why=f"{why} (offset {offset!r}, shape {list(size)!r}, stride {list(stride)!r})")
    return TensorRef(storage, dtype, offset, size, stride)


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data  # a Parameter's data is what is loaded; requires_grad is the module's business


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """``torch._tensor._rebuild_from_type_v2``: a tensor subclass; only plain tensors and Parameters are data."""
    if new_type in (torch.Tensor, torch.nn.Parameter) and func in _TENSOR_REBUILDERS and isinstance(args, tuple):
        return func(*args)
    return Inert("torch._tensor._rebuild_from_type_v2", (func, new_type))


def _encode(text: Any, encoding: Any = "utf-8", errors: Any = "strict") -> Any:
    """``_codecs.encode``, with which protocol 2 pickles write bytes: latin-1 only, so no bigger than its text."""
    if type(text) is str and encoding in ("latin1", "latin-1") and errors == "strict":
        return codecs.encode(text, "latin1")
    return Inert("_codecs.encode", (text, encoding, errors))


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
    ("_codecs", "encode"): _encode,
    **{("builtins", name): value for name, value in _BUILTINS.items()},
    **{("__builtin__", name): value for name, value in _BUILTINS.items()},
}
_CONSTRUCTIBLE = (collections.OrderedDict, torch.Size, torch.device, *_BUILTINS.values())
"""The types a pickle may build: containers and values whose construction runs no user code and
allocates no more than their arguments."""
_SCALAR_TYPES = (int, float, complex, bool, str, slice)
"""Built from numbers and strings only (``str`` of a nested list would cost time exponential in its depth)."""
_CONTAINERS = (list, tuple, dict, set, frozenset, collections.OrderedDict)
_TENSOR_REBUILDERS = (_rebuild_tensor_v2, _rebuild_tensor_v3, _rebuild_parameter)
_REBUILDERS = (*_TENSOR_REBUILDERS, _rebuild_from_type_v2, _encode)


class InertUnpickler(pickle._Unpickler):  # the pure-Python unpickler: its opcodes can be overridden one by one
    """Unpickles a torch pickle into data, :class:`TensorRef` s and :class:`Inert` placeholders.

    Args:
        file: the pickle's bytes, as a binary file.
        storage: ``storage(key, dtype, numel)`` checks that the storage a tensor refers to exists
            and returns its :class:`StorageRef` (raising a typed error when it does not).
        nbytes: the pickle's size, which bounds the items its constructors may copy and hash.

    Attributes:
        inert: the globals that were not built.
        built_on: every tensor or storage reference the pickle set attributes on (a BUILD), with what
            it would have set; the reference itself is left as the pickle first made it.
    """

    def __init__(self, file: io.BufferedIOBase, storage: Any, nbytes: int = 0) -> None:
        super().__init__(file, encoding="utf-8")
        self._storage = storage
        self._work = _WORK_PER_BYTE * nbytes + _WORK_FLOOR
        self.inert: set[str] = set()
        self.built_on: dict[int, tuple[TensorRef | StorageRef, Any]] = {}

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

    def _spend(self, items: int) -> None:
        """Count ``items`` copied or hashed against what the pickle's size allows."""
        self._work -= items
        if self._work < 0:
            raise pickle.UnpicklingError(
                "it asks to copy or hash far more items than its bytes hold (a container copied again and again, "
                "or a tuple nested on itself used as a key); torch.save never writes such a pickle")

    def _keys(self, keys: Any) -> None:
        """Charge the hashing of ``keys``: a tuple's hash visits every tuple nested in it, shared or not."""
        stack = [k for k in keys if type(k) is tuple]
        while stack:
            key = stack.pop()
            self._spend(len(key) + 1)
            stack.extend(k for k in key if type(k) is tuple)

    def _build(self, func: Any, args: Any, kwargs: Any, new: bool = False) -> Any:
        """What the pickle asks ``func`` to make of ``args``: the allowed containers and values, tensor references,
        and an :class:`Inert` for everything else (the global is never called)."""
        if func in _REBUILDERS:
            return func(*args, **kwargs)
        if isinstance(func, type) and func in _CONSTRUCTIBLE:
            if func in _SCALAR_TYPES and not all(type(a) in _SCALARS for a in (*args, *dict(kwargs).values())):
                return Inert(func.__qualname__, tuple(args), why="a value built from a container")
            for arg in args:
                if type(arg) in _CONTAINERS:
                    self._spend(len(arg))
                    self._keys(arg)
            return func.__new__(func, *args, **kwargs) if new else func(*args, **kwargs)
        name = func.name if isinstance(func, _Global) else getattr(func, "__qualname__", type(func).__name__)
        return Inert(name, tuple(args) + tuple(dict(kwargs).items()))

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._build(cls, args, {}, new=True))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._build(cls, args, kwargs, new=True))

    def load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._build(self.stack[-1], args, {})

    def _instantiate(self, klass: Any, args: Any) -> None:  # INST and OBJ (protocols 0 and 1)
        self.append(self._build(klass, tuple(args), {}))

    def load_build(self) -> None:
        """BUILD: kept on a placeholder, noted on a tensor or storage (the file is refused), an ``OrderedDict``'s
        attributes (a state dict's ``_metadata``) set as torch sets them, refused on anything else."""
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, Inert):
            inst.state = state
        elif isinstance(inst, (TensorRef, StorageRef)):
            self.built_on[id(inst)] = (inst, state)
        elif type(inst) is collections.OrderedDict and isinstance(state, dict) and all(type(k) is str for k in state):
            inst.__dict__.update(state)
        else:
            raise pickle.UnpicklingError(f"it sets attributes on a {type(inst).__name__} (BUILD), which torch.save "
                                         "never writes")

    def load_setitem(self) -> None:
        self._keys(self.stack[-2:-1])
        super().load_setitem()

    def load_setitems(self) -> None:
        self._keys(self.stack[0::2])  # the items above the mark: key, value, key, value...
        super().load_setitems()

    def load_dict(self) -> None:
        self._keys(self.stack[0::2])
        super().load_dict()

    def load_additems(self) -> None:
        self._keys(self.stack)
        super().load_additems()

    def load_frozenset(self) -> None:
        self._keys(self.stack)
        super().load_frozenset()

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.DICT[0]] = load_dict
    dispatch[pickle.ADDITEMS[0]] = load_additems
    dispatch[pickle.FROZENSET[0]] = load_frozenset
