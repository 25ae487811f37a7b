"""The runtime: how each layer runs after the load: offloaded layers copied in for their forward, layers on disk read
from the checkpoint file for theirs."""

from lightning_lowmem.runtime.offload import (
    Offload,
    dispatch,
    enable_offload,
    layer_offload,
    move_except_offloaded,
    offloaded,
    sequential_offload,
)

__all__ = [
    "Offload",
    "dispatch",
    "enable_offload",
    "layer_offload",
    "move_except_offloaded",
    "offloaded",
    "sequential_offload",
]
