"""LoadOptions: validated once, merged with keyword arguments, and accepted by every face as ``options=``."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem import (
    LoadOptions,
    UnsupportedQuantizationError,
    estimate_memory,
    generate,
    load_checkpoint,
    placement_plan,
)
from lightning_lowmem.quantize import BnbNF4

# ---------------------------------------------------------------- validation


def test_bad_dtype():
    with pytest.raises(TypeError, match=r"dtype must be a floating-point torch\.dtype.*'bf16'"):
        LoadOptions(dtype="bf16")
    with pytest.raises(TypeError, match="dtype must be a floating-point"):
        LoadOptions(dtype=torch.int8)
    assert LoadOptions(dtype=torch.float16).dtype == torch.float16


def test_bad_quantize_name_and_type():
    with pytest.raises(UnsupportedQuantizationError, match=r"Unknown quantization scheme 'bnb\.nf5'.*'bnb\.nf4'"):
        LoadOptions(quantize="bnb.nf5")
    with pytest.raises(ValueError):  # UnsupportedQuantizationError is a ValueError too
        LoadOptions(quantize="int4")
    with pytest.raises(TypeError, match="quantize must be"):
        LoadOptions(quantize=4)
    assert LoadOptions(quantize="bnb.nf4").quantize == BnbNF4()  # stored as the scheme object
    assert LoadOptions(quantize=BnbNF4(blocksize=128)).scheme.blocksize == 128


def test_skip_quantize_patterns_are_strings_and_one_string_is_one_pattern():
    with pytest.raises(TypeError, match="skip_quantize"):
        LoadOptions(quantize="bnb.nf4", skip_quantize=[3])
    with pytest.raises(TypeError, match="skip_quantize"):
        LoadOptions(skip_quantize=("lm_head", None))
    assert LoadOptions(quantize="bnb.nf4", skip_quantize="lm_head").skip_quantize == ("lm_head",)
    assert LoadOptions(skip_quantize=["lm_head", "*.proj"]).skip_quantize == ("lm_head", "*.proj")
    assert LoadOptions(skip_quantize=[]).skip_quantize == ()  # quantize every Linear: not the default (None)
    assert LoadOptions().skip_quantize is None


def test_device_and_max_memory_together():
    with pytest.raises(ValueError, match=r"Pass device='cpu' or max_memory=, not both"):
        LoadOptions(device="cpu", max_memory={"cpu": "1GiB"})
    assert LoadOptions(device="cpu").device == torch.device("cpu")
    assert LoadOptions(max_memory={"cpu": "1GiB"}).budgets.bytes == {"cpu": 2**30}


@pytest.mark.parametrize("field", ["context", "batch_size"])
@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-1, ValueError), (True, TypeError), (2.0, TypeError)])
def test_context_and_batch_size_are_positive_ints(field, value, error):
    with pytest.raises(error, match=rf"{field} must be an int >= 1"):
        LoadOptions(**{field: value})
    assert getattr(LoadOptions(**{field: 3}), field) == 3


def test_other_fields_are_type_checked():
    for field, value in [("strict", "yes"), ("key_map", 3), ("transform", "upper"), ("combine", {"a": "b"}),
                         ("progress", 1)]:
        with pytest.raises(TypeError, match=rf"{field} must be"):
            LoadOptions(**{field: value})


# ---------------------------------------------------------------- merge

def test_merge_puts_in_the_keywords_that_are_not_none():
    base = LoadOptions(quantize="bnb.nf4", dtype=torch.bfloat16, context=16)
    merged = LoadOptions.merge(base, dtype=torch.float16, context=None, quantize=None, skip_quantize="lm_head")
    assert (merged.dtype, merged.context, merged.quantize, merged.skip_quantize) == \
        (torch.float16, 16, BnbNF4(), ("lm_head",))
    assert (base.dtype, base.skip_quantize) == (torch.bfloat16, None)  # frozen: the base is unchanged
    assert LoadOptions.merge(base, dtype=None, quantize=None) is base  # nothing to put in
    assert LoadOptions.merge(None, batch_size=2) == LoadOptions(batch_size=2)
    assert LoadOptions.merge(None) == LoadOptions()
    assert LoadOptions.merge(options=base, batch_size=2) == LoadOptions.merge(base, batch_size=2)  # options= by name


def test_merge_validates_what_it_puts_in_and_refuses_unknown_keywords():
    base = LoadOptions(max_memory={"cpu": "1GiB"})
    with pytest.raises(UnsupportedQuantizationError, match="bnb.nf5"):
        LoadOptions.merge(base, quantize="bnb.nf5")
    with pytest.raises(ValueError, match="not both"):
        LoadOptions.merge(base, device="cpu")
    with pytest.raises(TypeError, match=r"LoadOptions.merge\(\) got an unknown keyword argument 'colour'"):
        LoadOptions.merge(base, colour="red")
    with pytest.raises(TypeError, match="options must be a LoadOptions"):
        LoadOptions.merge({"dtype": torch.bfloat16})


# ---------------------------------------------------------------- every face takes options=

# one pattern, given as one string: layer 0 stays in full precision; the head, no longer skipped by default, does not
OPTIONS = dict(quantize="torchao.int8wo", skip_quantize="*transformer.h.0.*", dtype=torch.bfloat16)


def test_load_checkpoint_options_equal_keywords(tmp_path, litgpt_model, write_checkpoint, meta_gpt,
                                                assert_same_weights):
    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    by_options, by_keywords = meta_gpt(litgpt_model.config), meta_gpt(litgpt_model.config)
    ours = load_checkpoint(by_options, path, options=LoadOptions(**OPTIONS))
    theirs = load_checkpoint(by_keywords, path, **OPTIONS)
    assert ours.quantized == theirs.quantized == {"lm_head": "torchao.int8wo",
                                                  "transformer.h.1.attn.qkv": "torchao.int8wo",
                                                  "transformer.h.1.attn.proj": "torchao.int8wo",
                                                  "transformer.h.1.mlp.fc": "torchao.int8wo",
                                                  "transformer.h.1.mlp.proj": "torchao.int8wo"}
    assert ours.bytes_loaded == theirs.bytes_loaded
    assert_same_weights(by_options, by_keywords)
    x = torch.randint(0, 100, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(by_options(x), by_keywords(x), rtol=0, atol=0)
    # keywords override the options' fields
    again = load_checkpoint(meta_gpt(litgpt_model.config), path, options=LoadOptions(**OPTIONS), quantize="bnb.int8")
    assert set(again.quantized.values()) == {"bnb.int8"} and set(again.quantized) == set(ours.quantized)


def test_placement_plan_options_equal_keywords(tiny_config, meta_gpt):
    model = meta_gpt(tiny_config(n_layer=6))
    budget = {"cuda:0": "150KiB", "cpu": "1GiB"}
    kwargs = dict(context=16, batch_size=2, dtype=torch.bfloat16, quantize="bnb.int8", skip_quantize="lm_head")
    ours = placement_plan(model, None, options=LoadOptions(max_memory=budget, **kwargs))
    theirs = placement_plan(model, None, budget, **kwargs)
    assert ours.offloaded  # a plan with layers on both devices
    assert [(x.name, x.nbytes, x.device) for x in ours.layers] == [(x.name, x.nbytes, x.device) for x in theirs.layers]
    assert (ours.cache_bytes, ours.activation_bytes, ours.stream_bytes) == \
        (theirs.cache_bytes, theirs.activation_bytes, theirs.stream_bytes)
    assert str(ours) == str(theirs)
    assert str(ours) != str(placement_plan(model, None, budget, context=16))  # the options made a difference
    with pytest.raises(ValueError, match="needs max_memory"):
        placement_plan(model, None, options=LoadOptions(context=16))


def test_estimate_memory_options_equal_keywords(tiny_config):
    config = tiny_config("gqa")
    kwargs = dict(quantize="bnb.nf4", skip_quantize="lm_head", dtype=torch.float16, batch_size=2)
    ours = estimate_memory(config, options=LoadOptions(**kwargs), max_seq_length=40)
    theirs = estimate_memory(config, max_seq_length=40, **kwargs)
    assert ours == theirs and str(ours) == str(theirs)
    assert ours.quantized_weights > 0 and ours != estimate_memory(config, max_seq_length=40)


def test_generate_options_equal_keywords(tmp_path, tiny_config, write_litgpt_dir):
    directory = write_litgpt_dir(tmp_path / "tiny", tiny_config("gqa"), torch.float32, tokenizer=False)
    options = LoadOptions(quantize="torchao.int8wo", dtype=torch.float32)
    ours = generate(directory, [1, 2, 3], options=options, max_new_tokens=6, temperature=0.0)
    theirs = generate(directory, [1, 2, 3], quantize="torchao.int8wo", precision="32-true", max_new_tokens=6,
                      temperature=0.0)
    assert ours.tokens[0].tolist() == theirs.tokens[0].tolist()
    assert ours.load_report.quantized == theirs.load_report.quantized and ours.load_report.quantized
    assert ours.memory.weights == theirs.memory.weights
    bf16 = generate(directory, [1, 2, 3], quantize="torchao.int8wo", max_new_tokens=6, temperature=0.0)
    assert bf16.memory.weights < ours.memory.weights  # the options' dtype was used, not generate's bf16 default


def test_strategy_options_equal_keywords(tmp_path, litgpt_model, write_checkpoint, assert_same_weights):
    import lightning as L
    from litgpt import GPT

    from lightning_lowmem import LowMemStrategy

    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    loaded = []
    for strategy in (LowMemStrategy(options=LoadOptions(**OPTIONS)), LowMemStrategy(**OPTIONS)):
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
        with fabric.init_module():
            model = GPT(litgpt_model.config)
        fabric.load_raw(path, model)
        loaded.append((strategy, model))
    (ours, ours_model), (theirs, theirs_model) = loaded
    assert ours.options == theirs.options
    assert ours.reports[-1].quantized == theirs.reports[-1].quantized and len(ours.reports[-1].quantized) == 5
    assert ours.reports[-1].bytes_loaded == theirs.reports[-1].bytes_loaded
    assert_same_weights(ours_model, theirs_model)


def test_callback_options_equal_keywords(tmp_path, litgpt_model, write_checkpoint, lit_module):
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_lowmem import LowMemCallback

    path = write_checkpoint(litgpt_model.state_dict(), "pth", tmp_path)
    data = DataLoader(torch.randint(0, 100, (4, 17), generator=torch.Generator().manual_seed(0)), batch_size=4)
    results = []
    for callback in (LowMemCallback(path, options=LoadOptions(**OPTIONS)), LowMemCallback(path, **OPTIONS)):
        trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-true", callbacks=[callback], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        results.append((callback, trainer.predict(lit_module(litgpt_model.config), data)[0]))
    (ours, ours_out), (theirs, theirs_out) = results
    assert ours.options == theirs.options
    assert ours.report.quantized == theirs.report.quantized and len(ours.report.quantized) == 5
    torch.testing.assert_close(ours_out, theirs_out, rtol=0, atol=0)


def test_disk_offload_needs_max_memory_and_a_bool():
    with pytest.raises(ValueError, match="disk_offload=True needs max_memory"):
        LoadOptions(disk_offload=True)
    with pytest.raises(TypeError, match="disk_offload must be True or False"):
        LoadOptions(max_memory={"cpu": "1GiB"}, disk_offload="yes")
    options = LoadOptions.merge(LoadOptions(max_memory={"cpu": "1GiB"}), disk_offload=True)
    assert options.disk_offload and LoadOptions.merge(options, disk_offload=None).disk_offload
