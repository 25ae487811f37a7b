"""A model with layers on disk, as a whole: what is refused rather than done wrong.

Between forwards a layer on disk holds placeholders (one element each, expanded: ``disk_units.py``), and its hooks
read it from the file for each forward. What treats the model as a whole would meet those placeholders, so:

::

    copy.deepcopy     refused (TypeError) on the model, any module holding a layer on disk, and the layer: a copy
                      would hold zeros where the weights are, and its hooks would fill the original's modules
    state_dict()      refused (ValueError) on a layer on disk, and so on anything holding one: torch.save,
                      fabric.save, trainer.save_checkpoint would write the placeholders as weights
    _apply            (.half(), .float(), .to(dtype), .to(device)): a cast that changes the dtype of a layer on disk
                      raises before any tensor of the model changes (ValueError); a move leaves the layers on disk
                      where they are (they are read onto the execution device), the rest moves as always

Each layer on disk is marked with :data:`ON_DISK` (the file's description): ``save_checkpoint`` refuses what it finds
marked. :func:`mark` puts all of it on the model when the disk tier starts, :func:`unmark` takes it off when the
tier closes (the layers are then on meta, and behave as meta modules do).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_lowmem.errors import format_names

ON_DISK = "_lowmem_on_disk"
"""Set on each module whose tensors stream from the checkpoint file (to the file's description): a save refuses it."""

_OWN = ("_apply", "__deepcopy__")  # what mark() puts in a module's __dict__


class DiskModel:
    """The layers on disk of one model, and what guards it; held by the closures :func:`mark` installs.

    Args:
        root: the model.
        modules: name -> each module on disk.
        dtypes: the dtypes of the placeholders the layers on disk hold (what a cast would change).
        description: the checkpoint's files, for messages.
    """

    def __init__(self, root: nn.Module, modules: Mapping[str, nn.Module], dtypes: set[torch.dtype],
                 description: str) -> None:
        self.names = list(modules)
        self.dtypes = dtypes
        self.description = description
        self._root = weakref.ref(root)
        self._marked: list[weakref.ref[nn.Module]] = []
        self._handles: list[RemovableHandle] = []

    def what(self, action: str) -> str:
        """``Cannot <action> <Model>: N of its modules (...) are read from <file> for each forward (disk_offload)``."""
        root = self._root()
        return (f"Cannot {action} {type(root).__name__ if root is not None else 'the model'}: "
                f"{len(self.names)} of its modules ({format_names(self.names, 3)}) are read from {self.description} "
                "for each forward (disk_offload)")

    def refuse_save(self) -> ValueError:
        """The error of a save (or a ``state_dict``) of the model."""
        return ValueError(
            f"{self.what('save')} and hold no weights between forwards (placeholders), which a save would write as "
            "weights; nothing was written. That file already holds them: copy it, or load the model without "
            "disk_offload (or quantized, with quantize=, so that it fits) to save it.")

    def refuse_copy(self) -> TypeError:
        return TypeError(
            f"{self.what('copy')}: a copy would hold no weights in them, and its hooks would read into this model. "
            "Load the checkpoint again (the same load_checkpoint call, or generate/Fabric/Trainer with the same "
            "options) for a second model; it reads the same file.")

    def check_cast(self, fn: Callable[[torch.Tensor], Any]) -> None:
        """Raise when ``fn`` (what ``_apply`` applies) would change the dtype of a tensor of a layer on disk."""
        for dtype in self.dtypes:
            try:
                cast = fn(torch.zeros((), dtype=dtype))
            except Exception:  # noqa: BLE001  (fn cannot run here: the real _apply raises its own error first)
                return
            if isinstance(cast, torch.Tensor) and cast.dtype != dtype:
                raise ValueError(
                    f"{self.what('cast')} and compute in {dtype}, as they were loaded; this cast would make them "
                    f"{cast.dtype}, which they are not read as. Nothing was changed. Load the model with "
                    f"dtype={cast.dtype} instead (the layers on disk are cast as they are read), or with budgets "
                    "that hold it all (no disk_offload) to cast it after.")


def mark(root: nn.Module, modules: Mapping[str, nn.Module], dtypes: set[torch.dtype], description: str) -> DiskModel:
    """Guard ``root``, whose ``modules`` are read from the file for each forward (see the module's docstring)."""
    disk = DiskModel(root, modules, dtypes, description)
    on_disk = {id(m) for m in modules.values()}
    holders = {id(m): m for name in modules for m in _ancestors(root, name)}
    for module in [*modules.values(), *(m for i, m in holders.items() if i not in on_disk)]:
        ref = weakref.ref(module)
        module.__dict__["_apply"] = _checked_apply(ref, disk, moves=id(module) not in on_disk)
        module.__dict__["__deepcopy__"] = _refused_copy(disk)
        disk._marked.append(ref)
    for module in modules.values():
        module.__dict__[ON_DISK] = description
        disk._handles.append(module.register_state_dict_pre_hook(_refused_state_dict(disk)))
    return disk


def unmark(disk: DiskModel) -> None:
    """Take off what :func:`mark` put on the model (the tier closed)."""
    for handle in disk._handles:
        handle.remove()
    for ref in disk._marked:
        module = ref()
        if module is not None:
            for key in (*_OWN, ON_DISK):
                module.__dict__.pop(key, None)
    disk._handles.clear()
    disk._marked.clear()


def on_disk_modules(module: nn.Module) -> dict[str, str]:
    """Module name -> the file it is read from, for each module of ``module`` on disk."""
    return {name: mod.__dict__[ON_DISK] for name, mod in module.named_modules() if ON_DISK in mod.__dict__}


def _ancestors(root: nn.Module, name: str) -> list[nn.Module]:
    """The modules above ``name`` in ``root``, the root included."""
    parts = name.split(".") if name else []
    return [root.get_submodule(".".join(parts[:i])) for i in range(len(parts))]


def _checked_apply(ref: weakref.ref[nn.Module], disk: DiskModel, moves: bool) -> Callable[..., nn.Module]:
    """A module's ``_apply``: a cast of the layers on disk refused first; then a module holding such layers does what
    its class does (its layers on disk leave themselves alone), a layer on disk nothing (its tensors are read from
    the file: moving or casting its placeholders would allocate them whole). Holds the module weakly."""
    def _apply(fn: Callable[..., Any], recurse: bool = True) -> nn.Module:
        module = ref()
        disk.check_cast(fn)
        if moves:
            return type(module)._apply(module, fn, recurse)
        return module
    return _apply


def _refused_copy(disk: DiskModel) -> Callable[[dict[int, Any]], Any]:
    def __deepcopy__(memo: dict[int, Any]) -> Any:
        raise disk.refuse_copy()
    return __deepcopy__


def _refused_state_dict(disk: DiskModel) -> Callable[..., None]:
    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        raise disk.refuse_save()
    return hook
