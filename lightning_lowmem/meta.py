"""Modules on the meta device: filling them, checking none is left, and undoing a fill.

Building them is :func:`~lightning_lowmem.building.init_empty`'s (``building.py``), re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lightning_lowmem.building import init_empty  # noqa: F401  (re-exported)
from lightning_lowmem.errors import MetaTensorError, format_names


def fabric_unwrapped(module: nn.Module) -> nn.Module:
    """The module under Lightning Fabric's wrapper (what ``fabric.setup`` returns), else ``module`` itself."""
    inner = getattr(module, "_original_module", None)
    return inner if isinstance(inner, nn.Module) else module


def owner_of(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule that holds tensor ``name`` and the tensor's local name."""
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def assign(module: nn.Module, names: list[str], tensor: torch.Tensor, is_parameter: bool) -> None:
    """Put ``tensor`` under every name in ``names`` (tied names share one object)."""
    first, leaf = owner_of(module, names[0])
    if is_parameter:
        old = first._parameters[leaf]
        if old is not None and not old.is_meta and old.device == tensor.device and old.dtype == tensor.dtype:
            old.data = tensor  # keep the Parameter object: optimizers and ties refer to it
            return
        value: torch.Tensor = nn.Parameter(tensor, requires_grad=old.requires_grad if old is not None else True)
    else:
        value = tensor
    for i, name in enumerate(names):
        owner, leaf = (first, leaf) if i == 0 else owner_of(module, name)
        (owner._parameters if is_parameter else owner._buffers)[leaf] = value


def empty_like(meta: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``torch.empty_like(meta, device=device)`` (uninitialised memory), for a tensor subclass too: inner tensors
    that its ``empty_like`` leaves on meta (torchao's ``NF4Tensor`` allocates its codes and scales, not its mean
    and code table) get memory as well.

    Example::

        >>> empty_like(torch.empty(2, 3, device="meta"), "cpu").device
        device(type='cpu')
    """
    tensor = torch.empty_like(meta, device=device)
    flatten = getattr(tensor, "__tensor_flatten__", None)
    for name in (flatten()[0] if flatten is not None else []):
        inner = getattr(tensor, name)
        if inner.is_meta:
            setattr(tensor, name, empty_like(inner, device))
    return tensor


def _recomputable(module: nn.Module) -> Iterator[tuple[str, nn.Module, list[str]]]:
    """``(module name, module, its meta non-persistent buffers)`` for each module that can rebuild them:
    no parameters of its own and a ``reset_parameters()`` (litgpt's ``GPT``: its RoPE ``cos``/``sin``)."""
    for name, mod in module.named_modules():
        meta = [n for n, b in mod._buffers.items()
                if b is not None and b.is_meta and n in mod._non_persistent_buffers_set]
        if meta and not mod._parameters and callable(getattr(mod, "reset_parameters", None)):
            yield name, mod, meta


def recomputable_buffers(module: nn.Module) -> set[str]:
    """The names of the meta buffers :func:`recompute_meta_buffers` would rebuild."""
    return {f"{name}.{n}" if name else n for name, _, meta in _recomputable(module) for n in meta}


def recompute_meta_buffers(module: nn.Module, device: torch.device) -> list[str]:
    """Rebuild non-persistent buffers left on meta by modules that know how.

    A module that owns such buffers and no parameters of its own, and has
    ``reset_parameters()`` (litgpt's ``GPT``: its RoPE ``cos``/``sin``), gets
    its buffers allocated on ``device`` and ``reset_parameters()`` called:
    with no parameters of its own, that call only recomputes derived state.

    Returns:
        The names of the buffers rebuilt.
    """
    rebuilt = []
    for name, mod, meta in list(_recomputable(module)):
        for n in meta:
            mod._buffers[n] = torch.empty_like(mod._buffers[n], device=device)
        mod.reset_parameters()
        rebuilt += [f"{name}.{n}" if name else n for n in meta]
    return rebuilt


class Snapshot:
    """Every module, parameter and buffer of a module tree as it is now, so that a failed load can put it back.

    A load replaces meta tensors by new ones, and the data of real parameters in place, and may swap
    ``nn.Linear`` modules for quantized ones. :meth:`restore` undoes all of it: the tree holds the very
    objects (and data) it held when the snapshot was taken. For meta tensors this costs nothing; for
    a module that already held real weights, their old data is kept until the load succeeds. DTensor
    shards that were already real (FSDP2) are filled in place and keep what was written into them; shards
    still on meta go back to meta (``ranks/shard_fill.py``).

    Example::

        >>> layer = nn.Linear(2, 2)
        >>> before = layer.weight.data.clone()
        >>> snap = Snapshot(layer)
        >>> layer.weight.data = torch.zeros(2, 2)
        >>> snap.restore()
        >>> torch.equal(layer.weight, before)
        True
    """

    def __init__(self, module: nn.Module) -> None:
        mods = [m for _, m in module.named_modules(remove_duplicate=False)]
        # the class too: a parametrization (bitsandbytes' quantized expert stacks) swaps it for a subclass
        self._tables = [(m, type(m), dict(m._modules), dict(m._parameters), dict(m._buffers)) for m in mods]
        # a DTensor shard (FSDP2) is filled in place, its storage shared with any `.data` kept here: not restored
        self._data = [(p, p.data) for m in mods for p in m._parameters.values()
                      if p is not None and not p.is_meta and not hasattr(p, "_local_tensor")]

    def restore(self) -> None:
        for mod, cls, modules, parameters, buffers in self._tables:
            mod.__class__ = cls
            mod._modules.clear()
            mod._modules.update(modules)
            mod._parameters.clear()
            mod._parameters.update(parameters)
            mod._buffers.clear()
            mod._buffers.update(buffers)
        for param, data in self._data:
            param.data = data


def check_meta_at_first_forward(module: nn.Module, advice: str) -> None:
    """Make ``module``'s first forward raise :class:`MetaTensorError`, naming what is still on meta and ``advice``,
    instead of torch's "Tensor on device meta is not on the expected device". The check runs once: after a
    forward that passes it, it is removed.

    Example::

        >>> with init_empty():
        ...     layer = nn.Linear(2, 2)
        >>> check_meta_at_first_forward(layer, "Load a checkpoint first.")
        >>> layer(torch.ones(2))
        Traceback (most recent call last):
        ...
        lightning_lowmem.errors.MetaTensorError: Linear's forward: 2 tensors are still on the meta device: 'weight', 'bias'. Load a checkpoint first.
    """
    if "_lowmem_meta_guard" in module.__dict__:
        return

    def guard(mod: nn.Module, args: object) -> None:
        left = meta_tensor_names(mod)
        if left:
            raise MetaTensorError(f"{type(mod).__name__}'s forward: {len(left)} tensors are still on the meta "
                                  f"device: {format_names(left)}. {advice}")
        mod.__dict__.pop("_lowmem_meta_guard").remove()

    module.__dict__["_lowmem_meta_guard"] = module.register_forward_pre_hook(guard)


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device.

    Example::

        >>> with init_empty():
        ...     layer = torch.nn.Linear(2, 2)
        >>> has_meta(layer)
        True
    """
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def meta_tensor_names(module: nn.Module) -> list[str]:
    """Names of every parameter and buffer of ``module`` still on the meta device."""
    names = [n for n, p in module.named_parameters() if p.is_meta]
    return names + [n for n, b in module.named_buffers() if b.is_meta]


def check_no_meta(module: nn.Module, context: str) -> None:
    """Raise :class:`MetaTensorError` if anything of ``module`` is still on meta."""
    left = meta_tensor_names(module)
    if left:
        raise MetaTensorError(
            f"{context}: {len(left)} tensors are still on the meta device: {format_names(left)}. "
            "Nothing filled or recomputed them. Load a checkpoint that has them, or build the module inside "
            "lightning_lowmem.init_empty() so that buffers computed in __init__ stay real."
        )
