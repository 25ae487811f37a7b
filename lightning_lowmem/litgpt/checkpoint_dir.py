"""A litgpt ``GPT`` from a checkpoint directory, through ``Fabric(strategy=LowMemStrategy(...))``.

Two layouts are read:

* litgpt's: ``lit_model.pth`` + ``model_config.yaml`` (+ tokenizer files);
* HF's: ``model.safetensors`` (or a sharded ``*.index.json`` set, or
  ``pytorch_model.bin``) renamed, reordered and fused (q, k, v into qkv) by
  litgpt's own conversion (:mod:`lightning_lowmem.litgpt.hf`) as it streams in;
  an output head that the checkpoint does not hold is tied to the embedding.
  A checkpoint transformers saved quantized (bitsandbytes, torchao) loads as
  stored, except the tensors litgpt fuses: their parts are dequantized, fused
  and quantized again in the same scheme, one tensor at a time.
  The litgpt config comes from
  ``model_config.yaml`` when present, else from the directory's name, as
  ``litgpt convert_to_litgpt`` does.

The model is built on the meta device, RoPE tables included, so nothing the
size of the whole context is allocated, then streamed in (and quantized) by the
strategy's ``fabric.load_raw``: caches are sized per request by
:func:`~lightning_lowmem.setup_kv_cache`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lowmem.dtypes import precision_flag
from lightning_lowmem.engine import LoadOptions, LoadReport, stored_in
from lightning_lowmem.errors import CheckpointNotFoundError, format_names
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.litgpt.hf import hf_to_litgpt, looks_hf
from lightning_lowmem.meta import init_empty

_HF_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
             "pytorch_model.bin")


@dataclass
class LitgptCheckpoint:
    """What is in a checkpoint directory: where the weights are, the config, the tokenizer if any."""

    directory: Path
    weights: Path
    config: Any
    tokenizer: Any | None

    @classmethod
    def find(cls, checkpoint_dir: str | Path, config: Any | None = None) -> LitgptCheckpoint:
        """Inspect ``checkpoint_dir`` (reads no weights).

        Raises:
            CheckpointNotFoundError: no ``lit_model.pth`` and no HF weights in the directory.
            ValueError: no config given, no ``model_config.yaml``, and the directory's name is no litgpt model name.
        """
        directory = Path(checkpoint_dir)
        return cls(directory=directory, weights=_weights_file(directory), config=config or _config(directory),
                   tokenizer=_tokenizer(directory))


def build_meta_gpt(config: Any) -> nn.Module:
    """litgpt's ``GPT(config)`` with every parameter and buffer on meta (no RoPE computed)."""
    from litgpt import GPT

    with init_empty(include_buffers=True):
        return GPT(config)


def load_litgpt(checkpoint: LitgptCheckpoint, options: LoadOptions) -> tuple[nn.Module, LoadReport]:
    """Load through ``Fabric(strategy=LowMemStrategy(...))``: built on meta, streamed (and quantized) in.

    The weights file is opened once: its headers give litgpt's conversion of an HF checkpoint and the
    plan, then its tensors are read.

    Args:
        checkpoint: the directory's contents.
        options: the load options; ``device`` defaults to CPU and ``dtype`` to bf16.

    Returns:
        ``(model, report)``: the model set up by Fabric (``fabric.setup_module``), in eval mode,
        and the loader's report.
    """
    import lightning as L

    from lightning_lowmem.lightning.strategy import LowMemStrategy

    device = options.device or torch.device("cpu")
    dtype = options.dtype or torch.bfloat16
    with Checkpoint.open(checkpoint.weights) as ckpt:
        conversion = None
        if looks_hf(ckpt.records):  # learned on the weights' own shapes, those stored quantized included
            conversion = hf_to_litgpt(checkpoint.config, stored_in(ckpt, options).logical_records(ckpt.records))
        if conversion is not None:
            options = LoadOptions.merge(options, key_map=conversion.key_map, combine=conversion.combine)
        # inference: a tensor the checkpoint lacks is an error, never a randomly initialized "adapter"
        strategy = LowMemStrategy(device=device, options=LoadOptions.merge(options, dtype=dtype), init_added=False)
        fabric = L.Fabric(accelerator=device.type, devices=1, strategy=strategy, precision=precision_flag(dtype))
        with fabric.init_module():  # the precision's default dtype; build_meta_gpt puts RoPE on meta too
            model = build_meta_gpt(checkpoint.config)
        if conversion is not None:
            conversion.tie(model)  # e.g. no lm_head in the checkpoint: litgpt copies the embedding; here it is shared
        fabric.load_raw(ckpt, model)
    model = fabric.setup_module(model)
    return model.eval(), strategy.reports[-1]


def _weights_file(directory: Path) -> Path:
    if (directory / "lit_model.pth").is_file():
        return directory / "lit_model.pth"
    for name in _HF_FILES:
        if (directory / name).is_file():
            return directory / name
    shards = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if len(shards) == 1:
        return shards[0]
    raise CheckpointNotFoundError(
        f"No checkpoint in {str(directory)!r}: expected lit_model.pth (litgpt) or model.safetensors / "
        f"model.safetensors.index.json / pytorch_model.bin (HF). Found: "
        f"{format_names(sorted(p.name for p in directory.iterdir())) if directory.is_dir() else 'no such directory'}."
    )


def _config(directory: Path) -> Any:
    from litgpt import Config

    if (directory / "model_config.yaml").is_file():
        return Config.from_file(directory / "model_config.yaml")
    try:
        return Config.from_name(directory.name)
    except ValueError as e:
        raise ValueError(
            f"No model_config.yaml in {str(directory)!r} and its name {directory.name!r} is no litgpt model name. "
            "Pass config=litgpt.Config.from_name('<model name>'), or name the directory after the model "
            "(e.g. checkpoints/EleutherAI/pythia-1b)."
        ) from e


def _tokenizer(directory: Path) -> Any | None:
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        return None
    from litgpt.tokenizer import Tokenizer

    return Tokenizer(directory)
