"""``estimate_memory``: what a load and a generation will need, before anything is allocated.

From a checkpoint's headers (keys, shapes, dtypes; no weights read) or from a
litgpt ``Config``, for a quantization scheme, a batch size and a context
(prompt + max_new_tokens)::

    weights        non-quantized tensors: numel x itemsize of the target dtype;
                   quantized Linear weights: lightning_lowmem.quant_sizes formulas
    KV cache       sum over layers 2 x B x n_query_groups x L_layer x head_size x itemsize
                   (L_layer = min(L, sliding_window_size) on sliding-window layers)
    mask           L x L bool
    RoPE           cos + sin: 2 x L x rope_n_elem x itemsize
    activations    prefill of the prompt: B x T x (vocab + 4 x n_embd + qkv width
                   + MLP width) x itemsize + B x n_head x T x T x 4 (attention scores)
                   + B x T x vocab x 4 (Fabric's precision plugin returns fp32 logits)
    first forward  the largest quantized Linear's first forward: bitsandbytes 4-bit repacks
                   its weight for the CPU kernel (7 bytes per weight, measured); others
                   are assumed to hold a dequantized copy
    runtime        what the first forward costs beyond its tensors: 24 MiB measured on
                   CPU (torch 2.13: oneDNN/MKL state, allocator arenas kept after the
                   prefill), independent of the model size; ``runtime=`` overrides it
    library        importing the quantization library and its first kernel call
                   (:mod:`lightning_lowmem.quant_sizes`)
    load transient the largest extra bytes one tensor holds while it is streamed in:
                   the tensor as read when it is cast; for weights read, cast and
                   quantized a block of rows at a time (bitsandbytes, torchao int8) one
                   block as read, cast and quantized (``quant_sizes``: bytes per element,
                   measured) + the freed heap a trim leaves (at most ``TRIM_AT``); for
                   torchao int4, the cast weight + what quantizing it holds; a tensor combined from
                   parts (an HF checkpoint's q, k, v into litgpt's qkv) adds itself and
                   its parts; plus 6 MiB measured for the load itself
    peak           weights + library + max(load transient, caches + activations
                   + dequantized + runtime)

The KV, mask and RoPE sizes come from litgpt's own builders run on the meta
device, so they follow its rules (sliding windows, latent attention) exactly.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lowmem.checkpoint import Checkpoint
from lightning_lowmem.memory import format_bytes
from lightning_lowmem.placement import MaxMemory, PlacementPlan, placement_plan
from lightning_lowmem.plan import Combine, KeyMap, make_plan
from lightning_lowmem.quantize.chunks import CHUNK_ELEMENTS
from lightning_lowmem.quantize.quantizer import TRIM_AT
from lightning_lowmem.quantize.selection import DEFAULT_SKIP
from lightning_lowmem.quant_sizes import SchemeSize, scheme_size

LOAD_RUNTIME = 6 * 2**20  # measured: load_checkpoint beyond weights + one tensor (plan, Python objects, buffers)
CPU_RUNTIME = 24 * 2**20  # measured: generate() on 1- and 4-layer models and pythia-1b, beyond weights + caches


@dataclass
class MemoryEstimate:
    """Bytes a load and a generation need. Every size is in bytes; :meth:`__str__` is a table."""

    model: str
    quantize: str | None
    dtype: torch.dtype
    batch_size: int
    max_seq_length: int
    prompt_length: int
    params: int = 0
    quantized_params: int = 0
    weights: int = 0
    quantized_weights: int = 0
    kv_cache: int = 0
    mask: int = 0
    rope: int = 0
    activations: int = 0
    dequantized: int = 0
    runtime: int = 0
    library: int = 0
    load_transient: int = 0
    notes: list[str] = field(default_factory=list)
    placement: PlacementPlan | None = None

    @property
    def caches(self) -> int:
        return self.kv_cache + self.mask + self.rope

    @property
    def load_peak(self) -> int:
        return self.weights + self.library + self.load_transient

    @property
    def generate_peak(self) -> int:
        return self.weights + self.library + self.caches + self.activations + self.dequantized + self.runtime

    @property
    def peak(self) -> int:
        return max(self.load_peak, self.generate_peak)

    def rows(self) -> list[tuple[str, int]]:
        """``(label, bytes)`` for each line of the table."""
        quant = f", {self.quantized_params / 1e6:.1f}M params {self.quantize}" if self.quantize else ""
        return [(f"weights ({self.params / 1e6:.1f}M params{quant})", self.weights),
                (f"KV cache ({self.batch_size} x {self.max_seq_length} positions)", self.kv_cache),
                ("mask", self.mask), ("RoPE", self.rope),
                (f"activations (prefill of {self.prompt_length} tokens, approx.)", self.activations),
                ("first forward of the largest quantized Linear", self.dequantized),
                ("runtime (first forward: kernels, allocator)", self.runtime),
                (f"{self.quantize or 'quantization'} library (import, first kernel call)", self.library),
                ("load transient (largest tensor in flight + load)", self.load_transient),
                ("peak while loading", self.load_peak), ("peak while generating", self.generate_peak),
                ("peak", self.peak)]

    def __str__(self) -> str:
        head = f"Memory estimate: {self.model}, {self.quantize or 'not quantized'}, {str(self.dtype).split('.')[-1]}"
        rows = self.rows()
        width = max(len(label) for label, _ in rows)
        lines = [head] + [f"  {label:<{width}}  {format_bytes(n):>12}" for label, n in rows]
        placement = [str(self.placement)] if self.placement is not None else []
        return "\n".join(lines + [f"  note: {note}" for note in self.notes] + placement)


def estimate_memory(
    source: str | Path | Any,
    *,
    quantize: str | None = None,
    skip_quantize: list[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    batch_size: int = 1,
    max_seq_length: int | None = None,
    prompt_length: int | None = None,
    config: Any | None = None,
    key_map: KeyMap | None = None,
    runtime: int = CPU_RUNTIME,
    max_memory: MaxMemory | None = None,
) -> MemoryEstimate:
    """Estimate the memory of loading ``source`` and generating from it, reading headers only.

    Args:
        source: a checkpoint (file or directory, as :func:`~lightning_lowmem.load_checkpoint` takes) or a litgpt
            ``Config``. For a checkpoint, the litgpt config is ``config`` or the directory's ``model_config.yaml``;
            without one, Linear weights are guessed from key names and caches are not estimated.
        quantize / skip_quantize: as :func:`~lightning_lowmem.load_checkpoint`.
        dtype: the weights' and caches' dtype (``generate``'s ``precision``); default bf16.
        batch_size: sequences generated at once.
        max_seq_length: positions to hold: prompt + max_new_tokens; default: the model's block size.
        prompt_length: tokens in the prompt (for the prefill activations); default ``max_seq_length``.
        config: a litgpt ``Config`` for a checkpoint without ``model_config.yaml``.
        key_map: checkpoint-to-module renames, as for ``load_checkpoint``.
        runtime: bytes the first forward costs beyond its tensors; default: measured on CPU.
        max_memory: device budgets (``{"cuda:0": "6GiB", "cpu": "20GiB"}``): the estimate then carries
            the placement plan (:func:`~lightning_lowmem.placement_plan`): which layer goes where, bytes
            per device. Needs a litgpt config. Raises ``MemoryBudgetError`` as the load would.

    Example::

        >>> from litgpt import Config  # doctest: +SKIP
        >>> print(estimate_memory(Config.from_name("pythia-1b"), quantize="bnb.nf4", max_seq_length=114))
    """
    scheme = scheme_size(quantize) if quantize else None
    if _is_config(source):
        config, records = source, None
    else:
        config = config or _config_near(Path(source))
        with Checkpoint.open(source) as ckpt:
            records = dict(ckpt.records)
    model = _meta_model(config) if config is not None else None
    length = max_seq_length or (config.block_size if config is not None else 0)
    est = MemoryEstimate(model=getattr(config, "name", "") or str(source), quantize=quantize, dtype=dtype,
                         batch_size=batch_size, max_seq_length=length, prompt_length=prompt_length or length,
                         runtime=runtime)
    skip = tuple(skip_quantize) if skip_quantize is not None else DEFAULT_SKIP
    combine = None
    if model is not None and records is not None and key_map is None and _looks_hf(records):
        key_map, combine = _hf_conversion(model, records)
    entries = _entries(model, records, dtype, key_map, combine, est)
    for name, shape, read_dtype, is_linear, parts in entries:
        _add_weight(est, name, shape, read_dtype, is_linear and not _skipped(name, skip), scheme, parts)
    if model is None:
        est.notes.append("no litgpt config: KV cache, mask, RoPE and activations not estimated")
    else:
        _add_caches(est, model, config)
    est.load_transient += LOAD_RUNTIME
    est.library = scheme.library if scheme is not None and est.quantized_params else 0
    if max_memory is not None:
        if model is None:
            raise ValueError("estimate_memory(max_memory=...) needs a litgpt config to group layers: pass config=.")
        est.placement = placement_plan(model, records, max_memory, context=length, batch_size=batch_size,
                                       dtype=dtype, quantize=quantize, skip_quantize=skip_quantize,
                                       key_map=key_map, strict=False, combine=combine)
    return est


def _hf_conversion(model: nn.Module, records: dict) -> tuple[KeyMap, Combine]:
    """litgpt's conversion of an HF checkpoint, learned from its headers; ties ``model`` as the load does."""
    from lightning_lowmem.hf_litgpt import hf_to_litgpt

    conversion = hf_to_litgpt(model.config, records)
    conversion.tie(model)
    return conversion.key_map, conversion.combine


def _entries(model: nn.Module | None, records: dict | None, dtype: torch.dtype, key_map: KeyMap | None,
             combine: Combine | None, est: MemoryEstimate) -> list[tuple[str, tuple[int, ...], torch.dtype, bool, int]]:
    """``(module name, shape, dtype as read, is a Linear weight, bytes of the parts it is combined from)``
    for every tensor to load."""
    if records is None:
        return [(n, tuple(p.shape), dtype, _is_linear_weight(model, n), 0) for n, p in model.named_parameters()]
    if model is None:
        return [(k, r.shape, r.dtype, _looks_linear(k, r.shape), 0) for k, r in records.items()]
    plan = make_plan(model, records, key_map=key_map, strict=False, dtype=dtype, device=torch.device("meta"),
                     combine=combine)
    if plan.missing:
        est.notes.append(f"{len(plan.missing)} module tensors are not in the checkpoint")
    return [(t.names[0], t.record.shape, t.record.dtype, _is_linear_weight(model, t.names[0]),
             sum(p.nbytes for p in t.parts)) for t in plan.targets]


def _add_weight(est: MemoryEstimate, name: str, shape: tuple[int, ...], read_dtype: torch.dtype, quantized: bool,
                scheme: SchemeSize | None, parts: int = 0) -> None:
    numel = 1
    for d in shape:
        numel *= d
    target = est.dtype if read_dtype.is_floating_point else read_dtype
    cast = numel * target.itemsize
    read = numel * read_dtype.itemsize if read_dtype != target else 0  # the tensor as read, beside its cast copy
    est.params += numel
    if quantized and scheme is not None:
        stored = scheme.nbytes(shape[0], shape[1])
        est.quantized_params += numel
        est.quantized_weights += stored
        est.weights += stored
        est.dequantized = max(est.dequantized, int(scheme.first_forward * numel))
        if scheme.chunked:  # blocks of rows, each read, cast and quantized on its own (_row_source)
            block = min(numel, CHUNK_ELEMENTS)
            whole = read + cast + parts if parts else 0  # a tensor combined from parts is built whole first
            transient = whole + int(block * (read_dtype.itemsize + target.itemsize + scheme.transient)) + TRIM_AT
        else:
            transient = max(read + cast + parts, cast + int(scheme.transient * numel))
    else:
        est.weights += cast
        transient = read + parts  # the parts of a combined tensor are held while it is built
    est.load_transient = max(est.load_transient, transient)


def _add_caches(est: MemoryEstimate, model: nn.Module, config: Any) -> None:
    """KV, mask and RoPE from litgpt's own builders on meta; the prefill activations from the formula."""
    length, batch, itemsize = est.max_seq_length, est.batch_size, est.dtype.itemsize
    if length > config.block_size:
        raise ValueError(f"max_seq_length={length} is past the model's block size ({config.block_size}); "
                         f"ask for prompt + max_new_tokens <= {config.block_size}.")
    model.max_seq_length = length  # RoPE tables on meta, shaped as litgpt builds them
    est.rope = (model.cos.numel() + model.sin.numel()) * itemsize
    est.mask = length * length
    for block in model.transformer.h:
        cache = block.attn.build_kv_cache(batch, length, model.rope_cache_length(), torch.device("meta"), est.dtype)
        est.kv_cache += (cache.k.numel() + cache.v.numel()) * itemsize
    t = est.prompt_length
    qkv = (config.n_head + 2 * config.n_query_groups) * config.head_size
    mlp = getattr(config, "intermediate_size", 4 * config.n_embd) * (1 if config.mlp_class_name == "GptNeoxMLP" else 2)
    est.activations = (batch * t * (config.padded_vocab_size + 4 * config.n_embd + qkv + mlp) * itemsize
                       + batch * config.n_head * t * t * 4 + batch * t * config.padded_vocab_size * 4)


def _meta_model(config: Any) -> nn.Module:
    from lightning_lowmem.litgpt_load import build_meta_gpt

    return build_meta_gpt(config)


def _config_near(path: Path) -> Any | None:
    directory = path if path.is_dir() else path.parent
    if not (directory / "model_config.yaml").is_file():
        return None
    from litgpt import Config

    return Config.from_file(directory / "model_config.yaml")


def _is_config(source: Any) -> bool:
    return not isinstance(source, (str, Path)) and hasattr(source, "n_layer") and hasattr(source, "block_size")


def _is_linear_weight(model: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    return leaf == "weight" and isinstance(model.get_submodule(owner), nn.Linear)


def _looks_linear(key: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and key.endswith(".weight") and not any(
        s in key for s in ("embed", "wte", "wpe", "lm_head"))


def _looks_hf(records: dict) -> bool:
    """Not litgpt's names (``transformer.*``, ``lm_head.*``), or Falcon's HF names under ``transformer.``."""
    return not all(key.startswith(("transformer.", "lm_head.")) for key in records) or any(
        "query_key_value" in key for key in records)


def _skipped(name: str, patterns: tuple[str, ...]) -> bool:
    module = name.rpartition(".")[0]
    return any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(name, p) for p in patterns)
