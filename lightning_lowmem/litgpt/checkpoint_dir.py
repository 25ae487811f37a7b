"""A litgpt ``GPT`` from a checkpoint directory, through ``Fabric(strategy=LowMemStrategy(...))``.

Three layouts are read:

* litgpt's: ``lit_model.pth`` + ``model_config.yaml`` (+ tokenizer files);
* HF's: ``model.safetensors`` (or a sharded ``*.index.json`` set, or
  ``pytorch_model.bin``) renamed, reordered and fused (q, k, v into qkv) by
  litgpt's own conversion (:mod:`lightning_lowmem.litgpt.hf`) as it streams in;
  an output head that the checkpoint does not hold is tied to the embedding.
  A checkpoint transformers saved quantized (bitsandbytes, torchao) loads as
  stored, except the tensors litgpt fuses: their parts are dequantized, fused
  and quantized again in the same scheme, one tensor at a time;
* a GGUF file (``model.Q4_0.gguf``, or a directory holding one): dequantized as it is
  read, converted by transformers' GGUF code and then litgpt's
  (:mod:`lightning_lowmem.litgpt.gguf`); config and tokenizer from the file.

The litgpt config of the first two comes from ``model_config.yaml`` when present,
else from the directory's name, as ``litgpt convert_to_litgpt`` does, else from the
directory's HF ``config.json`` (:mod:`lightning_lowmem.litgpt.hf_config`).

The model is built on the meta device, RoPE tables included, so nothing the
size of the whole context is allocated, then streamed in (and quantized) by the
strategy's ``fabric.load_raw``: caches are sized per request by
:func:`~lightning_lowmem.setup_kv_cache`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lowmem.dtypes import precision_flag
from lightning_lowmem.engine import LoadOptions, LoadReport, stored_in
from lightning_lowmem.errors import CheckpointFormatError, CheckpointNotFoundError, format_names
from lightning_lowmem.formats import Checkpoint
from lightning_lowmem.formats.discovery import GGUF_MAGIC
from lightning_lowmem.litgpt.config_check import check_config_fits
from lightning_lowmem.litgpt.gguf import GGUFSource, gguf_to_litgpt, litgpt_config, read_gguf_source
from lightning_lowmem.litgpt.hf import hf_to_litgpt, looks_hf
from lightning_lowmem.litgpt.hf_config import config_from_hf_json
from lightning_lowmem.meta import init_empty

_HF_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
             "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@dataclass
class LitgptCheckpoint:
    """What is in a checkpoint directory: where the weights are, the config, the tokenizer if any.

    ``gguf`` holds what a GGUF file says beyond its tensors (its transformers config), None otherwise.
    """

    directory: Path
    weights: Path
    config: Any
    tokenizer: Any | None
    gguf: GGUFSource | None = None

    @classmethod
    def find(cls, checkpoint_dir: str | Path, config: Any | None = None) -> LitgptCheckpoint:
        """Inspect ``checkpoint_dir``, a directory or a ``.gguf`` file (reads no weights).

        Raises:
            CheckpointNotFoundError: no ``lit_model.pth``, no HF weights and no GGUF file in the directory.
            ValueError: no config given, and neither ``model_config.yaml``, the directory's name nor its
                ``config.json`` gives one (see :func:`find_config`); for a GGUF file: a model family
                lightning_lowmem builds no litgpt config for.
        """
        path = Path(checkpoint_dir)
        weights = path if path.is_file() else _weights_file(path)
        if _is_gguf(weights):
            with Checkpoint.open(weights) as ckpt:
                source = read_gguf_source(ckpt)
            return cls(directory=weights.parent, weights=weights, tokenizer=source.tokenizer, gguf=source,
                       config=config or litgpt_config(source.hf_config, source.names))
        directory = weights.parent if path.is_file() else path
        return cls(directory=directory, weights=weights, config=config or find_config(directory)[0],
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
        conversion = _conversion(checkpoint, ckpt, options)
        if conversion is not None:
            options = LoadOptions.merge(options, key_map=conversion.key_map, combine=conversion.combine,
                                        transform=getattr(conversion, "transform", None))
        # inference: a tensor the checkpoint lacks is an error, never a randomly initialized "adapter"
        strategy = LowMemStrategy(device=device, options=LoadOptions.merge(options, dtype=dtype), init_added=False)
        fabric = L.Fabric(accelerator=device.type, devices=1, strategy=strategy, precision=precision_flag(dtype))
        check_config_fits(checkpoint.config, ckpt.records, ckpt.description)
        with fabric.init_module():  # the precision's default dtype; build_meta_gpt puts RoPE on meta too
            model = build_meta_gpt(checkpoint.config)
        if conversion is not None:
            conversion.tie(model)  # e.g. no lm_head in the checkpoint: litgpt copies the embedding; here it is shared
        fabric.load_raw(ckpt, model)
    model = fabric.setup_module(model)
    return model.eval(), strategy.reports[-1]


def _conversion(checkpoint: LitgptCheckpoint, ckpt: Checkpoint, options: LoadOptions) -> Any | None:
    """How the checkpoint's tensors become litgpt's: GGUF or HF conversion, or None (litgpt's own keys)."""
    if checkpoint.gguf is not None:
        return gguf_to_litgpt(checkpoint.config, ckpt, checkpoint.gguf.hf_config)
    if not looks_hf(ckpt.records):
        return None
    # learned on the weights' own shapes, those stored quantized included
    return hf_to_litgpt(checkpoint.config, stored_in(ckpt, options).logical_records(ckpt.records))


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def litgpt_weights(path: Path) -> Path:
    """A directory's ``lit_model.pth`` when it has one (what ``generate`` and ``chat`` load, as litgpt does),
    else ``path`` itself (what :class:`~lightning_lowmem.formats.Checkpoint` finds there)."""
    return path / "lit_model.pth" if path.is_dir() and (path / "lit_model.pth").is_file() else path


def _weights_file(directory: Path) -> Path:
    if (directory / "lit_model.pth").is_file():
        return directory / "lit_model.pth"
    for name in _HF_FILES:
        if (directory / name).is_file():
            return directory / name
    for pattern in ("*.safetensors", "*.gguf"):
        found = sorted(directory.glob(pattern)) if directory.is_dir() else []
        if len(found) == 1:
            return found[0]
    raise CheckpointNotFoundError(
        f"No checkpoint in {str(directory)!r}: expected lit_model.pth (litgpt), model.safetensors / "
        f"model.safetensors.index.json / pytorch_model.bin (HF) or one .gguf file. Found: "
        f"{format_names(sorted(p.name for p in directory.iterdir())) if directory.is_dir() else 'no such directory'}."
    )


def find_config(directory: Path) -> tuple[Any, str]:
    """The litgpt ``Config`` of a checkpoint directory, and where it came from: ``model_config.yaml``, else the
    directory's name (a litgpt model name), else the HF ``config.json`` (its ``_name_or_path``, then its shapes).

    Raises:
        CheckpointNotFoundError: ``directory`` is not a directory.
        ValueError: none of these gives a config; the message lists what was tried.
        CheckpointFormatError: ``model_config.yaml`` cannot be read as a litgpt config (:func:`config_from_file`), or
            ``config.json`` is not a JSON object.
    """
    from litgpt import Config

    if not directory.is_dir():
        raise CheckpointNotFoundError(f"Checkpoint directory {str(directory)!r} does not exist (or is a file). "
                                      "Check the path.")
    if (directory / "model_config.yaml").is_file():
        return config_from_file(directory / "model_config.yaml"), "model_config.yaml"
    with contextlib.suppress(ValueError):
        return Config.from_name(directory.name), f"the directory's name {directory.name!r}"
    tried = f"no model_config.yaml in {str(directory)!r}, and its name {directory.name!r} is no litgpt model name"
    if not (directory / "config.json").is_file():
        raise ValueError(f"No litgpt config for {str(directory)!r}: {tried}, and there is no config.json. Pass "
                         "config=litgpt.Config.from_name('<model name>') (--config NAME), or name the directory after "
                         "the model (e.g. checkpoints/EleutherAI/pythia-1b).")
    try:
        return config_from_hf_json(directory / "config.json")
    except ValueError as e:
        raise ValueError(f"No litgpt config for {str(directory)!r}: {tried}. {e}") from e


def config_from_file(path: Path) -> Any:
    """litgpt's ``Config.from_file(path)``, a file that is not a litgpt config being a typed error naming it.

    Raises:
        CheckpointFormatError: ``path`` is not YAML (a syntax error, a ``!!python/...`` tag, which ``yaml.safe_load``
            refuses), not a mapping, or not ``Config``'s fields.
    """
    from litgpt import Config

    try:
        return Config.from_file(path)
    except Exception as e:  # noqa: BLE001  (yaml's, litgpt's and Config's errors: any of them means a bad file)
        raise CheckpointFormatError(
            f"{path} is not a litgpt config ({type(e).__name__}: {' '.join(str(e).split())[:300]}). It must be a YAML "
            "mapping of litgpt Config's fields, as litgpt "
            "writes it (litgpt.utils.save_config); fix or remove it, or pass the config another way (--config NAME, "
            "or config=litgpt.Config.from_name(NAME)).") from e


def config_near(path: Path) -> Any | None:
    """The litgpt config of the checkpoint at ``path`` (a file: its directory's) by :func:`find_config`, or None
    when nothing there gives one."""
    directory = path if path.is_dir() else path.parent
    if not directory.is_dir():
        return None
    try:
        return find_config(directory)[0]
    except (ValueError, CheckpointFormatError):
        return None


def has_tokenizer(directory: Path) -> bool:
    """Whether ``directory`` holds a tokenizer litgpt reads (``tokenizer.json`` or ``tokenizer.model``)."""
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def _tokenizer(directory: Path) -> Any | None:
    if not has_tokenizer(directory):
        return None
    from litgpt.tokenizer import Tokenizer

    return Tokenizer(directory)
