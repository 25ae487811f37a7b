"""The prompt style of a checkpoint directory, found as ``litgpt generate`` and ``litgpt chat`` find it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_lowmem.litgpt.requirement import import_litgpt


def prompt_style_for(directory: Path, config: Any) -> Any:
    """litgpt's ``PromptStyle`` for ``directory``: its ``prompt_style.yaml`` when it has one, else the style
    litgpt picks from the config's name (``PromptStyle.from_config``)."""
    prompts = import_litgpt("litgpt.prompts", needed_by="Finding a checkpoint's prompt style")
    if prompts.has_prompt_style(directory):
        return prompts.load_prompt_style(directory)
    return prompts.PromptStyle.from_config(config)
