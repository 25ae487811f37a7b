"""The prompt style of a checkpoint directory, found as ``litgpt generate`` and ``litgpt chat`` find it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def prompt_style_for(directory: Path, config: Any) -> Any:
    """litgpt's ``PromptStyle`` for ``directory``: its ``prompt_style.yaml`` when it has one, else the style
    litgpt picks from the config's name (``PromptStyle.from_config``)."""
    from litgpt.prompts import PromptStyle, has_prompt_style, load_prompt_style

    return load_prompt_style(directory) if has_prompt_style(directory) else PromptStyle.from_config(config)
