"""A GGUF file's own chat template as a litgpt prompt style, rendered as transformers renders it.

A chat model's GGUF file carries its chat format (``tokenizer.chat_template``, a Jinja template, the
one its ``tokenizer_config.json`` had). ``generate`` and ``chat`` apply it through litgpt's
``PromptStyle`` interface: the prompt (and ``--sys_prompt``) become a conversation of one user turn
(after a system turn), rendered with transformers' own ``render_jinja_template`` and the file's
special tokens, with the generation prompt added, exactly as transformers'
``apply_chat_template(..., add_generation_prompt=True)`` renders it. The text is a
:class:`~lightning_lowmem.litgpt.gguf_tokenizer.TemplatedPrompt`, which the file's tokenizer encodes
as its own tokens, so the ids equal ``apply_chat_template(..., tokenize=True)``'s.

transformers 5.3's GGUF Llama tokenizer sets its ``eos_token`` to the BOS token's text; here each
special token is the one the file names (``tokenizer.ggml.eos_token_id``, ...).
"""

from __future__ import annotations

from typing import Any

from lightning_lowmem.errors import CheckpointFormatError
from lightning_lowmem.litgpt.gguf_tokenizer import TemplatedPrompt
from lightning_lowmem.litgpt.requirement import import_litgpt

PromptStyle = import_litgpt("litgpt.prompts", needed_by="A GGUF file's chat template").PromptStyle


class ChatTemplate(PromptStyle):
    """litgpt's ``PromptStyle`` for a chat template (see the module's docstring).

    Args:
        template: the Jinja chat template.
        special_tokens: ``{"bos_token": ..., "eos_token": ...}`` for the template.
        stop_ids: token ids that end a reply.

    Example::

        >>> style = ChatTemplate("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        ...                      "{% if add_generation_prompt %}<|assistant|>{% endif %}", {}, (2,))
        >>> style.apply("hi", sys_prompt="be brief"), style.stop_tokens(None)
        ('<|system|>be brief<|user|>hi<|assistant|>', ([2],))
    """

    def __init__(self, template: str, special_tokens: dict[str, str], stop_ids: tuple[int, ...], *,
                 source: str = "the checkpoint's chat template") -> None:
        self.template, self.special_tokens, self.stop_ids = template, dict(special_tokens), tuple(stop_ids)
        self.source = source

    def apply(self, prompt: str, *, sys_prompt: str | None = None, **kwargs: Any) -> str:
        """The prompt rendered. A template that cannot be rendered (a syntax error, an attribute the sandbox
        refuses, a range past its limit, unbounded recursion, its own ``raise_exception``) is a
        :class:`~lightning_lowmem.CheckpointFormatError` naming :attr:`source`: the template is the checkpoint's."""
        from transformers.utils.chat_template_utils import render_jinja_template

        messages = ([{"role": "system", "content": sys_prompt}] if sys_prompt else [])
        messages.append({"role": "user", "content": prompt})
        try:
            rendered, _ = render_jinja_template(conversations=[messages], chat_template=self.template,
                                                add_generation_prompt=True, **self.special_tokens)
        except Exception as e:  # noqa: BLE001  (jinja2's, its sandbox's and the template's own: the file's fault)
            what = " ".join(str(e).split())[:200]
            raise CheckpointFormatError(
                f"The chat template of {self.source} cannot be rendered ({type(e).__name__}: {what}); it is rendered "
                "in transformers' sandbox, which refused it. Pass prompt_style=None to generate() to send the prompt "
                "as given (or a litgpt style's name), or fix the template in the file.") from e
        return TemplatedPrompt(rendered[0])

    def stop_tokens(self, tokenizer: Any) -> tuple[list[int], ...]:
        return tuple([i] for i in self.stop_ids)


def chat_template_style(template: str | None, tokenizer: Any | None,
                        source: str = "the checkpoint's chat template") -> ChatTemplate | None:
    """The :class:`ChatTemplate` of a GGUF file's template and tokenizer (a ``GGUFTokenizer``); None without
    either. ``source`` names where the template came from, for messages."""
    if not template or tokenizer is None:
        return None
    stops = getattr(tokenizer, "end_of_turn", ()) or ((tokenizer.eos_id,) if tokenizer.eos_id is not None else ())
    return ChatTemplate(template, getattr(tokenizer, "special_tokens", {}), stops, source=source)
