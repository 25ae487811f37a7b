"""The runtime: how each layer runs after the load.

``streamer`` is the one executor of the modules kept off the execution device: each brought in for its own forward
from a ``source`` while the one before computes, in the order the forward takes. Its two sources: ``host_copies``
(masters on the CPU, copied to the device: ``offload``'s layer and sequential offload) and ``file_reads`` (layers
left in the checkpoint file, read into ``layer_buffers`` as ``disk_units``: the ``disk_tier``).
"""

from lightning_lowmem.runtime.disk_tier import DiskTier
from lightning_lowmem.runtime.offload import (
    Offload,
    dispatch,
    enable_offload,
    layer_offload,
    move_except_offloaded,
    offloaded,
    sequential_offload,
)
from lightning_lowmem.runtime.guard import streamers_in
from lightning_lowmem.runtime.streamer import LayerStreamer, StreamStats

__all__ = [
    "DiskTier",
    "LayerStreamer",
    "Offload",
    "StreamStats",
    "dispatch",
    "enable_offload",
    "layer_offload",
    "move_except_offloaded",
    "offloaded",
    "sequential_offload",
    "streamers_in",
]
