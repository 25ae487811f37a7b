"""lightning_lowmem: load, quantize and run large models in the memory of the final model.

Importing it does not import Lightning (3-5 s, ~200 MiB): ``LowMemStrategy`` and ``LowMemCallback``
are imported on first use, and ``Fabric(strategy="lowmem")`` is registered when Lightning's strategy
registry loads (:mod:`lightning_lowmem.registration`).
"""

import importlib
from typing import Any

from lightning_lowmem.checkpoint import Checkpoint, CheckpointNotFoundError
from lightning_lowmem.dtype_fallback import BF16FallbackWarning, assume_bf16_support, supports_bf16
from lightning_lowmem.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    KVCacheTooShortError,
    LowMemError,
    DeviceUnavailableError,
    MemoryBudgetError,
    MetaTensorError,
    UnsafeCheckpointError,
    UnsupportedQuantizationError,
)
from lightning_lowmem.estimate import MemoryEstimate, estimate_memory
from lightning_lowmem.generate import GenerateResult, GenerationMemory, generate
from lightning_lowmem.kv_cache import CacheBytes, cache_bytes, setup_kv_cache
from lightning_lowmem.litgpt_patch import patch_litgpt, unpatch_litgpt
from lightning_lowmem.loader import LoadReport, load_checkpoint
from lightning_lowmem.materialize import init_empty
from lightning_lowmem.memory import MemoryMonitor, MemoryUsage, format_bytes
from lightning_lowmem.offload import Offload, dispatch, enable_offload, layer_offload, sequential_offload
from lightning_lowmem.placement import PlacementPlan, placement_plan
from lightning_lowmem.plan import Combine
from lightning_lowmem.registration import register_when_lightning_loads

register_when_lightning_loads()

_LIGHTNING_CLASSES = {"LowMemStrategy": "lightning_lowmem.strategy", "LowMemCallback": "lightning_lowmem.callback"}


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_CLASSES:  # subclasses of Lightning's classes: importing them imports Lightning
        value = getattr(importlib.import_module(_LIGHTNING_CLASSES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LIGHTNING_CLASSES))

__version__ = "0.1.0.dev0"

__all__ = [
    "BF16FallbackWarning",
    "CacheBytes",
    "Checkpoint",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "Combine",
    "GenerateResult",
    "GenerationMemory",
    "KVCacheTooShortError",
    "LoadReport",
    "LowMemCallback",
    "LowMemError",
    "LowMemStrategy",
    "DeviceUnavailableError",
    "MemoryBudgetError",
    "MemoryEstimate",
    "MemoryMonitor",
    "MemoryUsage",
    "MetaTensorError",
    "Offload",
    "PlacementPlan",
    "UnsafeCheckpointError",
    "UnsupportedQuantizationError",
    "assume_bf16_support",
    "cache_bytes",
    "dispatch",
    "enable_offload",
    "estimate_memory",
    "format_bytes",
    "generate",
    "init_empty",
    "layer_offload",
    "load_checkpoint",
    "patch_litgpt",
    "placement_plan",
    "sequential_offload",
    "setup_kv_cache",
    "supports_bf16",
    "unpatch_litgpt",
]
