"""One owner of where a load computes and of the generation dtype (``request/defaults.py``), and the faces asking it."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem import BF16FallbackWarning, LoadOptions, assume_bf16_support, estimate_memory, generate
from lightning_lowmem.cli.options import default_device as cli_device
from lightning_lowmem.engine import placement_plan
from lightning_lowmem.request.defaults import GENERATION_DTYPE, default_device, execution_device, generation_dtype
from lightning_lowmem.litgpt.generation import generation_options, load_for_generation


def test_the_execution_device_is_the_budgets_then_the_device_then_the_default():
    offload = LoadOptions(max_memory={"cuda:1": "6GiB", "cpu": "20GiB"})
    assert execution_device(offload, "cpu") == torch.device("cuda", 1)  # where offloaded layers are brought
    assert execution_device(LoadOptions(max_memory={"cpu": "1GiB"}), "cuda") == torch.device("cpu")
    assert execution_device(LoadOptions(device="meta"), "cpu") == torch.device("meta")
    assert execution_device(LoadOptions(), "cpu") == torch.device("cpu")
    assert execution_device(LoadOptions()) is None  # load_checkpoint: each tensor where the module holds it


def test_litgpt_s_default_device_is_cuda_only_where_there_is_one():
    assert default_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert cli_device(None) == str(default_device()) and cli_device("cuda:3") == "cuda:3"


def test_the_generation_dtype_is_the_dtype_then_the_precision_then_bf16():
    assert GENERATION_DTYPE == torch.bfloat16
    assert generation_dtype() == torch.bfloat16
    assert generation_dtype(precision="16-true") == torch.float16
    assert generation_dtype(torch.float32, "32-true") == torch.float32
    with pytest.raises(ValueError, match="disagree"):
        generation_dtype(torch.float32, "bf16-true")
    with pytest.raises(ValueError, match="bf16-mixed"):
        generation_dtype(precision="bf16-mixed")


def test_the_faces_take_the_device_and_dtype_the_owner_decides(tiny_config, meta_gpt):
    options = generation_options(None, None)
    assert (options.device, options.dtype) == (torch.device("cpu"), torch.bfloat16)
    budgets = generation_options(LoadOptions(max_memory={"cpu": "1GiB"}), "16-true")
    assert (budgets.device, execution_device(budgets), budgets.dtype) == (None, torch.device("cpu"), torch.float16)
    with pytest.raises(ValueError, match="disagree"):
        generation_options(LoadOptions(max_memory={"cuda:0": "1GiB", "cpu": "1GiB"}), None, device="cpu")
    assert estimate_memory(tiny_config("gqa"), max_seq_length=16).dtype == torch.bfloat16
    plan = placement_plan(meta_gpt(tiny_config("gqa")), None, {"cuda:0": "1GiB", "cpu": "1GiB"}, context=16)
    assert plan.execution_device == str(execution_device(LoadOptions(max_memory={"cuda:0": "1GiB", "cpu": "1GiB"})))


def test_a_generation_on_a_device_without_bf16_loads_and_runs_in_fp16(tmp_path, tiny_config, write_litgpt_dir):
    """The default dtype is bf16; where the execution device lacks it (the CPU taken for one here) the execution plan
    gives every layer fp16 with one warning, and the generation runs: the same tokens as a load asked for fp16."""
    directory = write_litgpt_dir(tmp_path / "tiny", tiny_config("gqa"), torch.float32, tokenizer=False)
    with assume_bf16_support("cpu", False):
        with pytest.warns(BF16FallbackWarning, match="cpu does not support bfloat16"):
            model, _, report = load_for_generation(directory)
        assert {p.dtype for p in model.parameters()} == {torch.float16}
        assert {b.dtype for b in model.buffers() if b.is_floating_point()} <= {torch.float16, torch.float32}
        with pytest.warns(BF16FallbackWarning):
            fallback = generate(directory, [1, 2, 3], max_new_tokens=4, temperature=0.0)
    asked = generate(directory, [1, 2, 3], max_new_tokens=4, temperature=0.0, dtype=torch.float16)
    assert fallback.tokens[0].tolist() == asked.tokens[0].tolist()
    assert fallback.memory.weights == asked.memory.weights
