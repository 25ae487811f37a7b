"""A checkpoint directory's litgpt config: model_config.yaml, else its name, else its config.json."""

from __future__ import annotations

import json

import pytest

from lightning_lowmem import CheckpointNotFoundError
from lightning_lowmem.litgpt.checkpoint_dir import find_config


def test_the_order_of_the_sources(tmp_path, tiny_config, write_litgpt_dir):
    directory = write_litgpt_dir(tmp_path / "pythia-14m", tiny_config(), tokenizer=False)
    assert find_config(directory)[0].name == "pythia-tiny"  # model_config.yaml first
    (directory / "model_config.yaml").unlink()
    assert find_config(directory)[0].name == "pythia-14m"  # then the directory's name
    named = tmp_path / "anything"
    named.mkdir()
    (named / "config.json").write_text(json.dumps({"_name_or_path": "EleutherAI/pythia-70m"}))
    config, source = find_config(named)  # then config.json
    assert config.name == "pythia-70m" and source.startswith("config.json")


def test_none_found_lists_what_was_tried(tmp_path):
    with pytest.raises(ValueError, match=r"no model_config\.yaml in .*'empty' is no litgpt model name.*no config\.json"):
        (tmp_path / "empty").mkdir()
        find_config(tmp_path / "empty")
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        find_config(tmp_path / "nowhere")
