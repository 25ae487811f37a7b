"""Grouping a model's tensors into layers: the units a placement plan moves whole.

A transformer block is never split: the children of the first ``nn.ModuleList``
found in module order (litgpt's ``transformer.h``, HF's ``model.layers``) are
the blocks, one layer each. Every other tensor belongs to the shallowest module
on its path that is not an ancestor of that list: ``lm_head``,
``transformer.wte`` and ``transformer.ln_f`` in litgpt's ``GPT``; without a
``ModuleList``, the top-level modules. Tensors owned directly by the root or by
an ancestor of the blocks form a layer that cannot be offloaded (its forward is
the whole model). Tied tensors join their layers into one, so a tie never spans
two devices.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_lowmem.plan import LoadPlan, Target
from lightning_lowmem.quant_sizes import scheme_size
from lightning_lowmem.quantize.selection import DEFAULT_SKIP

def quantized_nbytes(scheme: str, out_features: int, in_features: int) -> int:
    """Bytes a ``scheme``-quantized ``(out_features, in_features)`` weight occupies (see :mod:`.quant_sizes`).

    Example::

        >>> quantized_nbytes("bnb.int8", 4096, 4096)  # 16 MiB of codes + 16 KiB of row scales
        16793600
    """
    return scheme_size(scheme).nbytes(out_features, in_features)


@dataclass
class Layer:
    """A unit of placement: one block, or one other top-level module (joined with those it ties to).

    Attributes:
        name: the module name (``'transformer.h.3'``), ``'a+b'`` for tied modules, ``''`` for the root.
        modules: the module names it covers.
        tensors: every name of its loaded tensors (tied names included).
        nbytes: bytes of its tensors on the device: target dtype, after quantization.
        activation_bytes: estimated bytes of its activations for the planned batch and context.
        is_block: a child of the model's first ``ModuleList``.
        movable: False for tensors owned by the root or an ancestor of the blocks: never offloaded.
        device: where the plan puts it (filled in by the placement).
    """

    name: str
    modules: list[str]
    tensors: list[str] = field(default_factory=list)
    nbytes: int = 0
    activation_bytes: int = 0
    is_block: bool = False
    movable: bool = True
    device: str = ""


def find_blocks(module: nn.Module) -> str | None:
    """The name of the first ``nn.ModuleList`` in module order (the transformer blocks), or None."""
    for name, mod in module.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            return name
    return None


def layer_name(tensor_name: str, blocks: str | None) -> tuple[str, bool, bool]:
    """The layer of a tensor: ``(module name, is_block, movable)``."""
    parts = tensor_name.split(".")[:-1]  # the owning module's path
    if blocks is not None and tensor_name.startswith(f"{blocks}." if blocks else ""):
        depth = blocks.count(".") + 2 if blocks else 1
        return ".".join(tensor_name.split(".")[:depth]), True, True
    ancestors = set() if blocks is None else {".".join(blocks.split(".")[:i]) for i in range(blocks.count(".") + 2)}
    for i in range(1, len(parts) + 1):
        candidate = ".".join(parts[:i])
        if candidate not in ancestors:
            return candidate, False, True
    return ".".join(parts), False, False  # owned by the root or an ancestor of the blocks


def group_layers(module: nn.Module, plan: LoadPlan, *, quantize: str | None = None,
                 skip_quantize: list[str] | tuple[str, ...] | None = None) -> list[Layer]:
    """The layers of ``module`` in module order, with the bytes each will occupy after the load."""
    blocks = find_blocks(module)
    patterns = tuple(skip_quantize) if skip_quantize is not None else DEFAULT_SKIP
    layers: dict[str, Layer] = {}
    home: dict[str, str] = {}  # module name -> the layer that holds it (after joining ties)
    for target in plan.targets:
        names = {layer_name(n, blocks) for n in target.names}
        found = [_layer_for(layers, home, name, is_block, movable) for name, is_block, movable in sorted(names)]
        layer = found[0]
        for other in found[1:]:
            if other is not layer:
                _join(layers, home, layer, other)
        layer.tensors += target.names
        layer.nbytes += target_nbytes(module, target, quantize, patterns)
    return list(layers.values())


def _layer_for(layers: dict[str, Layer], home: dict[str, str], name: str, is_block: bool, movable: bool) -> Layer:
    if name in home:
        return layers[home[name]]
    layers[name] = home_layer = Layer(name, [name], is_block=is_block, movable=movable)
    home[name] = name
    return home_layer


def _join(layers: dict[str, Layer], home: dict[str, str], keep: Layer, other: Layer) -> None:
    """Merge ``other`` into ``keep`` (tied tensors): one layer, one device, at ``keep``'s place."""
    keep.modules += other.modules
    keep.tensors += other.tensors
    keep.nbytes += other.nbytes
    keep.is_block = keep.is_block and other.is_block
    keep.movable = keep.movable and other.movable
    keep.name = f"{keep.name}+{other.name}"
    kept = [layer for layer in layers.values() if layer is not other]
    layers.clear()
    layers.update((layer.name, layer) for layer in kept)
    for mod in keep.modules:
        home[mod] = keep.name


def target_nbytes(module: nn.Module, target: Target, quantize: str | None, skip: tuple[str, ...]) -> int:
    """Bytes ``target`` occupies once loaded: quantized when it is the weight of a Linear that will be."""
    owner_name, _, leaf = target.names[0].rpartition(".")
    if quantize is not None and leaf == "weight" and len(target.names) == 1 and owner_name:
        owner = module.get_submodule(owner_name)
        if type(owner) is nn.Linear and not any(fnmatch.fnmatchcase(owner_name, p) for p in skip):
            return quantized_nbytes(quantize, owner.out_features, owner.in_features)
    return target.record.numel * target.dtype.itemsize


def activation_nbytes(module: nn.Module, layer: Layer, batch_size: int, tokens: int, itemsize: int) -> int:
    """A conservative estimate of one layer's activations during a forward of ``tokens`` tokens.

    Every output of its ``nn.Linear`` / ``nn.Embedding`` modules alive at once
    (``batch x tokens x width x itemsize`` each), plus, for a block of a model
    whose config has ``n_head``, the attention scores ``batch x n_head x tokens^2``
    in fp32 (the math attention kernel materializes them).
    """
    width = 0
    for name in layer.modules:
        for sub in module.get_submodule(name).modules():
            if isinstance(sub, nn.Linear):
                width += sub.out_features
            elif isinstance(sub, nn.Embedding):
                width += sub.embedding_dim
    scores = 0
    n_head = getattr(getattr(module, "config", None), "n_head", None)
    if layer.is_block and isinstance(n_head, int):
        scores = batch_size * n_head * tokens * tokens * 4
    return batch_size * tokens * width * itemsize + scores


def cache_nbytes(module: nn.Module, batch_size: int, context: int, itemsize: int) -> int:
    """KV cache, mask and RoPE bytes of a litgpt-style model for ``context`` tokens (0 if unknown).

    ``2 x n_layer x batch x n_query_groups x context x head_size x itemsize`` for k and v,
    ``context^2`` bytes of bool mask and ``2 x context x rope_n_elem x 4`` of fp32 RoPE
    tables, read from ``module.config``. Sliding-window layers are counted at full context.
    """
    config = getattr(module, "config", None)
    try:
        n_layer, groups, head = int(config.n_layer), int(config.n_query_groups), int(config.head_size)
    except (AttributeError, TypeError):
        return 0
    rope = int(getattr(config, "rope_n_elem", 0) or 0)
    kv = 2 * n_layer * batch_size * groups * context * head * itemsize
    return kv + context * context + 2 * context * rope * 4


def floating_itemsize(module: nn.Module, dtype: torch.dtype | None) -> int:
    """Bytes per element of activations: ``dtype``, else the module's first floating parameter's."""
    if dtype is not None:
        return dtype.itemsize
    for p in module.parameters():
        if p.dtype.is_floating_point:
            return p.dtype.itemsize
    return torch.get_default_dtype().itemsize
