"""An HF-format checkpoint streamed into litgpt's ``GPT``, converted by litgpt's own conversion code.

litgpt converts HF checkpoints with ``litgpt.scripts.convert_hf_checkpoint``'s
``copy_weights_*`` functions, which load everything and write a new
``lit_model.pth``. Here the function litgpt would pick runs once on meta tensors
built from the checkpoint's headers, with every torch call traced, to learn
where each litgpt tensor comes from:

* an HF tensor as it is, under a new name -> a rename in the ``key_map``;
* a tensor computed from HF tensors -> a :class:`~lightning_lowmem.plan.Combine`
  entry: the HF keys it is computed from, and a function that runs litgpt's
  conversion again on those real tensors as they are read. Llama-family
  ``q_proj``/``k_proj``/``v_proj`` fuse into ``attn.qkv`` this way, GPT-NeoX and
  Falcon reorder ``query_key_value``, Phi-3 splits ``gate_up_proj``;
* the same HF tensor under a second name (a missing ``lm_head`` is the
  embedding) -> a tie (:meth:`HFConversion.tie`), so it is read and held once;
* nothing -> the key is skipped (``rotary_emb.inv_freq`` and masks).

The parts of a fused tensor are read one after the other and fused at once, so a
load holds the final model plus one layer's q, k, v and qkv.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lightning_lowmem.errors import CheckpointFormatError, CheckpointMismatchError, format_names
from lightning_lowmem.litgpt.requirement import import_litgpt
from lightning_lowmem.meta import owner_of
from lightning_lowmem.plan import Combine
from lightning_lowmem.plan.combine import Stack, with_stacks
from lightning_lowmem.formats import TensorRecord

# convert_hf_checkpoint's choice of copy function, in its order.
_COPY_FUNCTIONS: tuple[tuple[Callable[[Any], bool], str], ...] = (
    (lambda c: "falcon" in c.name, "copy_weights_falcon"),
    (lambda c: c.name.lower().startswith("gemma-2"), "copy_weights_gemma_2"),
    (lambda c: c.name.lower().startswith("gemma-3"), "copy_weights_gemma_3"),
    (lambda c: c.name.lower().startswith("phi"), "copy_weights_phi"),
    (lambda c: c.name.lower().startswith(("qwen2.5", "qwq")), "copy_weights_qwen_2_5"),
    (lambda c: c.name.lower().startswith("olmo-2-"), "copy_weights_olmo2"),
    (lambda c: c.name.lower().startswith("qwen3"), "copy_weights_qwen_3"),
    (lambda c: c.mlp_class_name in ("LLaMAMLP", "GemmaMLP", "LLaMAMoE"), "copy_weights_hf_llama"),
    (lambda c: True, "copy_weights_gpt_neox"),
)
_CONVERT_FIRST = ("Convert it once with `litgpt convert_to_litgpt <checkpoint_dir>` and load the resulting "
                  "lit_model.pth, or pass the litgpt config of the checkpoint's model (config=...).")

Copy = Callable[[dict[str, torch.Tensor], Mapping[str, torch.Tensor]], None]


@dataclass
class HFConversion:
    """How an HF checkpoint's keys and tensors become litgpt's.

    Attributes:
        renames: HF key -> litgpt name (None: not loaded as it is).
        sources: litgpt name -> the HF keys litgpt's conversion computes it from.
        tied: litgpt name -> the litgpt name it is the same HF tensor as.
    """

    renames: dict[str, str | None]
    sources: dict[str, tuple[str, ...]] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    _copy: Copy | None = None
    _outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    _stacks: dict[str, Stack] = field(default_factory=dict)

    @property
    def function_name(self) -> str:
        """The name of litgpt's ``copy_weights_*`` function this conversion runs."""
        return getattr(self._copy, "__name__", "")

    def key_map(self, key: str) -> str | None:
        """For :func:`~lightning_lowmem.load_checkpoint`'s ``key_map``."""
        return self.renames.get(key, key)

    @property
    def combine(self) -> Combine:
        """For :func:`~lightning_lowmem.load_checkpoint`'s ``combine``."""
        return Combine(self.sources, self._convert, self._stacks)

    def tie(self, module: nn.Module) -> None:
        """Make the tensors of ``module`` that litgpt fills with one HF tensor one tensor (read and held once)."""
        params = dict(module.named_parameters(remove_duplicate=False))
        for name, same in self.tied.items():
            if name in params and same in params and params[name].shape == params[same].shape:
                owner, leaf = owner_of(module, name)
                setattr(owner, leaf, params[same])

    def _convert(self, name: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """litgpt's conversion of ``parts`` (the HF tensors ``name`` is computed from); returns ``name``."""
        # litgpt's functions read the state dict they fill (`"lm_head.weight" not in state_dict`): show them
        # every other output, as the meta tensors they were when learned.
        state = {n: t for n, t in self._outputs.items() if n != name}
        self._copy(state, parts)
        if name not in state:
            raise CheckpointFormatError(f"litgpt's conversion did not build {name!r} from {format_names(parts)}. "
                                        + _CONVERT_FIRST)
        return state[name]


def hf_to_litgpt(config: Any, records: Mapping[str, TensorRecord]) -> HFConversion:
    """Learn the conversion of ``records`` (an HF checkpoint's headers) for litgpt ``config``.

    Raises:
        CheckpointFormatError: litgpt's conversion fails on these keys, or builds a tensor from none of them.
        CheckpointMismatchError: keys litgpt's conversion does not know.
    """
    copy = _copy_function(config)
    inputs = _Inputs({key: torch.empty(rec.shape, dtype=rec.dtype, device="meta") for key, rec in records.items()})
    state: dict[str, torch.Tensor] = {}
    with _Provenance(inputs) as provenance:
        _run(copy, state, inputs, config)
    conversion = HFConversion(renames=dict.fromkeys(records), _copy=copy, _outputs=state)
    name_of = {id(tensor): key for key, tensor in inputs.items()}
    order = {key: i for i, key in enumerate(records)}
    for name, tensor in state.items():
        key = name_of.get(id(tensor))
        if key is not None and conversion.renames[key] is None:
            conversion.renames[key] = name
        elif key is not None:
            conversion.sources[name], conversion.tied[name] = (key,), conversion.renames[key]
        elif keys := provenance.get(id(tensor)):
            conversion.sources[name] = tuple(sorted(keys, key=order.__getitem__))
        else:
            raise CheckpointFormatError(f"litgpt's conversion for {config.name!r} builds {name!r} from no "
                                        "checkpoint tensor; that cannot be streamed. " + _CONVERT_FIRST)
    parts = {key for keys in conversion.sources.values() for key in keys}
    unused = [key for key in records if conversion.renames[key] is None and key not in parts]
    conversion.sources.update(_incomplete(conversion.sources, unused))
    # the tensors litgpt builds by moving rows (q, k, v stacked; GPT-NeoX's fused qkv reordered head by head): read
    # a run of rows at a time straight into place, where building them holds the parts and the result together.
    # Seen concatenated whole (torch.cat of the checkpoint's own tensors along rows): declared; others probed.
    declared = _declared_stacks(state, conversion.sources, provenance, records)
    # a tensor litgpt's conversion sets to a checkpoint tensor itself (a tied head): that tensor, row for row
    declared.update({name: Stack((0,), records[keys[0]].shape[1:]) for name, keys in conversion.sources.items()
                     if name in conversion.tied and len(records[keys[0]].shape) > 0})
    conversion._stacks = dict(with_stacks(Combine(conversion.sources, conversion._convert, declared), records).stacks)
    return conversion


def _declared_stacks(state: Mapping[str, torch.Tensor], sources: Mapping[str, tuple[str, ...]],
                     provenance: _Provenance, records: Mapping[str, TensorRecord]) -> dict[str, Stack]:
    """The tensors litgpt's conversion made by one ``torch.cat`` of its parts as they are, along their rows: where
    each part starts (in the order of ``sources``)."""
    stacks = {}
    for name, tensor in state.items():
        order = provenance.concatenated.get(id(tensor))
        if (order is None or name not in sources or sorted(order) != sorted(sources[name])
                or len(set(order)) != len(order)):
            continue
        starts, row = {}, 0
        for key in order:
            starts[key], row = row, row + records[key].shape[0]
        stacks[name] = Stack(tuple(starts[key] for key in sources[name]), records[order[0]].shape[1:])
    return stacks


def _copy_function(config: Any) -> Copy:
    """litgpt's ``copy_weights_*`` for ``config``, as ``convert_hf_checkpoint`` picks it, bound to ``config``."""
    convert = import_litgpt("litgpt.scripts.convert_hf_checkpoint", needed_by="Converting an HF checkpoint to litgpt")

    name = next(name for test, name in _COPY_FUNCTIONS if test(config))
    function = getattr(convert, name)
    params = inspect.signature(function).parameters

    def copy(state_dict: dict[str, torch.Tensor], hf_weights: Mapping[str, torch.Tensor]) -> None:
        extra: dict[str, Any] = {"config": config} if "config" in params else {}
        if "qkv_weights" in params:  # litgpt's holder of q, k, v until all three are seen: a fresh one each time
            extra["qkv_weights"] = {}
        function(state_dict=state_dict, hf_weights=hf_weights, **extra)

    copy.__name__ = name
    return copy


def _run(copy: Copy, state: dict[str, torch.Tensor], inputs: _Inputs, config: Any) -> None:
    """``copy`` over the meta ``inputs``, its failures told in terms of the checkpoint."""
    try:
        copy(state, inputs)
    except KeyError as e:
        if inputs.current is not None:
            raise CheckpointMismatchError(
                f"litgpt's conversion for {config.name!r} ({copy.__name__}) does not know the checkpoint key "
                f"{inputs.current!r}. Check that the checkpoint is of this model family, or pass the right "
                "litgpt config (config=...)."
            ) from e
        raise CheckpointMismatchError(
            f"litgpt's conversion for {config.name!r} ({copy.__name__}) needs {e.args[0]!r}, which the checkpoint "
            "does not provide. Check that the checkpoint is complete and of this model family."
        ) from e
    except (NotImplementedError, ValueError) as e:
        raise CheckpointFormatError(
            f"litgpt's conversion for {config.name!r} ({config.mlp_class_name}, {copy.__name__}) does not handle "
            f"this checkpoint: {type(e).__name__}: {e}. " + _CONVERT_FIRST
        ) from e
    except RuntimeError as e:  # torch's size checks on the meta tensors: the config is not the checkpoint's
        raise CheckpointMismatchError(
            f"litgpt's conversion for {config.name!r} ({copy.__name__}) fails on this checkpoint's shapes "
            f"({e}). The checkpoint is of another model configuration: pass its litgpt config (config=...)."
        ) from e


class _Inputs(dict):
    """The HF tensors, noting which key litgpt's conversion is at (None once it has seen them all)."""

    current: str | None = None

    def items(self):  # type: ignore[override]
        for key, value in super().items():
            self.current = key
            yield key, value
        self.current = None


class _Provenance(TorchFunctionMode):
    """Traces torch calls: which input keys each tensor made from them comes from (``id`` -> keys)."""

    def __init__(self, inputs: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.sources: dict[int, frozenset[str]] = {id(t): frozenset([k]) for k, t in inputs.items()}
        self.concatenated: dict[int, tuple[str, ...]] = {}
        """``id`` -> the input keys, in order, of a tensor made by ``torch.cat`` of inputs as they are, along rows."""
        self._inputs = {id(t): k for k, t in inputs.items()}
        self._alive = list(inputs.values())  # ids stay unique while traced tensors are alive

    def get(self, tensor_id: int) -> frozenset[str]:
        return self.sources.get(tensor_id, frozenset())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        used = frozenset().union(*(self.get(id(t)) for t in tree_flatten((args, kwargs))[0]
                                   if isinstance(t, torch.Tensor)))
        if used:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and id(t) not in self.sources:
                    self.sources[id(t)] = used
                    self._alive.append(t)
            self._note_cat(func, args, kwargs or {}, out)
        return out

    def _note_cat(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if func not in (torch.cat, torch.concat, torch.concatenate) or not isinstance(out, torch.Tensor):
            return
        tensors, dim = args[0] if args else kwargs.get("tensors"), args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if dim == 0 and isinstance(tensors, (list, tuple)) and tensors \
                and all(isinstance(t, torch.Tensor) and t.dim() > 0 and id(t) in self._inputs for t in tensors):
            self.concatenated[id(out)] = tuple(self._inputs[id(t)] for t in tensors)


def _incomplete(sources: dict[str, tuple[str, ...]], unused: list[str]) -> dict[str, tuple[str, ...]]:
    """Sources of fused tensors that litgpt dropped because a part is missing, guessed from the other layers.

    litgpt's conversion builds layer 1's ``qkv`` only when its q, k and v are all there; without k it
    silently keeps none of them. Naming the expected parts lets the plan name the missing key.
    """
    patterns = {_template(name)[0]: tuple(_template(key)[0] for key in keys) for name, keys in sources.items()}
    guessed: dict[str, tuple[str, ...]] = {}
    for key in unused:
        pattern, ids = _template(key)
        for name, parts in patterns.items():
            if pattern in parts and all(p.count("{}") == len(ids) for p in (name, *parts)):
                guessed[name.format(*ids)] = tuple(p.format(*ids) for p in parts)
    return {name: keys for name, keys in guessed.items() if name not in sources}


def _template(key: str) -> tuple[str, tuple[str, ...]]:
    """``'model.layers.1.mlp.w'`` -> ``('model.layers.{}.mlp.w', ('1',))``."""
    return re.sub(r"(?<=\.)\d+(?=\.)", "{}", key), tuple(re.findall(r"(?<=\.)\d+(?=\.)", key))
