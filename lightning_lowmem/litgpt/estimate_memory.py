"""``estimate_memory``: what a load and a generation will need, from a litgpt config or a checkpoint's headers.

The estimate is the engine's prepared load, read without reading a weight: the same
plan, the same Linears quantized, the same placement as
:func:`~lightning_lowmem.load_checkpoint` would make (see
:mod:`lightning_lowmem.engine.memory_estimate` for what each line counts). The model is
litgpt's ``GPT`` built on meta from the config, so the caches come from litgpt's
own builders.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lowmem.arguments import check_int, check_real
from lightning_lowmem.engine import (
    CPU_RUNTIME,
    LoadOptions,
    MemoryEstimate,
    Source,
    estimate_prepared,
    prepare_load,
    records_source,
    resolved,
)
from lightning_lowmem.request.defaults import default_device, execution_device, generation_dtype
from lightning_lowmem.errors import CheckpointNotFoundError
from lightning_lowmem.formats import TensorRecord
from lightning_lowmem.litgpt.checkpoint_dir import LitgptCheckpoint, build_meta_gpt
from lightning_lowmem.litgpt.gguf import GGUF_IMPORT_BYTES
from lightning_lowmem.litgpt.requirement import import_litgpt
from lightning_lowmem.litgpt.rope import generation_rope_dtype
from lightning_lowmem.litgpt.tokenizer_size import directory_tokenizer_nbytes
from lightning_lowmem.formats.read_speed import measure_read_speed
from lightning_lowmem.memory import format_bytes
from lightning_lowmem.placement import PlacementPlan, build_meta_model
from lightning_lowmem.quantize import QuantScheme
from lightning_lowmem.quantize.cpu_speed import cpu_speed_note


def estimate_memory(
    source: str | Path | Any,
    *,
    options: LoadOptions | None = None,
    dtype: torch.dtype | None = None,
    quantize: str | QuantScheme | None = None,
    max_seq_length: int | None = None,
    prompt_length: int | None = None,
    config: Any | None = None,
    runtime: int = CPU_RUNTIME,
    read_bandwidth: float | None = None,
    **load_options: Any,
) -> MemoryEstimate:
    """Estimate the memory of loading ``source`` and generating from it, reading headers only.

    Args:
        source: a checkpoint (file or directory, as :func:`~lightning_lowmem.load_checkpoint` takes), a litgpt
            ``Config``, or a litgpt model name (``"pythia-1b"``; a string that is no existing path). For a
            checkpoint, the litgpt config is ``config``, else the directory's ``model_config.yaml``, its name or
            its HF ``config.json`` (a GGUF file's: built from its metadata; the tokenizer its vocabulary becomes is
            counted too); without one, Linear weights are guessed from key names and caches are not estimated.
        options: :class:`~lightning_lowmem.LoadOptions`; the keyword arguments override its fields.
        dtype: the weights' and caches' dtype (``generate``'s ``precision``); default bf16, as ``generate``'s.
        quantize: as :func:`~lightning_lowmem.load_checkpoint`.
        max_seq_length: positions to hold: prompt + max_new_tokens; default: what ``generate`` holds with its
            defaults, ``prompt_length`` (default 64) + 50 new tokens, within the block size (a note says so).
        prompt_length: tokens in the prompt (for the prefill activations); default ``max_seq_length`` (64 without
            it).
        config: the litgpt config of a checkpoint without ``model_config.yaml``: a litgpt model name
            (``"pythia-1b"``), a ``Config``, or the path of a ``model_config.yaml``.
        runtime: bytes the first forward costs beyond its tensors; default: measured on CPU.
        read_bandwidth: bytes per second the checkpoint file is read at; default: measured on the file
            (:func:`~lightning_lowmem.formats.read_speed.measure_read_speed`: O_DIRECT, the storage, not the page
            cache) when layers are on disk; a litgpt config or name has no file to measure.
        load_options: any other :class:`~lightning_lowmem.LoadOptions` field as a keyword: see its attributes.
            ``batch_size``: sequences generated at once (default 1). With ``max_memory`` (needs a litgpt config) the
            estimate carries the placement plan the load would make, and raises ``MemoryBudgetError`` as the load
            would; with ``disk_offload`` too, it says which layers stay in the file (``est.placement.on_disk``), the
            bytes each token reads (``est.disk_read``) and the seconds that takes (``est.seconds_per_token``).
            ``device``: where the generation would run (default: cuda when there is one), for the notes. Keys are
            never checked (``strict`` is False): the estimate reads no weight.

    Raises:
        CheckpointNotFoundError: ``source`` is a string that is neither an existing path nor a litgpt model name.
        TypeError: ``config`` is not a model name, a ``Config`` or a path; a length, ``runtime`` or
            ``read_bandwidth`` is not a number.
        ValueError: a length below 1, ``prompt_length`` above ``max_seq_length``, ``runtime`` below 0,
            ``read_bandwidth`` not above 0.

    Example::

        >>> from litgpt import Config
        >>> est = estimate_memory(Config.from_name("pythia-1b"), quantize="bnb.nf4", max_seq_length=114)
        >>> est.kv_cache / 2**20, round(est.weights / 2**30, 2)
        (14.25, 0.81)
        >>> estimate_memory("pythia-1b", quantize="bnb.nf4", max_seq_length=114).weights == est.weights
        True
    """
    _check_arguments(max_seq_length, prompt_length, runtime, read_bandwidth)
    import_litgpt(needed_by="lightning_lowmem.estimate_memory()")  # its model is litgpt's GPT
    options = LoadOptions.merge(options, estimate_memory, dtype=dtype, quantize=quantize, **load_options)
    options = dataclasses.replace(options, dtype=generation_dtype(options.dtype), strict=False)
    with contextlib.ExitStack() as stack:
        model, source, name, tokenizer = _model_and_source(source, config, options, stack)
        is_litgpt = _is_config(getattr(model, "config", None))
        length, prompt_length, defaults = _lengths(model.config if is_litgpt else None, max_seq_length, prompt_length)
        if is_litgpt and length > model.config.block_size:
            raise ValueError(f"max_seq_length={length} is past the model's block size ({model.config.block_size}); "
                             f"ask for prompt + max_new_tokens <= {model.config.block_size}.")
        if options.budgets is not None and not is_litgpt:
            raise ValueError("max_memory= needs a litgpt config to group layers into a placement: pass config=.")
        options = LoadOptions.merge(options, context=length or None)
        prepared = prepare_load(model, source, options, check_keys=False)
        note = _read_bandwidth(prepared.placement, source, read_bandwidth)
        reads_gguf = source.checkpoint is not None and source.checkpoint.gguf is not None
        held = prepared.selection.scheme if prepared.selection is not None else None  # on load, or as stored
    est = estimate_prepared(prepared, model=name, dtype=options.dtype, batch_size=options.batch_size,
                            max_seq_length=length, prompt_length=prompt_length, runtime=runtime,
                            with_caches=is_litgpt, rope_dtype=generation_rope_dtype(options.dtype, held),
                            with_transformers=(is_litgpt and reads_gguf) or None)
    est.tokenizer = tokenizer
    if defaults:
        est.notes.append(defaults)
    if is_litgpt and reads_gguf:
        est.imports = GGUF_IMPORT_BYTES
        est.notes.append("upper bound: the imports a GGUF load into litgpt's model does (transformers' model classes, "
                         f"{format_bytes(GGUF_IMPORT_BYTES)}; nothing where the process imported them already)")
    if not is_litgpt:
        built = f"the {name} its config.json describes (transformers), built on meta" if hasattr(model, "config") \
            else "Linear layers guessed from key names and shapes"
        est.notes.append(f"no litgpt config: KV cache, mask, RoPE and activations not estimated; {built}")
    if note:
        est.notes.append(note)
    if speed := cpu_speed_note(options.quantize, execution_device(options, default_device())):
        est.notes.append(speed)
    return est


def _check_arguments(max_seq_length: object, prompt_length: object, runtime: object,
                     read_bandwidth: object) -> None:
    """Raise on an argument of the estimate's own that no load would check (see ``lightning_lowmem.arguments``)."""
    check_int("max_seq_length", max_seq_length, optional=True)
    check_int("prompt_length", prompt_length, optional=True)
    check_int("runtime", runtime, 0)
    check_real("read_bandwidth", read_bandwidth, 0.0, above=True, optional=True)
    if max_seq_length is not None and prompt_length is not None and prompt_length > max_seq_length:
        raise ValueError(f"prompt_length={prompt_length} is above max_seq_length={max_seq_length}: the positions "
                         "held are the prompt's and the new tokens'; pass max_seq_length >= prompt_length.")


DEFAULT_PROMPT = 64
"""Tokens of the prompt the estimate sizes when no length is given (the benchmarks' prompts: docs/generation.md)."""
DEFAULT_NEW_TOKENS = 50
"""``generate``'s ``max_new_tokens`` default, and the command's."""


def _lengths(config: Any | None, max_seq_length: int | None, prompt_length: int | None) -> tuple[int, int, str]:
    """``(positions, prompt tokens, a note)``: those given; without ``max_seq_length``, what ``generate`` holds with its
    defaults, ``prompt_length`` (64 when not given) + 50 new tokens, within the block size, and a note saying so."""
    if max_seq_length is not None or config is None:
        length = max_seq_length or 0
        return length, prompt_length or length, ""
    block = config.block_size
    prompt = min(prompt_length or DEFAULT_PROMPT, max(1, block - DEFAULT_NEW_TOKENS))
    length = min(prompt + DEFAULT_NEW_TOKENS, block)
    given = "the prompt given" if prompt_length else f"a {prompt}-token prompt"
    return length, prompt, (f"no lengths given: sized for what generate holds with its defaults, {given} + "
                            f"{DEFAULT_NEW_TOKENS} new tokens ({length} positions; the model's context is {block}); "
                            "pass max_seq_length= and prompt_length= (--max_seq_length, --prompt_length) for a request")


def _read_bandwidth(placement: PlacementPlan | None, source: Source, given: float | None) -> str:
    """Put the read bandwidth on a placement with layers on disk: ``given``, else measured on the source's files;
    returns a note saying which (empty without layers on disk)."""
    if placement is None or not placement.on_disk:
        return ""
    if given is not None:
        placement.read_bandwidth = float(given)
        return f"layers on disk read at {format_bytes(given)}/s (given)"
    if not source.paths:
        return "no checkpoint file to measure its read speed: pass read_bandwidth= (bytes per second) for s/token"
    speed = measure_read_speed(source.paths)
    placement.read_bandwidth = speed.bytes_per_second
    return f"read speed of {source.description} measured: {speed}"


def _model_and_source(source: Any, config: Any | None, options: LoadOptions,
                      stack: contextlib.ExitStack) -> tuple[nn.Module, Source, str, int]:
    """The meta-built litgpt model (a stand-in module without a config), the resolved source to plan from (opened
    on ``stack``), a name for the estimate, and the bytes of the tokenizer ``generate`` builds (a GGUF file's
    vocabulary, a directory's ``tokenizer.json``; 0 without one). The weights and the config are found as ``generate`` finds them."""
    source = _named_config(source)
    if _is_config(source):
        model = build_meta_gpt(source)
        records = {n: TensorRecord(n, tuple(t.shape), options.dtype if t.is_floating_point() else t.dtype,
                                   Path("<config>"))
                   for n, t in model.state_dict(keep_vars=True).items()}  # as if saved in the dtype it loads in
        return model, records_source(records, options, f"the config {source.name!r}"), source.name, 0
    found = LitgptCheckpoint.find(source, config, options.prefer, require_config=False, tokenizer=False,
                                  verify=options.verify_weight_sets, entry=options.entry)
    model = build_meta_gpt(found.config) if found.config is not None else None
    resolved_source = stack.enter_context(resolved(found.chosen, model, options))
    tokenizer = 0
    if found.gguf is not None:  # generate() builds a tokenizer from the file's vocabulary: it stays resident
        from lightning_lowmem.litgpt.gguf_tokenizer import tokenizer_nbytes

        tokenizer = tokenizer_nbytes(resolved_source.checkpoint.gguf.layout.arrays, found.gguf.hf_config.model_type)
    elif model is not None:  # and the directory's tokenizer, as litgpt's Tokenizer holds it
        tokenizer = directory_tokenizer_nbytes(found.directory)
    if model is None:  # no litgpt model: the one its family's config describes (transformers'), else a stand-in
        return _other_model(found, resolved_source, str(source), options, stack) + (tokenizer,)
    return model, resolved_source, found.config.name, tokenizer


def _other_model(found: LitgptCheckpoint, source: Source, name: str, options: LoadOptions,
                 stack: contextlib.ExitStack) -> tuple[nn.Module, Source, str]:
    """The model of a checkpoint with no litgpt config: the one its family's config describes (a transformers
    ``config.json``: :func:`~lightning_lowmem.placement.build_meta_model`), the source resolved for it again (its
    conversion is that model's); else a stand-in of the checkpoint's own tensors."""
    built = build_meta_model(found.directory)
    if built is None:
        return stand_in_module(source.stored.logical_records(source.records)), source, name
    model, name = built
    return model, stack.enter_context(resolved(found.chosen, model, options)), name


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
    Config = import_litgpt(needed_by="estimate_memory(<litgpt model name>)").Config

    try:
        return Config.from_name(source)
    except ValueError as e:
        raise CheckpointNotFoundError(
            f"{source!r} is neither an existing checkpoint path nor a litgpt model name (litgpt.Config.from_name "
            "does not know it). Check the path, or pass a name such as 'pythia-1b' or 'Llama-3.2-1B'."
        ) from e


def _is_config(source: Any) -> bool:
    return not isinstance(source, (str, Path)) and hasattr(source, "n_layer") and hasattr(source, "block_size")
