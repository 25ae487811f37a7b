"""Patches the library faces apply for the length of an ``init_empty()`` block (transformers' and diffusers'
``from_pretrained``: build on meta, read nothing), to their modules imported before the block or inside it.

A constructor may import its library only when it runs (``from transformers import CLIPTextModel`` inside
``__init__``): the module is then patched as it is imported, before anything calls it. Nothing of a library is
imported here; a module that is never imported is never patched.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

Hook = Callable[[ModuleType], contextlib.AbstractContextManager[Any]]
"""``hook(module)``: the patch of an imported module, for the length of the block (undone on exit)."""

_HOOKS: dict[str, Hook] = {}


@contextlib.contextmanager
def from_pretrained_replaced(cls: type, function: Callable[..., Any]) -> Iterator[None]:
    """``cls.from_pretrained`` is ``function`` (a classmethod) for the block; the library's own after it."""
    original = cls.__dict__["from_pretrained"]
    cls.from_pretrained = classmethod(function)
    try:
        yield
    finally:
        cls.from_pretrained = original


def refuse_reading_options(cls: type, path: Any, kwargs: dict[str, Any], names: tuple[str, ...]) -> None:
    """A ``from_pretrained`` keyword in ``names`` given inside ``init_empty()`` (``quantization_config``, a state dict
    to load from): a ``TypeError`` saying what to do, for no read follows that could honour it."""
    refused = [k for k in names if kwargs.get(k) is not None]
    if refused:
        raise TypeError(f"{cls.__name__}.from_pretrained({str(path)!r}, {refused[0]}=...) inside init_empty(): the "
                        "part is built on meta and filled by load_checkpoint, which does not take "
                        f"{refused[0]}; pass quantize= to load_checkpoint, or call from_pretrained outside "
                        "init_empty().")


def register_building_hook(module: str, hook: Hook) -> None:
    """Enter ``hook(module)`` in every ``init_empty()`` block where the module named ``module`` is imported, before
    the block or inside it; registering a name again replaces its hook."""
    _HOOKS[module] = hook


@contextlib.contextmanager
def hooks_applied() -> Iterator[None]:
    """Every registered hook entered for its module, now where it is imported, else when it is (inside the block)."""
    with contextlib.ExitStack() as stack:
        pending = {}
        for name, hook in _HOOKS.items():
            module = sys.modules.get(name)
            if module is not None:
                stack.enter_context(hook(module))
            else:
                pending[name] = hook
        watcher = _Watcher(pending, stack) if pending else None
        if watcher is not None:
            sys.meta_path.insert(0, watcher)
        try:
            yield
        finally:
            if watcher is not None:
                sys.meta_path.remove(watcher)


class _Watcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module a hook waits for, the path finder's spec, its loader wrapped so that the
    hook is entered once the module has run."""

    def __init__(self, pending: dict[str, Hook], stack: contextlib.ExitStack) -> None:
        self.pending, self.stack = pending, stack

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Then(spec.loader, lambda module: self._apply(fullname, module))
        return spec

    def _apply(self, name: str, module: ModuleType) -> None:
        hook = self.pending.pop(name, None)
        if hook is not None:
            self.stack.enter_context(hook(module))


class _Then(importlib.abc.Loader):
    """A loader that runs ``after(module)`` once ``loader`` has executed the module."""

    def __init__(self, loader: Any, after: Callable[[ModuleType], None]) -> None:
        self.loader, self.after = loader, after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.after(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ...: the wrapped loader's
        return getattr(self.loader, name)
