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

import math
from dataclasses import dataclass, field

from torch import nn

from lightning_lowmem.plan import LoadPlan, Target
from lightning_lowmem.transfer import block_nbytes, lay_out


@dataclass
class Layer:
    """A unit of placement: one block, or one other top-level module (joined with those it ties to).

    Attributes:
        name: the module name (``'transformer.h.3'``), ``'a+b'`` for tied modules, ``''`` for the root.
        modules: the module names it covers.
        tensors: every name of its loaded tensors (tied names included).
        nbytes: bytes of its tensors on the device: target dtype, after quantization (``Target.final_nbytes``).
        read_nbytes: bytes read from the checkpoint for its tensors (``Target.read_nbytes``): what a forward reads
            when the layer stays in the checkpoint file (``disk_offload``).
        is_block: a child of the model's first ``ModuleList``.
        movable: False for tensors owned by the root or an ancestor of the blocks: never offloaded.
        device: where the plan puts it (filled in by the placement).
        parts: bytes of each plain tensor its tensors are held as once loaded (a quantized weight's codes, scales
            and tables): what its masters are carved as when it is offloaded (``pinned_nbytes``).
        buffer_parts: bytes of each tensor a read buffer holds it as when it stays on disk (a weight stored
            quantized: its stored parts; another tensor: itself in its dtype).
    """

    name: str
    modules: list[str]
    tensors: list[str] = field(default_factory=list)
    nbytes: int = 0
    read_nbytes: int = 0
    is_block: bool = False
    movable: bool = True
    device: str = ""
    parts: list[int] = field(default_factory=list)
    buffer_parts: list[int] = field(default_factory=list)

    @property
    def pinned_nbytes(self) -> int:
        """Host memory its masters take when it is offloaded: one block of its parts, each carved 64-byte aligned,
        whole pages (``transfer/pinned.py``; pinned for a CUDA execution device)."""
        return block_nbytes(lay_out(self.parts)[1])

    @property
    def buffer_nbytes(self) -> int:
        """Host memory of one read buffer that holds it when it stays on disk: its buffer parts laid out as
        ``pinned_nbytes`` lays out its parts."""
        return block_nbytes(lay_out(self.buffer_parts)[1])

    @property
    def tied(self) -> bool:
        """Whether it is modules joined by a tie (an embedding and the head that shares its weight): they run apart in
        a forward, so a layer streamed in is kept from the first of them to the last (read once per forward)."""
        return len(self.modules) > 1


def find_blocks(module: nn.Module) -> str | None:
    """The name of the first ``nn.ModuleList`` in module order (the transformer blocks), or None."""
    for name, mod in module.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            return name
    return None


def layer_name(tensor_name: str, blocks: str | None) -> tuple[str, bool, bool]:
    """The layer of a tensor: ``(module name, is_block, movable)``.

    Example::

        >>> layer_name("transformer.h.3.attn.qkv.weight", "transformer.h")
        ('transformer.h.3', True, True)
        >>> layer_name("transformer.wte.weight", "transformer.h")
        ('transformer.wte', False, True)
    """
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


def group_layers(module: nn.Module, plan: LoadPlan) -> list[Layer]:
    """The layers of ``module`` in module order, with the bytes each will occupy after the load of ``plan``."""
    blocks = find_blocks(module)
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
        layer.nbytes += target.final_nbytes
        layer.read_nbytes += target.read_nbytes
        layer.parts += final_parts(target)
        layer.buffer_parts += buffer_parts(target)
    return list(layers.values())


def final_parts(target: Target) -> tuple[int, ...]:
    """Bytes of each plain tensor ``target`` is held as once loaded: itself in its dtype, or a quantized weight's
    parts (``QuantScheme.stored_parts``); they add up to ``target.final_nbytes``."""
    if target.scheme is None:
        return (target.cast_nbytes,)
    shape = tuple(target.record.shape) if target.shard is None else tuple(target.shard.local_shape)
    parts = getattr(target.scheme, "stored_parts", None)
    return tuple(parts(shape)) if parts is not None else (target.final_nbytes,)


def buffer_parts(target: Target) -> tuple[int, ...]:
    """Bytes of each tensor a disk tier's read buffer holds ``target`` as (``runtime/disk_units.py``): a weight
    stored quantized, its parts as the file stores them; else itself in its dtype."""
    if target.stored is not None:
        return tuple(math.prod(p.shape) * p.dtype.itemsize for p in target.parts)
    return (target.cast_nbytes,)


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
    keep.read_nbytes += other.read_nbytes
    keep.parts += other.parts
    keep.buffer_parts += other.buffer_parts
    keep.is_block = keep.is_block and other.is_block
    keep.movable = keep.movable and other.movable
    keep.name = f"{keep.name}+{other.name}"
    kept = [layer for layer in layers.values() if layer is not other]
    layers.clear()
    layers.update((layer.name, layer) for layer in kept)
    for mod in keep.modules:
        home[mod] = keep.name
