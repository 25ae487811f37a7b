"""The engine: one options object, one plan per load, the streaming loop and its report.

``options`` validates what a caller asks for once; ``resolve`` decides which weights a path
stands for and how their names become the module's (``weight_sets`` compares a directory's
sets); ``prepare`` decides the load from headers (plan, quantization, placement) and gives
the placement plan; ``stream`` reads
each tensor alone (``readahead`` overlaps and reuses reads); ``load`` is
``load_checkpoint``; ``report`` says what a load did; ``estimate`` reads the same
decision to say what a load and a generation will need; ``disk_reads`` hands the runtime (``runtime/``) the
reading of the layers a load leaves on disk; ``shards``, ``sharding`` and ``ranks``
load a model sharded across ranks (FSDP2), each rank its own part; ``save`` is
``save_checkpoint``, the way back. Every face (the Lightning
strategy and callback, the litgpt helpers) goes through here.
"""

from lightning_lowmem.engine.memory_estimate import CPU_RUNTIME, LOAD_RUNTIME, MemoryEstimate, estimate_prepared
from lightning_lowmem.engine.load import load_checkpoint, load_prepared, run_load
from lightning_lowmem.engine.options import LoadOptions
from lightning_lowmem.engine.prepare import PreparedLoad, placement_plan, prepare_load
from lightning_lowmem.engine.resolve import Source, opened, records_source, resolved
from lightning_lowmem.engine.report import LoadReport
from lightning_lowmem.engine.save import ModuleState, module_state, save_checkpoint
from lightning_lowmem.engine.shard_checks import quantize_for_sharding
from lightning_lowmem.engine.shard_fill import allocate_shards

__all__ = [
    "CPU_RUNTIME",
    "LOAD_RUNTIME",
    "LoadOptions",
    "LoadReport",
    "MemoryEstimate",
    "ModuleState",
    "PreparedLoad",
    "allocate_shards",
    "estimate_prepared",
    "load_checkpoint",
    "load_prepared",
    "module_state",
    "opened",
    "placement_plan",
    "prepare_load",
    "quantize_for_sharding",
    "run_load",
    "save_checkpoint",
    "Source",
    "records_source",
    "resolved",
]
