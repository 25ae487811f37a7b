"""Quantization schemes: their sizes equal what each library stores, their options, the registry, availability."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from torch import nn

from lightning_lowmem import Checkpoint, UnsupportedQuantizationError, init_empty, load_checkpoint
from lightning_lowmem.plan import make_plan
from lightning_lowmem.quantize import (
    LAYOUTS,
    SCHEMES,
    TRANSFORMS,
    BnbInt8,
    BnbNF4,
    QuantScheme,
    TorchaoInt4WeightOnly,
    Transform,
    layout_of,
    make_scheme,
    prepare_quantization,
    register_scheme,
    register_transform,
    select_linears,
)

SHAPES = [(96, 64), (100, 72), (33, 130), (96, 160)]  # block multiples and not


# ---------------------------------------------------------------- stored_nbytes == what the library stores

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.fp4", "bnb.nf4-dq", "bnb.fp4-dq"])
def test_bnb_4bit_size_equals_what_bitsandbytes_stores(scheme, shape):
    import bitsandbytes.functional as F

    weight = torch.randn(shape, dtype=torch.bfloat16)
    double = scheme.endswith("-dq")
    codes, state = F.quantize_4bit(weight, quant_type=scheme[4:7], blocksize=64, compress_statistics=double)
    # the code table is per weight; double quantization: uint8 absmax, their own fp32 absmax and code table,
    # and an fp32 offset
    stored = [codes, state.absmax, state.code] + ([state.state2.absmax, state.offset, state.state2.code]
                                                  if double else [])
    assert make_scheme(scheme).stored_nbytes(tuple(shape)) == sum(t.numel() * t.element_size() for t in stored)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_bnb_int8_size_equals_what_bitsandbytes_stores(shape, dtype):
    import bitsandbytes.functional as F

    codes, row_scales, _ = F.int8_vectorwise_quant(torch.randn(shape, dtype=dtype))
    assert make_scheme("bnb.int8").stored_nbytes(tuple(shape)) == \
        codes.numel() + row_scales.numel() * row_scales.element_size()


@pytest.mark.parametrize("scheme", ["torchao.int8wo", "torchao.int8dq"])
def test_torchao_int8_size_equals_what_torchao_stores(scheme):
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

    linear = torch.nn.Sequential(torch.nn.Linear(72, 100, bias=False, dtype=torch.bfloat16))
    quantize_(linear, Int8WeightOnlyConfig() if scheme.endswith("wo") else Int8DynamicActivationInt8WeightConfig())
    inner = linear[0].weight
    names, _ = inner.__tensor_flatten__()
    assert make_scheme(scheme).stored_nbytes((100, 72)) == sum(getattr(inner, n).numel() * getattr(inner, n).element_size()
                                                               for n in names)


# ---------------------------------------------------------------- options, registry, availability

def test_scheme_object_with_options(quant_checkpoint, quant_load):
    model, report = quant_load(quant_checkpoint, quantize=BnbNF4(blocksize=128))
    assert model.transformer.h[0].mlp.fc.weight.quant_state.blocksize == 128
    assert set(report.quantized.values()) == {"bnb.nf4"}


def test_scheme_configs_are_validated_frozen_and_registered():
    assert {"bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8", "torchao.int8wo", "torchao.int8dq",
            "torchao.int4wo"} <= set(SCHEMES)
    for bad in (lambda: BnbNF4(blocksize=100), lambda: BnbNF4(quant_type="nf3"), lambda: BnbInt8(threshold=-1.0),
                lambda: TorchaoInt4WeightOnly(group_size=100)):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(dataclasses.FrozenInstanceError):
        BnbNF4().blocksize = 128  # type: ignore[misc]
    with pytest.raises(ValueError, match="already registered"):
        register_scheme("bnb.nf4")(BnbInt8)


def test_a_new_scheme_is_a_config_and_a_transform(quant_checkpoint, quant_load, quant_linears):
    @dataclasses.dataclass(frozen=True)
    class HalfPrecision(QuantScheme):  # not quantization, but it exercises the protocol end to end
        package = "torch"

    class HalfTransform(Transform[HalfPrecision]):
        def quantize(self, module: nn.Module, weight: torch.Tensor) -> None:
            module.weight = nn.Parameter(weight.to(torch.float16), requires_grad=False)

    register_scheme("test.fp16")(HalfPrecision)
    register_transform(HalfPrecision)(HalfTransform)
    try:
        model, report = quant_load(quant_checkpoint, quantize="test.fp16")
    finally:
        del SCHEMES["test.fp16"], TRANSFORMS[HalfPrecision]
    assert set(report.quantized) == quant_linears()
    assert model.transformer.h[0].mlp.fc.weight.dtype == torch.float16 and model.lm_head.weight.dtype == torch.bfloat16


def test_a_scheme_without_a_transform_fails_before_any_read(quant_checkpoint, quant_config, meta_gpt, read_recorder):
    @dataclasses.dataclass(frozen=True)
    class NoTransform(QuantScheme):
        package = "torch"

    model = meta_gpt(quant_config)
    with pytest.raises(TypeError, match=r"has no transform.*@register_transform\(NoTransform\)"):
        load_checkpoint(model, quant_checkpoint, dtype=torch.bfloat16, quantize=NoTransform())
    assert read_recorder.keys == []


def test_every_registered_scheme_has_its_transform_and_its_library_one_layout():
    for name, cls in SCHEMES.items():
        assert isinstance(cls().transform, Transform), name
        assert cls().transform.scheme == cls()
    # a subclass of a registered config inherits its transform and layout
    assert type(BnbNF4(blocksize=128).transform) is type(BnbNF4().transform)
    assert {layout_of(SCHEMES[name]) for name in ("bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq")} \
        == {layout_of(BnbNF4)}
    assert layout_of(BnbInt8) is not layout_of(BnbNF4)
    assert layout_of(SCHEMES["torchao.int8wo"]) is layout_of(SCHEMES["torchao.int8dq"])
    assert layout_of(SCHEMES["torchao.nf4"]) is None and layout_of(TorchaoInt4WeightOnly) is None
    assert len(LAYOUTS) == len({id(layout) for layout in LAYOUTS}) == 3
    with pytest.raises(ValueError, match="already has the transform"):
        register_transform(BnbInt8)(type("Other", (Transform,), {}))  # BnbInt8 has its own


def test_unknown_scheme_fails_before_any_io(tmp_path):
    with init_empty():
        model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(UnsupportedQuantizationError, match=r"Unknown quantization scheme 'bnb\.nf5'.*'bnb\.nf4'"):
        load_checkpoint(model, tmp_path / "does-not-exist.safetensors", quantize="bnb.nf5")


@pytest.mark.parametrize(("given", "suggested"), [("nf4", "'bnb.nf4' (or 'torchao.nf4')"), ("NF4", "'bnb.nf4' (or 'torchao.nf4')"),
                                                  ("int8", "'bnb.int8'"), ("int8wo", "'torchao.int8wo'"),
                                                  ("bnb.nf5", "'bnb.nf4'")])
def test_an_unknown_scheme_suggests_the_spelling_meant(given, suggested):
    """As the command line says it: the library's spelling of a bare name (litgpt's `--quantize bnb.nf4`)."""
    from lightning_lowmem import LoadOptions

    with pytest.raises(UnsupportedQuantizationError) as error:
        LoadOptions(quantize=given)
    assert f"Did you mean {suggested}?" in str(error.value) and "Known schemes: 'bnb.nf4'" in str(error.value)


@pytest.mark.skipif(importlib.util.find_spec("mslk") is not None, reason="mslk is installed: int4 runs on CPU")
def test_int4_without_its_kernel_package_fails_before_reading(quant_checkpoint, quant_config, meta_gpt,
                                                              read_recorder):
    model = meta_gpt(quant_config)
    with pytest.raises(UnsupportedQuantizationError) as error:
        load_checkpoint(model, quant_checkpoint, dtype=torch.bfloat16, quantize="torchao.int4wo")
    message = str(error.value)
    for part in ("'torchao.int4wo'", "'cpu'", "'mslk'", "'bnb.nf4'", "'torchao.int8wo'"):
        assert part in message
    assert "'torchao.int4wo'" not in message.split("work on")[1]
    assert read_recorder.keys == []
    assert type(model.transformer.h[0].mlp.fc) is nn.Linear and model.transformer.h[0].mlp.fc.weight.is_meta


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_scheme_without_cuda_names_the_device(quant_checkpoint, quant_config, meta_gpt):
    # through prepare_quantization: load_checkpoint(device="cuda") stops earlier here, in its CUDA memory monitor
    model = meta_gpt(quant_config)
    with Checkpoint.open(quant_checkpoint) as ckpt:
        plan = make_plan(model, ckpt.records, dtype=torch.bfloat16, device=torch.device("cuda"))
    selection = select_linears(model, plan, BnbInt8(), None)
    with pytest.raises(UnsupportedQuantizationError, match=r"'bnb\.int8' cannot run on device 'cuda'.*CUDA is not"):
        prepare_quantization(model, selection, plan, torch.device("cuda"))
    assert type(model.transformer.h[0].mlp.fc) is nn.Linear
