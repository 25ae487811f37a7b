"""An HF-format checkpoint streamed into litgpt's ``GPT``, renamed by litgpt's own conversion code.

litgpt converts HF checkpoints with ``litgpt.scripts.convert_hf_checkpoint``'s
``copy_weights_*`` functions, which load everything and write a new
``lit_model.pth``. Here those functions are run once on meta tensors built from
the checkpoint's headers, one key at a time, to learn what each HF key becomes:

* the same tensor under a new name -> a rename in the ``key_map``;
* a new tensor (GPT-NeoX and Falcon reorder ``query_key_value`` rows with
  ``qkv_reassemble``) -> a rename plus a ``transform`` that runs litgpt's
  function again on that one real tensor as it is read;
* nothing -> the key is skipped (``rotary_emb.inv_freq`` and masks).

Families whose conversion fuses several HF tensors into one (Llama, Gemma,
Phi, Qwen, OLMo-2: separate q/k/v projections into ``qkv``) cannot be streamed
one tensor at a time; they raise :class:`CheckpointFormatError` saying to
convert with ``litgpt convert_to_litgpt`` first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from lightning_lowmem.errors import CheckpointFormatError, CheckpointMismatchError, format_names
from lightning_lowmem.records import TensorRecord

_FUSING_PREFIXES = ("gemma", "phi", "qwen", "qwq", "olmo-2")
_FUSING_MLPS = ("LLaMAMLP", "GemmaMLP", "LLaMAMoE")


@dataclass
class HFConversion:
    """How an HF checkpoint's keys and tensors become litgpt's.

    Attributes:
        renames: HF key -> litgpt name (None: not loaded).
        transformed: litgpt name -> HF key, for tensors litgpt's conversion changes.
    """

    renames: dict[str, str | None]
    transformed: dict[str, str] = field(default_factory=dict)
    _copy: Callable[..., None] | None = None

    def key_map(self, key: str) -> str | None:
        """For :func:`~lightning_lowmem.load_checkpoint`'s ``key_map``."""
        return self.renames.get(key, key)

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """For :func:`~lightning_lowmem.load_checkpoint`'s ``transform``: litgpt's conversion of one tensor."""
        source = self.transformed.get(name)
        if source is None or self._copy is None:
            return tensor
        out: dict[str, torch.Tensor] = {}
        self._copy(out, {source: tensor})
        return out[name]


def hf_to_litgpt(config: Any, records: Mapping[str, TensorRecord]) -> HFConversion:
    """Learn the conversion of ``records`` (an HF checkpoint's headers) for litgpt ``config``.

    Raises:
        CheckpointFormatError: the family's conversion fuses tensors (convert the checkpoint first).
        CheckpointMismatchError: keys litgpt's conversion does not know.
    """
    copy = _copy_function(config)
    renames: dict[str, str | None] = {}
    transformed: dict[str, str] = {}
    state: dict[str, torch.Tensor] = {}
    inputs = {key: torch.empty(rec.shape, dtype=rec.dtype, device="meta") for key, rec in records.items()}
    try:
        for key, new in _one_by_one(inputs, state, copy):
            if not new:
                renames[key] = None
            for name, tensor in new.items():
                renames[key] = name
                if tensor is not inputs[key]:
                    transformed[name] = key
    except KeyError as e:
        raise CheckpointMismatchError(
            f"litgpt's conversion for {config.name!r} does not know the checkpoint key {e.args[0]!r}. Check that "
            "the checkpoint is of this model family, or pass the right litgpt config (config=...)."
        ) from e
    return HFConversion(renames=renames, transformed=transformed, _copy=copy)


def _copy_function(config: Any) -> Callable[..., None]:
    """litgpt's ``copy_weights_*`` for ``config``, the choice ``convert_hf_checkpoint`` makes, one-to-one ones only."""
    from litgpt.scripts import convert_hf_checkpoint as convert

    name = config.name.lower()
    if "falcon" in name:
        return partial(convert.copy_weights_falcon, config)
    if name.startswith(_FUSING_PREFIXES) or config.mlp_class_name in _FUSING_MLPS:
        raise CheckpointFormatError(
            f"An HF checkpoint of {config.name!r} ({config.mlp_class_name}) keeps q, k and v in separate tensors that "
            "litgpt fuses into one; that cannot be streamed one tensor at a time. Convert it once with "
            "`litgpt convert_to_litgpt <checkpoint_dir>` and load the resulting lit_model.pth."
        )
    return partial(convert.copy_weights_gpt_neox, config)


def _one_by_one(inputs: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                copy: Callable[..., None]) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Run ``copy`` over ``inputs`` and yield, per input key, the outputs it produced."""
    log: list[tuple[str, dict[str, torch.Tensor]]] = []

    class Recorder(dict):
        def items(self) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
            for key, tensor in inputs.items():
                seen = set(state)
                yield key, tensor
                log.append((key, {k: v for k, v in state.items() if k not in seen}))

    copy(state, Recorder(inputs))
    produced = {name for _, new in log for name in new}
    late = [name for name in state if name not in produced]
    if late:
        raise CheckpointFormatError(
            f"litgpt's conversion built {format_names(late)} from several checkpoint tensors; that cannot be "
            "streamed. Convert the checkpoint with `litgpt convert_to_litgpt <checkpoint_dir>` first."
        )
    yield from log
