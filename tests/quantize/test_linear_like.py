"""A model's own Linear class (gemma_pytorch's: a 2-D weight and F.linear on it) is quantized as nn.Linear is, or
named with why not and the option that includes it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_lowmem import init_empty, load_checkpoint
from lightning_lowmem.quantize.linear_like import forward_reason, linear_filter, linear_shape


class Linear(nn.Module):
    """gemma_pytorch's Linear: no bias, ``F.linear`` on its weight, scaled first when ``quant``."""

    def __init__(self, in_features: int, out_features: int, quant: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty((out_features, in_features)), requires_grad=False)
        self.quant = quant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.quant:
            weight = weight * 2.0
        return F.linear(x, weight)


class BiasedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MatmulLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class Embedding(nn.Module):
    """gemma_pytorch's Embedding: linear-shaped, but a lookup."""

    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty((num, dim)), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.embedding(x, self.weight)


class Net(nn.Module):
    def __init__(self, linear: type = Linear, quant: bool = False) -> None:
        super().__init__()
        self.embedder = Embedding(128, 64)
        self.up = linear(64, 256) if linear is not Linear else Linear(64, 256, quant)
        self.down = Linear(256, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.embedder(tokens))))


class Twin(nn.Module):
    """The same model written with nn.Linear, the reference each scheme quantizes as it always did."""

    def __init__(self) -> None:
        super().__init__()
        self.embedder = Embedding(128, 64)
        self.up = nn.Linear(64, 256, bias=False)
        self.down = nn.Linear(256, 64, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.embedder(tokens))))


SCHEMES = ["bnb.nf4", "bnb.int8", "torchao.int8wo"]
TOKENS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """gemma_pytorch's own file layout: ``torch.save({"model_state_dict": ...})``."""
    torch.manual_seed(0)
    model = Net()
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("gemma") / "model.ckpt"
    torch.save({"model_state_dict": model.state_dict()}, path)
    return path


def load(model_cls, path, **options):
    with init_empty():
        model = model_cls()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = load_checkpoint(model, path, dtype=torch.bfloat16, progress=False, **options)
    return model, report, [str(w.message) for w in caught if "linear" in str(w.message)]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_linear_of_its_own_class_is_quantized_as_nn_linear_is(saved, scheme):
    model, report, said = load(Net, saved, quantize=scheme)
    twin, twin_report, _ = load(Twin, saved, quantize=scheme)
    assert sorted(report.quantized) == ["down", "up"] and report.left_out == {} and said == []
    assert report.quantized_bytes_after == twin_report.quantized_bytes_after
    with torch.no_grad():
        assert torch.equal(model(TOKENS), twin(TOKENS))  # the same kernels on the same quantized bytes


def test_a_linear_that_scales_its_weight_is_named_with_what_it_computes_and_how_to_include_it(saved):
    model, report, said = load(lambda: Net(quant=True), saved, quantize="bnb.nf4")
    assert sorted(report.quantized) == ["down"]
    assert report.left_out == {"up": "Linear is no nn.Linear and its forward computes mul, linear, not F.linear(input, "
                                     "weight, bias) alone; if it is a linear layer, pass treat_as_linear="
                                     f"{__name__}.Linear"}
    assert said == [f"quantize='bnb.nf4' leaves 1 linear-shaped modules in full precision: up ({report.left_out['up']})."]
    assert "kept in full precision: up (Linear is no nn.Linear" in str(report)
    assert model.up.weight.dtype == torch.bfloat16 and type(model.up) is Linear  # left as it is: its own forward


@pytest.mark.parametrize("given", [Linear, [Linear], (Linear,), lambda module, name: name == "up"])
def test_treat_as_linear_includes_it_as_a_class_classes_or_a_filter(saved, given):
    _, report, said = load(lambda: Net(quant=True), saved, quantize="bnb.nf4", treat_as_linear=given)
    assert "up" in report.quantized and "up" not in report.left_out and said == []


def test_a_matmul_forward_is_named_and_an_embedding_is_not(saved):
    model, report, _ = load(lambda: Net(MatmulLinear), saved, quantize="bnb.int8")
    assert "up" in report.left_out and "matmul" in report.left_out["up"] and "__matmul__" not in report.quantized
    assert "embedder" not in report.left_out and "embedder" not in report.quantized


def test_a_biased_linear_of_its_own_keeps_its_bias(tmp_path):
    torch.manual_seed(0)
    source = nn.Sequential(BiasedLinear(16, 32), nn.ReLU(), BiasedLinear(32, 16))
    for p in source.parameters():
        p.data.normal_(0, 0.3)
    torch.save(source.state_dict(), tmp_path / "b.pt")
    with init_empty():
        model = nn.Sequential(BiasedLinear(16, 32), nn.ReLU(), BiasedLinear(32, 16))
    report = load_checkpoint(model, tmp_path / "b.pt", quantize="bnb.int8", progress=False)
    assert sorted(report.quantized) == ["0", "2"]
    assert torch.equal(model[0].bias, source[0].bias)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(model(x), source(x), atol=0.1, rtol=0.05)


def test_the_forward_is_traced_on_meta_without_memory():
    with init_empty():
        layer = Linear(2**16, 2**16)  # 16 GiB in float32
    assert forward_reason(layer) is None and layer.weight.is_meta


def test_what_is_linear_shaped():
    assert linear_shape(Linear(3, 2)) == (3, 2, False) and linear_shape(BiasedLinear(3, 2)) == (3, 2, True)
    assert linear_shape(nn.Embedding(3, 2)) is None and linear_shape(nn.Linear(3, 2)) is None  # torch's own classes
    assert linear_shape(nn.Sequential(Linear(3, 2))) is None
    with pytest.raises(TypeError, match="treat_as_linear must be a module class"):
        linear_filter(["Linear"])


class Int8Linear(nn.Module):
    """gemma_pytorch's Linear with ``quant=True``: an int8 weight and a ``weight_scaler``, already quantized."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty((out_features, in_features), dtype=torch.int8), requires_grad=False)
        self.weight_scaler = nn.Parameter(torch.empty(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.weight_scaler.unsqueeze(-1))


def test_a_linear_quantized_by_its_own_scheme_is_named_and_kept(tmp_path):
    source = nn.Sequential(Int8Linear(16, 32), Int8Linear(32, 16))
    for layer in source:
        layer.weight.data = torch.randint(-127, 127, layer.weight.shape, dtype=torch.int8)
        layer.weight_scaler.data = torch.rand(layer.weight.shape[0]) / 100
    torch.save({"model_state_dict": source.state_dict()}, tmp_path / "int8.ckpt")
    with init_empty():
        model = nn.Sequential(Int8Linear(16, 32), Int8Linear(32, 16))
    with pytest.warns(UserWarning, match="quantizes nothing"):
        report = load_checkpoint(model, tmp_path / "int8.ckpt", quantize="bnb.int8", progress=False)
    assert report.quantized == {}
    assert report.left_out == {name: "Int8Linear holds a torch.int8 weight and 'weight_scaler' beside its weight: no "
                                     "plain linear layer, kept as it is" for name in ("0", "1")}
    assert torch.equal(model[0].weight, source[0].weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        declared = load_checkpoint(_meta_int8(), tmp_path / "int8.ckpt", quantize="bnb.int8", progress=False,
                                   treat_as_linear=Int8Linear)
    assert "not a floating weight and bias alone" in declared.left_out["0"]


def _meta_int8() -> nn.Module:
    with init_empty():
        return nn.Sequential(Int8Linear(16, 32), Int8Linear(32, 16))
