"""``generate()``: load a checkpoint directory, size the caches to the request, run litgpt's generate loop.

The notebook entry point and ``examples/generate.py`` go through the same three steps::

    load_for_generation(checkpoint_dir)   # meta build -> stream weights (quantize on load), no cache yet
    setup_kv_cache(model, 1, prompt + max_new_tokens)
    litgpt.generate.base.generate(model, prompt, prompt + max_new_tokens, ...)

and report the memory of each: weights, KV cache, mask, RoPE, peak RSS.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lowmem.devices import cuda_or_none
from lightning_lowmem.engine import LoadOptions, LoadReport
from lightning_lowmem.request.defaults import execution_device, generation_dtype
from lightning_lowmem.litgpt.checkpoint_dir import LitgptCheckpoint, load_litgpt
from lightning_lowmem.litgpt.compiled import compile_blocker, compiled_decoding
from lightning_lowmem.litgpt.kv_cache import cache_bytes, check_length, model_device, setup_kv_cache, unwrap_model
from lightning_lowmem.litgpt.prompt_style import styled_prompt
from lightning_lowmem.litgpt.request import check_request
from lightning_lowmem.litgpt.requirement import import_litgpt
from lightning_lowmem.memory import MemoryMonitor, format_bytes
from lightning_lowmem.memory.heap import handing_back_heap
from lightning_lowmem.quantize import QuantScheme, module_nbytes
from lightning_lowmem.quantize.cpu_speed import cpu_speed_note
from lightning_lowmem.quantize.bnb import trim_bnb_after_first_forward
from lightning_lowmem.quiet import quietly

log = logging.getLogger(__name__)


@dataclass
class GenerationMemory:
    """Memory of one :func:`generate` call. Sizes in bytes.

    Attributes:
        weights: the loaded model's parameters and buffers (after quantization).
        kv_cache / mask / rope: the generation caches, as sized for the request.
        load_peak: peak RSS above the start of the call, during the load.
        peak: peak RSS above the start of the call, over load and generation.
        rss_start: RSS when the call started (the floor the peaks are measured from).
        device_peak: peak CUDA memory allocated, or None on CPU.
    """

    weights: int = 0
    kv_cache: int = 0
    mask: int = 0
    rope: int = 0
    load_peak: int = 0
    peak: int = 0
    rss_start: int = 0
    device_peak: int | None = None

    def __str__(self) -> str:
        lines = [f"weights {format_bytes(self.weights)}, KV cache {format_bytes(self.kv_cache)}, "
                 f"mask {format_bytes(self.mask)}, RoPE {format_bytes(self.rope)}",
                 f"peak RSS +{format_bytes(self.peak)} above {format_bytes(self.rss_start)} "
                 f"(load +{format_bytes(self.load_peak)})"]
        if self.device_peak is not None:
            lines.append(f"device peak {format_bytes(self.device_peak)}")
        return "\n".join(lines)


@dataclass
class GenerateResult:
    """What :func:`generate` returns.

    Attributes:
        tokens: one tensor per sample: the prompt followed by the new tokens.
        prompt_length: tokens in the prompt.
        texts: each sample's reply, its new tokens decoded (not the prompt), as litgpt's ``LLM.generate`` returns it,
            when a tokenizer was found; else None.
        seconds: wall time of each sample's generation.
        memory: weights, caches and peaks.
        load_report: what the load did, or None when a loaded model was passed.
    """

    tokens: list[torch.Tensor]
    prompt_length: int
    texts: list[str] | None = None
    seconds: list[float] = field(default_factory=list)
    memory: GenerationMemory = field(default_factory=GenerationMemory)
    load_report: LoadReport | None = None

    @property
    def new_tokens(self) -> list[torch.Tensor]:
        return [t[self.prompt_length:] for t in self.tokens]

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second, over all samples."""
        total = sum(t.numel() for t in self.new_tokens)
        return total / sum(self.seconds) if self.seconds and sum(self.seconds) > 0 else 0.0


def generation_options(options: LoadOptions | None, precision: str | None, face: Any = None, /, *,
                       device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                       **overrides: Any) -> LoadOptions:
    """The load options of a generation, built once: ``options`` with the keyword arguments put in (an unknown one a
    ``TypeError`` naming ``face``), the dtype :func:`~lightning_lowmem.request.defaults.generation_dtype` (``dtype``,
    else ``options.dtype``, else ``precision``, litgpt's ``--precision``, else bf16), and the device (``device``, else
    ``options.device``, else the CPU; with ``max_memory``, the placement's execution device instead)."""
    given = dtype if dtype is not None else options.dtype if options is not None else None
    options = LoadOptions.merge(options, face, **overrides, dtype=generation_dtype(given, precision))
    device = device if device is not None else options.device
    if options.budgets is not None:
        if device is not None and torch.device(device).type != execution_device(options).type:
            raise ValueError(f"device={str(device)!r} and max_memory (whose layers run on "
                             f"{options.budgets.execution_device!r}) disagree: pass one of them.")
        return options
    return LoadOptions.merge(options, device=device or "cpu")


def load_for_generation(
    checkpoint_dir: str | Path | LitgptCheckpoint,
    *,
    options: LoadOptions | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    quantize: str | QuantScheme | None = None,
    precision: str | None = None,
    config: Any | None = None,
    **load_options: Any,
) -> tuple[nn.Module, Any | None, LoadReport]:
    """:func:`generate`'s load step on its own: ``(model, tokenizer, report)``. ``checkpoint_dir`` is a path, or
    what :meth:`LitgptCheckpoint.find` found there. With layers left on disk, ``report.disk`` reads them for each
    forward while the model lives (``report.disk.close()`` ends that).

    ``options``, ``device``, ``dtype``, ``quantize``, ``precision`` and ``config`` are :func:`generate`'s; any other
    :class:`~lightning_lowmem.LoadOptions` field as a keyword (``max_memory=``, ``disk_offload=``, ...): see its
    attributes."""
    options = generation_options(options, precision, load_for_generation, device=device, dtype=dtype,
                                 quantize=quantize, **load_options)
    checkpoint = _found(checkpoint_dir, config, options)
    model, report = load_litgpt(checkpoint, options)
    return model, checkpoint.tokenizer, report


def _found(checkpoint: str | Path | LitgptCheckpoint, config: Any | None, options: LoadOptions) -> LitgptCheckpoint:
    if not isinstance(checkpoint, LitgptCheckpoint):
        return LitgptCheckpoint.find(checkpoint, config, options.prefer, verify=options.verify_weight_sets,
                                     entry=options.entry)
    return checkpoint if config is None else checkpoint.with_config(config)


def encode_prompt(prompt: str | list[int] | torch.Tensor, tokenizer: Any | None,
                  device: torch.device) -> torch.Tensor:
    """Token ids of ``prompt``: a tokenizer's encoding, or ids given as a list, a tensor or ``'1 2 3'``."""
    if isinstance(prompt, torch.Tensor):
        ids = prompt.flatten().to(dtype=torch.int64)
    elif isinstance(prompt, str) and tokenizer is not None:
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, str):
        try:
            ids = torch.tensor([int(tok) for tok in prompt.replace(",", " ").split()], dtype=torch.int64)
        except ValueError as e:
            raise ValueError(
                f"No tokenizer in the checkpoint directory, so the prompt must be token ids like '1 2 3'; "
                f"got {prompt[:80]!r}. Add tokenizer.json (or tokenizer.model) to the directory, or pass ids."
            ) from e
    else:
        ids = torch.tensor(list(prompt), dtype=torch.int64)
    if ids.numel() == 0:
        raise ValueError("The prompt is empty: give at least one token.")
    return ids.to(device)


@quietly  # third-party noise, and bitsandbytes' int8 cast message once instead of once per layer per token
def generate(
    checkpoint: str | Path | LitgptCheckpoint | nn.Module,
    prompt: str | list[int] | torch.Tensor,
    *,
    options: LoadOptions | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    quantize: str | QuantScheme | None = None,
    precision: str | None = None,
    max_new_tokens: int = 50,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float = 1.0,
    num_samples: int = 1,
    config: Any | None = None,
    tokenizer: Any | None = None,
    seed: int | None = 1234,
    compile: bool = False,
    sys_prompt: str | None = None,
    prompt_style: Any = "auto",
    on_load: Callable[[LoadReport], None] | None = None,
    on_sample: Callable[[int, torch.Tensor, float], None] | None = None,
    **load_options: Any,
) -> GenerateResult:
    """Load a checkpoint (or take a loaded litgpt model) and generate ``max_new_tokens`` after ``prompt``.

    Args:
        checkpoint: a litgpt checkpoint directory (``lit_model.pth`` + ``model_config.yaml``), an HF-format
            directory (``model.safetensors``; litgpt config from ``model_config.yaml``, the directory's
            name or its ``config.json``), a ``.gguf`` file or a directory holding one (config and tokenizer
            from the file), what :meth:`LitgptCheckpoint.find` found in one, or an already loaded litgpt ``GPT``.
        prompt: text (needs a tokenizer in the directory or the GGUF file), or token ids (list, tensor, or
            ``'1 2 3'``). Text is put in the checkpoint's prompt style first, as ``lightning-lowmem generate``
            and ``litgpt generate`` do (``prompt_style``). It is encoded, and prompt + ``max_new_tokens`` checked
            against the block size, before any weight is read.
        options: :class:`~lightning_lowmem.LoadOptions` for the load; the keywords below override its fields.
        device: where the model runs; default CPU (with ``max_memory``: its execution device).
        dtype: the dtype of the load; default: ``precision``'s, else bf16 (a device without bf16 computes in fp16).
        quantize: ``'bnb.nf4'`` etc., applied while loading (see :func:`~lightning_lowmem.load_checkpoint`).
        precision: ``'bf16-true'`` (default), ``'16-true'`` or ``'32-true'``: litgpt's spelling of ``dtype``.
        max_new_tokens / temperature / top_k / top_p: as litgpt's ``generate``; ``temperature=0`` is greedy.
        num_samples: samples generated one after another, reusing the caches.
        config: a litgpt config overriding the directory's: a litgpt model name (``"pythia-1b"``), a ``Config``,
            or the path of a ``model_config.yaml`` (``TypeError`` for anything else).
        tokenizer: a litgpt ``Tokenizer`` for a model passed in directly.
        seed: seeds torch before sampling (litgpt's CLI uses 1234); None leaves the RNG alone.
        compile: compile the decode step, as ``litgpt generate --compile`` does (``mode="reduce-overhead"`` on
            CUDA), for caches of any length: the first sample pays the compile, requests of other lengths reuse it,
            the tokens and the caches' bytes are those without compile. Layers offloaded or on disk decode
            without compile, with a warning (see ``lightning_lowmem/litgpt/compiled.py``).
        sys_prompt: the system prompt the prompt style puts in (``--sys_prompt``).
        prompt_style: ``"auto"``: the checkpoint's, as the command line finds it (its ``prompt_style.yaml``, a
            GGUF file's chat template, else litgpt's style for the config's name;
            :mod:`~lightning_lowmem.litgpt.prompt_style`); None: the text as given; a litgpt style's name
            (``"alpaca"``) or a ``litgpt.prompts.PromptStyle``. Token ids are never styled.
        on_load: called with the load report as soon as the load ends, before any token is generated (the command
            line prints it then); not called for a model passed in.
        on_sample: called after each sample with its index, its new tokens and its seconds, before the next one
            starts (the command line prints the reply then).
        load_options: any other :class:`~lightning_lowmem.LoadOptions` field as a keyword: see its attributes. With
            ``max_memory`` (budgets instead of ``device``) the placement reserves this request's KV caches (prompt +
            ``max_new_tokens``); with ``disk_offload`` too, the layers that fit no budget are read from the file for
            each token's forward, and the file is closed when the generation ends.

    Returns:
        A :class:`GenerateResult`: tokens, texts, timings and a memory summary.

    Example::

        >>> from litgpt import GPT, Config
        >>> model = GPT(Config.from_name("pythia-14m")).eval()
        >>> out = generate(model, [1, 2, 3], max_new_tokens=5, temperature=0.0)
        >>> out.new_tokens[0].shape, out.memory.kv_cache  # 2 x 6 layers x 4 heads x 8 positions x 32 x 4 bytes
        (torch.Size([5]), 49152)

        With a checkpoint directory: ``generate("checkpoints/EleutherAI/pythia-1b", "What do llamas eat?",
        max_new_tokens=50, quantize="bnb.nf4")``.
    """
    # imported before the monitor starts: its import is no model memory
    import_litgpt("litgpt.generate.base", needed_by="lightning_lowmem.generate()")
    sampling = check_request(max_new_tokens=max_new_tokens, num_samples=num_samples, temperature=temperature,
                             top_k=top_k, top_p=top_p, seed=seed, compile=compile, sys_prompt=sys_prompt,
                             prompt_style=prompt_style, tokenizer=tokenizer, precision=precision)

    options = generation_options(options, precision, generate, device=device, dtype=dtype, quantize=quantize,
                                 **load_options)
    if note := cpu_speed_note(options.quantize, execution_device(options, "cpu"), compiled=compile):
        log.warning(note)
    found = None if isinstance(checkpoint, nn.Module) else _found(checkpoint, config, options)
    tokenizer = tokenizer or getattr(found, "tokenizer", None)  # loaded before the monitor too
    if isinstance(prompt, str) and tokenizer is not None and prompt_style is not None:
        config = found.config if found is not None else getattr(unwrap_model(checkpoint), "config", None)
        prompt = styled_prompt(prompt, prompt_style, found, config, sys_prompt)
    ids = encode_prompt(prompt, tokenizer, torch.device("cpu"))  # a prompt that cannot be encoded fails before any read
    if found is not None:
        check_length(ids.numel() + max_new_tokens, found.config.block_size)
    if options.budgets is not None and options.context is None:  # the placement holds this request's caches
        options = LoadOptions.merge(options, context=ids.numel() + max_new_tokens)
    with MemoryMonitor(device=cuda_or_none(execution_device(options, "cpu"))) as monitor:
        report = None
        if found is None:
            model = unwrap_model(checkpoint)
        else:
            model, report = load_litgpt(found, options)
            if on_load is not None:
                on_load(report)
        with report.disk if report is not None and report.disk is not None else contextlib.nullcontext():
            device = execution_device(options, "cpu") if report is not None else model_device(model)
            result = GenerateResult(tokens=[], prompt_length=ids.numel(), load_report=report)
            decoding = compiled_decoding(device, blocked_by=compile_blocker(report, model)) if compile else None
            with decoding if decoding is not None else contextlib.nullcontext():
                _run_samples(model, ids.to(device), result, tokenizer, max_new_tokens, num_samples, seed, sampling,
                             on_sample)
    result.memory = _memory(model, monitor, report)
    return result


def _run_samples(model: nn.Module, ids: torch.Tensor, result: GenerateResult, tokenizer: Any | None,
                 max_new_tokens: int, num_samples: int, seed: int | None, sampling: dict[str, Any],
                 on_sample: Callable[[int, torch.Tensor, float], None] | None = None) -> None:
    litgpt_generate = import_litgpt("litgpt.generate.base", needed_by="lightning_lowmem.generate()").generate

    total = ids.numel() + max_new_tokens
    eos_id = getattr(tokenizer, "eos_id", None)
    if seed is not None:
        torch.manual_seed(seed)
    trim_bnb_after_first_forward(model)  # also for bitsandbytes layers quantized elsewhere
    with handing_back_heap(model):  # each step's freed transients (they grow with the positions) out of RSS
        _samples(model, ids, result, total, eos_id, num_samples, sampling, on_sample, litgpt_generate)
    if tokenizer is not None:
        result.texts = [tokenizer.decode(t) for t in result.new_tokens]


def _samples(model: nn.Module, ids: torch.Tensor, result: GenerateResult, total: int, eos_id: int | None,
             num_samples: int, sampling: dict[str, Any], on_sample: Callable[[int, torch.Tensor, float], None] | None,
             litgpt_generate: Callable[..., torch.Tensor]) -> None:
    """``num_samples`` runs of litgpt's generate loop, the caches set up for each (the first allocates)."""
    for _ in range(num_samples):
        setup_kv_cache(model, 1, total, device=ids.device)  # the first sample allocates, the others reuse (zeroed)
        t0 = time.perf_counter()
        tokens = litgpt_generate(model, ids, total, eos_id=eos_id, **sampling)
        result.seconds.append(time.perf_counter() - t0)
        result.tokens.append(tokens)
        if on_sample is not None:
            on_sample(len(result.tokens) - 1, tokens[ids.numel():], result.seconds[-1])


def _memory(model: nn.Module, monitor: MemoryMonitor, report: LoadReport | None) -> GenerationMemory:
    caches = cache_bytes(model)
    usage = monitor.usage
    weights = report.bytes_loaded if report is not None else module_nbytes(model)
    return GenerationMemory(weights=weights, kv_cache=caches.kv, mask=caches.mask, rope=caches.rope,
                            load_peak=report.memory.rss_peak - usage.rss_start if report is not None else 0,
                            peak=usage.rss_peak_delta, rss_start=usage.rss_start,
                            device_peak=usage.device_peak)

