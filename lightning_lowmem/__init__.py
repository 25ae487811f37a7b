"""lightning_lowmem: load, quantize and run large models in the memory of the final model."""

from lightning_lowmem.callback import LowMemCallback
from lightning_lowmem.checkpoint import Checkpoint, CheckpointNotFoundError
from lightning_lowmem.dtype_fallback import BF16FallbackWarning, assume_bf16_support, supports_bf16
from lightning_lowmem.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    LowMemError,
    MemoryBudgetError,
    MetaTensorError,
    UnsafeCheckpointError,
    UnsupportedQuantizationError,
)
from lightning_lowmem.loader import LoadReport, load_checkpoint
from lightning_lowmem.materialize import init_empty
from lightning_lowmem.memory import MemoryMonitor, MemoryUsage, format_bytes
from lightning_lowmem.offload import Offload, dispatch, enable_offload, layer_offload, sequential_offload
from lightning_lowmem.placement import PlacementPlan, placement_plan
from lightning_lowmem.strategy import LowMemStrategy  # registers Fabric(strategy="lowmem")

__version__ = "0.1.0.dev0"

__all__ = [
    "BF16FallbackWarning",
    "Checkpoint",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "LoadReport",
    "LowMemCallback",
    "LowMemError",
    "LowMemStrategy",
    "MemoryBudgetError",
    "MemoryMonitor",
    "MemoryUsage",
    "MetaTensorError",
    "Offload",
    "PlacementPlan",
    "UnsafeCheckpointError",
    "UnsupportedQuantizationError",
    "assume_bf16_support",
    "dispatch",
    "enable_offload",
    "format_bytes",
    "init_empty",
    "layer_offload",
    "load_checkpoint",
    "placement_plan",
    "sequential_offload",
    "supports_bf16",
]
