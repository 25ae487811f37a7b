"""The engine: the load pipeline, from a path to a loaded module, and the estimate that reads the same decision.

It stands on four rooms below it: ``request/`` (what a caller asks, ``LoadOptions``, and the defaults when it does
not say), ``sources/`` (which weights a path stands for, which entry of a torch file, and how their names become the
module's), ``ranks/`` (many ranks: collectives, every rank failing together, shards filled in place) and ``routes/``
(how each tensor travels from the file into the module, the device path included). Here: ``prepare`` decides the
load from headers (plan, quantization, placement, the execution plan) and gives the placement plan; ``stream`` is
the streaming loop along the routes; ``load`` is ``load_checkpoint``; ``report`` says what a load did;
``memory_estimate`` counts what a load and a generation will need from the same routes; ``shard_checks`` checks
what shards can take before any read; ``disk_reads`` hands the runtime (``runtime/``) the reading of the layers a
load leaves on disk. Writing a checkpoint is the room above (``saving/``), which this one never imports. Every face
(the Lightning strategies and callback, the litgpt helpers, the command line) goes through here.
"""

from lightning_lowmem.engine.memory_estimate import CPU_RUNTIME, LOAD_RUNTIME, MemoryEstimate, estimate_prepared
from lightning_lowmem.engine.load import load_checkpoint, load_prepared, run_load
from lightning_lowmem.request.options import LoadOptions
from lightning_lowmem.engine.prepare import PreparedLoad, placement_plan, prepare_load
from lightning_lowmem.sources.resolve import Source, opened, records_source, resolved
from lightning_lowmem.engine.report import LoadReport
from lightning_lowmem.engine.shard_checks import quantize_for_sharding
from lightning_lowmem.ranks.shard_fill import allocate_shards

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
