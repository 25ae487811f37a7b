"""``LoadOptions``: how to load a checkpoint, validated once and accepted by every face.

``load_checkpoint``, ``placement_plan``, ``estimate_memory``, ``generate``, ``load_for_generation``,
``LowMemStrategy``, ``LowMemFSDPStrategy`` and ``LowMemCallback`` all take ``options=LoadOptions(...)``, the
keywords users pass most (``dtype``, ``quantize``, and ``device`` where the face has one) and any other field by
name (``**load_options``); the keywords override the fields they name (``None`` leaves a field as it is). Each face
merges them once, :meth:`LoadOptions.merge`, which names the face in the error for a keyword it does not take.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_lowmem.devices import as_device
from lightning_lowmem.placement import Budgets, MaxMemory, parse_max_memory
from lightning_lowmem.plan import Combine, KeyMap
from lightning_lowmem.quantize import QuantScheme, parse_scheme, parse_skip
from lightning_lowmem.quantize.linear_like import LinearFilter, linear_filter


@dataclass(frozen=True)
class LoadOptions:
    """How to load a checkpoint. Validated when built; unknown schemes and bad values fail here, before any I/O.

    Attributes:
        device: where the tensors go; default: where each tensor already is, or CPU for meta.
        dtype: floating-point tensors are cast to it; default: each module tensor's dtype.
        quantize: a scheme, in litgpt's spelling (``"bnb.nf4"``, ``"bnb.nf4-dq"``, ``"bnb.fp4"``,
            ``"bnb.fp4-dq"``, ``"bnb.int8"``, ``"torchao.int8wo"``, ``"torchao.int8dq"``,
            ``"torchao.int4wo"``) or a scheme object (``BnbNF4(blocksize=128)``); stored as the object.
            Each chosen ``nn.Linear`` weight is quantized as it is read.
        skip_quantize: module-name globs left in full precision (one string is one pattern); default:
            the output head (``lm_head``) and anything tied to the input embedding. Stored as a tuple.
        treat_as_linear: modules of other classes than ``nn.Linear`` that ``quantize`` quantizes as linear layers: a
            class, a sequence of classes, or a function ``(module, name) -> bool`` (as torchao's ``filter_fn``); each
            must hold a 2-D ``weight`` ``(out, in)`` and an optional ``bias`` and compute ``F.linear(input, weight,
            bias)``, for it is replaced by the scheme's Linear. Without it, a module of a model's own class is
            quantized when its forward, traced on meta, is ``F.linear(input, weight, bias)`` alone; a linear-shaped
            one whose forward does more is left in full precision and named in ``LoadReport.left_out``. Stored as a
            tuple of classes, or the function.
        strict: raise on missing or unexpected keys (the default, None, means True; in Fabric, the
            ``strict`` argument of each load call). Tensors left on meta are an error either way.
        key_map: checkpoint-to-module renames: a dict of prefixes (``{"model.": ""}``) or a callable
            returning the module name (or None to skip the key). Without it, a single missing or extra
            top-level prefix is detected.
        transform: ``transform(module_name, tensor)`` on each tensor as read, before the cast and
            quantization; returns the tensor to load (same shape). The tensor passed in may live in a
            buffer reused for the next read: do not keep it.
        combine: module tensors built from several checkpoint keys (:class:`~lightning_lowmem.Combine`),
            e.g. an HF checkpoint's q, k and v projections into litgpt's ``qkv``.
        max_memory: device budgets, e.g. ``{"cuda:0": "6GiB", "cpu": "20GiB"}``, instead of ``device``:
            a placement plan decides each layer's device before any weight is read; layers on the CPU
            are streamed to the accelerator for their forward. Stored parsed (:class:`Budgets`).
        disk_offload: with ``max_memory``, leave the layers that fit no budget in the checkpoint file (its own
            safetensors, torch, GGUF or pre-quantized file: no copy is written) and read each of them for its own
            forward, the next one read while this one computes, into two reused host buffers the size of the
            largest of them (beside the budgets). Inference only; the file stays open, and watched, while the model
            lives (``LoadReport.disk``). Without it, a model the budgets cannot hold raises ``MemoryBudgetError``.
        context: tokens of KV cache (prompt + max_new_tokens) the placement plan reserves room for.
        batch_size: sequences per forward the placement plan reserves caches and activations for.
        progress: show a progress bar by bytes; default: when stderr is a terminal.
        mmap: when every tensor goes to the CPU as it is stored (no cast, no quantization, no transform,
            nothing combined), make the tensors views of the file's mapped pages instead of copies: the
            load reads nothing up front, pages are file-backed and read when first touched. The file must
            then not change while the model lives (a file cut short under a mapping crashes the process),
            and mapped torch-file tensors are not CRC-checked. Any other load copies, whatever this says.
        prefer: which weights to read from a directory holding several different weight sets: one of their
            file names (``"lit_model.pth"``, ``"model.safetensors.index.json"``) or a format (``"safetensors"``,
            ``"torch"``, ``"gguf"``). Sets whose names, shapes and dtypes agree are read in the documented order,
            with an :class:`~lightning_lowmem.UnverifiedWeightsWarning` (see ``docs/loading.md``).
        entry: the entry of a torch checkpoint that holds the weights (``"model_state_dict"``, ``"ema"``, ``""`` for
            the top level). Without it, the only entry holding tensors is read, else the one whose names fit the
            module; two that fit (a model and its EMA copy) are an ``AmbiguousCheckpointError`` naming them.
        verify_weight_sets: in a directory holding several weight sets whose names, shapes and dtypes agree, read
            every byte of each and compare them before the load (the cost: reading every set once more): the same
            -> the documented one is read, without a warning; different -> ``AmbiguousCheckpointError``. Without
            it, the sets are compared by headers and a sample of bytes only, and the load warns that it did not
            check the rest.

    Example::

        >>> options = LoadOptions(quantize="bnb.nf4", skip_quantize="lm_head")
        >>> options.quantize.name, options.skip_quantize
        ('bnb.nf4', ('lm_head',))
        >>> LoadOptions.merge(options, dtype=torch.bfloat16, quantize=None).quantize.name
        'bnb.nf4'
    """

    device: torch.device | str | None = None
    dtype: torch.dtype | None = None
    quantize: str | QuantScheme | None = None
    skip_quantize: str | Sequence[str] | None = None
    treat_as_linear: type | Sequence[type] | LinearFilter | None = None
    strict: bool | None = None
    key_map: KeyMap | None = None
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    combine: Combine | None = None
    max_memory: MaxMemory | Budgets | None = None
    disk_offload: bool = False
    context: int | None = None
    batch_size: int = 1
    progress: bool | None = None
    mmap: bool = False
    prefer: str | None = None
    entry: str | None = None
    verify_weight_sets: bool = False

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        if self.device is not None:
            set_("device", as_device(self.device))
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating-point torch.dtype such as torch.bfloat16, got {self.dtype!r}.")
        set_("quantize", parse_scheme(self.quantize))
        set_("skip_quantize", parse_skip(self.skip_quantize))
        linear_filter(self.treat_as_linear)  # a TypeError naming the option for anything else
        if isinstance(self.treat_as_linear, (type, Sequence)):
            set_("treat_as_linear", (self.treat_as_linear,) if isinstance(self.treat_as_linear, type)
                 else tuple(self.treat_as_linear))
        if self.max_memory is not None:
            if self.device is not None:
                raise ValueError(f"Pass device={str(self.device)!r} or max_memory=, not both: with max_memory the "
                                 "placement plan decides each layer's device.")
            set_("max_memory", parse_max_memory(self.max_memory))
        self._check_types()
        if self.disk_offload and self.max_memory is None:
            raise ValueError("disk_offload=True needs max_memory: the budgets decide which layers stay in memory and "
                             "which are read from the checkpoint file, e.g. max_memory={'cpu': '2GiB'}.")

    def _check_types(self) -> None:
        checks: list[tuple[str, Any, bool, str]] = [
            ("strict", self.strict, self.strict is None or isinstance(self.strict, bool), "True, False or None"),
            ("key_map", self.key_map, self.key_map is None or callable(self.key_map)
             or isinstance(self.key_map, Mapping), "a dict of prefixes or a callable"),
            ("transform", self.transform, self.transform is None or callable(self.transform), "a callable"),
            ("combine", self.combine, self.combine is None or isinstance(self.combine, Combine), "a Combine"),
            ("context", self.context, self.context is None or _is_int(self.context), "an int >= 1 or None"),
            ("batch_size", self.batch_size, _is_int(self.batch_size), "an int >= 1"),
            ("progress", self.progress, self.progress is None or isinstance(self.progress, bool), "a bool or None"),
            ("mmap", self.mmap, isinstance(self.mmap, bool), "True or False"),
            ("disk_offload", self.disk_offload, isinstance(self.disk_offload, bool), "True or False"),
            ("prefer", self.prefer, self.prefer is None or isinstance(self.prefer, str), "a file name, a format or None"),
            ("entry", self.entry, self.entry is None or isinstance(self.entry, str), "an entry's name or None"),
            ("verify_weight_sets", self.verify_weight_sets, isinstance(self.verify_weight_sets, bool), "True or False"),
        ]
        for name, value, ok, expected in checks:
            if not ok:
                raise TypeError(f"{name} must be {expected}, got {value!r}.")
        for name, value in (("context", self.context), ("batch_size", self.batch_size)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}.")

    @property
    def budgets(self) -> Budgets | None:
        """The parsed ``max_memory``."""
        return self.max_memory  # type: ignore[return-value]  (parsed in __post_init__)

    @property
    def linear_filter(self) -> LinearFilter | None:
        """``treat_as_linear`` as a function ``(module, name) -> bool``."""
        return linear_filter(self.treat_as_linear)

    @property
    def scheme(self) -> QuantScheme | None:
        """The parsed ``quantize``."""
        return self.quantize  # type: ignore[return-value]  (parsed in __post_init__)

    @classmethod
    def merge(cls, options: LoadOptions | None = None, face: Callable[..., Any] | None = None,
              **overrides: Any) -> LoadOptions:
        """``options`` (default: ``LoadOptions()``) with every keyword argument that is not None put in.

        Args:
            options: the options the keywords override.
            face: the function or class whose keyword arguments ``overrides`` are (``load_checkpoint``,
                ``LowMemStrategy``): an unknown keyword's error names it and its own keywords.
            overrides: fields of :class:`LoadOptions` by name.

        Raises:
            TypeError: a keyword that is not a field (the error names the face, a close match, the valid names).

        Example::

            >>> LoadOptions.merge(None, batch_size=2).batch_size
            2
            >>> LoadOptions.merge(None, quantise="bnb.nf4")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            TypeError: LoadOptions.merge() got an unknown keyword argument 'quantise' (did you mean 'quantize'?)....
        """
        base = options if options is not None else cls()
        if not isinstance(base, LoadOptions):
            raise TypeError(f"options must be a LoadOptions, got {type(base).__name__}.")
        unknown = sorted(set(overrides) - set(option_names()))
        if unknown:
            raise TypeError(unknown_keywords(unknown, face))
        changes = {name: value for name, value in overrides.items() if value is not None}
        return dataclasses.replace(base, **changes) if changes else base


def option_names() -> tuple[str, ...]:
    """The fields of :class:`LoadOptions`, in their order: the load options every face takes by name."""
    return tuple(f.name for f in dataclasses.fields(LoadOptions))


def own_keywords(face: Callable[..., Any]) -> tuple[str, ...]:
    """The keyword arguments ``face`` (a function, or a class: its constructor) takes that are not load options:
    its own (``init_added``, ``max_new_tokens``, Lightning's strategy arguments) and ``options``."""
    fields = set(option_names())
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(name for name, p in inspect.signature(face).parameters.items()
                 if p.kind in kinds and name not in fields)


def unknown_keywords(names: Sequence[str], face: Callable[..., Any] | None) -> str:
    """The message for keywords ``face`` does not take: each with its closest valid name, then the valid names."""
    fields = option_names()
    own = own_keywords(face) if face is not None else ()
    hints = []
    for name in names:
        close = difflib.get_close_matches(name, (*own, *fields), n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    who = f"{getattr(face, '__qualname__', face)}()" if face is not None else "LoadOptions.merge()"
    plural = "s" if len(names) > 1 else ""
    takes = f"its own arguments {', '.join(own)} and " if own else ""
    return (f"{who} got {'an ' if not plural else ''}unknown keyword argument{plural} {', '.join(hints)}. It takes "
            f"{takes}any LoadOptions field by name: {', '.join(fields)} (see LoadOptions' attributes for each).")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
