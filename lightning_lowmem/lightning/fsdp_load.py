"""What ``LowMemFSDPStrategy`` does around a sharded model's load: shards not filled yet, a full checkpoint file.

After ``setup``, a rank's shards hold memory but no values (nothing is initialised, a load fills them):
:func:`guard_unfilled` makes the model's first forward before any load an error instead of a silent
forward over garbage. :func:`load_full_checkpoint` is ``fabric.load`` of one checkpoint file (not
Lightning's sharded directory): the model's entry streamed into the shards, optimizer states restored
the way Lightning's ``ModelParallelStrategy`` restores a full checkpoint's, the rest as Lightning does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from torch import nn
from torch.optim import Optimizer

from lightning_lowmem.engine import opened
from lightning_lowmem.engine.ranks import agreement, from_first_rank
from lightning_lowmem.errors import MetaTensorError, format_names
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.formats.checkpoint import headers_shared
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

    Args:
        path: one checkpoint file (or directory of safetensors files), not Lightning's sharded directory.
        state: what to restore: the model (its entry ``stream``-ed), optimizers, other objects.
        strict, weights_only: as ``fabric.load``.
        stream: loads the checkpoint's weights into a module.
    """
    # Every rank reads the other entries and streams its shards before the optimizer states are exchanged (a
    # collective): a rank failing here (a read error in the optimizer state) stops every rank here, not there.
    sharded = any(is_dtensor(p) for v in state.values() if isinstance(v, nn.Module) for p in v.parameters())
    with agreement(sharded, "while reading the checkpoint"), headers_shared(from_first_rank if sharded else None), \
            opened(path) as ckpt:  # once: headers (parsed on rank 0), the other entries, then the weights
        rest = other_entries(ckpt, state, weights_only)
        key = weights_key(ckpt, state)
        _validate_keys_for_strict_loading(state.keys(), [*rest, *([key] if key else [])], strict=strict)
        if key is not None:
            stream(ckpt, state[key])
    model = state[key] if key is not None else next((v for v in state.values() if isinstance(v, nn.Module)), None)

    def load_optimizer(optimizer: Optimizer, saved: dict[str, Any]) -> None:
        _load_optimizer(model, optimizer, saved, strict)

    return restore_entries(state, rest, key, strict, load_optimizer if model is not None else None)


def _load_optimizer(model: nn.Module, optimizer: Optimizer, saved: dict[str, Any], strict: bool) -> None:
    """A full optimizer state (saved by ``fabric.save`` with ``save_distributed_checkpoint=False``) given to a
    sharded model's optimizer, each rank its part, as Lightning's ``ModelParallelStrategy`` does it."""
    from lightning.fabric.strategies.model_parallel import _rekey_optimizer_state_if_needed
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=_rekey_optimizer_state_if_needed(saved, model),
                             options=options)
