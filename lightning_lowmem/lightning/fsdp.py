"""``LowMemFSDPStrategy``: Lightning's ``ModelParallelStrategy`` (FSDP2) where each rank reads and holds its own shard.

::

    fabric = L.Fabric(strategy="lowmem_fsdp", devices=8, precision="bf16-true")  # or quantize="torchao.nf4"
    fabric.launch()
    with fabric.init_module():                 # parameters on meta, buffers real
        model = GPT(config)
    model = fabric.setup(model)                # fully_shard per block; this rank's shards allocated, no init
    fabric.load_raw("model.safetensors", model)  # each rank reads its own rows into its shards

Where Lightning's ``ModelParallelStrategy`` runs ``to_empty`` and ``reset_parameters`` in ``setup`` (a random
init the load overwrites, and garbage in buffers such as RoPE tables), then has every rank map the whole
file and rank 0 broadcast each tensor, this one allocates each rank's shards and reads its rows straight
into them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_lowmem.engine import LoadOptions, allocate_shards, quantize_for_sharding
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.lightning.fsdp_load import guard_unfilled, load_full_checkpoint, unfilled
from lightning_lowmem.lightning.load import FABRIC_LOG, LightningLoader, LoaderOwner
from lightning_lowmem.meta import check_meta_at_first_forward, init_empty
from lightning_lowmem.placement import architecture_of, shard_model
from lightning_lowmem.quantize import QuantScheme
from lightning_lowmem.plan.dtensor_part import is_dtensor

_META_ADVICE = ("Load its weights before the first forward (fabric.load_raw(path, model) or fabric.load), or, for a "
                "fresh run without a checkpoint, build it with fabric.init_module(empty_init=False).")


class LowMemFSDPStrategy(LoaderOwner, ModelParallelStrategy):
    """Fabric on many ranks (FSDP2, Lightning's ``ModelParallelStrategy``) where each rank reads only its shard.

    * ``fabric.init_module()`` builds parameters on the meta device, buffers real (RoPE tables keep their
      values); ``init_module(empty_init=False)`` builds real, initialised parameters, for a fresh run.
    * ``fabric.setup(model)`` shards the model with ``parallelize_fn`` (default:
      :func:`~lightning_lowmem.placement.shard_model`, each transformer block ``fully_shard``-ed, tied modules
      in one group, the root last) and gives this rank's shards memory, with no random initialisation.
      With ``quantize="torchao.nf4"`` the chosen Linears become 4-bit ``NF4Linear`` modules first (QLoRA).
    * ``fabric.load_raw(path, model)`` and the model entry of ``fabric.load(path, state)`` stream each rank's rows
      into its shards (:func:`~lightning_lowmem.load_checkpoint`); a quantized weight's rows are read and quantized
      on this rank alone. LoRA adapters missing from the checkpoint are initialised.
    * ``fabric.save`` and ``fabric.load`` of Lightning's own sharded checkpoints (a directory, one file per rank)
      work as in ``ModelParallelStrategy``; from a full checkpoint file each rank reads its part of each optimizer
      state tensor (``optimizer_shards.py``).

    Args:
        parallelize_fn: ``fn(model, device_mesh) -> model``; default :func:`~lightning_lowmem.placement.shard_model`.
        data_parallel_size, tensor_parallel_size: the device mesh, as for ``ModelParallelStrategy``. With the
            default ``parallelize_fn`` and both ``"auto"``: every rank shards (data parallel = world size).
        save_distributed_checkpoint, process_group_backend, timeout: as for ``ModelParallelStrategy``.
        options: :class:`~lightning_lowmem.LoadOptions`; the keyword arguments below override its fields.
            ``max_memory`` and ``device`` are not supported (``ValueError``): each rank holds its shard on its own
            device.
        dtype: what weights are cast to; default: the precision plugin's dtype.
        quantize: only ``"torchao.nf4"`` (other schemes cannot be sharded).
        init_added: initialize trainable parameters the checkpoint lacks (LoRA adapters).
        load_options: any other :class:`~lightning_lowmem.LoadOptions` field as a keyword: see its attributes.
    """

    strategy_name = "lowmem_fsdp"

    def __init__(
        self,
        parallelize_fn: Callable[[nn.Module, Any], nn.Module] | None = None,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        *,
        options: LoadOptions | None = None,
        dtype: torch.dtype | None = None,
        quantize: str | QuantScheme | None = None,
        init_added: bool = True,
        **load_options: Any,
    ) -> None:
        super().__init__(parallelize_fn or shard_model, data_parallel_size, tensor_parallel_size,
                         save_distributed_checkpoint, process_group_backend, timeout)
        options = LoadOptions.merge(options, type(self), dtype=dtype, quantize=quantize, **load_options)
        if options.max_memory is not None:
            raise ValueError("LowMemFSDPStrategy shards the model across ranks; max_memory (offload) is not "
                             "supported with it. Leave max_memory unset, or use strategy='lowmem' on one device.")
        if options.device is not None:
            raise ValueError(f"LowMemFSDPStrategy puts each rank on its own device, which Fabric(accelerator=..., "
                             f"devices=...) picks; device={str(options.device)!r} cannot be honoured here. Drop "
                             "device= (from the options too).")
        self._default_layout = parallelize_fn is None
        self.loader = LightningLoader(options, init_added=init_added, logger=FABRIC_LOG, face=type(self).__name__)

    @override
    def setup_environment(self) -> None:
        if self._default_layout and self._data_parallel_size == "auto" and self._tensor_parallel_size == "auto":
            self._data_parallel_size, self._tensor_parallel_size = self.num_nodes * self.num_processes, 1
        super().setup_environment()

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        if empty_init is False:  # real, initialised parameters, as Lightning builds them (a fresh run)
            return super().module_init_context(empty_init=False)
        stack = ExitStack()
        stack.enter_context(self.root_device)  # buffers built in __init__ go straight to the device
        stack.enter_context(self.precision.module_init_context())
        stack.enter_context(init_empty())
        return stack

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        if self.options.scheme is not None:  # the chosen Linears built 4-bit on meta, before sharding
            shards = self.device_mesh["data_parallel"].size()
            quantize_for_sharding(module, self.options, shards, self.root_device, dtype=self.load_dtype)
        module = self._parallelize_fn(module, self.device_mesh)
        if not isinstance(module, nn.Module):
            raise TypeError(f"The `parallelize_fn` must return a `nn.Module` instance, but got: {type(module).__name__}")
        # Lightning's precision plugin converted every floating buffer (bf16-true: RoPE tables to bf16); its own
        # materialization (to_empty + reset_parameters) rebuilds them after that, as the model's code gives them
        # (litgpt: float32 RoPE tables): left so here, and again after each load
        architecture_of(module).reset_buffers(module, self.root_device)
        allocation = allocate_shards(module, self.root_device)  # this rank's shards: memory, no init
        if allocation.names:
            guard_unfilled(module, allocation.names, _META_ADVICE)
        check_meta_at_first_forward(module, _META_ADVICE)  # anything the parallelize_fn left unsharded on meta
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self.loader.track(optimizer)
        return super().setup_optimizer(optimizer)

    @override
    def load_checkpoint(
        self,
        path: str | Path | Checkpoint,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if not isinstance(path, Checkpoint):
            path = Path(self.broadcast(path))
            if _is_sharded_checkpoint(path):  # Lightning's own sharded checkpoint: every rank its own file
                rest = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
                for module in _modules_of(state):
                    unfilled(module).clear()
                return rest
        if isinstance(state, nn.Module):
            self._stream(path, state, strict=strict)
            return {}
        if not state or isinstance(state, Optimizer):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        return load_full_checkpoint(path, state, strict, weights_only, stream=lambda ckpt, module: self._stream(
            ckpt, module, strict=strict, optimizers=_optimizers_of(state)))

    def _stream(self, path: str | Path | Checkpoint, module: nn.Module, strict: bool,
                optimizers: list[Optimizer] = ()) -> None:
        if not any(is_dtensor(p) for p in module.parameters()):
            rank_zero_warn("LowMemFSDPStrategy: loading into a model that is not sharded yet, so every rank reads "
                           "and holds all of it. Call fabric.setup(model) first, then load: each rank then reads "
                           "only its shard.")
        self.loader.load(module, path, device=self.root_device, precision=self.precision, strict=strict,
                         unfilled=frozenset(unfilled(module)), optimizers=optimizers)
        architecture_of(module).reset_buffers(module, self.root_device)  # as reset_parameters() leaves them
        unfilled(module).clear()


def _modules_of(state: object) -> list[nn.Module]:
    if isinstance(state, nn.Module):
        return [state]
    return [v for v in state.values() if isinstance(v, nn.Module)] if isinstance(state, dict) else []


def _optimizers_of(state: dict[str, Any]) -> list[Optimizer]:
    return [v for v in state.values() if isinstance(v, Optimizer)]
