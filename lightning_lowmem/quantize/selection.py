"""The one rule that decides which ``nn.Linear`` a load quantizes, written onto the load plan.

:func:`select_linears` runs once per plan; the loader quantizes exactly the
targets it marks (``Target.scheme``), and the placement plan and the memory
estimate count exactly those at the scheme's size. Candidates are modules whose type is
exactly ``nn.Linear`` (subclasses: LoRA layers, already-quantized layers,
``nn.MultiheadAttention``'s ``NonDynamicallyQuantizableLinear`` may have their own
forward), transformers' ``Conv1D`` (GPT-2's projections: a Linear whose weight is
stored transposed, ``(in, out)``; it is replaced by the scheme's Linear and its weight
transposed as it is read, as transformers' own bitsandbytes integration does), and a model's
own class whose forward is ``F.linear(input, weight, bias)`` alone, or that ``treat_as_linear``
names (``linear_like.py``; a linear-shaped one whose forward does more is named in ``left_out``
with what it computes). A candidate stays in full precision when

* its name matches a ``skip_quantize`` glob (default: ``lm_head`` and the
  model's output embeddings, as transformers does),
* its weight is tied to another tensor (an input embedding): quantizing it
  would break the tie,
* its weight is not in the checkpoint, or the scheme cannot take it
  (:meth:`~lightning_lowmem.quantize.schemes.QuantScheme.layer_reason`).

A module that already is the scheme's own (``torchao.nf4``'s ``NF4Linear``, built on meta before the
model was sharded) is a candidate too, under the same rules.

Stacks of expert weights are candidates too: a 3-D parameter ``(experts, out, in)`` held by a module named
``experts`` (transformers 5 fuses an MoE layer's experts into ``mlp.experts.gate_up_proj`` and ``down_proj``,
which are no ``nn.Linear``). The same rules apply (a ``skip_quantize`` glob matching the module or the weight, a
tie, a weight the checkpoint lacks), and the scheme says whether it can quantize a stack
(:meth:`~lightning_lowmem.quantize.schemes.QuantScheme.stack_reason`).
"""

from __future__ import annotations

import fnmatch
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from lightning_lowmem.errors import format_names
from lightning_lowmem.plan import LoadPlan, Target
from lightning_lowmem.quantize.layouts import scheme_of
from lightning_lowmem.quantize.linear_like import LinearFilter, forward_reason, linear_shape, stand_in, unlike_linear
from lightning_lowmem.quantize.schemes import QuantScheme

DEFAULT_SKIP = ("lm_head", "*.lm_head", "lm_head.linear", "*.lm_head.linear")
"""Module-name globs left in full precision when ``skip_quantize`` is not given (``.linear``: litgpt's LoRA head)."""


@dataclass
class Selection:
    """The outcome of :func:`select_linears`.

    Attributes:
        scheme: the scheme the chosen Linears are quantized with.
        chosen: module name -> name of its weight in the plan, for each Linear to quantize.
        left_out: module name -> why that Linear stays in full precision.
        transposed: the chosen modules whose weight is stored ``(in, out)`` (transformers' ``Conv1D``).
        stored: the chosen modules whose weight the checkpoint holds quantized: loaded as stored.
        requantized: the chosen modules whose weight is built from weights the checkpoint holds quantized:
            dequantized, combined, quantized again.
        experts: stacks of expert weights to quantize: weight name -> the module holding it (``left_out`` names
            the stacks left in full precision by their weight's name).
        stand_ins: the chosen modules that are no ``nn.Linear`` (``Conv1D``, a model's own class) -> the meta
            ``nn.Linear`` of their features the scheme's module is made from.
    """

    scheme: QuantScheme
    chosen: dict[str, str] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    transposed: set[str] = field(default_factory=set)
    stored: set[str] = field(default_factory=set)
    requantized: set[str] = field(default_factory=set)
    experts: dict[str, str] = field(default_factory=dict)
    stand_ins: dict[str, nn.Linear] = field(default_factory=dict)


@dataclass(frozen=True)
class Transposed:
    """``scheme`` for a weight stored transposed, ``(in, out)``: read whole and transposed, then quantized."""

    scheme: QuantScheme
    by_rows: ClassVar[bool] = False  # a block of stored rows is a block of input features

    def stored_nbytes(self, shape: tuple[int, ...]) -> int:
        return self.scheme.stored_nbytes(tuple(reversed(shape)))

    def __getattr__(self, name: str) -> Any:  # name, transient, library_bytes, first_forward, ...
        return getattr(self.scheme, name)


def as_linear(module: nn.Module) -> tuple[nn.Linear | None, bool]:
    """``(the Linear module stands for, whether its weight is stored transposed)``: ``module`` itself for an
    ``nn.Linear``, a meta ``nn.Linear`` of the same features for transformers' ``Conv1D``, else ``(None, False)``.

    Example::

        >>> as_linear(nn.Linear(3, 2))[1], as_linear(nn.Conv1d(3, 2, 1))[0] is None
        (False, True)
    """
    if type(module) is nn.Linear:
        return module, False
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int) and \
            isinstance(weight, torch.Tensor) and tuple(weight.shape) == (module.nx, module.nf):
        bias = getattr(module, "bias", None)
        stand_in = nn.Linear(module.nx, module.nf, bias=bias is not None, device="meta", dtype=weight.dtype)
        if bias is not None:
            stand_in.bias = bias
        return stand_in, True
    return None, False


def parse_skip(skip_quantize: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``skip_quantize=`` as a tuple of module-name globs: one string is one pattern; None stays None (default).

    Example::

        >>> parse_skip("lm_head")
        ('lm_head',)
        >>> parse_skip(["lm_head", "transformer.h.0.*"])
        ('lm_head', 'transformer.h.0.*')
    """
    if skip_quantize is None:
        return None
    patterns = (skip_quantize,) if isinstance(skip_quantize, str) else tuple(skip_quantize)
    bad = [p for p in patterns if not isinstance(p, str)]
    if bad:
        raise TypeError(f"skip_quantize must be module-name globs (str), got {bad!r}.")
    return patterns


def select_linears(module: nn.Module, plan: LoadPlan, scheme: QuantScheme,
                   skip: tuple[str, ...] | None, treat_as_linear: LinearFilter | None = None) -> Selection:
    """Pick the Linears of ``module`` that ``scheme`` quantizes during the load of ``plan``, and mark their
    weights' targets with the scheme.

    Args:
        module: the module being loaded (usually built on meta).
        plan: the load plan; its targets say which weights arrive and which are tied.
        scheme: the quantization scheme.
        skip: module-name globs (``fnmatch``) to leave alone; None for :data:`DEFAULT_SKIP` plus
            the module's ``get_output_embeddings()`` when it has one.
        treat_as_linear: modules of other classes to quantize as linear layers (``treat_as_linear=``).
    """
    if skip is not None:
        _warn_unmatched(module, skip)
    targets = {name: target for target in plan.targets for name in target.names}
    uses = Counter(id(m) for _, m in module.named_modules(remove_duplicate=False))
    output_head = _output_embeddings(module) if skip is None else None
    patterns = DEFAULT_SKIP if skip is None else skip
    selection = Selection(scheme)
    built = scheme.transform.built
    for name, mod in module.named_modules():
        linear, transposed = (mod, False) if built(mod) else as_linear(mod)
        if linear is None:
            linear = _own_linear(name, mod, treat_as_linear, selection)
        if linear is None:
            continue
        weight_name = f"{name}.weight" if name else "weight"
        target = targets.get(weight_name)
        reason = _reason(name, linear, target, patterns, scheme, shared=uses[id(mod)] > 1,
                         is_output_head=mod is output_head)
        if reason is None:
            selection.chosen[name] = weight_name
            target.scheme = Transposed(scheme) if transposed else scheme
            if transposed:
                selection.transposed.add(name)
            if linear is not mod:
                selection.stand_ins[name] = linear
        else:
            selection.left_out[name] = reason
    _select_expert_stacks(module, targets, patterns, scheme, selection)
    if not selection.chosen and not selection.experts:
        _warn_nothing_chosen(module, scheme, selection)
    else:
        _warn_own_classes_left(selection)
    return selection


def _own_linear(name: str, mod: nn.Module, treat_as_linear: LinearFilter | None,
                selection: Selection) -> nn.Linear | None:
    """The stand-in ``nn.Linear`` of a module of a class of its own that is a linear layer (its forward, or
    ``treat_as_linear`` says so), else None; a linear-shaped one that is not is named in ``selection.left_out``."""
    declared = treat_as_linear is not None and treat_as_linear(mod, name)
    if linear_shape(mod) is None:
        held = unlike_linear(mod)
        if declared:
            selection.left_out[name] = (f"treat_as_linear names it, but {type(mod).__name__} holds "
                                        f"{held or 'no 2-D weight (out, in)'}, not a floating weight and bias alone")
        elif held and forward_reason(mod):  # a linear layer quantized by its own scheme (gemma_pytorch's int8)
            selection.left_out[name] = f"{type(mod).__name__} holds {held}: no plain linear layer, kept as it is"
        return None
    reason = None if declared else forward_reason(mod)
    if reason is None:
        return stand_in(mod)
    if reason:
        kind = f"{type(mod).__module__}.{type(mod).__qualname__}"
        selection.left_out[name] = (f"{type(mod).__name__} is no nn.Linear and {reason}; if it is a linear layer, "
                                    f"pass treat_as_linear={kind}")
    return None


def expert_stacks(module: nn.Module) -> list[tuple[str, str]]:
    """``(module name, weight name)`` of each stack of expert weights in ``module``: a 3-D parameter held by a module
    named ``experts`` (transformers 5's fused MoE experts).

    Example::

        >>> experts = nn.Module()
        >>> experts.gate_up_proj = nn.Parameter(torch.empty(4, 16, 8, device="meta"))
        >>> expert_stacks(nn.ModuleDict({"experts": experts}))
        [('experts', 'experts.gate_up_proj')]
    """
    found = []
    for name, mod in module.named_modules():
        if name.rsplit(".", 1)[-1] != "experts":
            continue
        found += [(name, f"{name}.{leaf}") for leaf, p in mod._parameters.items() if p is not None and p.dim() == 3]
    return found


def _select_expert_stacks(module: nn.Module, targets: dict[str, Target], patterns: tuple[str, ...],
                          scheme: QuantScheme, selection: Selection) -> None:
    """Mark the stacks of expert weights ``scheme`` quantizes; note why the others stay in full precision."""
    for name, weight in expert_stacks(module):
        target = targets.get(weight)
        matched = next((p for p in patterns if fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(weight, p)), None)
        if matched is not None:
            reason = f"matches skip_quantize pattern {matched!r}"
        elif target is None:
            reason = "its weight is not loaded from the checkpoint"
        elif len(target.names) > 1:
            reason = f"its weight is tied to {format_names([n for n in target.names if n != weight], quote=False)}"
        else:
            reason = scheme.stack_reason(target.record.shape, target.dtype)
        if reason is None:
            selection.experts[weight] = name
            target.scheme = scheme
        else:
            selection.left_out[weight] = reason


def _warn_nothing_chosen(module: nn.Module, scheme: QuantScheme, selection: Selection) -> None:
    """A ``quantize=`` that quantizes nothing says so, and what the module is made of; not when the module
    already holds layers quantized by the scheme's library (a load of adapters into a quantized model)."""
    if any(isinstance(scheme_of(m), type(scheme)) for m in module.modules()):
        return
    kinds = Counter(type(m).__name__ for m in module.modules() if isinstance(getattr(m, "weight", None), torch.Tensor))
    seen = format_names((f"{kind} x {n}" for kind, n in kinds.most_common()), quote=False)
    reasons = format_names((f"{n} ({why})" for n, why in selection.left_out.items()), limit=3, quote=False)
    warnings.warn(f"quantize={scheme.name!r} quantizes nothing in {type(module).__name__}: it quantizes nn.Linear, "
                  "transformers' Conv1D and modules whose forward is F.linear(input, weight, bias); the layers with "
                  f"weights here are {seen or 'none'}"
                  + (f", and the Linears left out are {reasons}" if selection.left_out else "")
                  + ". A linear layer of another class is quantized with treat_as_linear=TheClass.",
                  UserWarning, stacklevel=3)


def _warn_own_classes_left(selection: Selection) -> None:
    """Linear-shaped modules of a model's own classes whose forward is no plain ``F.linear`` are named, with the
    option that includes them: quantizing 0 of 60 of a model's own Linears never passes in silence."""
    left = [name for name, why in selection.left_out.items() if "treat_as_linear=" in why]
    if left:
        warnings.warn(f"quantize={selection.scheme.name!r} leaves {len(left)} linear-shaped modules in full "
                      f"precision: {format_names((f'{n} ({selection.left_out[n]})' for n in left), limit=3, quote=False)}.",
                      UserWarning, stacklevel=3)


def _warn_unmatched(module: nn.Module, patterns: tuple[str, ...]) -> None:
    """Warn about skip patterns that name no module: a typo, or names relative to another module (a
    LightningModule's ``model.`` prefix), would otherwise quantize what was meant to be skipped."""
    names = [name for name, _ in module.named_modules() if name]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(name, p) for name in names)]
    if unmatched:
        linears = [name for name, mod in module.named_modules() if type(mod) is nn.Linear]
        warnings.warn(
            f"skip_quantize patterns {format_names(unmatched)} match no module of {type(module).__name__}; its "
            f"Linear modules are named like {format_names(linears, limit=3)}. Patterns are globs of full module "
            "names (e.g. '*.lm_head'); an explicit skip_quantize also replaces the default, which keeps lm_head "
            "in full precision.", UserWarning, stacklevel=3)


def _reason(name: str, mod: nn.Linear, target: Target | None, patterns: tuple[str, ...], scheme: QuantScheme,
            shared: bool, is_output_head: bool) -> str | None:
    """Why ``mod`` stays in full precision, or None to quantize it."""
    matched = next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)
    if matched is not None:
        return f"matches skip_quantize pattern {matched!r}"
    if not name:
        return "it is the module being loaded itself; put it in a container (nn.Sequential) to quantize it"
    if is_output_head:
        return "it is the model's output embeddings (get_output_embeddings())"
    if target is None:
        return "its weight is not loaded from the checkpoint"
    if len(target.names) > 1:
        others = [n for n in target.names if n != f"{name}.weight"]
        return f"its weight is tied to {format_names(others, quote=False)}"
    if shared:
        return "the module is used under several names"
    return scheme.layer_reason(mod, target.dtype)


def _output_embeddings(module: nn.Module) -> nn.Module | None:
    getter = getattr(module, "get_output_embeddings", None)
    if not callable(getter):
        return None
    try:
        return getter()
    except (NotImplementedError, AttributeError):
        return None
