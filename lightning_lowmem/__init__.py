"""lightning_lowmem: load, quantize and run large models in the memory of the final model."""

from lightning_lowmem.callback import LowMemCallback
from lightning_lowmem.checkpoint import Checkpoint, CheckpointNotFoundError
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
from lightning_lowmem.strategy import LowMemStrategy  # registers Fabric(strategy="lowmem")

__version__ = "0.1.0.dev0"

__all__ = [
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
    "UnsafeCheckpointError",
    "UnsupportedQuantizationError",
    "format_bytes",
    "init_empty",
    "load_checkpoint",
]
