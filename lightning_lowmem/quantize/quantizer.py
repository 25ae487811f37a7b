"""The loader's side of quantize-on-load: prepare the module, then quantize each weight as it arrives.

::

    selection = select_linears(module, plan, scheme, skip)   # the plan's targets marked (selection.py)
    quantizer = prepare_quantization(module, selection, device)
                                                  # before any weight is read:
                                                  # kernel check, Linear -> scheme's module (on meta)
    for each target read:  quantizer.load(module, target, tensor)  # True: quantized and installed
                           # (a RowSource instead of a tensor where quantizer.by_rows(target))
                           quantizer.load_stored(module, target, parts)  # a weight stored quantized: as it is

A pre-quantized checkpoint's selection comes from ``stored.mark_stored`` instead of ``select_linears``;
each target carries its own scheme (the file's options), which is the one used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from lightning_lowmem.errors import format_names
from lightning_lowmem.memory.heap import release_free_heap, trim_after_first_forward
from lightning_lowmem.meta import owner_of
from lightning_lowmem.plan import LoadPlan, Target
from lightning_lowmem.quantize.layouts import layout_of
from lightning_lowmem.quantize.nbytes import tensor_nbytes
from lightning_lowmem.quantize.rows import RowSource
from lightning_lowmem.quantize.schemes import check_available
from lightning_lowmem.quantize.selection import Selection

log = logging.getLogger(__name__)

TRIM_AT = 32 * 2**20
"""Free heap bytes above which a quantized weight's load hands them back to the OS (see ``heap.py``).
Without it, quantizing pythia-1b to bnb.int8 peaked 700 MiB above the final model instead of 120 MiB."""


class Quantizer:
    """Quantizes the weights the plan marked (``Target.scheme``) as the loader reads them.

    Attributes:
        scheme: the scheme in use.
        quantized: module name -> scheme name, for each module holding a quantized weight so far (a stack of
            expert weights: the weight's name).
        prequantized: those loaded as the checkpoint stores them (nothing quantized).
        requantized: those built from weights the checkpoint stores quantized, then quantized again.
        left_out: module name -> why that ``nn.Linear`` stays in full precision.
        bytes_before: full-precision bytes of the weights quantized during the load (as read and cast).
        bytes_after: their bytes once quantized (scales and other state included).
    """

    def __init__(self, selection: Selection) -> None:
        self.scheme = selection.scheme
        self.left_out = dict(selection.left_out)
        self.quantized: dict[str, str] = {}
        self.prequantized: dict[str, str] = {}
        self.requantized: dict[str, str] = {}
        self.bytes_before = 0
        self.bytes_after = 0
        self._modules = {weight: name for name, weight in selection.chosen.items()}  # weight name -> module name
        self._experts = dict(selection.experts)  # stacks of expert weights: weight name -> module name
        self._transposed = selection.transposed
        self._requantize = selection.requantized

    def by_rows(self, target: Target) -> bool:
        """Whether ``target`` may be handed to :meth:`load` as a :class:`RowSource` (read a block at a time)."""
        return target.scheme is not None and target.scheme.by_rows

    def load(self, module: nn.Module, target: Target, tensor: torch.Tensor | RowSource) -> bool:
        """Quantize ``tensor`` into the module that owns ``target``'s weight.

        Returns:
            False when the plan did not mark ``target`` for quantization (biases, norms, embeddings,
            skipped Linears): the caller assigns it as usual.
        """
        if target.scheme is None:
            return False
        if target.names[0] in self._experts:
            self._load_stack(module, target, tensor)
            return True
        module_name = self._modules[target.names[0]]
        owner = module.get_submodule(module_name)
        if module_name in self._transposed:  # stored (in, out), as transformers' Conv1D holds it
            tensor = tensor.t().contiguous()
        self.bytes_before += tensor.nbytes
        target.scheme.transform.quantize(owner, tensor)
        self.bytes_after += tensor_nbytes(owner.weight)
        self.quantized[module_name] = target.scheme.name
        if module_name in self._requantize:
            self.requantized[module_name] = target.scheme.name
        if tensor.device.type == "cpu":  # what its first forward frees stays resident otherwise
            trim_after_first_forward(owner)
        release_free_heap(TRIM_AT)  # the previous weight and this one's temporaries: out of RSS, not only freed
        return True

    def _load_stack(self, module: nn.Module, target: Target, tensor: torch.Tensor | RowSource) -> None:
        """Quantize a stack of expert weights into the parameter it fills (listed by the weight's name)."""
        name = target.names[0]
        owner, leaf = owner_of(module, name)
        self.bytes_before += tensor.nbytes
        target.scheme.transform.quantize_stack(owner, leaf, tensor, target.record.shape)
        self.bytes_after += target.scheme.stored_nbytes(target.record.shape)
        self.quantized[name] = target.scheme.name
        if target.device.type == "cpu":  # its first forward dequantizes the stack: handed back after
            trim_after_first_forward(owner)
        release_free_heap(TRIM_AT)

    def load_stored(self, module: nn.Module, target: Target, tensors: dict[str, torch.Tensor]) -> None:
        """Put the parts of a weight the checkpoint holds quantized (``target.stored``; ``tensors`` by checkpoint
        key, as read) into the module that owns it, as they are."""
        module_name = self._modules[target.names[0]]
        owner = module.get_submodule(module_name)
        stored = target.stored
        layout_of(target.scheme).load_stored(owner, stored, {role: tensors[rec.key] for role, rec in
                                                             stored.roles.items()}, target.device)
        self.quantized[module_name] = self.prequantized[module_name] = target.scheme.name
        if target.device.type == "cpu":
            trim_after_first_forward(owner)

    def load_shard(self, target: Target, weight: torch.Tensor, index: int, count: int) -> torch.Tensor:
        """The ``index``-th of ``count`` row shards of the whole ``weight`` of ``target``, quantized
        (:meth:`~lightning_lowmem.quantize.schemes.Transform.quantize_shard`); the caller copies it into place."""
        module_name = self._modules[target.names[0]]
        self.bytes_before += weight.nbytes // count
        shard = self.scheme.transform.quantize_shard(weight, index, count)
        self.bytes_after += tensor_nbytes(shard)
        self.quantized[module_name] = self.scheme.name
        release_free_heap()  # the whole weight and its temporaries went: give them back before the next
        return shard


    def load_own_rows(self, target: Target, rows: torch.Tensor,
                      sum_across: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """This rank's shard of ``target``'s weight quantized from its own ``rows`` alone, the whole weight's sums
        agreed by ``sum_across`` (:meth:`~lightning_lowmem.quantize.schemes.Transform.quantize_own_rows`); the
        caller copies it into place."""
        module_name = self._modules[target.names[0]]
        self.bytes_before += rows.nbytes
        shard = target.scheme.transform.quantize_own_rows(rows, target.record.shape, sum_across)
        self.bytes_after += tensor_nbytes(shard)
        self.quantized[module_name] = target.scheme.name
        release_free_heap(TRIM_AT)
        return shard


def prepare_quantization(module: nn.Module, selection: Selection, plan: LoadPlan,
                         device: torch.device) -> Quantizer:
    """Get ``module`` ready to be quantized while it loads; reads no weight.

    Checks that the scheme's kernels exist on ``device`` and puts the scheme's own module type
    in place of each Linear the selection chose, weights still on meta.

    Raises:
        UnsupportedQuantizationError: the scheme cannot run on ``device`` (the message names
            the missing package and the schemes that work there).
    """
    scheme = selection.scheme
    targets = {name: target for target in plan.targets for name in target.names}
    weights = [*selection.chosen.values(), *selection.experts]
    for checked in {scheme, *(targets[weight].scheme for weight in weights)}:
        check_available(checked, device)
    built = scheme.transform.built
    for module_name, weight_name in selection.chosen.items():
        old = module.get_submodule(module_name)
        if built(old):  # built before the load (before the model was sharded): kept as it is
            continue
        linear = selection.stand_ins.get(module_name, old)  # a Conv1D's or a model's own class's: its stand-in
        target = targets[weight_name]
        new = target.scheme.transform.replace(linear, target.dtype)
        if new is not old:
            parent, leaf = owner_of(module, module_name)
            setattr(parent, leaf, new)
    if selection.left_out:
        log.info("%s: %d Linear modules stay in full precision: %s", scheme.name, len(selection.left_out),
                 format_names((f"{n} ({why})" for n, why in selection.left_out.items()), quote=False, sep="; "))
    return Quantizer(selection)
