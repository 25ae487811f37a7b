"""The root's forward inside a try/finally, so that a layer streamer's end of forward runs on every way out.

Forward hooks are not enough: torch runs ``always_call`` forward hooks after an ``Exception`` only, so a
``KeyboardInterrupt`` (Ctrl-C) inside a forward would leave layers installed and the thread count lowered. The
guard is set on the model instance (``model.forward``) and calls the class's own ``forward`` (or a forward set on
the instance before it); it holds its streamers (so the model keeps them alive) and the model weakly (so dropping
the model frees it, with no collector pass).

::

    guard(root, streamer)     the root's forward guarded (a second streamer joins the same guard)
    unguard(root, streamer)   the streamer taken off; the root's own forward back once none is left
    streamers_in(model)       the streamers guarding a model or any of its modules
"""

from __future__ import annotations

import copy as copy_module
import inspect
import weakref
from typing import Any, Protocol

from torch import nn


class LayerStreamer(Protocol):
    """What the guard calls (``streamer.py``'s ``LayerStreamer``)."""

    def begin_forward(self) -> None: ...

    def end_forward(self, hooks_follow: bool = False) -> None: ...


class Guarded:
    """The root's forward, its streamers' ``begin_forward`` before and ``end_forward`` after, on every way out."""

    def __init__(self, root: nn.Module, streamer: LayerStreamer) -> None:
        self._root = weakref.ref(root)
        self._own = root.__dict__.get("forward")  # a forward set on the instance before, called as it was
        self.streamers = [streamer]
        # what inspects the forward (transformers' generate reads its parameters) sees the model's own
        self.__signature__ = inspect.signature(self._own if self._own is not None else root.forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        root = self._root()
        forward = self._own if self._own is not None else type(root).forward.__get__(root)
        begun: list[LayerStreamer] = []  # a streamer that refuses to begin (another thread's forward) is not ended
        try:
            for streamer in list(self.streamers):
                streamer.begin_forward()
                begun.append(streamer)
            result = forward(*args, **kwargs)
        except Exception:
            _end_all(begun, hooks_follow=True)
            raise
        except BaseException:
            _end_all(begun, hooks_follow=False)  # no forward hook runs after a KeyboardInterrupt
            raise
        _end_all(begun, hooks_follow=True)
        return result

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copy of the model is not streamed (its hooks call the original's streamer): it gets the plain forward
        of its own, never one that runs the original model."""
        root = self._root()
        copy = memo.get(id(root))
        if self._own is not None:
            return copy_module.deepcopy(self._own, memo)
        return type(copy).forward.__get__(copy) if copy is not None else None

    def remove(self, root: nn.Module, streamer: LayerStreamer | None = None) -> None:
        """Take ``streamer`` off (all of them when None); the root's own forward back once none is left."""
        self.streamers = [s for s in self.streamers if streamer is not None and s is not streamer]
        if self.streamers:
            return
        if self._own is not None:
            root.__dict__["forward"] = self._own
        else:
            root.__dict__.pop("forward", None)


def _end_all(streamers: list[LayerStreamer], hooks_follow: bool) -> None:
    for streamer in reversed(streamers):
        streamer.end_forward(hooks_follow)


def streamers_in(model: nn.Module) -> list[Any]:
    """The streamers guarding ``model``'s forward or any of its modules' (a module offloaded on its own)."""
    found = []
    for module in model.modules():
        current = module.__dict__.get("forward")
        if isinstance(current, Guarded):
            found += current.streamers
    return found


def guard(root: nn.Module, streamer: LayerStreamer) -> None:
    """Run ``streamer``'s begin and end of forward around ``root``'s forward."""
    current = root.__dict__.get("forward")
    if isinstance(current, Guarded):
        current.streamers.append(streamer)  # a second streamer on the same model (offload and a disk tier)
    else:
        root.__dict__["forward"] = Guarded(root, streamer)


def unguard(root: nn.Module | None, streamer: LayerStreamer) -> None:
    """Take ``streamer`` off ``root``'s guard (nothing when the root is gone or not guarded)."""
    current = root.__dict__.get("forward") if root is not None else None
    if isinstance(current, Guarded):
        current.remove(root, streamer)
