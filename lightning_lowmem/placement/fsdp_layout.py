"""How a model is split across ranks by FSDP2 (``fully_shard``), when its user does not say.

:func:`shard_model` is the default ``parallelize_fn`` of ``Fabric(strategy="lowmem_fsdp")``: each
transformer block (a child of the model's first ``nn.ModuleList``, as ``layers.py`` finds them) is
``fully_shard``-ed on its own, so one block's weights are gathered at a time; the rest (embeddings,
final norm, output head) goes with the root, sharded last. A block holding a parameter tied to one
outside it is left to the root's group: torch 2.13 refuses a tied parameter split across two
``fully_shard`` groups.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_lowmem.placement.layers import find_blocks


def shard_model(module: nn.Module, mesh: Any, **fully_shard_kwargs: Any) -> nn.Module:
    """``fully_shard`` each block of ``module`` that ties nothing outside itself, then the root; returns ``module``.

    Args:
        module: the model (on the meta device or real).
        mesh: the device mesh to shard over: a 1-D mesh, or a mesh with a ``"data_parallel"`` dimension
            (Lightning's ``ModelParallelStrategy`` mesh), which is used.
        fully_shard_kwargs: passed to every ``fully_shard`` call (``reshard_after_forward``, ``mp_policy``).
    """
    from torch.distributed.fsdp import fully_shard

    if mesh.mesh_dim_names and "data_parallel" in mesh.mesh_dim_names:
        mesh = mesh["data_parallel"]
    for block in shardable_blocks(module):
        fully_shard(block, mesh=mesh, **fully_shard_kwargs)
    fully_shard(module, mesh=mesh, **fully_shard_kwargs)
    return module


def shardable_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks of ``module`` none of whose parameters is tied to a parameter outside the block.

    Example::

        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 10)]))
        >>> model[1][1].weight = model[0].weight  # tied to the embedding: sharded with the root
        >>> [b is model[1][0] for b in shardable_blocks(model)]
        [True]
    """
    blocks = find_blocks(module)
    if blocks is None:
        return []
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    kept = []
    for index, block in enumerate(module.get_submodule(blocks)):
        prefix = f"{blocks}.{index}."
        ties_out = any(not n.startswith(prefix) for p in block.parameters() for n in names[id(p)])
        if not ties_out:
            kept.append(block)
    return kept
