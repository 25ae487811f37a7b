"""``compile=True``: litgpt's decode step compiled, as ``litgpt generate --compile`` compiles it, for caches of any
length.

litgpt 0.5.13 compiles its module-level ``next_token`` (``litgpt/generate/base.py``, ``--compile``:
``torch.compile(next_token, mode="reduce-overhead")`` with automatic dynamic shapes; ``litgpt/chat/base.py``: the
same with ``dynamic=True``, and its chat then holds the caches for the model's whole context). Its generate loop
calls ``next_token`` by its module-level name, so :func:`compiled_decoding` puts a :class:`DecodeStep` there for the
length of a generation (litgpt's own loop, its chat's too, runs unchanged) and puts back what was there after:

* **The decode step is compiled, the prefill is not.** A forward of one token after the prompt goes to
  ``next_token`` compiled; the prompt's forward, once a request and whatever its length (a 1-token prompt's too,
  told by its position), runs eagerly as litgpt runs it (it also gives bitsandbytes its first,
  repacking forward outside the compiled graph).
* **The cache read as eager reads it; on CUDA, one shape a request.** On a CPU the compiled step takes litgpt's
  ``input_pos_maxp1`` (attention over the filled positions only, as the eager loop), a symbolic int. On CUDA it reads
  the whole KV cache through the mask (``input_pos_maxp1=None``, as gpt-fast does): every step of a request has the
  same shapes, which a CUDA graph replays, where a slice growing a position a token would record a graph a token.
  Masked positions add exact zeros, but the attention then sums in another order: on pythia-410m's config (random
  weights, CPU) the whole cache parted from eager at the 8th token, where eager's two best logits were one bf16
  rounding apart; the filled positions alone did not.
* **Eager's rounding.** Inductor fuses bf16 operations and rounds once where eager rounds each result; greedy
  tokens then part where two logits are close (on CPU, tiny configs and pythia-14m's parted after 2-9 tokens).
  ``emulate_precision_casts`` (inductor's setting for this) rounds as eager does, and the tests check the greedy
  tokens equal the eager loop's.
* **No recompile across request lengths.** The caches stay sized to prompt + ``max_new_tokens``
  (:func:`~lightning_lowmem.setup_kv_cache`: the same bytes with and without compile), and one compiled graph serves
  every cache length: ``dynamic=True`` as litgpt's chat, with the caches' buffer shapes and the model's
  ``max_seq_length`` left symbolic (``force_parameter_static_shapes=False``, ``allow_unspec_int_on_nn_module=True``,
  set only while a generation runs). A prompt of another size, or a chat turn, reuses the graph.
* **The mode.** On CUDA ``mode="reduce-overhead"`` (CUDA graphs) with ``coordinate_descent_tuning``, as litgpt sets
  it; on a CPU the default mode (CUDA graphs do not apply there).
* **Where it does not apply**, one warning says why and the step runs eagerly: layers offloaded to the CPU or left
  on disk (hooks move their weights for each forward; found on the model itself, whoever loaded it), and
  torch.compile failing (no C++ compiler, an operator it
  cannot trace). A decode step that compiles into more than one graph (``bnb.int8``: bitsandbytes' int8 kernels
  return shapes that depend on the data) runs compiled, and one warning names the break.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_lowmem.litgpt.requirement import import_litgpt
from lightning_lowmem.runtime import streamers_in

_COMPILED: dict[tuple[Callable[..., torch.Tensor], str | None], Callable[..., torch.Tensor]] = {}


class DecodeStep:
    """What litgpt's loop calls as ``next_token`` under :func:`compiled_decoding`: one token's forward compiled, any
    other forward (the prefill) eager, and eager for good after a compile that failed."""

    def __init__(self, eager: Callable[..., torch.Tensor], device: torch.device) -> None:
        self.eager = eager
        self.mode = compile_mode(device)
        self.whole_cache = device.type == "cuda"  # one shape a request, for CUDA graphs
        self.failed: str | None = None

    def __call__(self, model: Any, input_pos: torch.Tensor, x: torch.Tensor, input_pos_maxp1: int | None = None,
                 **sample: Any) -> torch.Tensor:
        if self.failed is not None or _prefill(input_pos, x, input_pos_maxp1):
            return self.eager(model, input_pos, x, input_pos_maxp1=input_pos_maxp1, **sample)
        breaks = _graph_breaks()
        try:
            maxp1 = None if self.whole_cache else input_pos_maxp1
            token = _compiled(self.eager, self.mode)(model, input_pos, x, input_pos_maxp1=maxp1, **sample)
        except torch._dynamo.exc.TorchDynamoException as e:  # the step's cache writes are redone, with the same values
            self.failed = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            warnings.warn(f"compile=True: torch.compile failed on the decode step ({self.failed}); decoding "
                          "without compile.", stacklevel=2)
            return self.eager(model, input_pos, x, input_pos_maxp1=input_pos_maxp1, **sample)
        _warn_breaks(breaks)
        return token


def _prefill(input_pos: torch.Tensor, x: torch.Tensor, input_pos_maxp1: int | None) -> bool:
    """Whether litgpt's loop asks for the prompt's forward: more than one token, or one token at the first position
    (a 1-token prompt). litgpt passes ``input_pos_maxp1`` = the positions filled after this forward, the prompt's
    length for the prompt's forward; without it (litgpt leaves it out for Thunder modules) the position is read."""
    if x.size(-1) != 1:
        return True
    if input_pos_maxp1 is not None:
        return input_pos_maxp1 <= 1
    return int(input_pos.reshape(-1)[0]) == 0


@contextlib.contextmanager
def compiled_decoding(device: torch.device | str, *, blocked_by: str | None = None) -> Iterator[DecodeStep | None]:
    """While open, litgpt's generate loop (``litgpt.generate.base.generate_fn``, which litgpt's chat runs too)
    decodes with its ``next_token`` compiled for ``device``: see the module's docstring.

    Args:
        device: where the model runs: ``mode="reduce-overhead"`` on CUDA, the default mode elsewhere.
        blocked_by: why compile cannot apply to this model (:func:`compile_blocker`); then one warning, and the
            loop runs eagerly.

    Yields:
        The :class:`DecodeStep` in litgpt's loop, or None when ``blocked_by``.
    """
    if blocked_by is not None:
        warnings.warn(f"compile=True: not compiling, {blocked_by}; decoding without compile.", stacklevel=3)
        yield None
        return
    base = import_litgpt("litgpt.generate.base", needed_by="generate(compile=True)")
    before = base.next_token
    step = DecodeStep(getattr(before, "eager", before), torch.device(device))
    base.next_token = step
    try:
        with _settings(torch.device(device)):
            yield step
    finally:
        base.next_token = before


def compile_mode(device: torch.device) -> str | None:
    """litgpt's ``mode="reduce-overhead"`` (CUDA graphs) on CUDA; torch.compile's default mode elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else None


def compile_blocker(report: Any, model: nn.Module | None = None) -> str | None:
    """Why a model cannot have its decode step compiled (its layers' weights move for each forward), or None: from
    the :class:`~lightning_lowmem.LoadReport` it was loaded with, or, whoever loaded it, from the streamers on
    ``model`` (layers offloaded or on disk)."""
    if getattr(report, "disk", None) is not None:
        return "layers are read from the checkpoint file for each forward (disk_offload)"
    placement = getattr(report, "placement", None)
    if placement is not None and placement.offloaded:
        return f"{len(placement.offloaded)} layers are offloaded to the CPU and copied in for each forward"
    streamers = streamers_in(model) if model is not None else []
    return streamers[0].streaming if streamers else None


def _compiled(eager: Callable[..., torch.Tensor], mode: str | None) -> Callable[..., torch.Tensor]:
    """litgpt's ``next_token`` compiled once a process for ``mode`` (its graphs are cached by torch per model)."""
    if (eager, mode) not in _COMPILED:
        _COMPILED[eager, mode] = torch.compile(eager, mode=mode, dynamic=True)
    return _COMPILED[eager, mode]


def _settings(device: torch.device) -> contextlib.ExitStack:
    """The dynamo and inductor settings of a compiled generation, set while it runs."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._dynamo.config.patch(force_parameter_static_shapes=False,
                                                   allow_unspec_int_on_nn_module=True))
    stack.enter_context(torch._inductor.config.patch(emulate_precision_casts=True,
                                                     coordinate_descent_tuning=device.type == "cuda"))
    return stack


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _warn_breaks(before: int) -> None:
    """One warning when the call just made compiled the decode step into several graphs."""
    counted = torch._dynamo.utils.counters["graph_break"]
    if sum(counted.values()) > before:
        reason = " ".join(next(reversed(counted)).split())[:200]
        warnings.warn(f"compile=True: torch.compile split the decode step into several graphs ({reason}); it runs "
                      "compiled, with less gain.", stacklevel=3)
