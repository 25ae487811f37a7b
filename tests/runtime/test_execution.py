"""The execution plan: each layer's tier, compute device and dtypes, decided once from the placement; bf16 -> fp16
by where a layer computes, not where it is kept."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem import BF16FallbackWarning, LoadOptions, assume_bf16_support
from lightning_lowmem.engine import prepare_load, records_source
from lightning_lowmem.plan import module_records


def prepared_gpt(model, max_memory, disk_offload=False):
    options = LoadOptions(dtype=torch.bfloat16, max_memory=max_memory, disk_offload=disk_offload)
    return prepare_load(model, records_source(module_records(model), options, "the module's own tensors"), options)


@pytest.fixture
def gpt_6(tiny_config, tiny_gpt):
    """A 6-layer tiny GPT in bf16, and its weight bytes."""
    model = tiny_gpt(tiny_config(n_layer=6), torch.bfloat16)
    return model, sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_layers_kept_on_the_cpu_compute_in_fp16_where_the_gpu_lacks_bf16(gpt_6):
    """A placement with cuda:0 and cpu layers on a GPU without bf16: every layer computes on cuda:0, so every layer
    computes in fp16, the offloaded ones too (kept on the CPU, which has bf16: by where they are stored, they stayed
    bf16 and the forward failed with "mat1 and mat2 must have the same dtype")."""
    model, nbytes = gpt_6
    with assume_bf16_support("cuda", False):
        prepared = prepared_gpt(model, {"cuda:0": nbytes // 2, "cpu": "1GiB"})
        execution = prepared.execution
        assert set(execution.tiers().values()) == {"resident", "cpu"}
        assert {layer.compute_device for layer in execution.layers} == {torch.device("cuda:0")}
        assert {layer.compute_dtype for layer in execution.layers} == {torch.float16}
        assert {layer.storage_dtype for layer in execution.offloaded} == {torch.float16}  # cast once, at load
        kept_on_cpu = [t for t in prepared.plan.targets if t.device.type == "cpu"]
        assert kept_on_cpu and {t.dtype for t in kept_on_cpu} == {torch.bfloat16}  # before the load applies it
        with pytest.warns(BF16FallbackWarning, match="cuda:0 does not support bfloat16") as warned:
            assert execution.apply(prepared.plan) == {"cuda:0": torch.float16}
    assert len(warned) == 1  # once for the device, not once per tensor or per storage device
    floating = [t for t in prepared.plan.targets if t.record.dtype.is_floating_point]
    assert {t.dtype for t in floating} == {torch.float16}


def test_layers_on_disk_are_stored_as_the_file_holds_them_and_compute_as_the_device_allows(gpt_6):
    model, nbytes = gpt_6
    with assume_bf16_support("cuda", False):
        execution = prepared_gpt(model, {"cuda:0": nbytes // 3, "cpu": nbytes // 5}, disk_offload=True).execution
    on_disk = execution.on_disk
    assert on_disk and all(layer.storage_dtype == torch.bfloat16 and layer.compute_dtype == torch.float16
                           for layer in on_disk)
    assert sum(layer.read_nbytes for layer in on_disk) == execution.read_nbytes == \
        execution.placement.disk_read_bytes > 0
    assert "disk" in str(execution) and "bfloat16 -> float16" in str(execution)


def test_where_the_gpu_has_bf16_and_without_a_placement_nothing_falls_back(gpt_6):
    model, nbytes = gpt_6
    with assume_bf16_support("cuda", True):
        execution = prepared_gpt(model, {"cuda:0": nbytes // 2, "cpu": "1GiB"}).execution
    assert execution.fallback == {} and {layer.compute_dtype for layer in execution.layers} == {torch.bfloat16}
    options = LoadOptions(dtype=torch.bfloat16)
    with assume_bf16_support("cpu", False):  # no placement: each tensor computes where it is loaded
        prepared = prepare_load(model, records_source(module_records(model), options, "own"), options)
    assert prepared.execution.layers == [] and prepared.execution.fallback == {"cpu": torch.float16}
