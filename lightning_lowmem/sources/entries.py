"""Which entry of a torch file a load reads, decided with the module it goes to.

A torch file may hold its weights under any entry (``formats/state_entry.py`` finds the candidates). For a load into
a module, the entry is:

* the one ``entry=`` names (``--entry`` on the command line), which must be there;
* else the only candidate;
* else the one candidate that fits the module (at least half of the module's tensors found among its tensors, by name
  and shape, a single missing or extra top-level prefix allowed, as the plan allows it): a generator's weights beside
  a discriminator's;
* else, two or more that fit (a model and its EMA copy), or none: an
  :class:`~lightning_lowmem.errors.AmbiguousCheckpointError` naming them and the option that picks one.

Every face opens checkpoints inside :func:`entry_for` (the resolver and ``choose_set``), so they read the same entry.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from torch import nn

from lightning_lowmem.errors import AmbiguousCheckpointError
from lightning_lowmem.formats.state_entry import (
    Chooser,
    Shapes,
    ambiguous_message,
    choosing_entry,
    name_of,
    only_candidate,
)
from lightning_lowmem.plan import apply_key_map, guess_prefix

log = logging.getLogger(__name__)


ModuleOrMaker = nn.Module | Callable[[], nn.Module] | None
"""The module a load goes to, or a function that builds it (on meta) when a file's entries must be compared with it."""


@contextlib.contextmanager
def entry_for(module: ModuleOrMaker, wanted: str | None) -> Iterator[None]:
    """Torch files opened in the block read the entry ``wanted`` names, else the one candidate that fits ``module``
    (see the module docstring); without a module, the only candidate."""
    with choosing_entry(chooser(module, wanted)):
        yield


def chooser(module: ModuleOrMaker, wanted: str | None) -> Chooser:
    """The entry :func:`entry_for` reads, as a function of a file's path and candidates."""
    def choose(path: Path, found: Mapping[str, Shapes]) -> str:
        if wanted is not None or len(found) == 1 or module is None:
            return only_candidate(path, found, wanted)
        built = module if isinstance(module, nn.Module) else module()
        own = {name: tuple(t.shape) for name, t in built.state_dict(keep_vars=True).items()}
        fitting = [entry for entry, tensors in found.items() if fits(own, tensors)]
        if len(fitting) == 1:
            log.info("%s: read %s, the one of its %d entries holding tensors whose names fit the module", path,
                     name_of(fitting[0]), len(found))
            return fitting[0]
        why = (f"{len(fitting)} of its entries hold state dicts that fit the module" if fitting else
               "it holds several state dicts and none of them fits the module's names")
        raise AmbiguousCheckpointError(ambiguous_message(path, {e: found[e] for e in fitting} or found, why))

    return choose


def fits(own: Mapping[str, tuple[int, ...]], tensors: Shapes) -> bool:
    """Whether ``tensors`` (a candidate entry's: name -> shape) hold at least half of the module's tensors ``own``
    (name -> shape) under their names and in their shapes, a single missing or extra top-level prefix allowed.

    Example::

        >>> fits({"a.weight": (2, 2), "b.weight": (2, 2)}, {"model.a.weight": (2, 2), "model.b.weight": (2, 2)})
        True
        >>> fits({"a.weight": (2, 2), "b.weight": (2, 2)}, {"a.weight": (3, 1), "b.weight": (3, 1)})
        False
    """
    if not own:
        return False
    key_map, _ = guess_prefix(set(own), list(tensors))
    found = {name for key, shape in tensors.items()
             if (name := apply_key_map(key, key_map)) in own and own[name] == shape}
    return 2 * len(found) >= len(own)
