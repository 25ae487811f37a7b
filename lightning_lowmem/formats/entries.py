"""A torch checkpoint's entries beside the weights (optimizer state, counters), rebuilt as ``torch.load`` builds them.

What :class:`~lightning_lowmem.formats.unpickler.InertUnpickler` made of the pickle is a graph: an object
the pickle refers to twice (its memo) is one object reached by two paths. Rebuilding it path by path
would cost memory exponential in the pickle's size (``x = [x, x]`` nested 14 times on a 16 Ki-element
tensor, a 67 KiB file, became 16,384 tensors and +1 GiB). So it is rebuilt as pickle built it: each
object once, by identity, every path to it sharing the one copy, and each storage read once, the
tensors on it views of it, as ``torch.load`` gives them. What it builds is also counted, and
refused past a bound proportional to the file's size.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from lightning_lowmem.formats.unpickler import Inert, TensorRef

_CONTAINERS = (dict, list, tuple, set, frozenset)


class EntriesTooLargeError(Exception):
    """The entries hold more items than the bound allows (the caller names the file)."""


def rebuild(value: Any, tensor_of: Callable[[TensorRef, str], Any], limit: int) -> Any:
    """``value`` with every :class:`TensorRef` replaced by ``tensor_of(ref, where)``, sharing kept.

    Args:
        value: what the unpickler made (dicts, OrderedDicts, lists, tuples, sets, tensor references,
            placeholders and plain values).
        tensor_of: makes the tensor of a reference; ``where`` is the first path that reaches it, for messages.
        limit: at most this many container items are built, in all.

    Raises:
        EntriesTooLargeError: more than ``limit`` items.
        RecursionError: nested deeper than Python's recursion limit.
    """
    return _Rebuild(tensor_of, limit).build(value, "")


class _Rebuild:
    def __init__(self, tensor_of: Callable[[TensorRef, str], Any], limit: int) -> None:
        self.tensor_of, self.left = tensor_of, limit
        self.built: dict[int, Any] = {}  # id of an unpickled object -> what it became

    def build(self, value: Any, where: str) -> Any:
        if not isinstance(value, (TensorRef, *_CONTAINERS)):
            return value
        done = self.built.get(id(value))
        if done is not None:
            return done
        if isinstance(value, TensorRef):
            out = self.built[id(value)] = self.tensor_of(value, where or "(the whole entry)")
            return out
        self._spend(len(value))
        if isinstance(value, dict):  # made before its items, so an item may refer back to it (pickle allows)
            ordered = isinstance(value, collections.OrderedDict)
            out = self.built[id(value)] = collections.OrderedDict() if ordered else {}
            out.update((k, self.build(v, f"{where}.{k}" if where else str(k))) for k, v in value.items())
            if ordered:
                out.__dict__.update(value.__dict__)  # a state dict's _metadata
        elif isinstance(value, list):
            out = self.built[id(value)] = []
            out.extend(self.build(v, f"{where}[{i}]") for i, v in enumerate(value))
        else:  # tuples and sets: immutable, so made from their items (an item cannot refer back but through a list)
            out = self.built[id(value)] = type(value)(self.build(v, f"{where}[{i}]") for i, v in enumerate(value))
        return out

    def _spend(self, items: int) -> None:
        self.left -= items + 1
        if self.left < 0:
            raise EntriesTooLargeError


def inert_paths(obj: Any, prefix: str = "", limit: int = 1000) -> list[str]:
    """Where in ``obj`` the :class:`Inert` placeholders are (``"hyper_parameters.path"``), sorted; each object is
    visited once (the first path that reaches it), and at most ``limit`` places are listed."""
    found: list[str] = []
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [(prefix, obj)]
    while stack and len(found) < limit:
        where, value = stack.pop()
        if not isinstance(value, (Inert, *_CONTAINERS)) or id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, Inert):
            found.append(where or "(the whole object)")
        elif isinstance(value, dict):  # pushed last first: the first path to an object is the one listed
            stack.extend(reversed([(f"{where}.{k}" if where else str(k), v) for k, v in value.items()]))
        else:
            stack.extend(reversed([(f"{where}[{i}]", v) for i, v in enumerate(value)]))
    return sorted(found)
