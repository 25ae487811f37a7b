"""``estimate_memory``: what a load and a generation will need, from a litgpt config or a checkpoint's headers.

The estimate is the engine's prepared load, read without reading a weight: the same
plan, the same Linears quantized, the same placement as
:func:`~lightning_lowmem.load_checkpoint` would make (see
:mod:`lightning_lowmem.engine.memory_estimate` for what each line counts). The model is
litgpt's ``GPT`` built on meta from the config, so the caches come from litgpt's
own builders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lowmem.engine import (
    CPU_RUNTIME,
    LoadOptions,
    MemoryEstimate,
    estimate_prepared,
    prepare_load,
    stored_in,
)
from lightning_lowmem.errors import CheckpointNotFoundError
from lightning_lowmem.formats import Checkpoint, TensorRecord
from lightning_lowmem.litgpt.checkpoint_dir import build_meta_gpt, config_near, litgpt_weights
from lightning_lowmem.litgpt.config_check import check_config_fits
from lightning_lowmem.litgpt.gguf import gguf_to_litgpt, litgpt_config, read_gguf_source
from lightning_lowmem.litgpt.hf import hf_to_litgpt, looks_hf
from lightning_lowmem.placement import MaxMemory
from lightning_lowmem.plan import KeyMap
from lightning_lowmem.quantize import QuantScheme
from lightning_lowmem.quantize.stored import StoredWeights


def estimate_memory(
    source: str | Path | Any,
    *,
    options: LoadOptions | None = None,
    quantize: str | QuantScheme | None = None,
    skip_quantize: list[str] | str | None = None,
    dtype: torch.dtype | None = None,
    batch_size: int | None = None,
    max_seq_length: int | None = None,
    prompt_length: int | None = None,
    config: Any | None = None,
    key_map: KeyMap | None = None,
    runtime: int = CPU_RUNTIME,
    max_memory: MaxMemory | None = None,
) -> MemoryEstimate:
    """Estimate the memory of loading ``source`` and generating from it, reading headers only.

    Args:
        source: a checkpoint (file or directory, as :func:`~lightning_lowmem.load_checkpoint` takes), a litgpt
            ``Config``, or a litgpt model name (``"pythia-1b"``; a string that is no existing path). For a
            checkpoint, the litgpt config is ``config``, else the directory's ``model_config.yaml``, its name or
            its HF ``config.json`` (a GGUF file's: built from its metadata); without one, Linear weights are
            guessed from key names and caches are not estimated.
        options: :class:`~lightning_lowmem.LoadOptions`; the keyword arguments override its fields.
        quantize / skip_quantize / key_map / max_memory: as :func:`~lightning_lowmem.load_checkpoint`.
            With ``max_memory`` (needs a litgpt config) the estimate carries the placement plan the load
            would make, and raises ``MemoryBudgetError`` as the load would.
        dtype: the weights' and caches' dtype (``generate``'s ``precision``); default bf16.
        batch_size: sequences generated at once (default 1).
        max_seq_length: positions to hold: prompt + max_new_tokens; default: the model's block size.
        prompt_length: tokens in the prompt (for the prefill activations); default ``max_seq_length``.
        config: a litgpt ``Config`` for a checkpoint without ``model_config.yaml``.
        runtime: bytes the first forward costs beyond its tensors; default: measured on CPU.

    Raises:
        CheckpointNotFoundError: ``source`` is a string that is neither an existing path nor a litgpt model name.

    Example::

        >>> from litgpt import Config
        >>> est = estimate_memory(Config.from_name("pythia-1b"), quantize="bnb.nf4", max_seq_length=114)
        >>> est.kv_cache / 2**20, round(est.weights / 2**30, 2)
        (14.25, 0.81)
        >>> estimate_memory("pythia-1b", quantize="bnb.nf4", max_seq_length=114).weights == est.weights
        True
    """
    options = LoadOptions.merge(options, dtype=dtype, quantize=quantize, skip_quantize=skip_quantize, key_map=key_map,
                                max_memory=max_memory, batch_size=batch_size, strict=False)
    dtype = options.dtype or torch.bfloat16
    options = LoadOptions.merge(options, dtype=dtype)
    model, records, name, files, conversion, stored = _model_and_records(source, config, dtype, options)
    if model is None:
        model = stand_in_module(stored.logical_records(records))
    elif options.key_map is None and (conversion is not None or looks_hf(records)):
        conversion = conversion or hf_to_litgpt(model.config, stored.logical_records(records))
        conversion.tie(model)  # as the load does
        options = LoadOptions.merge(options, key_map=conversion.key_map, combine=conversion.combine,
                                    transform=getattr(conversion, "transform", None))
    length = max_seq_length or (model.config.block_size if hasattr(model, "config") else 0)
    is_litgpt = hasattr(model, "config")
    if is_litgpt and length > model.config.block_size:
        raise ValueError(f"max_seq_length={length} is past the model's block size ({model.config.block_size}); "
                         f"ask for prompt + max_new_tokens <= {model.config.block_size}.")
    if options.budgets is not None and not is_litgpt:
        raise ValueError("estimate_memory(max_memory=...) needs a litgpt config to group layers: pass config=.")
    options = LoadOptions.merge(options, context=length or None)
    prepared = prepare_load(model, records, options, files=files, check_keys=False, stored=stored)
    est = estimate_prepared(prepared, model=name, dtype=dtype, batch_size=options.batch_size, max_seq_length=length,
                            prompt_length=prompt_length or length, runtime=runtime, with_caches=is_litgpt)
    if not is_litgpt:
        est.notes.append("no litgpt config: KV cache, mask, RoPE and activations not estimated; "
                         "Linear layers guessed from key names and shapes")
    return est


def _model_and_records(source: Any, config: Any | None, dtype: torch.dtype, options: LoadOptions
                       ) -> tuple[nn.Module | None, dict[str, TensorRecord], str, str, Any | None, StoredWeights]:
    """The meta-built litgpt model (None without a config), the records to plan from, a name, the files, a GGUF
    file's conversion (None for other checkpoints) and the weights the checkpoint holds already quantized."""
    source = _named_config(source)
    if _is_config(source):
        model = build_meta_gpt(source)
        records = {n: TensorRecord(n, tuple(t.shape), dtype if t.is_floating_point() else t.dtype, Path("<config>"))
                   for n, t in model.state_dict(keep_vars=True).items()}  # as if saved in the dtype it loads in
        return model, records, source.name, f"the config {source.name!r}", None, StoredWeights()
    conversion = None
    weights = litgpt_weights(Path(source)) if isinstance(source, (str, Path)) else source  # what generate loads
    with Checkpoint.open(weights) as ckpt:
        records, files, stored = dict(ckpt.records), ckpt.description, stored_in(ckpt, options)
        if ckpt.gguf is not None:  # the config and the conversion from the file, as generate() makes them
            found = read_gguf_source(ckpt, tokenizer=False)
            config = config or litgpt_config(found.hf_config, found.names)
            conversion = gguf_to_litgpt(config, ckpt, found.hf_config)
    config = config or config_near(Path(source))
    if config is not None:
        check_config_fits(config, records, files)
    model = build_meta_gpt(config) if config is not None else None
    return model, records, getattr(config, "name", "") or str(source), files, conversion, stored


def stand_in_module(records: dict[str, TensorRecord]) -> nn.Module:
    """A meta module holding the checkpoint's tensors, for a checkpoint with no model to build.

    A 2-D ``<name>.weight`` whose name does not say embedding (``embed``, ``wte``, ``wpe``) becomes an
    ``nn.Linear`` (with ``<name>.bias`` when there is one); every other tensor is a parameter of a plain
    container. The load's own selection rule then decides what would be quantized.
    """
    root = nn.Module()
    linears = {key.rpartition(".")[0] for key, rec in records.items() if key.endswith(".weight")
               and len(rec.shape) == 2 and not any(s in key for s in ("embed", "wte", "wpe"))}
    for key, rec in records.items():
        path, _, leaf = key.rpartition(".")
        owner = _module_at(root, path, linears, records)
        if not (path in linears and leaf in ("weight", "bias")):
            owner.register_parameter(leaf, nn.Parameter(torch.empty(rec.shape, dtype=rec.dtype, device="meta"),
                                                        requires_grad=rec.dtype.is_floating_point))
    return root


def _module_at(root: nn.Module, path: str, linears: set[str], records: dict[str, TensorRecord]) -> nn.Module:
    """The module at ``path`` under ``root``, made (a Linear where ``linears`` says so) on the way."""
    module, prefix = root, ""
    for part in path.split(".") if path else []:
        prefix = f"{prefix}.{part}" if prefix else part
        if part not in module._modules:
            if prefix in linears:
                out_features, in_features = records[f"{prefix}.weight"].shape
                child: nn.Module = nn.Linear(in_features, out_features, bias=f"{prefix}.bias" in records,
                                             device="meta", dtype=records[f"{prefix}.weight"].dtype)
            else:
                child = nn.Module()
            module.add_module(part, child)
        module = module._modules[part]
    return module


def _named_config(source: Any) -> Any:
    """``source``, or the litgpt config it names when it is a string that is no existing path."""
    if not isinstance(source, str) or Path(source).expanduser().exists():
        return source
    from litgpt import Config

    try:
        return Config.from_name(source)
    except ValueError as e:
        raise CheckpointNotFoundError(
            f"{source!r} is neither an existing checkpoint path nor a litgpt model name (litgpt.Config.from_name "
            "does not know it). Check the path, or pass a name such as 'pythia-1b' or 'Llama-3.2-1B'."
        ) from e


def _is_config(source: Any) -> bool:
    return not isinstance(source, (str, Path)) and hasattr(source, "n_layer") and hasattr(source, "block_size")
