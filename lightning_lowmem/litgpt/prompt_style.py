"""A checkpoint's prompt style, found as ``litgpt generate`` and ``litgpt chat`` find it, or its own chat template.

In this order:

1. the directory's ``prompt_style.yaml`` (litgpt's ``save_prompt_style``), whose ``class_path`` picks one of the
   known styles by name (:func:`known_prompt_styles`: litgpt's own, and this library's chat template). Any other
   ``class_path`` is refused: litgpt's ``load_prompt_style`` would import the module it names and call what it
   finds there, so a checkpoint directory could run code; here nothing the file names is imported or called. One
   that names
   :class:`~lightning_lowmem.litgpt.chat_template.ChatTemplate` (what ``lightning-lowmem quantize`` writes beside
   the copy of a GGUF file with a chat template) is the chat template in the directory's ``tokenizer_config.json``
   (``chat_template``, where transformers keeps it), rendered as the GGUF file rendered it;
2. a GGUF file's own chat template (``tokenizer.chat_template``);
3. the style litgpt picks from the config's name (``PromptStyle.from_config``).

``generate()`` and the ``generate`` and ``chat`` commands all ask :func:`prompt_style_for`, so the API and the
command line prompt one checkpoint alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_lowmem.errors import CheckpointFormatError, UnsafeCheckpointError, format_names
from lightning_lowmem.litgpt.requirement import import_litgpt

CHAT_TEMPLATE_STYLE = "lightning_lowmem.litgpt.chat_template.ChatTemplate"
"""The ``class_path`` a ``prompt_style.yaml`` gives for "the chat template of this directory's tokenizer_config.json"."""


def prompt_style_for(directory: Path, config: Any, gguf: Any | None = None, tokenizer: Any | None = None,
                     source: str | None = None) -> Any:
    """litgpt's ``PromptStyle`` for a checkpoint in ``directory`` (see the module's docstring).

    Args:
        directory: where ``prompt_style.yaml`` and ``tokenizer_config.json`` are looked for.
        config: the litgpt ``Config`` (its name picks litgpt's style).
        gguf: a GGUF file's ``GGUFSource``, or None.
        tokenizer: the checkpoint's tokenizer, for a chat template's special and end-of-turn tokens.
        source: the GGUF file, for messages about its chat template.

    Raises:
        CheckpointFormatError: ``prompt_style.yaml`` is no mapping with a ``class_path`` string, or names the chat
            template and ``tokenizer_config.json`` holds none.
        UnsafeCheckpointError: its ``class_path`` is none of :func:`known_prompt_styles`; nothing was imported.
    """
    prompts = import_litgpt("litgpt.prompts", needed_by="Finding a checkpoint's prompt style")
    if (directory / "prompt_style.yaml").is_file():
        class_path = _named_style(directory / "prompt_style.yaml")
        if class_path == CHAT_TEMPLATE_STYLE:
            return _directory_template(directory, tokenizer)
        return known_prompt_styles()[class_path]()
    if gguf is not None:
        from lightning_lowmem.litgpt.chat_template import chat_template_style

        source = f"the GGUF file in {directory} (tokenizer.chat_template)" if source is None else source
        style = chat_template_style(gguf.chat_template, gguf.tokenizer, source)
        if style is not None:
            return style
    return prompts.PromptStyle.from_config(config)


def styled_prompt(prompt: str, style: Any, found: Any | None, config: Any, sys_prompt: str | None = None) -> str:
    """``prompt`` in ``style``: ``"auto"``, the checkpoint's own (:func:`prompt_style_for` of ``found``, what
    :meth:`LitgptCheckpoint.find` found; without one, litgpt's for ``config``), a litgpt style's name
    (``"alpaca"``), or a ``PromptStyle``.

    Raises:
        ValueError: a name litgpt has no style for.
    """
    prompts = import_litgpt("litgpt.prompts", needed_by="Applying a prompt style")
    if style == "auto":
        style = prompt_style_for(found.directory, found.config, found.gguf, found.tokenizer,
                                 f"{found.weights} (tokenizer.chat_template)") if found is not None \
            else prompts.PromptStyle.from_config(config)
    elif isinstance(style, str):
        check_style_name(style)
        style = prompts.PromptStyle.from_name(style)
    return style.apply(prompt, sys_prompt=sys_prompt)


def check_style_name(style: str) -> None:
    """Raise ``ValueError`` unless ``style`` is ``"auto"`` or the name of one of litgpt's prompt styles."""
    prompts = import_litgpt("litgpt.prompts", needed_by="Applying a prompt style")
    if style != "auto" and style not in prompts.prompt_styles:
        raise ValueError(f"prompt_style={style!r} is no litgpt prompt style: pass 'auto' (the checkpoint's), None "
                         f"(the prompt as given), a litgpt.prompts.PromptStyle, or one of "
                         f"{', '.join(sorted(prompts.prompt_styles))}.")


def known_prompt_styles() -> dict[str, type]:
    """The prompt styles a ``prompt_style.yaml`` may name, by the ``class_path`` litgpt's ``save_prompt_style``
    writes for them: every ``PromptStyle`` class of ``litgpt.prompts``, and :data:`CHAT_TEMPLATE_STYLE`.

    Example::

        >>> styles = known_prompt_styles()
        >>> styles["litgpt.prompts.Alpaca"].__name__, CHAT_TEMPLATE_STYLE in styles
        ('Alpaca', True)
    """
    prompts = import_litgpt("litgpt.prompts", needed_by="Finding a checkpoint's prompt style")
    from lightning_lowmem.litgpt.chat_template import ChatTemplate

    known = {f"{value.__module__}.{value.__name__}": value for value in vars(prompts).values()
             if isinstance(value, type) and issubclass(value, prompts.PromptStyle)
             and value.__module__ == prompts.__name__}
    return known | {CHAT_TEMPLATE_STYLE: ChatTemplate}


def _named_style(path: Path) -> str:
    """The ``class_path`` of the ``prompt_style.yaml`` at ``path``, checked to name a known style."""
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise CheckpointFormatError(
            f"{path} cannot be read as YAML ({type(e).__name__}: {' '.join(str(e).split())[:300]}). A prompt style "
            "file holds one line, 'class_path: litgpt.prompts.NAME', as litgpt's save_prompt_style writes it; fix or "
            "remove it.") from e
    class_path = loaded.get("class_path") if isinstance(loaded, dict) else None
    if not isinstance(class_path, str):
        what = f"its class_path is {class_path!r}" if isinstance(loaded, dict) else \
            f"it holds a {type(loaded).__name__}, not a mapping"
        raise CheckpointFormatError(
            f"{path} is no prompt style: {what}. It must be a mapping whose class_path names a style, "
            "'class_path: litgpt.prompts.NAME', as litgpt's save_prompt_style writes it; fix or remove it.")
    known = known_prompt_styles()
    if class_path not in known:
        raise UnsafeCheckpointError(
            f"{path} names class_path: {class_path!r}, which is none of the known prompt styles; nothing it names "
            "was imported or called (litgpt's own loader would import that module and call it: a checkpoint "
            "directory must not choose code to run). Name one of litgpt's styles "
            f"({format_names(sorted(known))}), remove the file to use litgpt's style for the model, or pass "
            "prompt_style= (a style's name, or a litgpt.prompts.PromptStyle you built) to generate().")
    return class_path


def write_chat_template_style(directory: Path) -> Path:
    """``prompt_style.yaml`` in ``directory`` naming the chat template of its ``tokenizer_config.json`` as its prompt
    style (litgpt's file, with the class litgpt's ``load_prompt_style`` would import); returns its path."""
    path = directory / "prompt_style.yaml"
    path.write_text(f"class_path: {CHAT_TEMPLATE_STYLE}\n", encoding="utf-8")
    return path


def has_chat_template_style(directory: Path) -> bool:
    """Whether ``directory``'s ``prompt_style.yaml`` names the chat template of its ``tokenizer_config.json``."""
    import yaml

    try:
        loaded = yaml.safe_load((directory / "prompt_style.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return False  # none, or one litgpt's own loader reads and says what is wrong with
    return isinstance(loaded, dict) and loaded.get("class_path") == CHAT_TEMPLATE_STYLE


def _directory_template(directory: Path, tokenizer: Any | None) -> Any:
    from lightning_lowmem.litgpt.chat_template import chat_template_style

    path = directory / "tokenizer_config.json"
    try:
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        template = None
    style = chat_template_style(template if isinstance(template, str) else None, tokenizer,
                                f"{path} (chat_template)")
    if style is None:
        raise CheckpointFormatError(
            f"{directory / 'prompt_style.yaml'} says the prompt style is the chat template of {path}, but "
            f"{'there is no tokenizer in the directory' if tokenizer is None else 'that file holds none'}. Put the "
            "model's tokenizer.json and tokenizer_config.json (with its chat_template) there, or remove "
            "prompt_style.yaml to prompt with litgpt's style for the model.")
    return style
