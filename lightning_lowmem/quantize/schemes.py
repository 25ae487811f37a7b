"""Quantization schemes: small frozen configs, tied to their transforms by a registry.

As in torchao's ``quant_api`` (a config dataclass per workflow, a registry from config type to the
function that applies it), a scheme is split in three, each tied to the config class by a registry:

* the **config** (this module's :class:`QuantScheme`): a frozen dataclass of the scheme's options,
  validated in ``__post_init__``, that knows its sizes (:meth:`~QuantScheme.stored_nbytes`, what
  quantizing holds meanwhile (:attr:`~QuantScheme.transient`), what its library costs to import and
  first call (:attr:`~QuantScheme.library_bytes`), what its largest layer holds in a first forward
  (:attr:`~QuantScheme.first_forward`)), which Linears it takes (:meth:`~QuantScheme.layer_reason`),
  whether its kernels run on a device (:meth:`~QuantScheme.unavailable_reason`) and whether its weights
  shard (:meth:`~QuantScheme.shard_reason`). The loader, the placement plan and the estimate all ask the
  scheme object, so ``BnbNF4(blocksize=128)`` is counted with its own block size. :data:`SCHEMES` files
  each config class under its ``quantize=`` spelling (:func:`register_scheme`).
* its **transform** (:class:`Transform`, filed in :data:`TRANSFORMS` by :func:`register_transform`): the
  module that takes a Linear's place and how a weight is quantized into it; ``scheme.transform``.
* its library's **stored layout** (``layouts.py``): how a module of it is saved and read back.

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
(:meth:`Transform.replace` on the meta device), and each rank quantizes its own rows
(:meth:`Transform.quantize_own_rows`, with :attr:`~QuantScheme.shards_by_rows`), or a whole weight and keeps its
rows (:meth:`Transform.quantize_shard`). Of the registered schemes only ``torchao.nf4``
does: bitsandbytes' ``Params4bit`` loses its ``quant_state`` under ``fully_shard``, and torchao's
int8 and int4 tensors fail inside it (torch 2.13, torchao 0.18).

Adding a scheme is adding a config class and a transform (see ``bnb.py`` and ``torchao.py`` next to this
file), and for a new library a stored layout.

Example::

    >>> from lightning_lowmem.quantize import SCHEMES, BnbNF4
    >>> sorted(SCHEMES)[:2]
    ['bnb.fp4', 'bnb.fp4-dq']
    >>> BnbNF4().stored_nbytes((4096, 4096)), BnbNF4(blocksize=128).stored_nbytes((4096, 4096))
    (9437248, 8912960)
    >>> type(BnbNF4().transform).__name__
    'Bnb4bitTransform'
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import torch
from torch import nn

from lightning_lowmem.errors import UnsupportedQuantizationError, format_names
from lightning_lowmem.quantize.rows import RowSource

SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class QuantScheme:
    """Base class of every scheme config. Subclasses are frozen dataclasses holding the scheme's options."""

    name: ClassVar[str] = ""
    """The spelling the scheme is registered under, e.g. ``"bnb.nf4"`` (set by :func:`register_scheme`)."""
    package: ClassVar[str] = ""
    """The pip package whose kernels the scheme uses."""
    by_rows: ClassVar[bool] = False
    """Whether its transform also takes a :class:`~lightning_lowmem.quantize.rows.RowSource`: the loader then
    reads the weight a block of rows at a time, and the whole full-precision weight never exists."""
    transient: ClassVar[float] = 0.0
    """Bytes per element quantized at once (one block of rows, or the whole weight) that quantizing holds
    beyond its input and its result (measured on CPU, see the scheme's module)."""
    library_bytes: ClassVar[int] = 0
    """What importing the scheme's library and its first kernel call add to the process (CPU, measured)."""
    library_import_bytes: ClassVar[int] = 0
    """The part of :attr:`library_bytes` a load already holds: importing the library (its first forward adds the
    rest)."""
    library_import_in_transformers: ClassVar[int] = 0
    """The part of :attr:`library_import_bytes` that transformers' own imports hold already (measured beside its
    model classes): a process whose model transformers built, or that reads a GGUF file into litgpt's model
    (which imports transformers' classes), pays only the rest. The torchao schemes keep 0 although transformers
    imports torchao (+0.0 MiB after its classes): loads beside transformers varied by 21 MiB from run to run
    (bert-large, torchao.int8wo), and the import stays counted as their margin."""
    first_forward: ClassVar[float] = 2.0
    """Bytes per weight the largest quantized Linear holds in its first forward (a dequantized bf16 copy is
    assumed where not measured)."""
    forward_heap: ClassVar[int] = 0
    """Freed heap a forward of the model keeps resident until it ends, beyond a generation's own (``heap`` in the
    estimate): what its layers free inside one forward (torchao's NF4 dequantizes each weight, its int8 tensors
    convert theirs), handed back only after the model's forward."""
    forward_heap_per_weight: ClassVar[float] = 0.0
    """The part of :attr:`forward_heap` that grows with the largest quantized Linear: bytes per weight of it."""
    shardable: ClassVar[bool] = False
    """Whether its weights can be sharded by rows across ranks (FSDP2): see :meth:`Transform.quantize_shard`."""
    shards_by_rows: ClassVar[bool] = False
    """Whether a rank can quantize its own rows of a weight alone, the statistics of the whole weight agreed as sums
    across the ranks (:meth:`Transform.quantize_own_rows`): each rank then reads only its rows. False, for a
    shardable scheme: each rank reads the whole weight, quantizes it and keeps its rows."""

    def transient_nbytes(self, numel: int) -> int:
        """What quantizing ``numel`` elements at once (one block of rows, or the whole weight) holds beyond its input
        and its result: :attr:`transient` bytes per element, unless the scheme says more."""
        return int(self.transient * numel)

    def stored_nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes stored for a weight of ``shape`` (``(out_features, in_features)``), scales included."""
        raise NotImplementedError

    def stored_parts(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Bytes of each plain tensor a weight of ``shape`` is held as (codes, scales, code tables), which add up to
        :meth:`stored_nbytes`: what the weight's master takes in host memory when its layer is offloaded, each part
        carved on its own (``transfer/pinned.py``). Default: one tensor."""
        return (self.stored_nbytes(shape),)

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

    def shard_reason(self, shape: tuple[int, ...], count: int) -> str | None:
        """Why a weight of ``shape`` cannot be split by rows into ``count`` shards, or None when it can."""
        return f"{self.name!r} cannot be sharded"

    def stack_reason(self, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
        """Why a stack of expert weights of ``shape`` (a 3-D parameter, ``(experts, out, in)``: transformers 5's
        fused MoE experts) arriving in ``dtype`` stays in full precision, or None when this scheme's transform
        quantizes it (:meth:`Transform.quantize_stack`)."""
        return (f"{self.name!r} quantizes nn.Linear weights, and {self.package} has no quantized form of a 3-D "
                "stack of expert weights (transformers 5 leaves fused experts in full precision with it too); "
                "the bitsandbytes 4-bit schemes quantize them")

    @property
    def transform(self) -> Transform:
        """How this scheme quantizes a weight: the :class:`Transform` registered for its class (or the nearest
        base class) by :func:`register_transform`, bound to these options.

        Raises:
            TypeError: no transform is registered for the scheme's class.
        """
        for cls in type(self).__mro__:
            transform = TRANSFORMS.get(cls)
            if transform is not None:
                return transform(self)
        raise TypeError(f"Quantization scheme {self.name or type(self).__name__!r} has no transform: register a "
                        f"Transform subclass for it with @register_transform({type(self).__name__}).")


SchemeT = TypeVar("SchemeT", bound=QuantScheme)


class Transform(Generic[SchemeT]):
    """How the weights of a scheme are made: the module that takes an ``nn.Linear``'s place before its weight
    is read, and the quantization of the weight into it. Filed for config classes by :func:`register_transform`
    and reached as ``scheme.transform``.

    Args:
        scheme: the config whose options it applies.
    """

    def __init__(self, scheme: SchemeT) -> None:
        self.scheme = scheme

    def replace(self, linear: nn.Linear, dtype: torch.dtype) -> nn.Module:
        """The module that takes ``linear``'s place before its weight is read (weights on meta); by default
        ``linear`` itself."""
        return linear

    def built(self, module: nn.Module) -> bool:
        """Whether ``module`` already is what :meth:`replace` makes (built before the model was sharded)."""
        return False

    def quantize(self, module: nn.Module, weight: torch.Tensor | RowSource) -> None:
        """Quantize the full-precision ``weight`` into ``module`` (made by :meth:`replace`).

        ``weight`` is a :class:`RowSource` only for schemes with :attr:`QuantScheme.by_rows`. Must keep no
        reference to ``weight``: the loader frees it before reading the next tensor.
        """
        raise NotImplementedError

    def quantize_shard(self, weight: torch.Tensor, index: int, count: int) -> torch.Tensor:
        """The ``index``-th of ``count`` row shards of the whole ``weight`` quantized (schemes with
        :attr:`~QuantScheme.shardable`): the whole weight is quantized, so that scales computed over all of it
        agree on every rank, and the shard is cut out of the result as ``torch.chunk`` (and FSDP2) cut it."""
        raise NotImplementedError(f"{self.scheme.name!r} cannot be sharded")

    def quantize_own_rows(self, rows: torch.Tensor, shape: tuple[int, ...],
                          sum_across: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """This rank's row shard of a weight of ``shape`` quantized from its own ``rows`` alone (schemes with
        :attr:`~QuantScheme.shards_by_rows`), equal to :meth:`quantize_shard` of the whole weight; ``sum_across``
        sums a tensor over the ranks that hold the weight's other rows (an all-reduce, the same calls on each)."""
        raise NotImplementedError(f"{self.scheme.name!r} cannot quantize a shard from its own rows")

    def quantize_stack(self, module: nn.Module, name: str, weight: torch.Tensor | RowSource,
                       shape: tuple[int, ...]) -> None:
        """Quantize the stack of expert weights ``weight`` (the whole stack, or with :attr:`QuantScheme.by_rows` its
        rows one block at a time) into parameter ``name`` of ``module``, so that the module's own forward still
        reads the parameter as a full-precision tensor of ``shape`` (schemes whose
        :meth:`QuantScheme.stack_reason` is None)."""
        raise NotImplementedError(f"{self.scheme.name!r} does not quantize stacks of expert weights")


SchemeClassT = TypeVar("SchemeClassT", bound=type[QuantScheme])
TransformClassT = TypeVar("TransformClassT", bound=type[Transform])

SCHEMES: dict[str, type[QuantScheme]] = {}
"""Spelling -> scheme config class. Filled by :func:`register_scheme`."""

TRANSFORMS: dict[type[QuantScheme], type[Transform]] = {}
"""Scheme config class -> its transform. Filled by :func:`register_transform`; a subclass without its own
uses its nearest base class's."""


def register_scheme(name: str) -> Callable[[SchemeClassT], SchemeClassT]:
    """Class decorator: file a scheme config under ``name`` (its ``quantize=`` spelling).

    Example::

        >>> @register_scheme("mylib.int8")
        ... @dataclass(frozen=True)
        ... class MyInt8(QuantScheme):
        ...     package: ClassVar[str] = "mylib"
        >>> make_scheme("mylib.int8")
        MyInt8()
        >>> del SCHEMES["mylib.int8"]  # only so that this example leaves the registry as it found it
    """

    def decorate(cls: SchemeClassT) -> SchemeClassT:
        if name in SCHEMES and SCHEMES[name] is not cls:
            raise ValueError(f"Quantization scheme {name!r} is already registered by {SCHEMES[name].__qualname__}.")
        cls.name = name
        SCHEMES[name] = cls
        return cls

    return decorate


def register_transform(*schemes: type[QuantScheme]) -> Callable[[TransformClassT], TransformClassT]:
    """Class decorator: file a :class:`Transform` as the transform of the config classes ``schemes`` (and of
    their subclasses that have none of their own), as torchao's ``register_quantize_module_handler`` does.

    Example::

        >>> @dataclass(frozen=True)
        ... class Half(QuantScheme):
        ...     package: ClassVar[str] = "torch"
        >>> @register_transform(Half)
        ... class HalfTransform(Transform[Half]):
        ...     def quantize(self, module, weight):
        ...         module.weight = nn.Parameter(weight.to(torch.float16), requires_grad=False)
        >>> linear = nn.Linear(2, 2)
        >>> Half().transform.quantize(linear, torch.ones(2, 2))
        >>> linear.weight.dtype
        torch.float16
        >>> del TRANSFORMS[Half]  # only so that this example leaves the registry as it found it
    """

    def decorate(cls: TransformClassT) -> TransformClassT:
        for scheme in schemes:
            if TRANSFORMS.get(scheme, cls) is not cls:
                raise ValueError(f"{scheme.__qualname__} already has the transform {TRANSFORMS[scheme].__qualname__}.")
        TRANSFORMS.update(dict.fromkeys(schemes, cls))
        return cls

    return decorate


def make_scheme(name: str) -> QuantScheme:
    """The scheme registered as ``name``, with its default options.

    Raises:
        UnsupportedQuantizationError: no scheme has that name.
    """
    cls = SCHEMES.get(name)
    if cls is None:
        meant = meant_schemes(name)
        hint = f" Did you mean {meant[0]!r}{f' (or {format_names(meant[1:])})' if meant[1:] else ''}?" if meant else ""
        raise UnsupportedQuantizationError(
            f"Unknown quantization scheme {name!r}.{hint} Known schemes: {format_names(SCHEMES, limit=len(SCHEMES))}. "
            "Pass one of these as quantize=, or None to load in full precision."
        )
    return cls()


def meant_schemes(name: str) -> list[str]:
    """The registered spellings ``name`` most likely meant: those it is the scheme part of (``"nf4"``: ``bnb.nf4``,
    then ``torchao.nf4``), else the closest by spelling.

    Example::

        >>> meant_schemes("int8"), meant_schemes("bnb.nf5")
        (['bnb.int8'], ['bnb.nf4'])
    """
    bare = [known for known in SCHEMES if known.partition(".")[2].lower() == name.lower()]
    return bare or difflib.get_close_matches(name, list(SCHEMES), n=1)


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
