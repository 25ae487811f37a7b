"""lightning_lowmem: load, quantize and run large models in the memory of the final model.

The package follows the data flow; each folder imports only those above it in this list::

    errors, dtypes, devices, meta, memory/   the ground: errors, dtypes, devices, meta tensors, memory accounting
    formats/     checkpoint files: headers first, then one tensor (or block of rows) at a time
    plan/        the load plan: which module tensor comes from which key(s), dtype, device
    quantize/    quantization schemes, and the one rule that picks the Linears to quantize
    placement/   budgets, layers, what a model family needs beyond its weights, each layer's device
    runtime/     how each layer runs after the load: offloaded layers copied in, layers on disk read, per forward
    engine/      LoadOptions, one prepared load, the streaming loop, LoadReport, the estimate
    lightning/   the Lightning faces: Fabric strategy, Trainer callback, registration
    litgpt/      the litgpt faces: KV caches, RoPE, HF conversion, generate, patch_litgpt, estimate_memory
    transformers/  the transformers face: a PreTrainedModel's buffers rebuilt after a load, as from_pretrained does
    diffusers/   the diffusers face: ModelMixin.from_pretrained inside init_empty() builds on meta, reads nothing
    cli/         the command line: lightning-lowmem estimate | inspect | generate | chat (python -m lightning_lowmem)

Importing it does not import Lightning (3-5 s, ~200 MiB): ``LowMemStrategy``, ``LowMemFSDPStrategy`` and
``LowMemCallback`` are imported on first use, and ``Fabric(strategy="lowmem")`` and
``Fabric(strategy="lowmem_fsdp")`` are registered when Lightning's strategy registry loads
(:mod:`lightning_lowmem.lightning.registration`).
"""

from lightning_lowmem.interrupts import catch_while_starting as _catch_while_starting

_catch_while_starting()  # in the lightning-lowmem command only: Ctrl-C while it imports is one line (interrupts.py)

import importlib  # noqa: E402
from typing import Any  # noqa: E402

from lightning_lowmem.system import check_supported

check_supported()  # before anything that needs fcntl: Windows gets one clear error, not a missing module

from lightning_lowmem.dtypes import BF16FallbackWarning, assume_bf16_support, supports_bf16
from lightning_lowmem.engine import (
    LoadOptions,
    LoadReport,
    MemoryEstimate,
    load_checkpoint,
    placement_plan,
)
from lightning_lowmem.errors import (
    AmbiguousCheckpointError,
    CheckpointChangedError,
    CheckpointDiffersError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointReadError,
    DeviceUnavailableError,
    ForeignWeightsError,
    KVCacheBatchError,
    KVCacheLengthError,
    KVCachePositionError,
    KVCacheTooShortError,
    LowMemError,
    MemoryBudgetError,
    MetaTensorError,
    RankLostError,
    NoStateDictError,
    SaveError,
    UnsafeCheckpointError,
    UnsupportedPlatformError,
    UnsupportedQuantizationError,
    UnverifiedWeightsWarning,
)
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.saving import save_checkpoint
from lightning_lowmem.lightning.registration import register_when_lightning_loads
from lightning_lowmem.litgpt import (
    GenerateResult,
    GenerationMemory,
    cache_bytes,
    estimate_memory,
    generate,
    patch_litgpt,
    setup_kv_cache,
    unpatch_litgpt,
)
from lightning_lowmem.memory import MemoryMonitor, MemoryUsage, Timeline, format_bytes, save_timeline
from lightning_lowmem.meta import init_empty
from lightning_lowmem.placement import CacheBytes, PlacementPlan
from lightning_lowmem.plan import Combine, GGUFConversion, gguf_config, gguf_to_transformers
from lightning_lowmem.runtime import Offload, dispatch, enable_offload, layer_offload, sequential_offload
from lightning_lowmem.transformers import TRANSFORMERS  # noqa: F401  (registers transformers' PreTrainedModel)
from lightning_lowmem import diffusers as _diffusers  # noqa: F401,E402  (registers from_pretrained inside init_empty())

register_when_lightning_loads()

_LIGHTNING_CLASSES = {"LowMemStrategy": "lightning_lowmem.lightning.strategy",
                      "LowMemFSDPStrategy": "lightning_lowmem.lightning.fsdp",
                      "LowMemCallback": "lightning_lowmem.lightning.callback"}


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
    "AmbiguousCheckpointError",
    "BF16FallbackWarning",
    "CacheBytes",
    "Checkpoint",
    "CheckpointChangedError",
    "CheckpointDiffersError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "Combine",
    "DeviceUnavailableError",
    "ForeignWeightsError",
    "GGUFConversion",
    "GenerateResult",
    "GenerationMemory",
    "KVCacheBatchError",
    "KVCacheLengthError",
    "KVCachePositionError",
    "KVCacheTooShortError",
    "LoadOptions",
    "LoadReport",
    "LowMemCallback",
    "LowMemError",
    "LowMemFSDPStrategy",
    "LowMemStrategy",
    "MemoryBudgetError",
    "MemoryEstimate",
    "MemoryMonitor",
    "MemoryUsage",
    "MetaTensorError",
    "NoStateDictError",
    "Offload",
    "PlacementPlan",
    "RankLostError",
    "SaveError",
    "Timeline",
    "UnsafeCheckpointError",
    "UnsupportedPlatformError",
    "UnsupportedQuantizationError",
    "UnverifiedWeightsWarning",
    "assume_bf16_support",
    "cache_bytes",
    "dispatch",
    "enable_offload",
    "estimate_memory",
    "format_bytes",
    "generate",
    "gguf_config",
    "gguf_to_transformers",
    "init_empty",
    "layer_offload",
    "load_checkpoint",
    "patch_litgpt",
    "placement_plan",
    "save_checkpoint",
    "save_timeline",
    "sequential_offload",
    "setup_kv_cache",
    "supports_bf16",
    "unpatch_litgpt",
]
