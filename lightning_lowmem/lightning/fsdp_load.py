"""What ``LowMemFSDPStrategy`` does around a sharded model's load: shards not filled yet, a full checkpoint file.

After ``setup``, a rank's shards hold memory but no values (nothing is initialised, a load fills them):
:func:`guard_unfilled` makes the model's first forward before any load an error instead of a silent
forward over garbage. :func:`load_full_checkpoint` is ``fabric.load`` of one checkpoint file (not
Lightning's sharded directory): the model's entry streamed into the shards, each optimizer state tensor
read as this rank's part of its parameter (``optimizer_shards.py``), the rest as Lightning does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from torch import nn
from torch.optim import Optimizer

from lightning_lowmem.engine import opened
from lightning_lowmem.ranks.agreement import agreement, from_first_rank
from lightning_lowmem.errors import MetaTensorError, format_names
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.formats.checkpoint import headers_shared
from lightning_lowmem.lightning.optimizer_shards import load_optimizer_shards
from lightning_lowmem.lightning.state import other_entries, restore_entries, weights_key
from lightning_lowmem.plan.dtensor_part import is_dtensor

_UNFILLED = "_lowmem_unfilled"


def unfilled(module: nn.Module) -> set[str]:
    """The names of ``module``'s shards that hold memory but no values yet (emptied by a load)."""
    return module.__dict__.get(_UNFILLED, set())


def guard_unfilled(module: nn.Module, names: Iterable[str], advice: str) -> None:
    """Mark ``names`` unfilled, and make ``module``'s forward raise :class:`MetaTensorError` while any is."""
    module.__dict__[_UNFILLED] = set(names)

    def guard(mod: nn.Module, args: object) -> None:
        left = sorted(unfilled(mod))
        if left:
            raise MetaTensorError(f"{type(mod).__name__}'s forward: {len(left)} sharded parameters were given memory "
                                  f"by setup but were never loaded ({format_names(left)}). {advice}")
        handle.remove()

    handle = module.register_forward_pre_hook(guard, prepend=True)  # before FSDP2 gathers the shards


def load_full_checkpoint(path: str | Path | Checkpoint, state: dict[str, Any], strict: bool,
                         weights_only: bool | None, stream: Callable[[Checkpoint, nn.Module], None]) -> dict[str, Any]:
    """``fabric.load(file, state)`` for a sharded model; returns the entries ``state`` did not ask for.

    The model's entry is ``stream``-ed into its shards; each optimizer's entry is left unread until then, and each
    of its state tensors read as this rank's part of its parameter (:func:`load_optimizer_shards`); the rest as
    Lightning restores it.

    Args:
        path: one checkpoint file (or directory of safetensors files), not Lightning's sharded directory.
        state: what to restore: the model (its entry ``stream``-ed), optimizers, other objects.
        strict, weights_only: as ``fabric.load``.
        stream: loads the checkpoint's weights into a module.
    """
    # Every rank reads the other entries, streams its shards and reads its rows of the optimizer states inside one
    # agreement: a rank failing anywhere here (a read error in the optimizer state) stops every rank together.
    has_model = any(isinstance(v, nn.Module) for v in state.values())
    optimizers = frozenset(k for k, v in state.items() if isinstance(v, Optimizer)) if has_model else frozenset()
    sharded = any(is_dtensor(p) for v in state.values() if isinstance(v, nn.Module) for p in v.parameters())
    module = next((v for v in state.values() if isinstance(v, nn.Module)), None)  # the entry that fits it is read
    with agreement(sharded, "while reading the checkpoint"), headers_shared(from_first_rank if sharded else None), \
            opened(path, module) as ckpt:  # once: headers (parsed on rank 0), the other entries (optimizers' unread), the
        rest = other_entries(ckpt, state, weights_only, unread=optimizers)  # weights, then the optimizers' rows
        key = weights_key(ckpt, state)
        _validate_keys_for_strict_loading(state.keys(), [*rest, *([key] if key else [])], strict=strict)
        if key is not None:
            stream(ckpt, state[key])
        model = state[key] if key is not None else next((v for v in state.values() if isinstance(v, nn.Module)),
                                                        None)

        def load_optimizer(optimizer: Optimizer, saved: dict[str, Any]) -> None:
            load_optimizer_shards(model, optimizer, saved)

        return restore_entries(state, rest, key, strict, load_optimizer if model is not None else None)
