"""Reading torch zip files (``torch.save``: ``.pt``, ``.pth``, ``.bin``, ``.ckpt``) one tensor at a time.

The file is read through its zip central directory (``zip_records.py``): every record
the pickle refers to must be there, stored (not compressed), and hold exactly the bytes
its storage needs; each record's data is located from its own local header, so a file
written by another zip writer reads the same as one written by torch. The pickle
(``data.pkl``) is unpickled by :class:`~lightning_lowmem.formats.unpickler.InertUnpickler`:
tensors become references to those records (checked to fit inside them), and objects
of any other class (a LightningModule's hyper-parameters, callbacks' state) become
inert placeholders: nothing the pickle names is imported, constructed or run. Each
tensor is then read on its own with ``os.preadv`` straight into the memory that becomes
the parameter; nothing maps the file. The file's other entries (optimizer state,
counters) come from the same pickle (:meth:`TorchZipFile.other_entries`, ``entries.py``): each
object once, each storage read once, as ``torch.load`` builds them.
"""

from __future__ import annotations

import io
import logging
import math
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_lowmem.errors import CheckpointFormatError, NoStateDictError, UnsafeCheckpointError, format_names
from lightning_lowmem.formats.files import OpenedFile
from lightning_lowmem.formats.records import TensorRecord, row_span
from lightning_lowmem.formats.entries import EntriesTooLargeError, inert_paths, rebuild
from lightning_lowmem.formats.entry_tensor import EntryTensor
from lightning_lowmem.formats.state_entry import candidates, choose
from lightning_lowmem.formats.unpickler import Inert, InertUnpickler, StorageRef, TensorRef
from lightning_lowmem.formats.zip_records import RESAVE as _RESAVE
from lightning_lowmem.formats.crc_pieces import Pieces, Unchecked
from lightning_lowmem.formats.zip_records import ZipRecords, check_crc, crc_of

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Location:
    offset: int  # byte offset of the storage's data in the file
    ref: TensorRef

    @property
    def contiguous(self) -> bool:
        expected, step = [], 1
        for size in reversed(self.ref.shape):
            expected.insert(0, step)
            step *= size
        return math.prod(self.ref.shape) <= 1 or all(
            size == 1 or stride == want for size, stride, want in zip(self.ref.shape, self.ref.stride, expected))


class TorchZipFile(OpenedFile):
    """A ``torch.save`` zip archive, planned from its pickle and read tensor by tensor.

    Args:
        path: the file.
        fd: a descriptor open on it (see :func:`~lightning_lowmem.formats.files.open_regular`); the reader owns it.
    """

    def __init__(self, path: Path, fd: int) -> None:
        super().__init__(path, fd)
        self.entry = ""
        self._refs: dict[str, StorageRef] = {}  # storage key -> what the pickle says of it
        self._offsets: dict[str, int] = {}  # storage key -> where its record's bytes start
        self._crcs: dict[str, int] = {}  # storage key -> the CRC-32 its record's bytes are checked against
        self._pieces: dict[str, Pieces] = {}  # storage key -> the pieces of it read by rows, not checked yet
        self._mapped_storages: set[str] | None = None  # storages a tensor was mapped from (made when mapped)
        self._zip = ZipRecords(self)
        self._prefix = self._archive_prefix()
        self._check_byteorder()
        self._check_alignment()
        self._checkpoint, self.inert, built_on = self._unpickle()
        self._state, self.entry = self._unwrap()
        if built_on:
            self._refuse_built_on(built_on)
        self._records: dict[str, TensorRecord] = {}
        self._locations: dict[str, _Location] = {}
        for key, value in self._state.items():
            ref = self._weight(key, value)
            if ref is not None:
                self._records[key] = TensorRecord(key, ref.shape, ref.dtype, path)
                self._locations[key] = self._locate(key, ref)
        # Only the records of storages not located yet (the entries beside the weights) are kept from the zip
        # directory: its entries cost ~370 bytes each, a million of them while every tensor is loaded.
        self._zip.keep_only(f"{self._prefix}data/{key}" for key in self._refs.keys() - self._offsets.keys())

    # ------------------------------------------------------------ headers

    def _archive_prefix(self) -> str:
        pickles = [name for name in self._zip.directory if name.endswith("data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise CheckpointFormatError(
                f"{self.path} is a zip archive but not a torch.save file: it holds {len(pickles)} '<name>/data.pkl' "
                f"records ({format_names(pickles)}). {_RESAVE}")
        return pickles[0][: -len("data.pkl")]

    def _info(self, name: str, limit: int | None = None, what: str = "its pickle") -> zipfile.ZipInfo:
        return self._zip.info(self._prefix + name, limit, what)

    def _small_record(self, name: str, limit: int | None = None) -> bytes:
        return self._zip.small_record(self._prefix + name, limit)

    def _check_byteorder(self) -> None:
        if self._prefix + "byteorder" not in self._zip.directory:
            return
        order = self._small_record("byteorder", limit=16).decode("ascii", errors="replace")
        if order != "little":
            raise CheckpointFormatError(f"{self.path} says its byte order is {order!r}; lightning_lowmem reads "
                                        "little-endian files. Re-save it on a little-endian machine.")

    def _check_alignment(self) -> None:
        """``.storage_alignment`` (torch >= 2.6) must hold a positive decimal number, as torch.load requires; the
        records are found through the zip directory, so its value is not needed."""
        if self._prefix + ".storage_alignment" not in self._zip.directory:
            return
        text = self._small_record(".storage_alignment", limit=16)
        if not (text.isdigit() and text.isascii() and int(text) > 0):
            raise CheckpointFormatError(
                f"{self.path}: its record {self._prefix + '.storage_alignment'!r} holds {text[:16]!r}, not a positive "
                f"number (torch.save writes b'64'; torch.load refuses anything else). The file is damaged. {_RESAVE}")

    def _unpickle(self) -> tuple[Any, set[str], dict[int, tuple[Any, Any]]]:
        data = self._small_record("data.pkl")
        unpickler = InertUnpickler(io.BytesIO(data), self._storage, nbytes=len(data))
        try:
            obj = unpickler.load()
        except CheckpointFormatError:
            raise
        except Exception as e:  # a damaged or hostile pickle (RecursionError included): a format error
            raise CheckpointFormatError(
                f"{self.path}: its pickle (data.pkl) cannot be read: {type(e).__name__}: {str(e)[:200]}. {_RESAVE}"
            ) from e
        return obj, unpickler.inert, unpickler.built_on

    def _refuse_built_on(self, built_on: dict[int, tuple[Any, Any]]) -> None:
        """Refuse a file whose pickle sets attributes on a tensor or storage after building it (a BUILD); torch.save
        never writes one and torch.load refuses it. Applied, ``{"offset": -64}`` would read bytes outside the
        tensor's storage."""
        keys = [key for key, value in self._state.items() if id(value) in built_on]
        where = (f"tensor {format_names(keys)}" if keys else
                 f"{len(built_on)} tensor(s) in the entries beside {'the weights' if self.entry else 'its tensors'}")
        states = format_names([repr(state)[:60] for _, state in built_on.values()], 3, quote=False)
        raise UnsafeCheckpointError(
            f"{self.path}: its pickle sets attributes on {where} after building it ({states}), which torch.save "
            "never writes and torch.load refuses; nothing was applied or read. The file was altered: download or "
            "save it again from a source you trust.")

    def _storage(self, key: str, dtype: torch.dtype | None, numel: int) -> StorageRef:
        """The storage ``data/<key>`` the pickle refers to (its record is checked when a tensor uses it)."""
        storage = self._refs.setdefault(key, StorageRef(key, dtype, numel))
        if (storage.dtype, storage.numel) != (dtype, numel):
            raise CheckpointFormatError(f"{self.path}: storage {key!r} is referred to as {storage.numel} x "
                                        f"{storage.dtype} and as {numel} x {dtype}. The file is damaged. {_RESAVE}")
        return storage

    def _record_of(self, storage: StorageRef, key: str) -> int:
        """Where the record ``data/<storage.key>`` starts; it must be there, stored, and exactly the storage's bytes."""
        if storage.key not in self._offsets:
            info = self._info(f"data/{storage.key}", what=f"tensor {key!r}")
            if info.file_size != storage.nbytes:
                raise CheckpointFormatError(
                    f"{self.path}: tensor {key!r}: its storage record {info.filename!r} holds {info.file_size} bytes, "
                    f"but the pickle says {storage.numel} x {storage.dtype or 'byte'} = {storage.nbytes} bytes. "
                    f"The file is truncated or damaged: download or save it again.")
            self._offsets[storage.key] = self._zip.data_offset(info)
            self._crcs[storage.key] = info.CRC
        return self._offsets[storage.key]

    def _unwrap(self) -> tuple[Mapping[str, Any], str]:
        """The state dict inside the checkpoint, and the entry it was found under (``formats/state_entry.py``: the top
        level, or any entry one level down that maps names to tensors; several: the chooser in force decides)."""
        obj = self._checkpoint
        found = candidates(obj, lambda v: tuple(v.shape) if isinstance(v, TensorRef) else _is_tensor(v) and None)
        if found:
            entry = choose(self.path, found)
            return (obj[entry] if entry else obj), entry
        if self.inert:
            raise UnsafeCheckpointError(
                f"{self.path} holds no state dict of tensors; its pickle asks to build "
                f"{format_names(sorted(self.inert))}, which lightning_lowmem never imports or runs (nothing was "
                "run). If you trust the file, load it with torch.load(weights_only=False) and save its state_dict() "
                "with safetensors.torch.save_file.")
        raise NoStateDictError(
            f"{self.path} holds a {type(obj).__name__} with no tensors at its top level nor in any entry of it. "
            "Save the model's state_dict() and load that file.")

    def _weight(self, key: Any, value: Any) -> TensorRef | None:
        """``value`` when it is a tensor of the state dict, None for anything else beside them; raises for a
        tensor that cannot be read and for a key that is not a name."""
        if not isinstance(key, str):
            raise CheckpointFormatError(f"{self.path}: the state dict has the key {key!r} ({type(key).__name__}); "
                                        "keys must be strings (module names). Save the model's state_dict().")
        if isinstance(value, TensorRef):
            return value
        if isinstance(value, Inert) and value.name.startswith("torch._utils._rebuild_tensor") and value.why:
            raise CheckpointFormatError(f"{self.path}: tensor {key!r} cannot be read: {value.why}. The file is "
                                        f"damaged or was altered. {_RESAVE}")
        if isinstance(value, Inert) and value.name.startswith("torch."):
            subclass = _subclass_name(value)
            if subclass.startswith("torchao."):
                raise CheckpointFormatError(
                    f"{self.path}: tensor {key!r} is a pickled torchao tensor subclass ({subclass}), as transformers 4 "
                    "writes torchao weights (save_pretrained(safe_serialization=False)); lightning_lowmem reads a "
                    "pickle as data and builds no tensor subclass. It reads torchao weights from safetensors, as "
                    "transformers >= 5 and save_checkpoint write them: load the full-precision checkpoint with "
                    "quantize='torchao.int8wo' (or 'torchao.int8dq'), or load this one with transformers' "
                    "from_pretrained.")
            raise CheckpointFormatError(
                f"{self.path}: tensor {key!r} is a kind lightning_lowmem cannot read (sparse, quantized, meta, "
                f"nested or a tensor subclass; {subclass or value.name}). Convert it to a plain dense tensor and "
                "save the state dict again.")
        if isinstance(value, Inert):
            log.info("%s: %r is not a tensor but an object built by %s; it is not loaded and nothing was run.",
                     self.path, key, value.name)
        return None  # not a weight (a module's _extra_state, a number): the plan reports it if it is expected

    def _locate(self, key: str, ref: TensorRef) -> _Location:
        """Where ``ref``'s data is, after checking its storage record and that its view fits inside it."""
        storage, start = ref.storage, self._record_of(ref.storage, key)
        itemsize = ref.dtype.itemsize
        elements = storage.nbytes // itemsize
        if storage.nbytes % itemsize:
            raise CheckpointFormatError(f"{self.path}: tensor {key!r} is {ref.dtype}, but its storage holds "
                                        f"{storage.nbytes} bytes, not a whole number of elements. {_RESAVE}")
        # the view's last element must be in the storage; an empty view's offset at most at its end (torch checks it)
        last = ref.offset + sum((size - 1) * stride for size, stride in zip(ref.shape, ref.stride)) \
            if math.prod(ref.shape) else ref.offset - 1
        if last >= elements:
            raise CheckpointFormatError(
                f"{self.path}: tensor {key!r} (shape {list(ref.shape)}, stride {list(ref.stride)}, offset "
                f"{ref.offset}) reaches element {last} of a storage of {elements}. The file is damaged. {_RESAVE}")
        return _Location(start, ref)

    # ------------------------------------------------------------ data

    def header_spans(self) -> list[tuple[int, int]]:
        """The central directory and its end records: every record's name, place, size and CRC-32 (which the
        bytes read are checked against: the data needs no sample)."""
        return [(self._zip.directory_start, self.size - self._zip.directory_start)]

    def records(self) -> dict[str, TensorRecord]:
        return self._records

    def metadata(self) -> dict[str, str]:
        """The state dict's ``__metadata__`` entry when it maps str to str (what a safetensors header's
        ``__metadata__`` holds, kept beside the tensors of a torch file); else empty."""
        value = self._state.get("__metadata__")
        if isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            return dict(value)
        return {}

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._read(self._locations[key], out, key)

    def _read(self, loc: _Location, out: torch.Tensor | None = None, key: str = "") -> torch.Tensor:
        ref = loc.ref
        if loc.contiguous:
            out = torch.empty(ref.shape, dtype=ref.dtype, device="cpu") if out is None else out
            self.read_into(out, loc.offset + ref.offset * ref.dtype.itemsize)
            if ref.offset == 0 and out.nbytes == ref.storage.nbytes:  # the whole record: check its CRC-32
                self._check_crc(ref.storage.key, crc_of(out), key)
            return out
        # A strided view (rare in checkpoints): read its whole storage, then copy the view out.
        whole = torch.empty(ref.storage.nbytes // ref.dtype.itemsize, dtype=ref.dtype, device="cpu")
        whole = self.read_into(whole, loc.offset)
        self._check_crc(ref.storage.key, crc_of(whole), key)
        return whole.as_strided(ref.shape, ref.stride, ref.offset).clone()

    def map(self, key: str) -> torch.Tensor | None:
        """Tensor ``key`` over the file's mapped pages (see :meth:`OpenedFile.mapped_view`), its storage record
        checked against its CRC-32 over those pages (which reads each of them once); None (read it instead) for a
        strided view, and for a second tensor on a storage already mapped: two keys on one storage are two
        tensors of their own, as the copying load makes them, never views that write through to each other."""
        loc, ref = self._locations[key], self._locations[key].ref
        if not loc.contiguous or ref.storage.key in (self._mapped_storages or ()):
            return None
        tensor = self.mapped_view(loc.offset + ref.offset * ref.dtype.itemsize, ref.shape, ref.dtype)
        if tensor is not None:
            record = self.mapped_view(loc.offset, (ref.storage.nbytes,), torch.uint8)
            self._check_crc(ref.storage.key, crc_of(record), key)
            self._mapped_storages = self._mapped_storages or set()
            self._mapped_storages.add(ref.storage.key)
        return tensor

    def reads_rows(self, key: str) -> bool:
        return self._locations[key].contiguous and len(self._records[key].shape) >= 1

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        rec, loc = self._records[key], self._locations[key]
        if not loc.contiguous:
            raise ValueError(f"{self.path}: {key!r} is a strided view; read it whole with read().")
        skip, shape = row_span(rec, start, stop)
        out = torch.empty(shape, dtype=rec.dtype, device="cpu") if out is None else out
        self.read_into(out, loc.offset + loc.ref.offset * rec.dtype.itemsize + skip)
        self._check_rows_crc(key, loc, skip, out)
        return out

    def _check_crc(self, storage_key: str, crc: int, what: str) -> None:
        check_crc(self.path, f"{self._prefix}data/{storage_key}", self._crcs[storage_key], crc, what)

    def _check_rows_crc(self, key: str, loc: _Location, skip: int, rows: torch.Tensor) -> None:
        """Blocks of rows (``rows``, from byte ``skip``) are kept as pieces of their record (``crc_pieces.py``); once
        the pieces cover it, in any order, the record's CRC-32 is checked. Pieces that never do (the rows of one
        rank) wait for :meth:`unchecked`."""
        ref = loc.ref
        if ref.offset != 0 or math.prod(ref.shape) * ref.dtype.itemsize != ref.storage.nbytes:
            return  # a view of part of its storage: its CRC covers bytes it does not read
        pieces = self._pieces.setdefault(ref.storage.key, Pieces(ref.storage.nbytes, self._crcs[ref.storage.key]))
        if pieces.add(skip, rows.nbytes, lambda crc: crc_of(rows, crc)):
            del self._pieces[ref.storage.key]
            self._check_crc(ref.storage.key, pieces.crc(), key)

    def unchecked(self) -> list[Unchecked]:
        """The records read in blocks of rows that did not cover them (a rank's own rows): their pieces, for the
        ranks to check together (:func:`~lightning_lowmem.formats.crc_pieces.check_unchecked`)."""
        return [Unchecked(str(self.path), f"{self._prefix}data/{storage}", pieces.expected, pieces.nbytes,
                          tuple(pieces.pieces)) for storage, pieces in self._pieces.items()]

    def other_entries(self, unread: frozenset[str] = frozenset()) -> tuple[dict[str, Any], list[str]]:
        """The top-level entries other than the weights' (:attr:`entry`), their tensors read, and where in them
        objects stand that were not built (``"hyper_parameters.path"``).

        Empty for a bare state dict. The weights are not read. Built as ``torch.load`` builds them (see
        ``entries.py``): an object the pickle refers to twice is one object, and the tensors on one storage
        are views of it, read once. At most one item per byte of the file is built. The tensors of the
        entries named in ``unread`` are left unread, as :class:`EntryTensor` handles (read later, whole or by rows).
        """
        if not self.entry:
            return {}, []
        rest = {name: value for name, value in self._checkpoint.items() if name != self.entry}
        storages: dict[str, torch.Tensor] = {}

        def tensor_of(ref: TensorRef, where: str) -> torch.Tensor | EntryTensor:
            loc = self._locate(where, ref)  # its view fits its storage
            if where.split(".", 1)[0] in unread:
                return EntryTensor(where, ref.shape, ref.dtype, lambda start, stop, out: self._read_entry_rows(
                    loc, where, start, stop, out), loc.contiguous)
            if ref.storage.key not in storages:
                storages[ref.storage.key] = self._read_storage(ref.storage, where)
            return storages[ref.storage.key].view(ref.dtype).as_strided(ref.shape, ref.stride, ref.offset)

        try:
            return rebuild(rest, tensor_of, limit=self.size), inert_paths(rest)
        except RecursionError as e:
            raise CheckpointFormatError(f"{self.path}: its entries beside the weights nest too deeply to read. "
                                        f"{_RESAVE}") from e
        except EntriesTooLargeError:
            raise CheckpointFormatError(
                f"{self.path}: its entries beside the weights hold more than {self.size} items, more than a file of "
                f"{self.size} bytes can describe; the file is damaged or crafted. {_RESAVE}") from None

    def _read_entry_rows(self, loc: _Location, where: str, start: int, stop: int,
                         out: torch.Tensor | None) -> torch.Tensor:
        """Rows ``start:stop`` of an entry's tensor (all of them: read as :meth:`read` reads a weight, its CRC-32
        checked when it is its whole record; some rows of a contiguous one: those bytes alone, unchecked)."""
        ref = loc.ref
        if not ref.shape or (start == 0 and stop == ref.shape[0]):
            return self._read(loc, out, where)
        row = math.prod(ref.shape[1:]) * ref.dtype.itemsize
        out = torch.empty((stop - start, *ref.shape[1:]), dtype=ref.dtype) if out is None else out
        return self.read_into(out, loc.offset + ref.offset * ref.dtype.itemsize + start * row)

    def _read_storage(self, storage: StorageRef, where: str) -> torch.Tensor:
        """A storage's record read whole (its bytes), checked against its CRC-32."""
        data = torch.empty(storage.nbytes, dtype=torch.uint8, device="cpu")
        data = self.read_into(data, self._record_of(storage, where))
        self._check_crc(storage.key, crc_of(data), where)
        return data


def _is_tensor(value: Any) -> bool:
    """A tensor the pickle describes, readable or not (its view refused by the unpickler)."""
    return isinstance(value, TensorRef) or (isinstance(value, Inert) and value.name.startswith("torch._utils._rebuild"))


def _subclass_name(value: Inert) -> str:
    """The tensor subclass a ``_rebuild_from_type_v2`` placeholder names (``"torchao...Int8Tensor"``), else ""."""
    if value.name != "torch._tensor._rebuild_from_type_v2" or len(value.args) < 2:
        return ""
    name = getattr(value.args[1], "name", "")  # a global the unpickler did not build (an Inert or its maker)
    return name if isinstance(name, str) else ""
