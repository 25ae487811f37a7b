"""Linear layers under another name: a model's own class whose forward is ``F.linear(input, weight, bias)``.

Research code often writes its own ``Linear`` (gemma_pytorch's: a 2-D ``weight`` parameter and ``F.linear`` on it).
Such a module is *linear-shaped*: its only parameters are a 2-D floating ``weight`` ``(out, in)`` and optionally a
1-D ``bias`` ``(out)``, and it has no children. Whether it is a linear layer is told from what its forward does,
traced once on a one-row input (on meta when its weight is on meta: no compute, no memory): a forward whose only
torch call is ``F.linear(input, self.weight, self.bias or None)``, returned as it is, is one, and is quantized as
an ``nn.Linear`` is (replaced by the scheme's module). Any other forward that calls a matrix product (it scales its
weight first, it transposes it, it multiplies by ``@``) is named with what it calls, and ``treat_as_linear=``
(:func:`linear_filter`) includes it when it is a linear layer after all; a forward that calls none (an embedding
lookup) is not a linear layer and is not named.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from lightning_lowmem.errors import format_names

LinearFilter = Callable[[nn.Module, str], bool]
"""``filter(module, name) -> bool``: whether a module is a linear layer to quantize (as torchao's ``filter_fn``)."""

_LINEAR = {F.linear, torch._C._nn.linear}
_PRODUCTS = _LINEAR | {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.mm,
                       torch.Tensor.mm, torch.addmm, torch.bmm, torch.einsum, torch.tensordot}


def linear_filter(value: type | Sequence[type] | LinearFilter | None) -> LinearFilter | None:
    """``treat_as_linear=`` as a filter: a class or a sequence of classes (``isinstance``), or a function
    ``(module, name) -> bool``; None stays None.

    Raises:
        TypeError: anything else.

    Example::

        >>> keep = linear_filter(nn.Conv1d)
        >>> keep(nn.Conv1d(2, 2, 1), "conv"), keep(nn.Linear(2, 2), "fc")
        (True, False)
    """
    if value is None or (callable(value) and not isinstance(value, type)):
        return value
    classes = (value,) if isinstance(value, type) else tuple(value) if isinstance(value, Sequence) else None
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"treat_as_linear must be a module class, a sequence of them, or a function (module, name) -> "
                        f"bool, got {value!r}.")
    return lambda module, name: isinstance(module, classes)


def linear_shape(module: nn.Module) -> tuple[int, int, bool] | None:
    """``(in_features, out_features, has_bias)`` of a linear-shaped module of a class of its own (see the module
    docstring), else None: torch's own layers and their subclasses (``nn.Embedding``, a LoRA ``nn.Linear``) are
    what their class says."""
    weight = _own_weight(module)
    if weight is None or set(module._parameters) - {"weight", "bias"} or not weight.is_floating_point():
        return None
    bias = module._parameters.get("bias")
    out_features, in_features = weight.shape
    if bias is not None and tuple(bias.shape) != (out_features,):
        return None
    return in_features, out_features, bias is not None


def unlike_linear(module: nn.Module) -> str | None:
    """What a module of a class of its own with a 2-D ``weight`` holds that an ``nn.Linear`` does not (a weight stored
    as int8, a ``weight_scaler`` beside it: quantized by its own scheme), or None when it is linear-shaped or has no
    2-D weight of its own."""
    weight = _own_weight(module)
    if weight is None or linear_shape(module) is not None:
        return None
    extra = sorted(set(module._parameters) - {"weight", "bias"})
    held = [f"a {weight.dtype} weight"] if not weight.is_floating_point() else []
    held += [f"{format_names(extra)} beside its weight"] if extra else []
    return " and ".join(held) or "a bias of another shape than its outputs"


def _own_weight(module: nn.Module) -> torch.Tensor | None:
    """The 2-D ``weight`` parameter of a childless module of a class of its own, else None."""
    if any(c.__module__.startswith("torch.nn.") for c in type(module).__mro__ if c is not nn.Module):
        return None
    weight = module._parameters.get("weight")
    return weight if not module._modules and isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def forward_reason(module: nn.Module) -> str | None:
    """None when ``module``'s forward, traced on a one-row input, is ``F.linear(input, weight, bias)`` alone; else why
    not, naming what it calls (``""`` when it calls no matrix product, or has no 2-D weight of its own: no linear
    layer at all)."""
    weight = _own_weight(module)
    if weight is None:
        return ""
    dtype = weight.dtype if weight.is_floating_point() else torch.get_default_dtype()
    x = torch.zeros(1, weight.shape[1], dtype=dtype, device=weight.device)
    trace = _Trace()
    try:
        with torch.no_grad(), trace:
            out = module.forward(x)
    except Exception as e:  # noqa: BLE001  (any forward: one that needs more than one input cannot be traced)
        reached = any(func in _PRODUCTS for func, _, _ in trace.calls)  # an embedding's lookup of floats: none
        return f"its forward could not be traced on one input ({type(e).__name__})" if reached else ""
    if not any(func in _PRODUCTS for func, _, _ in trace.calls):
        return ""
    linear = [(args, kwargs, result) for func, (args, kwargs), result in trace.calls if func in _LINEAR]
    computed = [func for func, _, result in trace.calls if isinstance(result, torch.Tensor)]
    if len(computed) == 1 and len(linear) == 1 and _plain(module, x, out, *linear[0]):
        return None
    names = [getattr(func, "__name__", str(func)) for func in computed]
    return f"its forward computes {', '.join(names)}, not F.linear(input, weight, bias) alone"


def stand_in(module: nn.Module) -> nn.Linear:
    """A meta ``nn.Linear`` of ``module``'s features (its bias the module's own), which the scheme's module is made from."""
    in_features, out_features, has_bias = linear_shape(module)
    linear = nn.Linear(in_features, out_features, bias=has_bias, device="meta", dtype=module.weight.dtype)
    if has_bias:
        linear.bias = module.bias
    return linear


def _plain(module: nn.Module, x: torch.Tensor, out: Any, args: tuple, kwargs: dict, result: Any) -> bool:
    """Whether one ``F.linear`` call took ``x``, the module's weight and bias (or none) and gave the forward's output."""
    given = list(args) + [kwargs.get(k) for k in ("input", "weight", "bias")[len(args):] if k in kwargs]
    if len(given) < 2 or given[0] is not x or given[1] is not module.weight or result is not out:
        return False
    bias = given[2] if len(given) > 2 else None
    return bias is module._parameters.get("bias")


class _Trace(TorchFunctionMode):
    """Records every torch call: ``(func, (args, kwargs), result)``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[tuple, dict], Any]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.calls.append((func, (args, kwargs), None))  # recorded first: a call that raises is seen too
        result = func(*args, **kwargs)
        self.calls[-1] = (func, (args, kwargs), result)
        return result
