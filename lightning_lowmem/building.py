"""Building a module on the meta device with any constructor, as its authors wrote it.

:func:`init_empty` puts each parameter on the meta device as it is registered (no memory, no random init) and keeps
buffers real: RoPE tables, position ids and masks computed in ``__init__`` (or in any method it calls) are not in
checkpoints, and on meta they would be lost (transformers#34234, accelerate#3668). They are small next to the
weights.

What a constructor does to its tensors works as it does eagerly:

* ``.to(dtype, device="cpu")``, ``.cpu()``, ``.cuda()``, ``module.to(...)`` on a meta tensor: the dtype changes, the
  tensor stays on meta (torch itself raises "Cannot copy out of meta tensor"); real buffers move and cast as asked;
* ``.half()``, ``.bfloat16()``, ``.float()``, ``requires_grad_``, ``nn.init.*``: as torch does them on meta (a random
  fill of a meta tensor skipped: it has no values to fill);
* a floating buffer cast to bf16 remembers what it was cast from, so that a load that falls back from bf16 to fp16
  (a device without bf16) casts it once from the constructor's own values, as the same constructor run with fp16
  gives it, instead of rounding it twice, and a model family that computes it wider gets it exact
  (:func:`cast_buffer`); a load that needs neither drops them before it reads;
* a library's ``from_pretrained`` called inside the block (a wrapper whose constructor loads its parts) reads no
  weights: hooks registered by the library faces (``library_hooks.py``; transformers' in ``transformers/deferred.py``,
  diffusers' in ``diffusers/deferred.py``), applied to their modules imported before the block or inside it, build
  the part on meta from its config, to be filled by a load.
"""

from __future__ import annotations

import contextlib
from collections.abc import Container, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_lowmem.dtypes import fallback_dtype
from lightning_lowmem.library_hooks import hooks_applied

ORIGIN = "_lowmem_cast_from"
"""The attribute on a buffer cast to a narrower dtype inside :func:`init_empty` that holds the tensor it was cast
from (the widest of a chain of casts)."""

SOURCE = "_lowmem_pretrained_source"
"""The attribute of a part a library's ``from_pretrained`` built inside :func:`init_empty` without reading: the path
its weights are to be read from (:func:`deferred_parts`)."""

_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}
_FILLS = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.log_normal_, torch.Tensor.exponential_,
          torch.Tensor.cauchy_, torch.Tensor.geometric_, torch.Tensor.random_, torch.Tensor.bernoulli_,
          *(getattr(nn.init, name) for name in dir(nn.init) if name.endswith("_") and not name.startswith("_"))}
"""Fills (``nn.init.*``, random draws): on a meta tensor they change nothing, but torch's meta ``normal_`` imports
``torch._dynamo`` (73 MiB and a second, once per process, measured on the 2-core machine)."""
_CASTS = {torch.Tensor.to, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.float, torch.Tensor.double,
          torch.Tensor.type, torch.Tensor.type_as}
@contextlib.contextmanager
def init_empty(include_buffers: bool = False) -> Iterator[None]:
    """Build modules with parameters on the meta device and real (CPU) buffers, whatever their constructors do.

    Args:
        include_buffers: put buffers on meta too (everything must then come from
            the checkpoint or be recomputable, see :func:`~lightning_lowmem.meta.recompute_meta_buffers`).

    Example::

        >>> from lightning_lowmem import init_empty
        >>> with init_empty():
        ...     layer = torch.nn.Linear(4096, 4096).to(dtype=torch.bfloat16, device="cpu")  # as a constructor may end
        >>> layer.weight.device, layer.weight.dtype
        (device(type='meta'), torch.bfloat16)
    """
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            # Parameter(torch.empty(...)) reserves but never touches its pages: this costs no RSS.
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        with contextlib.ExitStack() as stack:
            if include_buffers:
                stack.enter_context(torch.device("meta"))
            stack.enter_context(_AsConstructed())
            stack.enter_context(hooks_applied())
            yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


class _AsConstructed(TorchFunctionMode):
    """Meta tensors asked to move stay on meta (with the dtype asked); narrowing casts of real floating tensors
    remember their origin (:data:`ORIGIN`)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func in _FILLS and source is None:  # nn.init's functions hand their tensor over by name
            source = kwargs.get("tensor")
        if source is not None and source.is_meta and func in _MOVES:
            return _stay_on_meta(func, source, args[1:], kwargs)
        if source is not None and source.is_meta and func in _FILLS:
            return source  # nothing to fill (nn.init.normal_ of a parameter on meta)
        out = func(*args, **kwargs)
        if source is not None and func in _CASTS and isinstance(out, torch.Tensor):
            _remember_origin(source, out)
        return out


def _stay_on_meta(func: Any, tensor: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    """``tensor`` (on meta) with the dtype ``func(tensor, *args, **kwargs)`` asks for, still on meta."""
    if func is torch.Tensor.to:
        _, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        return tensor.to("meta", dtype=dtype or tensor.dtype,
                         memory_format=memory_format or torch.preserve_format)
    return tensor  # .cpu(), .cuda(): only the device changes


def _remember_origin(source: torch.Tensor, out: torch.Tensor) -> None:
    """A cast to bf16 of a wider floating tensor: ``out`` remembers the widest tensor of its chain of casts."""
    if out.dtype != torch.bfloat16 or out is source or out.is_meta or not source.is_floating_point():
        return
    origin = getattr(source, ORIGIN, source)
    if origin.dtype.itemsize > out.dtype.itemsize:
        setattr(out, ORIGIN, origin)


def cast_buffer(buffer: torch.Tensor, device: torch.device | str, dtype: torch.dtype,
                computed: bool = False) -> torch.Tensor:
    """``buffer.to(device, dtype)``, bf16 becoming fp16 on a device without bf16
    (:func:`~lightning_lowmem.dtypes.fallback_dtype`). A buffer its constructor cast to bf16 inside :func:`init_empty`
    is cast from the constructor's own values instead, rounded once: under that fallback (as the same constructor run
    with fp16 gives it), and, with ``computed``, when ``dtype`` is wider than bf16 (a model family whose own loader
    computes the buffer in ``dtype``: transformers' RoPE ``inv_freq`` in float32).

    Example::

        >>> from lightning_lowmem import assume_bf16_support, init_empty
        >>> with init_empty():
        ...     table = torch.tensor([1.0 + 2**-9]).to(torch.bfloat16)   # rounds to 1.0 in bf16, not in fp16
        >>> with assume_bf16_support("cpu", False):
        ...     cast_buffer(table, "cpu", torch.bfloat16).item() == float(torch.tensor(1.0 + 2**-9).half())
        True
    """
    cast = fallback_dtype(dtype, device, warn=False)  # the loaded tensors' fallback warned
    origin = getattr(buffer, ORIGIN, None)
    wider = computed and cast.itemsize > buffer.dtype.itemsize
    source = origin if origin is not None and (cast != dtype or wider) else buffer
    return source.to(device=device, dtype=cast)


def forget_origins(module: nn.Module, keep: Container[str] = ()) -> None:
    """Drop what the buffers of ``module`` (but those named in ``keep``) remember of their constructor's values
    (:func:`cast_buffer`), from a view's base too: a load that will not use them need not hold the wider copies."""
    for name, buffer in module.named_buffers(remove_duplicate=False):
        if name in keep:
            continue
        for tensor in (buffer, buffer._base):
            if tensor is not None and hasattr(tensor, ORIGIN):
                delattr(tensor, ORIGIN)


def after_fill(module: nn.Module) -> None:
    """What ``module``'s construction left for a load, dropped once a load filled it: what its buffers remember of
    their constructor's values (:func:`forget_origins`), and the path of each deferred part (:func:`deferred_parts`)
    that holds no meta tensor any more."""
    forget_origins(module)
    for name in deferred_parts(module):
        part = module.get_submodule(name)
        if not any(t.is_meta for t in [*part.parameters(), *part.buffers()]):
            delattr(part, SOURCE)


def deferred_parts(module: nn.Module) -> dict[str, str]:
    """The parts of ``module`` that a library's ``from_pretrained`` built inside :func:`init_empty` without reading
    their weights: module name -> the path it named (the outermost part of a nest only)."""
    found: dict[str, str] = {}
    for name, sub in module.named_modules():
        source = getattr(sub, SOURCE, None)
        if isinstance(source, str) and not any(name.startswith(f"{outer}.") or not outer for outer in found):
            found[name] = source
    return found
