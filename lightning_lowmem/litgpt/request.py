"""A generation request's own arguments (``generate``'s sampling, lengths, seed, prompt style), checked before
anything is read or generated: a bad value is a ``TypeError`` or ``ValueError`` naming it, never an error from deep
inside torch or litgpt's loop (``'unsupported range: 0 -> nan'``, ``'selected index k out of range'``).

litgpt's own reading of each: ``temperature`` 0 is greedy; ``top_k`` None samples among every token; ``top_p`` in
[0, 1], 0 greedy, 1 off (litgpt's ``sample`` refuses anything else).
"""

from __future__ import annotations

from typing import Any

from lightning_lowmem.arguments import check_flag, check_int, check_real
from lightning_lowmem.litgpt.prompt_style import check_style_name


def check_request(*, max_new_tokens: Any, num_samples: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any,
                  compile: Any, sys_prompt: Any, prompt_style: Any, tokenizer: Any, precision: Any) -> dict[str, Any]:
    """Raise for a bad value of one of ``generate``'s own arguments; returns the sampling arguments as litgpt's loop
    takes them (``temperature`` and ``top_p`` as floats).

    Raises:
        TypeError: a value of the wrong kind (a float of tokens, a bool for a number, a tokenizer without
            ``encode``/``decode``).
        ValueError: a value out of range (0 new tokens, a negative or NaN temperature, ``top_k`` 0, ``top_p`` past 1,
            a seed torch cannot take).

    Example::

        >>> check_request(max_new_tokens=5, num_samples=1, temperature=0, top_k=None, top_p=1, seed=1234,
        ...               compile=False, sys_prompt=None, prompt_style="auto", tokenizer=None, precision=None)
        {'temperature': 0.0, 'top_k': None, 'top_p': 1.0}
    """
    check_int("max_new_tokens", max_new_tokens)
    check_int("num_samples", num_samples)
    sampling = {"temperature": check_real("temperature", temperature, 0.0),
                "top_k": top_k, "top_p": check_real("top_p", top_p, 0.0, 1.0)}
    check_int("top_k", top_k, optional=True)
    check_int("seed", seed, -(2**63), optional=True, below=2**64)  # torch.manual_seed's range
    check_flag("compile", compile)
    if sys_prompt is not None and not isinstance(sys_prompt, str):
        raise TypeError(f"sys_prompt must be a str or None, got {sys_prompt!r}.")
    if prompt_style is not None and not isinstance(prompt_style, str) and not callable(getattr(prompt_style, "apply",
                                                                                                None)):
        raise TypeError(f"prompt_style must be 'auto', None, a litgpt style's name or a litgpt.prompts.PromptStyle, "
                        f"got {prompt_style!r}.")
    if isinstance(prompt_style, str):
        check_style_name(prompt_style)
    if tokenizer is not None and not all(callable(getattr(tokenizer, n, None)) for n in ("encode", "decode")):
        raise TypeError(f"tokenizer must be a litgpt Tokenizer (with encode and decode) or None, got {tokenizer!r}.")
    if precision is not None and not isinstance(precision, str):
        raise TypeError(f"precision must be a str such as 'bf16-true', or None; got {precision!r}.")
    return sampling
