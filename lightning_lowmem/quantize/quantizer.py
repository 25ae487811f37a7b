"""The loader's side of quantize-on-load: parse the request, prepare the module, quantize each weight as it arrives.

::

    QuantizeSpec.parse("bnb.nf4", None)          # unknown names fail here, before any I/O
    quantizer = prepare_quantization(module, spec, plan, device)
                                                  # after the plan, before any weight is read:
                                                  # kernel check, Linear -> scheme's module (on meta)
    for each tensor read:  quantizer.load(module, name, tensor)  # True: quantized and installed
                           # (a RowSource instead of a tensor where quantizer.by_rows(name))
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_lowmem.heap import release_free_heap, trim_after_first_forward
from lightning_lowmem.materialize import owner_of
from lightning_lowmem.plan import LoadPlan
from lightning_lowmem.quantize.chunks import RowSource
from lightning_lowmem.quantize.nbytes import tensor_nbytes
from lightning_lowmem.quantize.schemes import QuantScheme, check_available, make_scheme
from lightning_lowmem.quantize.selection import select_linears

log = logging.getLogger(__name__)

TRIM_AT = 32 * 2**20
"""Free heap bytes above which a quantized weight's load hands them back to the OS (see ``heap.py``).
Without it, quantizing pythia-1b to bnb.int8 peaked 700 MiB above the final model instead of 120 MiB."""


@dataclass(frozen=True)
class QuantizeSpec:
    """A validated quantization request.

    Attributes:
        scheme: the scheme, with its options.
        skip: module-name globs left in full precision; None for the default
            (``lm_head`` and the output embeddings). Linears tied to another tensor are
            never quantized.
    """

    scheme: QuantScheme
    skip: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        return self.scheme.name

    @classmethod
    def parse(cls, quantize: str | QuantScheme | None,
              skip_quantize: str | Sequence[str] | None = None) -> QuantizeSpec | None:
        """Validate ``load_checkpoint``'s ``quantize`` and ``skip_quantize`` arguments.

        Args:
            quantize: a registered spelling (``"bnb.nf4"``, ``"torchao.int8wo"``, ...), a scheme
                instance (``BnbNF4(blocksize=128)``), or None for no quantization.
            skip_quantize: module-name globs, e.g. ``["lm_head", "transformer.h.0.*"]``.

        Returns:
            The spec, or None when ``quantize`` is None.

        Raises:
            UnsupportedQuantizationError: unknown scheme name.
            TypeError: arguments of the wrong type.

        Example::

            >>> QuantizeSpec.parse("bnb.nf4", ["lm_head"]).name
            'bnb.nf4'
        """
        if quantize is None:
            return None
        if isinstance(quantize, QuantScheme):
            scheme = quantize
        elif isinstance(quantize, str):
            scheme = make_scheme(quantize)
        else:
            raise TypeError(f"quantize must be a scheme name such as 'bnb.nf4' or a QuantScheme, "
                            f"got {type(quantize).__name__}: {quantize!r}.")
        return cls(scheme, _parse_skip(skip_quantize))


def _parse_skip(skip_quantize: str | Sequence[str] | None) -> tuple[str, ...] | None:
    if skip_quantize is None:
        return None
    patterns = (skip_quantize,) if isinstance(skip_quantize, str) else tuple(skip_quantize)
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"skip_quantize must be module-name globs (str), got {bad!r}.")
    return patterns


class Quantizer:
    """Quantizes each chosen Linear's weight as the loader reads it.

    Attributes:
        scheme: the scheme in use.
        quantized: module name -> scheme name, for each weight quantized so far.
        left_out: module name -> why that ``nn.Linear`` stays in full precision.
        bytes_before: full-precision bytes of the quantized weights (as read and cast).
        bytes_after: their bytes once quantized (scales and other state included).
    """

    def __init__(self, scheme: QuantScheme, weights: dict[str, str], left_out: dict[str, str]) -> None:
        self.scheme = scheme
        self.left_out = left_out
        self.quantized: dict[str, str] = {}
        self.bytes_before = 0
        self.bytes_after = 0
        self._weights = weights  # weight name -> module name

    def owns(self, name: str) -> bool:
        """Whether weight ``name`` is quantized by this quantizer (so :meth:`load` copies it)."""
        return name in self._weights

    def by_rows(self, name: str) -> bool:
        """Whether weight ``name`` may be handed to :meth:`load` as a :class:`RowSource` (read a block at a time)."""
        return self.scheme.by_rows and name in self._weights

    def load(self, module: nn.Module, name: str, tensor: torch.Tensor | RowSource) -> bool:
        """Quantize ``tensor`` into the module that owns weight ``name``.

        Returns:
            False when ``name`` is not a weight this quantizer owns (biases, norms, embeddings,
            skipped Linears): the caller assigns it as usual.
        """
        module_name = self._weights.get(name)
        if module_name is None:
            return False
        target = module.get_submodule(module_name)
        self.bytes_before += tensor.nbytes
        self.scheme.load_weight(target, tensor)
        self.bytes_after += tensor_nbytes(target.weight)
        self.quantized[module_name] = self.scheme.name
        if tensor.device.type == "cpu":  # what its first forward frees stays resident otherwise
            trim_after_first_forward(target)
        release_free_heap(TRIM_AT)  # the previous weight and this one's temporaries: out of RSS, not only freed
        return True


def prepare_quantization(module: nn.Module, spec: QuantizeSpec | None, plan: LoadPlan,
                         device: torch.device) -> Quantizer | None:
    """Get ``module`` ready to be quantized while it loads; reads no weight.

    Checks that the scheme's kernels exist on ``device``, picks the Linears to quantize
    (see :mod:`lightning_lowmem.quantize.selection`) and puts the scheme's own module type
    in their place, weights still on meta.

    Raises:
        UnsupportedQuantizationError: the scheme cannot run on ``device`` (the message names
            the missing package and the schemes that work there).
    """
    if spec is None:
        return None
    check_available(spec.scheme, device)
    dtypes = {name: target.dtype for target in plan.targets for name in target.names}
    selection = select_linears(module, plan, spec.scheme, spec.skip)
    for module_name, weight_name in selection.chosen.items():
        old = module.get_submodule(module_name)
        new = spec.scheme.replace(old, dtypes[weight_name])
        if new is not old:
            parent, leaf = owner_of(module, module_name)
            setattr(parent, leaf, new)
    if selection.left_out:
        log.info("%s: %d Linear modules stay in full precision: %s", spec.name, len(selection.left_out),
                 "; ".join(f"{n} ({why})" for n, why in list(selection.left_out.items())[:10]))
    weights = {weight: name for name, weight in selection.chosen.items()}
    return Quantizer(spec.scheme, weights, selection.left_out)
