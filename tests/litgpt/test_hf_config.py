"""The litgpt config of an HF directory, from its config.json: by name, then by shape; what was tried when neither."""

from __future__ import annotations

import json

import pytest

from lightning_lowmem.litgpt.hf_config import config_from_hf_json, hf_shape

PYTHIA_14M = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 128,
              "intermediate_size": 512, "num_attention_heads": 4, "num_hidden_layers": 6, "vocab_size": 50304,
              "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0}}
LLAMA_3_2_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
                "intermediate_size": 8192, "num_attention_heads": 32, "num_hidden_layers": 16,
                "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0}


def _write(tmp_path, data):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


def test_by_name_or_path(tmp_path):
    config, source = config_from_hf_json(_write(tmp_path, {"_name_or_path": "EleutherAI/pythia-160m"}))
    assert config.name == "pythia-160m" and "_name_or_path 'EleutherAI/pythia-160m'" in source


def test_by_shape(tmp_path):
    config, source = config_from_hf_json(_write(tmp_path, PYTHIA_14M))
    assert config.name == "pythia-14m" and "shapes (n_layer=6, n_embd=128" in source
    assert hf_shape(PYTHIA_14M)["rotary_percentage"] == 0.25


def test_configs_that_differ_by_name_only_warn_and_take_the_first(tmp_path):
    with pytest.warns(UserWarning, match=r"'Llama-3\.2-1B', 'Llama-3\.2-1B-Instruct'.*prompt style"):
        config, _ = config_from_hf_json(_write(tmp_path, LLAMA_3_2_1B))
    assert config.name == "Llama-3.2-1B"


def test_nothing_matches_says_what_was_tried(tmp_path):
    tiny = {**PYTHIA_14M, "hidden_size": 32, "_name_or_path": "me/my-model"}
    with pytest.raises(ValueError, match=r"tried the names 'me/my-model', 'my-model', the shapes \(n_layer=6, n_embd=32"):
        config_from_hf_json(_write(tmp_path, tiny))
    with pytest.raises(ValueError, match="does not say the model's layers"):
        config_from_hf_json(_write(tmp_path, {"model_type": "llama"}))
