"""Placement and offload: which layer lives on which device under memory budgets, and streaming the rest in.

``budgets`` reads ``max_memory``, ``layers`` groups a model's tensors into the units
that move whole, ``architectures`` says what a model family needs beyond its weights
(caches, activations), ``place`` fits the layers into the budgets from the load plan,
``offload`` copies offloaded layers to the execution device for their forward, ``sharding``
splits a model across ranks (FSDP2) when its user does not say how.
"""

from lightning_lowmem.placement.architectures import (
    GENERIC,
    Architecture,
    CacheBytes,
    architecture_of,
    build_meta_model,
    register_architecture,
)
from lightning_lowmem.placement.budgets import Budgets, MaxMemory, parse_max_memory
from lightning_lowmem.placement.layers import Layer, find_blocks, group_layers
from lightning_lowmem.placement.offload import (
    Offload,
    dispatch,
    enable_offload,
    layer_offload,
    move_except_offloaded,
    offloaded,
    sequential_offload,
)
from lightning_lowmem.placement.place import DISK, PlacementPlan, place_layers
from lightning_lowmem.placement.fsdp_layout import shard_model, shardable_blocks

__all__ = [
    "DISK",
    "GENERIC",
    "Architecture",
    "Budgets",
    "CacheBytes",
    "Layer",
    "MaxMemory",
    "Offload",
    "PlacementPlan",
    "architecture_of",
    "build_meta_model",
    "dispatch",
    "enable_offload",
    "find_blocks",
    "group_layers",
    "layer_offload",
    "move_except_offloaded",
    "offloaded",
    "parse_max_memory",
    "place_layers",
    "register_architecture",
    "sequential_offload",
    "shard_model",
    "shardable_blocks",
]
