"""``patch_litgpt()``: litgpt's generation setup sizes its caches to the request.

litgpt 0.5.13, read in its source, allocates more than a request needs in four places:

* ``GPT.set_kv_cache`` / ``CausalSelfAttention.build_kv_cache`` with no ``dtype``
  (``LLM.generate``, ``LLM.distribute``, the chat CLI, ``generate/sequentially``)
  build fp32 k/v caches, twice the bytes of a bf16 model's, converted to the
  activation dtype only in the first forward (``KVCache.forward``).
* ``LLM.generate`` sizes k/v and mask to prompt + max_new_tokens but leaves
  ``max_seq_length``, and with it the RoPE tables, at the whole context.
* ``LLM.load`` / ``LLM.distribute`` build the RoPE tables for the whole context
  (``GPT.__init__``) and keep them.
* A request past a fixed cache (``distribute(fixed_kv_cache_size=...)``) fails
  with ``IndexError: index out of range in self`` from the mask lookup.

And its single-device load (``LLM.load`` / ``LLM.distribute`` without
quantization) builds the model with random weights, then copies the checkpoint
over them; patched, it builds on meta and streams the checkpoint in with
:func:`~lightning_lowmem.load_checkpoint`, so the patched API peaks where
``lightning_lowmem.generate`` does.

:func:`patch_litgpt` replaces those methods with wrappers that go through
:func:`~lightning_lowmem.setup_kv_cache` (model dtype, model device, RoPE,
mask and k/v sized to the request, reuse when a request fits) and raise
:class:`~lightning_lowmem.errors.KVCacheTooShortError` with the lengths.
The patch is explicit, idempotent and reversible (:func:`unpatch_litgpt`,
or use the return value as a context manager).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch
from torch import nn

from lightning_lowmem.dtypes import model_dtype
from lightning_lowmem.engine import LoadOptions, load_checkpoint
from lightning_lowmem.errors import KVCacheLengthError, KVCachePositionError
from lightning_lowmem.litgpt.guard import release_all_rope
from lightning_lowmem.litgpt.checkpoint_dir import build_meta_gpt
from lightning_lowmem.litgpt.kv_cache import model_device, size_caches, unwrap_model
from lightning_lowmem.litgpt.rope import generation_rope_dtype_of
from lightning_lowmem.litgpt.requirement import import_litgpt

_ORIGINALS: dict[tuple[type, str], Any] = {}
_STREAM_OPTIONS: list[LoadOptions | None] = [None]  # patch_litgpt(options=...): what LLM's streamed load is given


class LitgptPatch:
    """Returned by :func:`patch_litgpt`; as a context manager, undoes the patch on exit if it applied it."""

    def __init__(self, applied: bool) -> None:
        self.applied = applied

    def undo(self) -> None:
        if self.applied:
            unpatch_litgpt()
            self.applied = False

    def __enter__(self) -> LitgptPatch:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.undo()


def patch_litgpt(options: LoadOptions | None = None) -> LitgptPatch:
    """Make every litgpt path that sets up generation size its caches to prompt + max_new_tokens.

    Patched: ``GPT.set_kv_cache``, ``CausalSelfAttention.build_kv_cache`` (and
    ``MultiheadLatentAttention.build_kv_cache``), ``LLM.generate``,
    ``LLM.distribute`` and ``LLM.load``. Calling it again does nothing but set ``options``.

    Args:
        options: the load options of ``LLM.load`` / ``LLM.distribute``'s streamed load, e.g.
            ``LoadOptions(max_memory={"cpu": "2GiB"}, disk_offload=True)`` to leave the layers that do not fit
            in ``lit_model.pth`` and read them for each forward (``LLM.generate`` runs under inference mode);
            default: the device Fabric chose, nothing else.

    Example::

        >>> from litgpt import GPT, Config
        >>> model = GPT(Config.from_name("pythia-14m")).to(torch.bfloat16)
        >>> with patch_litgpt():  # LLM.load / distribute / generate go through the same methods
        ...     model.set_kv_cache(batch_size=1, max_seq_length=114)
        >>> model.transformer.h[0].attn.kv_cache.k.dtype, model.cos.shape[0]  # litgpt alone: float32, 2048
        (torch.bfloat16, 114)
    """
    _STREAM_OPTIONS[:] = [options]
    if _ORIGINALS:
        return LitgptPatch(applied=False)
    litgpt_model = import_litgpt("litgpt.model", needed_by="lightning_lowmem.patch_litgpt()")
    LLM = import_litgpt("litgpt.api", needed_by="lightning_lowmem.patch_litgpt()").LLM

    targets = [(litgpt_model.GPT, "set_kv_cache", _set_kv_cache),
               (litgpt_model.CausalSelfAttention, "build_kv_cache", _build_kv_cache),
               (LLM, "generate", _llm_generate), (LLM, "distribute", _llm_distribute), (LLM, "load", _llm_load)]
    if hasattr(litgpt_model, "MultiheadLatentAttention"):
        targets.append((litgpt_model.MultiheadLatentAttention, "build_kv_cache", _build_kv_cache))
    for owner, name, make in targets:
        original = owner.__dict__[name]
        _ORIGINALS[(owner, name)] = original
        setattr(owner, name, make(original))
    return LitgptPatch(applied=True)


def unpatch_litgpt() -> None:
    """Put litgpt's own methods back. Hooks already added to model instances stay (they only raise clear errors)."""
    _STREAM_OPTIONS[:] = [None]
    while _ORIGINALS:
        (owner, name), original = _ORIGINALS.popitem()
        setattr(owner, name, original)


def is_litgpt_patched() -> bool:
    return bool(_ORIGINALS)


def _mark(wrapper: Any, original: Any) -> Any:
    wrapper.__lowmem_original__ = original
    return wrapper


def _set_kv_cache(original: Any) -> Any:
    @functools.wraps(original)
    def set_kv_cache(self: nn.Module, batch_size: int, max_seq_length: int | None = None,
                     rope_cache_length: int | None = None, device: torch.device | None = None,
                     dtype: torch.dtype | None = None) -> None:
        if rope_cache_length is not None and rope_cache_length != self.rope_cache_length():
            return original(self, batch_size, max_seq_length, rope_cache_length, device, dtype)
        # litgpt's set_kv_cache leaves the RoPE tables as litgpt made them; sized here, they keep that dtype
        # (fp32 after litgpt's max_seq_length setter, which `litgpt chat` calls first), so the numbers are litgpt's
        rope = getattr(self, "cos", None)
        rope_dtype = rope.dtype if isinstance(rope, torch.Tensor) and rope.is_floating_point() else None
        # as litgpt builds them: exactly this batch and length (smaller than before too), max_seq_length untouched
        size_caches(self, batch_size, max_seq_length or self.max_seq_length, device=device, dtype=dtype,
                    rope_dtype=generation_rope_dtype_of(self) or rope_dtype, reuse=False, keep_max_seq_length=True)
    return _mark(set_kv_cache, original)


def _build_kv_cache(original: Any) -> Any:
    @functools.wraps(original)
    def build_kv_cache(self: nn.Module, batch_size: int, max_seq_length: int, rope_cache_length: int | None = None,
                       device: torch.device | None = None, dtype: torch.dtype | None = None) -> nn.Module:
        if dtype is None:
            dtype = model_dtype(self)
        return original(self, batch_size, max_seq_length, rope_cache_length, device, dtype)
    return _mark(build_kv_cache, original)


def _llm_generate(original: Any) -> Any:
    @functools.wraps(original)
    def generate(self: Any, prompt: str, sys_prompt: str | None = None, max_new_tokens: int = 50,
                 *args: Any, **kwargs: Any) -> Any:
        if self.model is not None:
            with torch.inference_mode():
                needed = self._text_to_token_ids(prompt, sys_prompt).size(0) + max_new_tokens
            _prepare_llm_caches(self, needed)
        return original(self, prompt, sys_prompt, max_new_tokens, *args, **kwargs)
    return _mark(generate, original)


def _prepare_llm_caches(llm: Any, needed: int) -> None:
    """Size ``llm``'s caches to ``needed`` positions, or check that a fixed cache holds them; a request litgpt would
    refuse is refused with the type litgpt raises there."""
    model = unwrap_model(llm.model)
    written = needed - 1  # the last new token is never written to the cache
    if written > model.max_seq_length:  # litgpt's generate: NotImplementedError, before any forward
        raise KVCacheLengthError(
            f"max_seq_length {model.max_seq_length} needs to be >= {written}: this request needs {needed} positions "
            f"(prompt + max_new_tokens), the model takes {model.max_seq_length}. Ask for fewer new tokens or "
            "shorten the prompt.", needed=needed, available=model.max_seq_length)
    if llm.fixed_kv_cache_size or llm.generate_strategy is not None:
        capacity = model.mask_cache.size(-1) if getattr(model, "mask_cache", None) is not None else None
        if capacity is not None and written > capacity:  # litgpt: an IndexError from its mask lookup
            raise KVCachePositionError(
                f"This request needs {needed} KV-cache positions (prompt + max_new_tokens), but the cache is fixed "
                f"at {capacity} (fixed_kv_cache_size={llm.fixed_kv_cache_size!r}, generate_strategy="
                f"{llm.generate_strategy!r}). Ask for at most {capacity} positions in all, or call "
                f"llm.distribute(fixed_kv_cache_size={needed}) (or None to size it per request).",
                needed=needed, available=capacity,
            )
        return
    size_caches(model, 1, min(needed, model.max_seq_length), device=model_device(model), dtype=model_dtype(model),
                rope_dtype=generation_rope_dtype_of(model), keep_max_seq_length=True)
    llm.kv_cache_initialized = True
    # litgpt's generate reallocates when this is below the request; the caches now hold `needed` positions
    llm.prev_generated_seq_length = max(llm.prev_generated_seq_length, needed)


def _llm_distribute(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def distribute(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        stream = bound.arguments["generate_strategy"] is None and bound.arguments["quantize"] is None
        with _streamed_weights() if stream else contextlib.nullcontext():
            original(self, *args, **kwargs)
        if self.generate_strategy is None and not self.fixed_kv_cache_size:
            model = unwrap_model(self.model)
            release_all_rope(model, model_device(model))
    return _mark(distribute, original)


def _llm_load(original: Any) -> Any:
    function = original.__func__
    signature = inspect.signature(function)

    @functools.wraps(function)
    def load(cls: type, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(cls, *args, **kwargs)
        bound.apply_defaults()
        stream = bound.arguments["init"] == "pretrained" and bound.arguments["distribute"] == "auto"
        with _streamed_weights() if stream else contextlib.nullcontext():
            llm = function(cls, *args, **kwargs)
        if llm is not None and llm.model is not None:
            model = unwrap_model(llm.model)
            release_all_rope(model, model_device(model))
        return llm
    return classmethod(_mark(load, original))


@contextlib.contextmanager
def _streamed_weights() -> Iterator[None]:
    """Inside, ``litgpt.api`` builds ``GPT`` on meta and streams ``lit_model.pth`` into it.

    litgpt's single-device load builds the model with real (randomly initialised)
    weights and copies the checkpoint over them with ``load_state_dict``; this
    swaps the two names ``litgpt.api`` uses for that, ``GPT`` and
    ``load_checkpoint``, for :func:`~lightning_lowmem.load_checkpoint`'s path, so
    the patched API holds the weights once, as ``lightning_lowmem.generate`` does.
    The swap lasts for the one call; loading LLMs from several threads at once is not supported.
    """
    api = import_litgpt("litgpt.api", needed_by="lightning_lowmem.patch_litgpt()")

    saved = api.GPT, api.load_checkpoint
    api.GPT, api.load_checkpoint = _meta_gpt, _stream_checkpoint
    try:
        yield
    finally:
        api.GPT, api.load_checkpoint = saved


def _meta_gpt(config: Any) -> nn.Module:
    return build_meta_gpt(config)  # in the dtype Fabric's init_module set as default


def _stream_checkpoint(fabric: Any, model: nn.Module, checkpoint_path: Any, strict: bool = True) -> None:
    options = _STREAM_OPTIONS[0]
    if options is not None and options.max_memory is not None:  # the placement decides the devices
        load_checkpoint(model, checkpoint_path, options=options, strict=strict)
        return
    load_checkpoint(model, checkpoint_path, options=options, device=fabric.device, strict=strict)
