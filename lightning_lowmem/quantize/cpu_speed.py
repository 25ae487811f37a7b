"""How fast each scheme decodes on a CPU against bf16, as measured: the one line that says a scheme costs speed there.

On a GPU a quantized scheme reads fewer bytes a token and decodes about as fast as bf16 or faster. On a CPU the
kernels are another matter: bitsandbytes unpacks its 4-bit codes for every product, and the memory a scheme saves
can cost several times the time. :func:`cpu_speed_note` says so where the measurement says it, with the measured ratio
and the measured scheme that decodes fastest while still saving memory.

The ratios are decode tokens/s over bf16's, measured by ``benchmarks/generate_speed.py``: :data:`MEASURED` says where,
and ``docs/benchmarks.md`` ("Generation speed") has the table they come from. A scheme not measured gets no note.
"""

from __future__ import annotations

import torch

from lightning_lowmem.quantize.schemes import QuantScheme, parse_scheme

MEASURED = ("pythia-1b's config, 16 greedy tokens, a 2-core x86_64 CPU with AVX-512 bf16 and nothing else running, "
            "torch 2.13, bitsandbytes 0.50.2, torchao 0.18; docs/benchmarks.md")
"""Where :data:`CPU_DECODE` was measured: said in each note."""

CPU_DECODE: dict[tuple[str, bool], float] = {
    ("bnb.nf4", False): 2.80,  # rounds: 3.23, 2.75, 2.80
    ("bnb.int8", False): 1.62,  # rounds: 1.96, 1.62, 1.56
    ("torchao.int8wo", False): 0.23,  # rounds: 0.25, 0.23, 0.22
    ("bnb.nf4", True): 3.48,  # rounds: 3.48, 3.58, 2.83
    ("bnb.int8", True): 1.32,  # rounds: 0.71, 1.58, 1.32
    ("torchao.int8wo", True): 2.13,  # rounds: 2.13, 2.21, 1.82
}
"""``(scheme, compiled)`` -> decode tokens/s over bf16's (bf16 with the same ``compiled``), as measured: the median
of the same-round ratios of ``benchmarks/generate_speed.py``'s best decode steps (3 rounds), on a machine no other work
shares."""

SLOW = 0.5
"""A scheme decoding at under this fraction of bf16's speed is called out."""

SHAPE = (8192, 2048)
"""The weight shape bytes per weight are quoted for (pythia-1b's MLP)."""


def cpu_speed_note(scheme: str | QuantScheme | None, device: torch.device | str, *, compiled: bool = False
                   ) -> str | None:
    """One line saying that ``scheme`` decodes far slower than bf16 on ``device`` (a CPU), with the measured ratio and
    the measured scheme that is fastest among those that save memory; None where there is nothing to say.

    Example::

        >>> cpu_speed_note("bnb.nf4", "cuda") is None  # measured on a CPU only
        True
    """
    scheme = parse_scheme(scheme)
    if scheme is None or torch.device(device).type != "cpu":
        return None
    ratio = CPU_DECODE.get((scheme.name, compiled))
    if ratio is None or ratio >= SLOW:
        return None
    mode = "compiled" if compiled else "eager"
    line = (f"on a CPU, {scheme.name} ({_bytes_per_weight(scheme)}) decoded at {ratio:.2f}x bf16's tokens/s "
            f"({mode}; measured: {MEASURED})")
    faster = _fastest_saving(compiled, ratio)
    if faster is not None:
        name, speed = faster
        line += f"; {name} ({_bytes_per_weight(parse_scheme(name))}) decoded at {speed:.2f}x"
    return line + "."


def _fastest_saving(compiled: bool, than: float) -> tuple[str, float] | None:
    """The measured scheme decoding fastest (faster than ``than``), all of which hold less than bf16."""
    measured = [(name, r) for (name, c), r in CPU_DECODE.items() if c == compiled and r > than]
    return max(measured, key=lambda item: item[1], default=None)


def _bytes_per_weight(scheme: QuantScheme) -> str:
    return f"{scheme.stored_nbytes(SHAPE) / (SHAPE[0] * SHAPE[1]):.2f} bytes a weight against bf16's 2"
