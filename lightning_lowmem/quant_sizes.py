"""Bytes of a quantized ``nn.Linear`` weight, per scheme, from its shape alone.

For an ``(out_features, in_features)`` weight of ``n = out * in`` elements:

============================  =========================================================  ===========
scheme                        bytes                                                      ~ per param
============================  =========================================================  ===========
``bnb.nf4`` / ``bnb.fp4``     ``ceil(n/2)`` 4-bit codes + fp32 absmax per 64-block        0.5625
                              (``4 * ceil(n/64)``) + the 16-value fp32 code table (64)
``bnb.nf4-dq``/``bnb.fp4-dq`` ``ceil(n/2)`` + uint8 absmax per 64-block (``ceil(n/64)``)  0.5159
                              + fp32 absmax of those per 256 (``4 * ceil(ceil(n/64)/256)``)
                              + fp32 offset (4) + code tables (64 + 1024)
``bnb.int8``                  int8 ``n`` + fp32 scale per row (``4 * out``)                1 + 4/in
``torchao.int8wo``/``int8dq`` int8 ``n`` + fp32 scale + int8 zero point per row            1 + 5/in
                              (``5 * out``)
``torchao.int4wo``            ``ceil(n/2)`` + bf16 scale and zero per 128-group            0.53125
                              (``4 * ceil(n/128)``)
============================  =========================================================  ===========

Measured on CPU (bitsandbytes 0.50.2 ``quantize_4bit`` / ``int8_vectorwise_quant``,
torchao 0.18 ``Int8WeightOnlyConfig`` / ``Int8DynamicActivationInt8WeightConfig``):
every row but ``torchao.int4wo``, whose kernels need CUDA (formula from torchao's
``Int4WeightOnlyConfig(group_size=128)`` layout, not measured here).

``transient`` is what quantizing holds beyond its input and its result, in bytes per
element quantized at once, as the loader does it: one block of rows
(:mod:`lightning_lowmem.quantize.chunks`, 512 Ki elements) for bitsandbytes and torchao
int8, the whole weight for torchao int4. Measured on CPU in a fresh process, on a
512 Ki-element bf16 block after a first call: 14.3 bytes per element in ``quantize_4bit``
(nf4), 15.0 in ``int8_vectorwise_quant`` (its float16 copy included), 11-12 in torchao's
``quantize_`` (int8wo, int8dq); torchao int4 (7.0) is not measured here (no CPU kernel).

``library`` is what importing the quantization library and its first kernel
call add to the process (CPU, measured: bitsandbytes 46.6 MiB import + 11.4 MiB
first 4-bit call / 6.5 MiB first int8 call; torchao 11.8 + 13.6 MiB); nothing
when the library is already imported and used.

``first_forward`` is what the largest quantized layer holds, per weight, while it
runs for the first time: bitsandbytes 4-bit on a CPU with AVX512-bf16 repacks the
weight for its CPU kernel (an int32 unpacked copy and byte copies; 7 bytes per
weight measured on pythia-1b); elsewhere a dequantized bf16 copy (2) is assumed,
not measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_lowmem.errors import UnsupportedQuantizationError


@dataclass(frozen=True)
class SchemeSize:
    """How many bytes a scheme stores for a weight, and the transient while quantizing it."""

    name: str
    code_bits: int
    block: int = 0            # elements per block scale (0: none)
    block_scale_bytes: float = 0.0
    row_bytes: int = 0        # bytes per output row (per-row scales, zero points)
    double_quant: bool = False
    tables: int = 0           # bytes of per-weight lookup tables (bitsandbytes' code)
    transient: float = 0.0    # bytes per element quantized at once (a block, or the weight) held meanwhile
    library: int = 0          # import + first kernel call (CPU, measured)
    first_forward: float = 2.0  # bytes per weight the largest quantized Linear holds in its first forward
    chunked: bool = True      # the loader reads and quantizes blocks of rows (all but torchao int4: whole)

    def nbytes(self, out_features: int, in_features: int) -> int:
        """Bytes stored for an ``(out_features, in_features)`` weight."""
        n = out_features * in_features
        total = math.ceil(n * self.code_bits / 8) + self.row_bytes * out_features + self.tables
        if self.block:
            blocks = math.ceil(n / self.block)
            if self.double_quant:  # absmax as uint8, with fp32 absmax per 256 of them, an fp32 offset, its code
                total += blocks + 4 * math.ceil(blocks / 256) + 4 + 1024
            else:
                total += math.ceil(blocks * self.block_scale_bytes)
        return total


_MiB = 2**20
_BNB4 = {"code_bits": 4, "block": 64, "block_scale_bytes": 4.0, "tables": 64, "transient": 14.3,
         "library": 58 * _MiB, "first_forward": 7.0}
_TORCHAO = {"code_bits": 8, "row_bytes": 5, "transient": 12.0, "library": 25 * _MiB}
SCHEMES: dict[str, SchemeSize] = {
    "bnb.nf4": SchemeSize("bnb.nf4", **_BNB4),
    "bnb.fp4": SchemeSize("bnb.fp4", **_BNB4),
    "bnb.nf4-dq": SchemeSize("bnb.nf4-dq", **_BNB4, double_quant=True),
    "bnb.fp4-dq": SchemeSize("bnb.fp4-dq", **_BNB4, double_quant=True),
    "bnb.int8": SchemeSize("bnb.int8", code_bits=8, row_bytes=4, transient=15.0, library=53 * _MiB),
    "torchao.int8wo": SchemeSize("torchao.int8wo", **_TORCHAO),
    "torchao.int8dq": SchemeSize("torchao.int8dq", **_TORCHAO),
    "torchao.int4wo": SchemeSize("torchao.int4wo", **{**_TORCHAO, "code_bits": 4, "row_bytes": 0, "block": 128,
                                                      "block_scale_bytes": 4.0, "transient": 7.0, "chunked": False}),
}


def scheme_size(quantize: str) -> SchemeSize:
    """The :class:`SchemeSize` of a scheme in litgpt's / torchao's spelling."""
    try:
        return SCHEMES[quantize]
    except KeyError:
        raise UnsupportedQuantizationError(
            f"Unknown quantization scheme {quantize!r}; known: {', '.join(SCHEMES)}.") from None
