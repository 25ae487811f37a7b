"""What a load and a generation will need, read off a prepared load before anything is allocated.

::

    weights        every target's bytes once loaded (``Target.final_nbytes``): the target dtype,
                   quantized exactly where the load quantizes (the scheme's own size)
    KV cache       the model architecture's caches for batch x max_seq_length positions
    mask, RoPE     (litgpt's own builders for litgpt's GPT; see ``placement.architectures``)
    activations    the architecture's activations for a prefill of the prompt
    first forward  the largest quantized Linear's first forward (``QuantScheme.first_forward``)
    runtime        what the first forward costs beyond its tensors: 28 MiB on CPU, the highest of 24-27 MiB
                   measured (torch 2.13: oneDNN/MKL state, allocator arenas kept after the prefill),
                   independent of the model size; ``runtime=`` overrides it
    library        importing the quantization library and its first kernel call
                   (``QuantScheme.library_bytes``); a load holds the import (``library_import_bytes``); beside
                   transformers' model classes (a model transformers built, a GGUF file read into litgpt's model),
                   less what their imports hold already (``library_import_in_transformers``: 8 MiB of bitsandbytes')
    imports        what else the load imports that a script has not imported already (a GGUF file read into
                   litgpt's model: transformers' model classes, measured); 0 where they are imported
    load transient the largest extra bytes one tensor holds while it is streamed in, asked of the route
                   the stream takes for it (``routes/choice.py``: the tensor as read when it is cast;
                   a block of rows as read, cast and quantized + the freed heap a trim leaves (up to
                   ``TRIM_AT``, 32 MiB: earlier weights' temporaries); a combined tensor's parts; one part of
                   a stacked one; a weight stored quantized, loaded as it is, nothing on CPU; a GGUF
                   tensor's dequantization workspace, and, kept unquantized and cast or rewritten, one
                   block of its rows as read (twice when the transform rewrites it), never the tensor
                   in float32) plus 6 MiB measured for the load itself
    staging        a load onto a device with a copy engine (CUDA): the ring of pinned host buffers its reads land
                   in (``staging.py``: one per reading thread + 2, each the largest piece read, 32 MiB at most,
                   whole pages). Host memory, held during the load only; beside the device's peak, not in it
    pinned         layers offloaded to the CPU: the blocks of host memory their masters are carved from (the
                   placement's ``pinned_bytes``: whole pages, each part 64-byte aligned, pinned for the accelerator);
                   what that takes beyond their weights is in both peaks
    tokenizer      a tokenizer the generation builds from the checkpoint itself (a GGUF file's
                   vocabulary), resident from before the load to the end; 0 otherwise
    disk           with layers left in the checkpoint file (``disk_offload``): their weights are not in memory;
                   two read buffers of the largest of them are, with the largest tensor a forward reads and
                   casts (its route's transient); each token reads them all (``disk_read``), which at
                   ``read_bandwidth`` takes ``seconds_per_token``
    peak           the larger of the two phases: loading, weights + library import + imports + tokenizer + load
                   transient + one read buffer; generating, weights + library + imports + tokenizer + caches +
                   activations + first forward + runtime + read buffers

Where a term depends on what cannot be known before the load (the freed heap a quantized load finds resident,
whether a library is imported already), the term is its upper bound, and the estimate's notes say which.
Measured against fresh processes on CPU, every scheme, bf16 and GGUF sources, litgpt and transformers models
(``benchmarks/estimate_accuracy.py``; ``tests/litgpt/test_estimate_memory.py``): never under the measured peak,
within 1.10 x measured once the terms taken at their upper bound are set aside (the table: ``docs/generation.md``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_lowmem.engine.prepare import PreparedLoad
from lightning_lowmem.routes.route import Route, Traits
from lightning_lowmem.routes.choice import route_of
from lightning_lowmem.routes.staging import ring_nbytes, stage_workers
from lightning_lowmem.engine.stream import path_device
from lightning_lowmem.routes.whole_reads import whole_reads
from lightning_lowmem.errors import format_names
from lightning_lowmem.memory import format_bytes
from lightning_lowmem.memory.heap import GENERATION_TRIM_AT
from lightning_lowmem.placement import PlacementPlan, architecture_of
from lightning_lowmem.quantize import QuantScheme
from lightning_lowmem.quantize.quantizer import TRIM_AT
from lightning_lowmem.transfer import block_nbytes
from lightning_lowmem.transfer.ring import SPARE_SLOTS

LOAD_RUNTIME = 8 * 2**20  # measured 6.0-6.5 MiB: a load beyond weights + one tensor (plan, Python objects, buffers)
CPU_RUNTIME = 28 * 2**20  # measured 24-27 MiB: generate() on 1- to 30-layer models and pythia-1b, beyond weights + caches


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
    library_import: int = 0
    imports: int = 0
    load_transient: int = 0
    tokenizer: int = 0
    heap: int = 0
    staging: int = 0
    pinned: int = 0
    disk_weights: int = 0
    disk_read: int = 0
    disk_buffers: int = 0
    read_bandwidth: float | None = None
    notes: list[str] = field(default_factory=list)
    placement: PlacementPlan | None = None
    source: str = ""

    @property
    def caches(self) -> int:
        return self.kv_cache + self.mask + self.rope

    @property
    def pinning(self) -> int:
        """What the offloaded layers' blocks of host memory take beyond their weights (alignment, whole pages)."""
        if not self.pinned or self.placement is None:
            return 0
        return self.pinned - sum(layer.nbytes for layer in self.placement.offloaded)

    @property
    def load_peak(self) -> int:
        return (self.weights + self.pinning + self.library_import + self.imports + self.tokenizer
                + self.load_transient + self.disk_buffers // 2)  # the first read ahead

    @property
    def generate_peak(self) -> int:
        return (self.weights + self.pinning + self.library + self.imports + self.tokenizer + self.caches
                + self.activations + self.dequantized + self.runtime + self.heap + self.disk_buffers)

    @property
    def seconds_per_token(self) -> float | None:
        """Seconds each token spends reading the layers on disk at ``read_bandwidth`` (0 without any; None when the
        bandwidth is not known). The next layer is read while this one computes: where reading is the slower,
        this is the time per token."""
        if not self.disk_read:
            return 0.0
        return self.disk_read / self.read_bandwidth if self.read_bandwidth else None

    @property
    def peak(self) -> int:
        return max(self.load_peak, self.generate_peak)

    def to_dict(self) -> dict[str, Any]:
        """Every number of the estimate, in bytes, with the totals and the placement plan (or None), for JSON.

        Example::

            >>> est = MemoryEstimate("m", None, torch.bfloat16, 1, 8, 8, weights=100, kv_cache=20, runtime=5)
            >>> d = est.to_dict()
            >>> d["dtype"], d["caches"], d["generate_peak"], d["peak"], d["placement"]
            ('bfloat16', 20, 125, 125, None)
        """
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "placement"}
        out |= {"dtype": str(self.dtype).removeprefix("torch."), "notes": list(self.notes), "caches": self.caches,
                "load_peak": self.load_peak, "generate_peak": self.generate_peak, "peak": self.peak,
                "seconds_per_token": self.seconds_per_token}
        out["placement"] = self.placement.to_dict() if self.placement is not None else None
        return out

    def rows(self) -> list[tuple[str, int]]:
        """``(label, bytes)`` for each line of the table."""
        quant = f", {self.quantized_params / 1e6:.1f}M params {self.quantize}" if self.quantize else ""
        return [(f"weights ({self.params / 1e6:.1f}M params{quant})", self.weights),
                (f"KV cache ({self.batch_size} x {self.max_seq_length} positions)", self.kv_cache),
                ("mask", self.mask), ("RoPE", self.rope),
                (f"activations (prefill of {self.prompt_length} tokens, or a step over {self.max_seq_length}, "
                 "approx.)", self.activations),
                ("first forward of the largest quantized Linear", self.dequantized),
                ("runtime (first forward: kernels, allocator)", self.runtime),
                *([("freed heap a generation keeps (at most)", self.heap)] if self.heap else []),
                (f"{self.quantize or 'quantization'} library (import, first kernel call)", self.library),
                *([("  of which the load holds (its import)", self.library_import)] if self.library else []),
                *([("imports of the load (transformers' model classes)", self.imports)] if self.imports else []),
                ("load transient (largest tensor in flight + load)", self.load_transient),
                *([("tokenizer (from the checkpoint's vocabulary)", self.tokenizer)] if self.tokenizer else []),
                *([("staging ring (pinned host memory, during the load)", self.staging)] if self.staging else []),
                *([("offloaded layers' host blocks (pinned; weights included)", self.pinned)] if self.pinned else []),
                *self._disk_rows(),
                ("peak while loading", self.load_peak), ("peak while generating", self.generate_peak),
                ("peak", self.peak)]

    def _disk_rows(self) -> list[tuple[str, int]]:
        if not self.disk_weights:
            return []
        return [("left in the checkpoint file (not in memory)", self.disk_weights),
                ("  read from it for each token", self.disk_read),
                ("  read buffers (2 x the largest layer on disk, + a cast)", self.disk_buffers)]

    def __str__(self) -> str:
        head = f"Memory estimate: {self.model}, {self.quantize or 'not quantized'}, {str(self.dtype).split('.')[-1]}"
        rows = self.rows()
        width = max(len(label) for label, _ in rows)
        lines = [head] + [f"  {label:<{width}}  {format_bytes(n):>12}" for label, n in rows]
        if self.disk_read:
            seconds = self.seconds_per_token
            lines.append("  reading the layers on disk: " + (
                f"~{seconds:.3g} s/token at {format_bytes(self.read_bandwidth)}/s" if seconds is not None
                else "pass read_bandwidth= for s/token"))
        placement = [str(self.placement)] if self.placement is not None else []
        return "\n".join(lines + [f"  note: {note}" for note in self.notes] + placement)


def estimate_prepared(prepared: PreparedLoad, *, model: str, dtype: torch.dtype, batch_size: int,
                      max_seq_length: int, prompt_length: int, runtime: int = CPU_RUNTIME,
                      with_caches: bool = True, rope_dtype: torch.dtype | None = None,
                      with_transformers: bool | None = None) -> MemoryEstimate:
    """The estimate of ``prepared``: weights and load transient from its plan, caches and activations from
    the module's architecture (``with_caches``), the placement it carries. ``with_transformers``: whether the process
    imports transformers' model classes before the scheme's library (None: when the module is a transformers
    model); their imports hold part of the library's (``QuantScheme.library_import_in_transformers``).
    """
    selection = prepared.selection  # with a pre-quantized checkpoint: the scheme the file holds
    scheme = selection.scheme if selection is not None else prepared.options.scheme
    requantized = {selection.chosen[name] for name in selection.requantized} if selection is not None else set()
    est = MemoryEstimate(model=model, quantize=scheme.name if scheme is not None else None, dtype=dtype,
                         batch_size=batch_size, max_seq_length=max_seq_length, prompt_length=prompt_length,
                         runtime=runtime, placement=prepared.placement, source=prepared.source.why)
    traits = Traits.of(prepared.plan, prepared.source.checkpoint, transform=prepared.transform,
                       requantized=frozenset(requantized), staged=path_device(prepared.plan))
    placement = prepared.placement
    routes = [route_of(target, traits) for target in prepared.plan.targets]
    for route in routes:
        _add_target(est, route, placement is not None and placement.is_on_disk(route.target.names[0]))
    staged = [spec for route in routes if route.staged for spec in route.specs]
    if staged:  # the ring the stream's device path allocates (``open_stager``), host memory beside the device's
        est.staging = (stage_workers() + SPARE_SLOTS) * block_nbytes(ring_nbytes(staged))
    est.pinned = placement.pinned_bytes if placement is not None else 0
    if est.disk_weights:
        execution = prepared.execution  # the streamer's numbers: each layer on disk read once per forward
        est.disk_read, est.disk_buffers = execution.read_nbytes, est.disk_buffers + execution.buffer_nbytes
        est.read_bandwidth = placement.read_bandwidth
    est.load_transient += LOAD_RUNTIME
    if scheme is not None and est.quantized_params:
        if with_transformers is None:
            with_transformers = type(prepared.module).__module__.startswith("transformers.")
        shared = scheme.library_import_in_transformers if with_transformers else 0
        est.library, est.library_import = scheme.library_bytes - shared, scheme.library_import_bytes - shared
        if note := _bounds_note(scheme.name, any(t.scheme is not None and t.stored is None
                                                 for t in prepared.plan.targets), est.library_import > 0):
            est.notes.append(note)
    read_whole = whole_reads(prepared.plan, traits)
    if read_whole:
        est.notes.append(f"{len(read_whole)} sharded tensors are read whole on this rank, which keeps its part: "
                         + format_names((f"{n} ({why})" for n, why in read_whole.items()), limit=3, quote=False))
    if prepared.plan.missing:
        est.notes.append(f"{len(prepared.plan.missing)} module tensors are not in the checkpoint")
    if with_caches:
        _add_generation(est, prepared, scheme, batch_size, max_seq_length, prompt_length, dtype, rope_dtype)
    return est


def _add_generation(est: MemoryEstimate, prepared: PreparedLoad, scheme: QuantScheme | None, batch_size: int,
                    max_seq_length: int, prompt_length: int, dtype: torch.dtype, rope_dtype: torch.dtype | None) -> None:
    """What a generation adds to the load: caches, activations, and the freed heap it may keep."""
    architecture = architecture_of(prepared.module)
    caches = architecture.cache_bytes(prepared.module, batch_size, max_seq_length, dtype, rope_dtype)
    est.kv_cache, est.mask, est.rope = caches.kv, caches.mask, caches.rope
    est.activations = architecture.activation_bytes(prepared.module, batch_size, prompt_length, dtype,
                                                    length=max_seq_length)
    # what a generation's freed transients may keep resident, at most, and what a forward of quantized layers
    # keeps until it ends
    forward_heap = scheme.forward_heap + int(est.dequantized * scheme.forward_heap_per_weight
                                             / scheme.first_forward) \
        if scheme is not None and est.quantized_params else 0
    est.heap = GENERATION_TRIM_AT + forward_heap
    est.notes.append(f"upper bound: the freed heap a generation keeps (up to {format_bytes(est.heap)}: more is "
                     "handed back after the forward that freed it"
                     + (f"; {format_bytes(forward_heap)} of it what {scheme.name}'s layers free inside one forward"
                        if forward_heap else "") + ")")


def _bounds_note(scheme: str, quantizes: bool, imports: bool = True) -> str:
    """What of a quantized load's estimate is an upper bound, not known before the load."""
    bounds = [f"the freed heap quantizing finds resident (up to {format_bytes(TRIM_AT)}, in the load transient)"] \
        if quantizes else []
    if imports:
        bounds.append(f"importing {scheme}'s library (nothing where the process imported it already)")
    return f"upper bound{'s' if len(bounds) > 1 else ''}: {' and '.join(bounds)}" if bounds else ""


def _add_target(est: MemoryEstimate, route: Route, on_disk: bool = False) -> None:
    """Count a target's bytes, and the transient of streaming it in along ``route`` (for a target left on disk: of
    reading it for a forward, beside the read buffers)."""
    target = route.target
    numel = target.record.numel
    est.params += numel
    if on_disk:
        est.disk_weights += target.final_nbytes
        est.disk_buffers = max(est.disk_buffers, route.transient)
    else:
        est.weights += target.final_nbytes
        est.load_transient = max(est.load_transient, route.transient)
    if target.scheme is not None:
        est.quantized_params += numel
        est.quantized_weights += target.final_nbytes
        est.dequantized = max(est.dequantized, int(target.scheme.first_forward * numel))
