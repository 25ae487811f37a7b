"""Placement: which layer lives on which device under memory budgets (``runtime/`` runs the layers placed off the device).

``budgets`` reads ``max_memory``, ``layers`` groups a model's tensors into the units
that move whole, ``architectures`` says what a model family needs beyond its weights
(caches, activations), ``place`` fits the layers into the budgets from the load plan, ``fsdp_layout``
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
    "PlacementPlan",
    "architecture_of",
    "build_meta_model",
    "find_blocks",
    "group_layers",
    "parse_max_memory",
    "place_layers",
    "register_architecture",
    "shard_model",
    "shardable_blocks",
]
