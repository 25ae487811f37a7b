"""The prompt style of a checkpoint, found as ``litgpt generate`` and ``litgpt chat`` find it, or its own chat template
(:mod:`lightning_lowmem.litgpt.prompt_style`, which ``generate()`` asks too)."""

from lightning_lowmem.litgpt.prompt_style import prompt_style_for

__all__ = ["prompt_style_for"]
