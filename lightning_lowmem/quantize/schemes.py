"""Quantization schemes: small frozen configs tied to their transform by a registry.

A scheme is a frozen dataclass, validated in ``__post_init__``, that knows

* whether its kernels exist on a device (:meth:`QuantScheme.unavailable_reason`),
* whether it can take a given ``nn.Linear`` (:meth:`QuantScheme.layer_reason`),
* which module stands in for that Linear on the meta device (:meth:`QuantScheme.replace`),
* how to quantize a full-precision weight into that module (:meth:`QuantScheme.load_weight`),
* its sizes: the bytes it stores for a weight (:meth:`QuantScheme.stored_nbytes`), what quantizing
  holds meanwhile (:attr:`~QuantScheme.transient`), what its library costs to import and first call
  (:attr:`~QuantScheme.library_bytes`) and what its largest layer holds in a first forward
  (:attr:`~QuantScheme.first_forward`). The loader, the placement plan and the estimate all ask
  the scheme object, so ``BnbNF4(blocksize=128)`` is counted with its own block size.

Bytes stored for an ``(out_features, in_features)`` weight of ``n`` elements:

============================  =========================================================  ===========
scheme                        bytes                                                      ~ per param
============================  =========================================================  ===========
``bnb.nf4`` / ``bnb.fp4``     ``ceil(n/2)`` 4-bit codes + fp32 absmax per 64-block        0.5625
                              (``4 * ceil(n/64)``) + the 16-value fp32 code table (64)
``bnb.nf4-dq``/``bnb.fp4-dq`` ``ceil(n/2)`` + uint8 absmax per 64-block (``ceil(n/64)``)  0.5159
                              + fp32 absmax of those per 256 (``4 * ceil(ceil(n/64)/256)``)
                              + fp32 offset (4) + code tables (64 + 1024)
``bnb.int8``                  int8 ``n`` + fp32 scale per row (``4 * out``)                1 + 4/in
``torchao.int8wo``/``int8dq`` int8 ``n`` + fp32 scale + int8 zero point per row            1 + 5/in
                              (``5 * out``)
``torchao.int4wo``            ``ceil(n/2)`` + bf16 scale and zero per 128-group            0.53125
                              (``4 * ceil(n/128)``)
``torchao.nf4``               ``n/2`` + int8 scale per 64-block (``n/64``) + a bf16 scale  0.5157
                              per 256 of those (``2 * n/16384``) + bf16 mean (2) + the
                              16-value bf16 code table (32); for bf16 weights
============================  =========================================================  ===========

Every row but ``torchao.int4wo`` (whose kernels need CUDA here) is checked against what the
library stores on CPU (bitsandbytes 0.50.2, torchao 0.18) by the tests.

Under FSDP2 (parameters sharded by rows across ranks, see ``docs/many-ranks.md``) only a scheme
with :attr:`~QuantScheme.shardable` works: its module is built before sharding
(:meth:`~QuantScheme.replace` on the meta device), and each rank quantizes a whole weight and keeps
its rows (:meth:`~QuantScheme.quantize_shard`). Of the registered schemes only ``torchao.nf4``
does: bitsandbytes' ``Params4bit`` loses its ``quant_state`` under ``fully_shard``, and torchao's
int8 and int4 tensors fail inside it (torch 2.13, torchao 0.18).

:func:`register_scheme` files a class under its spelling in :data:`SCHEMES`; adding
a scheme is adding a class (see ``bnb.py`` and ``torchao.py`` next to this file).

Example::

    >>> from lightning_lowmem.quantize import SCHEMES, BnbNF4
    >>> sorted(SCHEMES)[:2]
    ['bnb.fp4', 'bnb.fp4-dq']
    >>> BnbNF4().stored_nbytes((4096, 4096)), BnbNF4(blocksize=128).stored_nbytes((4096, 4096))
    (9437248, 8912960)
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from lightning_lowmem.errors import UnsupportedQuantizationError, format_names
from lightning_lowmem.formats import TensorRecord
from lightning_lowmem.quantize.rows import RowSource

SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class QuantScheme:
    """Base class of every scheme. Subclasses are frozen dataclasses holding the scheme's options."""

    name: ClassVar[str] = ""
    """The spelling the scheme is registered under, e.g. ``"bnb.nf4"`` (set by :func:`register_scheme`)."""
    package: ClassVar[str] = ""
    """The pip package whose kernels the scheme uses."""
    by_rows: ClassVar[bool] = False
    """Whether :meth:`load_weight` also takes a :class:`~lightning_lowmem.quantize.rows.RowSource`: the loader
    then reads the weight a block of rows at a time, and the whole full-precision weight never exists."""
    transient: ClassVar[float] = 0.0
    """Bytes per element quantized at once (one block of rows, or the whole weight) that quantizing holds
    beyond its input and its result (measured on CPU, see the scheme's module)."""
    library_bytes: ClassVar[int] = 0
    """What importing the scheme's library and its first kernel call add to the process (CPU, measured)."""
    first_forward: ClassVar[float] = 2.0
    """Bytes per weight the largest quantized Linear holds in its first forward (a dequantized bf16 copy is
    assumed where not measured)."""
    shardable: ClassVar[bool] = False
    """Whether its weights can be sharded by rows across ranks (FSDP2): see :meth:`quantize_shard`."""

    def stored_nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes stored for a weight of ``shape`` (``(out_features, in_features)``), scales included."""
        raise NotImplementedError

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why the scheme cannot run on ``device`` (a missing package or kernel), or None when it can."""
        if importlib.util.find_spec(self.package) is None:
            return f"it needs the package {self.package!r}, which is not installed (pip install {self.package})"
        if device.type not in SUPPORTED_DEVICE_TYPES:
            return f"lightning_lowmem runs it only on {' and '.join(SUPPORTED_DEVICE_TYPES)}"
        if device.type == "cuda" and not torch.cuda.is_available():
            return "CUDA is not available in this PyTorch build or on this machine"
        return None

    def layer_reason(self, linear: nn.Linear, dtype: torch.dtype) -> str | None:
        """Why ``linear`` (whose weight will arrive in ``dtype``) cannot be quantized, or None when it can."""
        if not dtype.is_floating_point:
            return f"its weight is {dtype}, not floating point"
        return None

    def replace(self, linear: nn.Linear, dtype: torch.dtype) -> nn.Module:
        """The module that takes ``linear``'s place before its weight is read (weights on meta)."""
        return linear

    def load_weight(self, module: nn.Module, weight: torch.Tensor | RowSource) -> None:
        """Quantize the full-precision ``weight`` into ``module`` (made by :meth:`replace`).

        ``weight`` is a :class:`RowSource` only for schemes with :attr:`by_rows`. Must keep no
        reference to ``weight``: the loader frees it before reading the next tensor.
        """
        raise NotImplementedError

    def stack_reason(self, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
        """Why a stack of expert weights of ``shape`` (a 3-D parameter, ``(experts, out, in)``: transformers 5's
        fused MoE experts) arriving in ``dtype`` stays in full precision, or None when this scheme quantizes it
        (:meth:`load_stack`)."""
        return (f"{self.name!r} quantizes nn.Linear weights, and {self.package} has no quantized form of a 3-D "
                "stack of expert weights (transformers 5 leaves fused experts in full precision with it too); "
                "the bitsandbytes 4-bit schemes quantize them")

    def load_stack(self, module: nn.Module, name: str, weight: torch.Tensor | RowSource,
                   shape: tuple[int, ...]) -> None:
        """Quantize the stack of expert weights ``weight`` (the whole stack, or with :attr:`by_rows` its rows one
        block at a time) into parameter ``name`` of ``module``, so that the module's own forward still reads the
        parameter as a full-precision tensor of ``shape``."""
        raise NotImplementedError

    # ---- saved and pre-quantized weights (``stored.py`` has the whole story)

    @classmethod
    def holding(cls, module: nn.Module) -> QuantScheme | None:
        """The scheme of this class that ``module`` holds its weight in (with the options it was quantized
        with), or None. Cheap for modules of other libraries."""
        return None

    def state_dict_of(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """What ``module`` (holding its weight in this scheme) saves, by names relative to the module, in the
        layout transformers saves for the same library."""
        raise NotImplementedError

    @classmethod
    def file_metadata(cls, modules: Mapping[str, tuple[QuantScheme, nn.Module]]) -> dict[str, str]:
        """What a checkpoint file's metadata must say about the quantized ``modules`` (name -> scheme, module,
        every quantized module of the model) for this class's library to read them back; nothing by default."""
        return {}

    @classmethod
    def find_stored(cls, records: Mapping[str, TensorRecord], metadata: Mapping[str, str],
                    files: str) -> dict[str, StoredWeight]:
        """The weights ``records`` hold already quantized in this class's library's layout, by key, from the
        headers (and the file's metadata) alone; nothing is read."""
        return {}

    @classmethod
    def resolve_stored(cls, stored: StoredWeight, read: Callable[[str], torch.Tensor],
                       requested: QuantScheme | None) -> None:
        """Fill in ``stored.shape``, ``dtype`` and ``scheme`` and check its records against each other, reading
        at most the few bytes the library keeps beside the weight (``read(key)``).

        Raises:
            CheckpointFormatError: the stored parts do not fit together, naming the key.
            CheckpointMismatchError: ``requested`` stores weights with other options than the file.
        """
        raise NotImplementedError

    def load_stored(self, module: nn.Module, stored: StoredWeight, tensors: Mapping[str, torch.Tensor],
                    device: torch.device) -> None:
        """Put the stored ``tensors`` (by role, as read) into ``module`` (made by :meth:`replace`) on ``device``,
        as they are."""
        raise NotImplementedError

    def dequantize_stored(self, stored: StoredWeight, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The full-precision weight the stored ``tensors`` (by role) stand for; on meta, an empty one."""
        raise NotImplementedError

    def transformers_config(self, skip: list[str], compute_dtype: torch.dtype) -> dict[str, Any] | None:
        """The ``quantization_config`` transformers reads a checkpoint of this scheme with, ``skip`` naming
        the Linears kept in full precision; None when transformers cannot read it."""
        return None


    def built(self, module: nn.Module) -> bool:
        """Whether ``module`` already is what :meth:`replace` makes (built before the model was sharded)."""
        return False

    def shard_reason(self, shape: tuple[int, ...], count: int) -> str | None:
        """Why a weight of ``shape`` cannot be split by rows into ``count`` shards, or None when it can."""
        return f"{self.name!r} cannot be sharded"

    def quantize_shard(self, weight: torch.Tensor, index: int, count: int) -> torch.Tensor:
        """The ``index``-th of ``count`` row shards of the whole ``weight`` quantized (schemes with
        :attr:`shardable`): the whole weight is quantized, so that scales computed over all of it agree
        on every rank, and the shard is cut out of the result as ``torch.chunk`` (and FSDP2) cut it."""
        raise NotImplementedError


@dataclass
class StoredWeight:
    """A weight a checkpoint holds already quantized, as its headers describe it.

    Attributes:
        key: the weight's name in the checkpoint (``<module>.weight``, before any key map); for torchao's
            layout, which has no tensor of that name, the name its metadata gives it.
        scheme_name: the scheme its layout says, from the keys (and metadata) alone.
        roles: what each stored tensor is (``"weight"``, ``"absmax"``, ``"SCB"``, ``"qdata"``, ...) -> its record.
        info: what the library keeps beside the tensors, parsed (a bitsandbytes quant state, torchao metadata).
        shape: the weight's own shape, ``(out_features, in_features)``, once resolved.
        dtype: the dtype it dequantizes to, once resolved.
        scheme: the scheme object with the file's options, once resolved.
    """

    key: str
    scheme_name: str
    roles: dict[str, TensorRecord]
    info: dict[str, Any] = field(default_factory=dict)
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    scheme: QuantScheme | None = None

    @property
    def parts(self) -> tuple[TensorRecord, ...]:
        """The records read to load it, in the order of :attr:`roles`."""
        return tuple(self.roles.values())

    @property
    def record(self) -> TensorRecord:
        """A record of the weight itself (its own shape and dtype), named :attr:`key`."""
        first = next(iter(self.roles.values()))
        return TensorRecord(self.key, self.shape or (), self.dtype or first.dtype, first.file)

    def where(self, role: str) -> str:
        """``'<key>' in <file>``, for messages."""
        rec = self.roles[role]
        return f"{rec.key!r} in {rec.file}"


SchemeT = TypeVar("SchemeT", bound=type[QuantScheme])

SCHEMES: dict[str, type[QuantScheme]] = {}
"""Spelling -> scheme class. Filled by :func:`register_scheme`."""


def register_scheme(name: str) -> Callable[[SchemeT], SchemeT]:
    """Class decorator: file a scheme under ``name`` (its ``quantize=`` spelling).

    Example::

        >>> @register_scheme("mylib.int8")
        ... @dataclass(frozen=True)
        ... class MyInt8(QuantScheme):
        ...     package: ClassVar[str] = "mylib"
        >>> make_scheme("mylib.int8")
        MyInt8()
        >>> del SCHEMES["mylib.int8"]  # only so that this example leaves the registry as it found it
    """

    def decorate(cls: SchemeT) -> SchemeT:
        if name in SCHEMES and SCHEMES[name] is not cls:
            raise ValueError(f"Quantization scheme {name!r} is already registered by {SCHEMES[name].__qualname__}.")
        cls.name = name
        SCHEMES[name] = cls
        return cls

    return decorate


def make_scheme(name: str) -> QuantScheme:
    """The scheme registered as ``name``, with its default options.

    Raises:
        UnsupportedQuantizationError: no scheme has that name.
    """
    cls = SCHEMES.get(name)
    if cls is None:
        raise UnsupportedQuantizationError(
            f"Unknown quantization scheme {name!r}. Known schemes: {format_names(SCHEMES, limit=len(SCHEMES))}. "
            "Pass one of these as quantize=, or None to load in full precision."
        )
    return cls()


def parse_scheme(quantize: str | QuantScheme | None) -> QuantScheme | None:
    """``quantize=`` as a scheme object: a registered spelling, a scheme instance, or None.

    Raises:
        UnsupportedQuantizationError: no scheme has that name.
        TypeError: neither a name nor a scheme.

    Example::

        >>> parse_scheme("bnb.nf4")
        BnbNF4(quant_type='nf4', double_quant=False, blocksize=64, quant_storage=torch.uint8)
    """
    if quantize is None or isinstance(quantize, QuantScheme):
        return quantize
    if isinstance(quantize, str):
        return make_scheme(quantize)
    raise TypeError(f"quantize must be a scheme name such as 'bnb.nf4' or a QuantScheme, "
                    f"got {type(quantize).__name__}: {quantize!r}.")


def library_classes(method: str) -> list[type[QuantScheme]]:
    """One registered class per distinct implementation of the classmethod ``method`` (one per library layout).

    Example::

        >>> [cls.__name__ for cls in library_classes("find_stored")]
        ['BnbNF4', 'BnbInt8', 'TorchaoInt8WeightOnly']
    """
    seen: dict[object, type[QuantScheme]] = {}
    for cls in SCHEMES.values():
        function = getattr(cls, method).__func__
        if function is not getattr(QuantScheme, method).__func__:
            seen.setdefault(function, cls)
    return list(seen.values())


def schemes_available_on(device: torch.device) -> list[str]:
    """The names of the registered schemes whose kernels run on ``device``."""
    return [name for name, cls in SCHEMES.items() if cls().unavailable_reason(device) is None]


def check_shardable(scheme: QuantScheme, where: str) -> None:
    """Raise :class:`UnsupportedQuantizationError` when ``scheme`` cannot be sharded across ranks.

    Args:
        scheme: the scheme asked for.
        where: what is sharded, for the message (``"the model's parameters are DTensors"``).
    """
    if scheme.shardable:
        return
    shardable = [name for name, cls in SCHEMES.items() if cls.shardable]
    raise UnsupportedQuantizationError(
        f"Quantization scheme {scheme.name!r} cannot be sharded across ranks ({where}): its quantized weights "
        f"do not survive torch's fully_shard (FSDP2). Schemes that shard: {format_names(shardable)}. Pass "
        f"quantize={shardable[0] if shardable else None!r} for QLoRA under FSDP2, or load on one device "
        "(strategy='lowmem'); nothing was read from the checkpoint."
    )


def check_available(scheme: QuantScheme, device: torch.device) -> None:
    """Raise :class:`UnsupportedQuantizationError` when ``scheme`` has no kernel on ``device``.

    The message names the scheme, the device, the reason (usually a missing package) and the
    schemes that do work there.
    """
    reason = scheme.unavailable_reason(device)
    if reason is None:
        return
    working = schemes_available_on(device)
    others = format_names(working, limit=len(working)) if working else "none"
    raise UnsupportedQuantizationError(
        f"Quantization scheme {scheme.name!r} cannot run on device {str(device)!r}: {reason}. "
        f"Schemes that work on {str(device)!r} here: {others}. "
        "Pick one of those, or fix what is missing; nothing was read from the checkpoint."
    )
