"""Quantization schemes: each ``nn.Linear`` weight quantized the moment it is read.

``schemes`` holds the scheme configs' base class (sizes, which layers, kernels), the
:class:`Transform` base class (how a weight is quantized) and the registries tying them,
``layouts`` the stored-layout base class and its registry (how a library's quantized
modules are saved and read back), ``bnb`` and ``torchao`` each library's configs and
transforms (``nf4``: torchao's NF4 made by blocks of rows), ``bnb_layout`` and
``torchao_layout`` their weights as transformers saves them, ``selection`` the one rule
that picks the Linears (marking the load plan), ``stored`` checkpoints that hold weights
already quantized, ``rows`` quantizing a block of rows at a time, ``quantizer`` the
loader's side, ``nbytes`` what a quantized tensor really holds, ``moves`` (and ``bnb_moves``)
how a quantized weight moves whole: every tensor its forward reads, and the weight rebuilt
around copies of them.

Example::

    >>> import tempfile, torch, safetensors.torch
    >>> from lightning_lowmem import init_empty, load_checkpoint
    >>> path = tempfile.mkdtemp() + "/model.safetensors"
    >>> safetensors.torch.save_file({"0.weight": torch.randn(256, 256), "0.bias": torch.zeros(256)}, path)
    >>> with init_empty():
    ...     model = torch.nn.Sequential(torch.nn.Linear(256, 256))
    >>> report = load_checkpoint(model, path, dtype=torch.bfloat16, quantize="bnb.nf4", progress=False)
    >>> report.quantized, round(report.quantized_bytes_after / report.quantized_bytes_before, 2)
    ({'0': 'bnb.nf4'}, 0.28)
"""

from lightning_lowmem.quantize import bnb, bnb_layout, bnb_moves, torchao, torchao_layout  # noqa: F401  (register them)
from lightning_lowmem.quantize.bnb import BnbFP4, BnbFP4DQ, BnbInt8, BnbNF4, BnbNF4DQ
from lightning_lowmem.quantize.layouts import LAYOUTS, StoredLayout, StoredWeight, layout_of, register_layout, scheme_of
from lightning_lowmem.quantize.nbytes import module_nbytes, tensor_nbytes
from lightning_lowmem.quantize.quantizer import Quantizer, prepare_quantization
from lightning_lowmem.quantize.schemes import (
    SCHEMES,
    TRANSFORMS,
    QuantScheme,
    Transform,
    check_available,
    check_shardable,
    make_scheme,
    parse_scheme,
    register_scheme,
    register_transform,
    schemes_available_on,
)
from lightning_lowmem.quantize.selection import DEFAULT_SKIP, Selection, parse_skip, select_linears
from lightning_lowmem.quantize.stored import StoredWeights, find_stored, mark_stored
from lightning_lowmem.quantize.torchao import (
    TorchaoInt4WeightOnly,
    TorchaoInt8Dynamic,
    TorchaoInt8WeightOnly,
    TorchaoNF4,
)

__all__ = [
    "DEFAULT_SKIP",
    "LAYOUTS",
    "SCHEMES",
    "TRANSFORMS",
    "BnbFP4",
    "BnbFP4DQ",
    "BnbInt8",
    "BnbNF4",
    "BnbNF4DQ",
    "QuantScheme",
    "Quantizer",
    "Selection",
    "StoredLayout",
    "StoredWeight",
    "StoredWeights",
    "TorchaoInt4WeightOnly",
    "TorchaoInt8Dynamic",
    "TorchaoInt8WeightOnly",
    "TorchaoNF4",
    "Transform",
    "check_available",
    "check_shardable",
    "find_stored",
    "layout_of",
    "make_scheme",
    "mark_stored",
    "module_nbytes",
    "parse_scheme",
    "parse_skip",
    "prepare_quantization",
    "register_layout",
    "register_scheme",
    "register_transform",
    "select_linears",
    "scheme_of",
    "schemes_available_on",
    "tensor_nbytes",
]
