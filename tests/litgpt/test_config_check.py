"""A litgpt config checked against a checkpoint's tensors before a model is built: block and expert counts, the
embedding's shape and the attention widths, in litgpt's and HF's names; the key, its value and what the tensors
say in the error."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem import Checkpoint, CheckpointMismatchError
from lightning_lowmem.formats import TensorRecord
from lightning_lowmem.litgpt.config_check import check_config_fits


def _records(state: dict[str, torch.Tensor]) -> dict[str, TensorRecord]:
    from pathlib import Path

    return {k: TensorRecord(k, tuple(v.shape), v.dtype, Path("lit_model.pth")) for k, v in state.items()}


@pytest.mark.parametrize("kind", ["pythia", "gqa"])
def test_a_config_fits_the_checkpoint_it_was_saved_with(tiny_config, tiny_gpt, kind):
    config = tiny_config(kind)
    check_config_fits(config, _records(tiny_gpt(config).state_dict()))


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2.5"])
def test_an_hf_checkpoint_fits_its_litgpt_config(tmp_path, write_hf_dir, family):
    _, config = write_hf_dir(tmp_path / family, family, tokenizer=False)
    with Checkpoint.open(tmp_path / family) as ckpt:
        check_config_fits(config, ckpt.records, ckpt.description)


@pytest.mark.parametrize("field, value, says", [
    ("n_layer", 100_000_000, "2 blocks (transformer.h.0 ... transformer.h.1)"),
    ("n_layer", 1, "2 blocks"),
    ("n_embd", 64, "transformer.wte.weight of shape [128, 32]"),
    ("padded_vocab_size", 256, "transformer.wte.weight of shape [128, 32]"),
    ("n_head", 8, "transformer.h.0.attn.qkv.weight of shape [96, 32], where (n_head + 2 * n_query_groups) * "
                  "head_size is 192"),
])
def test_a_config_that_contradicts_the_tensors_names_the_key_the_value_and_the_tensors(tiny_config, tiny_gpt, field,
                                                                                     value, says):
    records = _records(tiny_gpt(tiny_config()).state_dict())
    config = tiny_config(**{field: value, **({"head_size": 8} if field == "n_head" else {})})
    with pytest.raises(CheckpointMismatchError, match=rf"config says {field}: {value}, but the checkpoint's tensors "
                                                      rf"hold .*{_escape(says)}.*no model was built"):
        check_config_fits(config, records, "lit_model.pth")


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_each_other_key_the_tensors_contradict_is_named_once(tiny_config, tiny_gpt):
    """A config of another model altogether (every count and width wrong): the first key in full, the others once
    each, though two attention weights contradict n_head."""
    records = _records(tiny_gpt(tiny_config("gqa")).state_dict())
    config = tiny_config("gqa", n_layer=3, n_embd=64, n_head=8, padded_vocab_size=256)
    with pytest.raises(CheckpointMismatchError) as error:
        check_config_fits(config, records, "lit_model.pth")
    message = str(error.value)
    assert message.startswith("The litgpt config says n_layer: 3, but the checkpoint's tensors hold 2 blocks")
    assert "(the tensors contradict n_embd, padded_vocab_size, n_head too)" in message
    assert message.count("n_head") == 1


def test_hf_names_count_their_blocks_and_experts(tiny_config):
    from pathlib import Path

    names = [f"model.layers.{i}.mlp.experts.{e}.w1.weight" for i in range(3) for e in range(4)]
    records = {n: TensorRecord(n, (8, 8), torch.float32, Path("model.safetensors")) for n in names}
    check_config_fits(tiny_config("gqa", n_layer=3, n_expert=4, n_expert_per_token=2, mlp_class_name="LLaMAMoE"),
                      records)
    with pytest.raises(CheckpointMismatchError, match=r"n_expert: 8, .*hold 4 experts per block"):
        check_config_fits(tiny_config("gqa", n_layer=3, n_expert=8, n_expert_per_token=2,
                                      mlp_class_name="LLaMAMoE"), records)
    with pytest.raises(CheckpointMismatchError, match=r"n_layer: 4, .*3 blocks \(model\.layers\.0 \.\.\. "):
        check_config_fits(tiny_config("gqa", n_layer=4), records)


def test_names_of_no_known_layout_still_bound_the_layers_by_the_tensors(tiny_config):
    from pathlib import Path

    records = {f"blk.{i}.w": TensorRecord(f"blk.{i}.w", (4,), torch.float32, Path("m.gguf")) for i in range(3)}
    check_config_fits(tiny_config(n_layer=3), records)
    with pytest.raises(CheckpointMismatchError, match=r"n_layer: 4, .*3 tensors in all, fewer than one per block"):
        check_config_fits(tiny_config(n_layer=4), records)


def test_the_load_checks_the_config_before_building_the_model(tmp_path, tiny_config, write_litgpt_dir, monkeypatch):
    import lightning_lowmem.litgpt.checkpoint_dir as checkpoint_dir
    directory = write_litgpt_dir(tmp_path / "tiny", tiny_config(n_layer=1), tokenizer=False)
    built = []
    monkeypatch.setattr(checkpoint_dir, "build_meta_gpt", lambda config: built.append(config))
    with pytest.raises(CheckpointMismatchError, match="n_layer: 100000000"):
        checkpoint_dir.LitgptCheckpoint.find(directory, config=tiny_config(n_layer=100_000_000))
    found = checkpoint_dir.LitgptCheckpoint.find(directory)  # a config given later is checked as well
    with pytest.raises(CheckpointMismatchError, match="n_layer: 100000000"):
        found.with_config(tiny_config(n_layer=100_000_000))
    assert not built
