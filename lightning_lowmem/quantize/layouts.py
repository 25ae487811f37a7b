"""Stored layouts: how a library's quantized ``nn.Linear`` is saved, recognised in a checkpoint and read back.

A scheme config (``schemes.py``) knows sizes and layers; how its weights sit in a file is its library's
business, the same for every scheme of that library. Each library has a :class:`StoredLayout`, filed for
the config classes whose weights it stores by :func:`register_layout`:

* the save side: which scheme a module holds its weight in (:meth:`~StoredLayout.holding`), what it saves
  (:meth:`~StoredLayout.state_dict_of`), what the files' metadata must say (:meth:`~StoredLayout.file_metadata`)
  and the ``quantization_config`` transformers reads it with (:meth:`~StoredLayout.transformers_config`);
* the load side: its saved tensors recognised from headers (:meth:`~StoredLayout.find_stored`), checked
  against each other (:meth:`~StoredLayout.resolve_stored`), loaded as they are (:meth:`~StoredLayout.load_stored`)
  or dequantized (:meth:`~StoredLayout.dequantize_stored`).

``stored.py`` and ``saving/save.py`` ask every layout in :data:`LAYOUTS`, with no branch per scheme. The
layouts are transformers' own: ``bnb_layout.py`` (bitsandbytes' 4-bit and 8-bit modules) and
``torchao_layout.py`` (torchao's safetensors flattening).

Example::

    >>> import lightning_lowmem.quantize  # registers the layouts
    >>> from lightning_lowmem.quantize import BnbNF4, TorchaoNF4
    >>> [type(layout).__name__ for layout in LAYOUTS]
    ['Bnb4bitLayout', 'BnbInt8Layout', 'TorchaoLayout']
    >>> type(layout_of(BnbNF4())).__name__, layout_of(TorchaoNF4())
    ('Bnb4bitLayout', None)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from lightning_lowmem.formats import TensorRecord
from lightning_lowmem.quantize.schemes import QuantScheme


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


class StoredLayout:
    """How one library's quantized Linears are saved (the layout transformers saves for that library) and read
    back. Subclasses are filed for the scheme configs they store by :func:`register_layout`."""

    # ---- the save side

    def holding(self, module: nn.Module) -> QuantScheme | None:
        """The scheme ``module`` holds its weight in, with the options it was quantized with, when ``module`` is
        one of this library's quantized modules; else None. Cheap for modules of other libraries."""
        return None

    def state_dict_of(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """What ``module`` (one :meth:`holding` recognises) saves, by names relative to the module."""
        raise NotImplementedError

    def file_metadata(self, modules: Mapping[str, nn.Module]) -> dict[str, str]:
        """What every file's metadata must say about ``modules`` (module name -> module: each quantized module of
        the model this layout stores) for the library to read them back; nothing by default."""
        return {}

    def transformers_config(self, scheme: QuantScheme, skip: list[str],
                            compute_dtype: torch.dtype) -> dict[str, Any] | None:
        """The ``quantization_config`` transformers reads a checkpoint of ``scheme`` with, ``skip`` naming the
        Linears kept in full precision; None when transformers cannot read it."""
        return None

    # ---- the load side (``stored.py`` has the whole story)

    def find_stored(self, records: Mapping[str, TensorRecord], metadata: Mapping[str, str],
                    files: str) -> dict[str, StoredWeight]:
        """The weights ``records`` hold already quantized in this layout, by key, from the headers (and the
        file's metadata) alone; nothing is read."""
        return {}

    def resolve_stored(self, stored: StoredWeight, read: Callable[[str], torch.Tensor],
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
        """Put the stored ``tensors`` (by role, as read) into ``module`` (made by the scheme's transform's
        ``replace``) on ``device``, as they are."""
        raise NotImplementedError

    def check_read(self, stored: StoredWeight, tensors: Mapping[str, torch.Tensor]) -> None:
        """Check the stored ``tensors`` (by role, as read, on the host) where their values matter and the headers could
        not tell (a format flag): called where they are read, so nothing is read back from a device. Nothing by
        default.

        Raises:
            CheckpointFormatError: a stored value the library cannot read, naming the key.
        """
        return None

    def dequantize_stored(self, stored: StoredWeight, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The full-precision weight the stored ``tensors`` (by role) stand for; on meta, an empty one."""
        raise NotImplementedError


LayoutClassT = TypeVar("LayoutClassT", bound=type[StoredLayout])

LAYOUTS: list[StoredLayout] = []
"""One instance of each registered layout, in registration order. Filled by :func:`register_layout`."""

_BY_SCHEME: dict[type[QuantScheme], StoredLayout] = {}


def register_layout(*schemes: type[QuantScheme]) -> Callable[[LayoutClassT], LayoutClassT]:
    """Class decorator: file a :class:`StoredLayout` as the layout of the config classes ``schemes`` (and of
    their subclasses), and add one instance of it to :data:`LAYOUTS`."""

    def decorate(cls: LayoutClassT) -> LayoutClassT:
        taken = [s.__qualname__ for s in schemes if s in _BY_SCHEME and type(_BY_SCHEME[s]) is not cls]
        if taken:
            raise ValueError(f"{', '.join(taken)} already have a stored layout.")
        if not any(type(layout) is cls for layout in LAYOUTS):
            LAYOUTS.append(cls())
        layout = next(layout for layout in LAYOUTS if type(layout) is cls)
        _BY_SCHEME.update(dict.fromkeys(schemes, layout))
        return cls

    return decorate


def layout_of(scheme: QuantScheme | type[QuantScheme]) -> StoredLayout | None:
    """The layout ``scheme``'s weights are stored in (that of its class or nearest base class), or None when
    its weights cannot be saved or read as stored."""
    cls = scheme if isinstance(scheme, type) else type(scheme)
    return next((_BY_SCHEME[c] for c in cls.__mro__ if c in _BY_SCHEME), None)


def scheme_of(module: nn.Module) -> QuantScheme | None:
    """The scheme ``module`` holds its weight in (asked of every registered layout), or None.

    Example::

        >>> scheme_of(nn.Linear(4, 4)) is None
        True
    """
    for layout in LAYOUTS:
        scheme = layout.holding(module)
        if scheme is not None:
            return scheme
    return None
