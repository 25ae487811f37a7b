"""Quantize on load: each ``nn.Linear`` weight is quantized the moment it is read.

The loader calls :meth:`QuantizeSpec.parse` before any I/O, :func:`prepare_quantization`
after the plan and before reading weights, and :meth:`Quantizer.load` for every tensor read.
Schemes live in one file per library (``bnb.py``, ``torchao.py``) and register themselves
in :data:`SCHEMES` by name.

Example::

    >>> from lightning_lowmem import init_empty, load_checkpoint  # doctest: +SKIP
    >>> with init_empty():
    ...     model = GPT(Config.from_name("pythia-1b"))
    >>> report = load_checkpoint(model, "model.safetensors", dtype=torch.bfloat16, quantize="bnb.nf4")
    >>> report.quantized_bytes_after / report.quantized_bytes_before
    0.28...
"""

from lightning_lowmem.quantize import bnb, torchao  # noqa: F401  (register the schemes)
from lightning_lowmem.quantize.bnb import BnbFP4, BnbFP4DQ, BnbInt8, BnbNF4, BnbNF4DQ
from lightning_lowmem.quantize.nbytes import module_nbytes, tensor_nbytes
from lightning_lowmem.quantize.quantizer import Quantizer, QuantizeSpec, prepare_quantization
from lightning_lowmem.quantize.schemes import (
    SCHEMES,
    QuantScheme,
    check_available,
    make_scheme,
    register_scheme,
    schemes_available_on,
)
from lightning_lowmem.quantize.selection import DEFAULT_SKIP
from lightning_lowmem.quantize.torchao import TorchaoInt4WeightOnly, TorchaoInt8Dynamic, TorchaoInt8WeightOnly

__all__ = [
    "DEFAULT_SKIP",
    "SCHEMES",
    "BnbFP4",
    "BnbFP4DQ",
    "BnbInt8",
    "BnbNF4",
    "BnbNF4DQ",
    "QuantScheme",
    "QuantizeSpec",
    "Quantizer",
    "TorchaoInt4WeightOnly",
    "TorchaoInt8Dynamic",
    "TorchaoInt8WeightOnly",
    "check_available",
    "make_scheme",
    "module_nbytes",
    "prepare_quantization",
    "register_scheme",
    "schemes_available_on",
    "tensor_nbytes",
]
