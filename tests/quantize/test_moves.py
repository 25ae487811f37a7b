"""A quantized weight moves whole: its parts are every tensor its module's forward reads, their sizes are the ones its
scheme declares, and the weight rebuilt around copies of them computes what it did, from the copies alone."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from torch import nn

from lightning_lowmem import init_empty, load_checkpoint
from lightning_lowmem.quantize import TorchaoNF4, scheme_of
from lightning_lowmem.quantize.moves import Plain, kind_of
from lightning_lowmem.quantize.nf4 import is_nf4

SCHEMES = ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.int8", "torchao.int8wo", "torchao.int8dq", "torchao.nf4"]


def quantized_linear(tmp_path, scheme: str) -> nn.Module:
    path = tmp_path / "linear.safetensors"
    torch.manual_seed(0)
    safetensors.torch.save_file({"0.weight": torch.randn(256, 512), "0.bias": torch.randn(256)}, path)
    with init_empty():
        model = nn.Sequential(nn.Linear(512, 256))
    load_checkpoint(model, path, dtype=torch.bfloat16, quantize=scheme, progress=False)
    return model[0]


def install(module: nn.Module, built: torch.Tensor) -> None:
    module._parameters["weight"] = built
    kind_of(built).attach(module, built)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_quantized_weight_rebuilt_around_copies_of_its_parts_computes_the_same_from_them(tmp_path, scheme):
    module = quantized_linear(tmp_path, scheme)
    weight = module.weight
    kind = kind_of(weight)
    assert not isinstance(kind, Plain)
    parts = kind.parts(weight, [module])
    scheme = TorchaoNF4() if is_nf4(weight) else scheme_of(module)  # NF4Linear is no saved layout's
    declared = scheme.stored_parts((256, 512))
    assert sorted(p.numel() * p.element_size() for p in parts.values()) == sorted(declared)

    x = torch.randn(3, 512, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = module(x)
    copies = {name: part.clone() for name, part in parts.items()}
    built = kind.build(module.weight, copies)
    install(module, built)
    with torch.no_grad():
        out = module(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    originals = {p.untyped_storage().data_ptr() for p in parts.values()}
    now = {p.untyped_storage().data_ptr() for p in kind.parts(module.weight, [module]).values()}
    assert not now & originals  # the module reads the copies: nothing of the first weight is left in it
    assert all(parts[name] is not copies[name] for name in parts)  # and the first weight kept its own parts

