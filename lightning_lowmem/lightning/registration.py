"""``Fabric(strategy="lowmem")`` and ``Fabric(strategy="lowmem_fsdp")`` without importing Lightning when
lightning_lowmem is imported.

Importing ``lightning`` takes 3-5 s and ~200 MiB of RSS (measured: a bare ``import torch``
process 218 MiB, with ``lightning`` 414 MiB), which a user of :func:`load_checkpoint` on a
transformers model should not pay. Fabric looks strategies up by name in
``lightning.fabric.strategies.STRATEGY_REGISTRY``, and nothing registers a third party's
strategy for it. So:

* if ``lightning.fabric.strategies`` is already imported, both names are registered at once;
* otherwise a one-shot import hook registers it right after that module runs, so the name is
  there before any ``Fabric(...)`` can be built, whichever package is imported first.

What is registered is a factory that imports :mod:`lightning_lowmem.lightning.strategy` (or
:mod:`lightning_lowmem.lightning.fsdp`) when Fabric builds the strategy; this module is the one
place both names are registered.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

REGISTRY_MODULE = "lightning.fabric.strategies"
DESCRIPTION = "One device; build on meta, stream (and quantize) checkpoints in."
FSDP_DESCRIPTION = "Many ranks (FSDP2); each rank reads and holds its own shard (QLoRA with torchao.nf4)."


def _build_strategy(**kwargs: Any) -> Any:
    from lightning_lowmem.lightning.strategy import LowMemStrategy

    return LowMemStrategy(**kwargs)


def _build_fsdp_strategy(**kwargs: Any) -> Any:
    from lightning_lowmem.lightning.fsdp import LowMemFSDPStrategy

    return LowMemFSDPStrategy(**kwargs)


def register(registry: Any) -> None:
    """File ``"lowmem"`` and ``"lowmem_fsdp"`` in a Fabric strategy registry (entries by those names are replaced)."""
    registry.register("lowmem", _build_strategy, description=DESCRIPTION, override=True)
    registry.register("lowmem_fsdp", _build_fsdp_strategy, description=FSDP_DESCRIPTION, override=True)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: lets the usual finder find :data:`REGISTRY_MODULE`, and runs :func:`register` after it."""

    def find_spec(self, fullname: str, path: Any,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding this hook again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                module.__spec__.loader = module.__loader__ = loader  # the module keeps its real loader
                loader.exec_module(module)
                register(module.STRATEGY_REGISTRY)

        spec.loader = _Loader()
        return spec


def register_when_lightning_loads() -> None:
    """Register both names now if Lightning's registry exists, else as soon as it is imported (idempotent)."""
    module = sys.modules.get(REGISTRY_MODULE)
    if module is not None and hasattr(module, "STRATEGY_REGISTRY"):
        register(module.STRATEGY_REGISTRY)
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
