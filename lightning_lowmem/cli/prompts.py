"""The prompt style of a checkpoint, found as ``litgpt generate`` and ``litgpt chat`` find it, or a GGUF file's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_lowmem.litgpt.requirement import import_litgpt


def prompt_style_for(directory: Path, config: Any, gguf: Any | None = None) -> Any:
    """litgpt's ``PromptStyle`` for a checkpoint in ``directory``: its ``prompt_style.yaml`` when it has one, else
    a GGUF file's own chat template (``gguf``: its ``GGUFSource``; rendered as transformers renders it), else the
    style litgpt picks from the config's name (``PromptStyle.from_config``)."""
    prompts = import_litgpt("litgpt.prompts", needed_by="Finding a checkpoint's prompt style")
    if prompts.has_prompt_style(directory):
        return prompts.load_prompt_style(directory)
    if gguf is not None:
        from lightning_lowmem.litgpt.chat_template import chat_template_style

        style = chat_template_style(gguf.chat_template, gguf.tokenizer)
        if style is not None:
            return style
    return prompts.PromptStyle.from_config(config)
