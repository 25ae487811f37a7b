"""Which entry of a torch checkpoint holds the weights.

``torch.save`` writes whatever its caller hands it: a state dict (the top level), a Lightning checkpoint (its
``state_dict``), a Fabric one (``model``), a research repository's own layout (gemma_pytorch's
``{"model_state_dict": ...}``, DeepSpeed's ``module``, an ``ema`` beside the model, JAX ports' ``params``). Each
mapping of names to tensors at the top level or one level down is a candidate (:func:`candidates`). Which one a load
reads is decided by the chooser in force (:func:`choosing_entry`; the engine's knows the module and the ``entry``
option), else by :func:`only_candidate`: the one candidate, or the one asked for.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from lightning_lowmem.errors import AmbiguousCheckpointError, NoStateDictError, format_names

Shapes = Mapping[str, "tuple[int, ...] | None"]
"""A candidate entry's tensors: name -> shape (None: a tensor the file describes but that cannot be read)."""
Chooser = Callable[[Path, Mapping[str, Shapes]], str]
"""``chooser(path, candidates)``: the entry to read among ``candidates`` (entry -> its tensors; ``""`` is the top
level), or an error saying how to pick."""

_CHOOSER: contextvars.ContextVar[Chooser | None] = contextvars.ContextVar("lowmem_entry_chooser", default=None)


@contextlib.contextmanager
def choosing_entry(chooser: Chooser | None) -> Iterator[None]:
    """Torch files opened in the block take their entry from ``chooser`` (None: :func:`only_candidate`)."""
    token = _CHOOSER.set(chooser)
    try:
        yield
    finally:
        _CHOOSER.reset(token)


def choose(path: Path, found: Mapping[str, Shapes]) -> str:
    """The entry of ``path`` to read, among ``found`` (at least one), by the chooser in force."""
    chooser = _CHOOSER.get()
    return chooser(path, found) if chooser is not None else only_candidate(path, found)


def candidates(obj: Any, shape_of: Callable[[Any], tuple[int, ...] | None | bool]) -> dict[str, dict[str, Any]]:
    """The mappings of names to tensors in an unpickled checkpoint ``obj``, each with its tensors' shapes (``shape_of``:
    a tensor's shape, None for a tensor without one, False for anything that is no tensor): ``""`` for the top level
    when it holds tensors itself, and each top-level entry (a string key) whose value holds tensors. A Fabric
    checkpoint's loose ``step`` tensor beside its ``model`` makes the top level a candidate too: the chooser tells them
    apart by what fits the module.

    Example::

        >>> tensor = object()
        >>> candidates({"model_state_dict": {"w": tensor, "b": tensor}, "step": tensor},
        ...            lambda v: (2, 3) if v is tensor else False)
        {'': {'step': (2, 3)}, 'model_state_dict': {'w': (2, 3), 'b': (2, 3)}}
    """
    if not isinstance(obj, Mapping):
        return {}

    def tensors(mapping: Mapping) -> dict[str, Any]:
        shapes = {str(k): shape_of(v) for k, v in mapping.items()}
        return {k: shape for k, shape in shapes.items() if shape is not False}

    found = {"": tensors(obj)}
    found |= {key: tensors(value) for key, value in obj.items() if isinstance(key, str) and isinstance(value, Mapping)}
    return {key: names for key, names in found.items() if names}


def only_candidate(path: Path, found: Mapping[str, Shapes], wanted: str | None = None) -> str:
    """``wanted`` when given (it must be one of ``found``), else the one candidate.

    Raises:
        NoStateDictError: ``wanted`` is not an entry holding tensors.
        AmbiguousCheckpointError: several candidates and none asked for.
    """
    if wanted is not None:
        if wanted not in found:
            raise NoStateDictError(f"{path} has no entry {wanted!r} holding tensors (entry={wanted!r}); its entries "
                                   f"holding tensors are {describe(found)}.")
        return wanted
    if len(found) == 1:
        return next(iter(found))
    raise AmbiguousCheckpointError(ambiguous_message(path, found, "it holds several state dicts"))


def describe(found: Mapping[str, Shapes]) -> str:
    """``'model' (24 tensors), the top level (3 tensors)``."""
    return format_names((f"{name_of(e)} ({len(keys)} tensors)" for e, keys in found.items()), quote=False)


def name_of(entry: str) -> str:
    return repr(entry) if entry else "the top level"


def ambiguous_message(path: Path, found: Mapping[str, Shapes], why: str) -> str:
    """Several entries could be the weights: which, and how to pick one."""
    entries = [e for e in found if e]
    pick = entries[-1] if entries else ""
    flag = pick or "''"
    return (f"{path}: {why}: {describe(found)}. lightning_lowmem does not guess which one is meant: pass "
            f"entry={pick!r} (command line: --entry {flag}) or another of them.")
