"""The engine: the load pipeline, from a path to a loaded module, and the estimate that reads the same decision.

``options`` validates what a caller asks for once (``LoadOptions``); ``resolve`` decides which weights a path
stands for and how their names become the module's (``weight_sets`` compares a directory's sets); ``prepare``
decides the load from headers (plan, quantization, placement, the execution plan) and gives the placement plan;
``routes`` (with ``route``, ``stacked``, ``row_reads``) decides how each tensor travels from the file, and
``reader`` and ``readahead`` read along them; ``stream`` is the streaming loop, and onto a CUDA device
``staging`` (with ``staged``, ``ring``, ``copies``) reads through a ring of pinned buffers with copies overlapped;
``load`` is ``load_checkpoint``; ``report`` says what a load did; ``memory_estimate`` counts what a load and a
generation will need from the same routes; ``disk_reads`` hands the runtime (``runtime/``) the reading of the
layers a load leaves on disk. A model sharded across ranks (FSDP2) loads through ``shard_checks``, ``shard_fill``,
``whole_reads`` and ``shard_sums``, the ranks agreeing through ``ranks`` on ``collectives``. Writing a
checkpoint is the room above (``saving/``), which this one never imports. Every face (the Lightning strategies and
callback, the litgpt helpers, the command line) goes through here.
"""

from lightning_lowmem.engine.memory_estimate import CPU_RUNTIME, LOAD_RUNTIME, MemoryEstimate, estimate_prepared
from lightning_lowmem.engine.load import load_checkpoint, load_prepared, run_load
from lightning_lowmem.engine.options import LoadOptions
from lightning_lowmem.engine.prepare import PreparedLoad, placement_plan, prepare_load
from lightning_lowmem.engine.resolve import Source, opened, records_source, resolved
from lightning_lowmem.engine.report import LoadReport
from lightning_lowmem.engine.shard_checks import quantize_for_sharding
from lightning_lowmem.engine.shard_fill import allocate_shards

__all__ = [
    "CPU_RUNTIME",
    "LOAD_RUNTIME",
    "LoadOptions",
    "LoadReport",
    "MemoryEstimate",
    "PreparedLoad",
    "allocate_shards",
    "estimate_prepared",
    "load_checkpoint",
    "load_prepared",
    "opened",
    "placement_plan",
    "prepare_load",
    "quantize_for_sharding",
    "run_load",
    "Source",
    "records_source",
    "resolved",
]
