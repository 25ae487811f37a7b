"""The litgpt faces: KV caches sized to the request, RoPE tables built when used, HF checkpoints converted
as they stream, ``generate()``, ``patch_litgpt()`` and ``estimate_memory()``.

Importing this package registers litgpt's ``GPT`` with the engine (:mod:`.architecture`); it does not
import litgpt itself, which is imported where it is used.
"""

from lightning_lowmem.litgpt.architecture import LITGPT, LitgptArchitecture
from lightning_lowmem.litgpt.conversions import GGUF_TO_LITGPT, HF_TO_LITGPT  # noqa: F401  (registers them)
from lightning_lowmem.litgpt.estimate_memory import estimate_memory
from lightning_lowmem.litgpt.generation import GenerateResult, GenerationMemory, generate
from lightning_lowmem.litgpt.kv_cache import cache_bytes, setup_kv_cache
from lightning_lowmem.litgpt.patch import patch_litgpt, unpatch_litgpt

__all__ = [
    "LITGPT",
    "GenerateResult",
    "GenerationMemory",
    "LitgptArchitecture",
    "cache_bytes",
    "estimate_memory",
    "generate",
    "patch_litgpt",
    "setup_kv_cache",
    "unpatch_litgpt",
]
