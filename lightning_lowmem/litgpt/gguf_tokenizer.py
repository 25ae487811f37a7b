"""A GGUF file's vocabulary as litgpt's ``Tokenizer``, built by transformers' GGUF tokenizer converter.

transformers' ``convert_gguf_tokenizer`` builds a ``tokenizers`` tokenizer from the vocabulary
(the tokens, scores, token types and merges this library parsed from the header); it is saved, with
the file's BOS/EOS tokens and its ``add_bos_token``, into a temporary directory that litgpt's
``Tokenizer`` reads (litgpt builds its tokenizer only from a directory).

A prompt rendered from the file's chat template (:class:`TemplatedPrompt`, from
``chat_template.py``) holds its special tokens as text already; :class:`GGUFTokenizer` encodes it
as transformers' ``apply_chat_template(..., tokenize=True)`` does: the text's own tokens, nothing
added or removed (litgpt's tokenizer drops a leading BOS when ``add_bos_token`` is false, and a
ChatML template's first ``<|im_start|>`` is the BOS of SmolLM2's files). Any other text is encoded
as litgpt encodes it.


This module imports litgpt and transformers' tokenizer converters: it is imported when a GGUF file's
tokenizer is built, not with the package.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_lowmem.litgpt.requirement import import_litgpt
from lightning_lowmem.litgpt.tokenizer_size import entries_nbytes
from lightning_lowmem.memory.heap import release_free_heap

Tokenizer = import_litgpt("litgpt.tokenizer", needed_by="A GGUF file's tokenizer").Tokenizer

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("bos", "eos", "unk", "pad")
"""The special tokens a GGUF file names by id (``tokenizer.ggml.<name>_token_id``) and a chat template may use."""
END_OF_TURN = ("eos", "eot", "eom")
"""Tokens that end a reply: end of sequence, of turn, of message (``tokenizer.ggml.<name>_token_id``)."""


class TemplatedPrompt(str):
    """A prompt rendered from a chat template: its special tokens are in its text (see the module's docstring)."""


def gguf_tokenizer(parsed: Mapping[str, Any], metadata: Mapping[str, Any], path: Path) -> Any | None:
    """litgpt's ``Tokenizer`` (a :class:`GGUFTokenizer`) of the file's vocabulary; None when the file has no
    vocabulary or transformers has no converter for it (a warning says so: prompts are then token ids).

    Args:
        parsed: the file's ``config`` and ``tokenizer`` dicts, as transformers' GGUF parser gives them.
        metadata: the file's scalar metadata fields.
        path: the file, for messages and the tokenizer's name.
    """
    from transformers.integrations.ggml import GGUF_TO_FAST_CONVERTERS, convert_gguf_tokenizer

    vocab = dict(parsed.get("tokenizer") or {})
    model_type = parsed["config"].get("model_type")
    if "tokens" not in vocab or model_type not in GGUF_TO_FAST_CONVERTERS:
        log.warning("%s: no tokenizer (%s); give prompts as token ids.", path,
                    "no vocabulary in the file" if "tokens" not in vocab else f"transformers has none for {model_type!r}")
        return None
    fast, _ = convert_gguf_tokenizer(model_type, vocab)
    spm = vocab.get("tokenizer_type", "llama") == "llama"
    tokens = vocab["tokens"]
    special = {name: tokens[i] for name in SPECIAL_TOKENS
               if isinstance(i := metadata.get(f"tokenizer.ggml.{name}_token_id"), int) and 0 <= i < len(tokens)}
    settings: dict[str, Any] = {f"{name}_token": special[name] for name in ("bos", "eos") if name in special}
    settings["add_bos_token"] = bool(metadata.get("tokenizer.ggml.add_bos_token", spm))
    settings["tokenizer_class"] = "LlamaTokenizerFast" if spm else "PreTrainedTokenizerFast"
    tokenizer = _litgpt_tokenizer(fast, settings, path.stem)
    tokenizer.special_tokens = {f"{name}_token": token for name, token in special.items()}
    tokenizer.end_of_turn = tuple(dict.fromkeys(
        i for name in END_OF_TURN
        if isinstance(i := metadata.get(f"tokenizer.ggml.{name}_token_id"), int) and 0 <= i < len(tokens)))
    del fast, vocab, tokens
    release_free_heap()  # what building it freed (lists, the converter's tokenizer, JSON): 49k BPE tokens, 30 MiB
    return tokenizer


def tokenizer_nbytes(arrays: Mapping[str, Any], model_type: str) -> int:
    """Bytes the tokenizer :func:`gguf_tokenizer` builds from a file holds (0 when it builds none), from the lengths
    of the file's vocabulary arrays (``layout.arrays``) alone."""
    from transformers.integrations.ggml import GGUF_TO_FAST_CONVERTERS

    if "tokenizer.ggml.tokens" not in arrays or model_type not in GGUF_TO_FAST_CONVERTERS:
        return 0
    return entries_nbytes(sum(len(arrays[k]) for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges") if k in arrays))


def _litgpt_tokenizer(fast: Any, settings: dict[str, Any], name: str) -> GGUFTokenizer:
    """A :class:`GGUFTokenizer` over ``fast`` (a ``tokenizers.Tokenizer``), read from a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="lowmem-gguf-tokenizer-") as directory:
        fast.save(str(Path(directory) / "tokenizer.json"))
        (Path(directory) / "tokenizer_config.json").write_text(json.dumps(settings))
        tokenizer = GGUFTokenizer(directory)
    tokenizer.model_name = name
    tokenizer.settings = dict(settings)
    return tokenizer


def write_tokenizer(tokenizer: GGUFTokenizer, directory: Path, chat_template: str | None = None) -> list[Path]:
    """A GGUF file's tokenizer as files in ``directory`` that litgpt's ``Tokenizer`` and transformers'
    ``AutoTokenizer`` read: ``tokenizer.json`` (the vocabulary as built), ``tokenizer_config.json`` (its special
    tokens, ``add_bos_token`` and ``chat_template``), ``generation_config.json`` (its end-of-turn ids as
    ``eos_token_id``). :func:`read_tokenizer` reads them back as the same tokenizer. Returns the files written."""
    tokenizer.processor.save(str(directory / "tokenizer.json"))
    config = {**tokenizer.special_tokens, **tokenizer.settings}
    if chat_template:
        config["chat_template"] = chat_template
    files = {"tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False)}
    if tokenizer.end_of_turn:
        stops = list(tokenizer.end_of_turn)
        files["generation_config.json"] = json.dumps({"bos_token_id": tokenizer.bos_id,
                                                      "eos_token_id": stops[0] if len(stops) == 1 else stops})
    for name, text in files.items():
        (directory / name).write_text(text + ("" if text.endswith("\n") else "\n"), encoding="utf-8")
    return [directory / name for name in ("tokenizer.json", *files)]


def read_tokenizer(directory: Path) -> GGUFTokenizer:
    """The tokenizer :func:`write_tokenizer` wrote into ``directory``, as it was: litgpt's ``Tokenizer`` of the
    files, its BOS added as ``add_bos_token`` says (not as litgpt guesses from the directory's name), with the
    special and end-of-turn tokens a chat template needs."""
    tokenizer = GGUFTokenizer(directory)
    settings = _json(directory / "tokenizer_config.json")
    tokenizer.settings = {k: v for k, v in settings.items() if k in ("bos_token", "eos_token", "add_bos_token",
                                                                      "tokenizer_class")}
    if isinstance(settings.get("add_bos_token"), bool):
        tokenizer.use_bos = settings["add_bos_token"]
    tokenizer.special_tokens = {f"{name}_token": settings[f"{name}_token"] for name in SPECIAL_TOKENS
                                if isinstance(settings.get(f"{name}_token"), str)}
    stops = _json(directory / "generation_config.json").get("eos_token_id", tokenizer.eos_id)
    tokenizer.end_of_turn = tuple(i for i in (stops if isinstance(stops, list) else [stops]) if isinstance(i, int))
    return tokenizer


def _json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


class GGUFTokenizer(Tokenizer):
    """litgpt's ``Tokenizer`` of a GGUF file's vocabulary.

    Attributes:
        special_tokens: ``{"bos_token": "<s>", ...}``: the file's special tokens, for a chat template.
        end_of_turn: ids that end a reply (the file's EOS, end-of-turn and end-of-message tokens).
        settings: what its ``tokenizer_config.json`` says (BOS and EOS tokens, ``add_bos_token``, class).
    """

    special_tokens: dict[str, str]
    end_of_turn: tuple[int, ...] = ()
    settings: dict[str, Any]

    def encode(self, string: str, device: torch.device | None = None, bos: bool | None = None, eos: bool = False,
               max_length: int = -1) -> torch.Tensor:
        """litgpt's ``encode``; a :class:`TemplatedPrompt` (with ``bos`` left None) as its own tokens, as
        transformers' ``apply_chat_template(tokenize=True)`` encodes it."""
        if not isinstance(string, TemplatedPrompt) or bos is not None:
            return super().encode(string, device=device, bos=bos, eos=eos, max_length=max_length)
        tokens = self.processor.encode(string, add_special_tokens=False).ids
        if eos and (not tokens or tokens[-1] != self.eos_id):
            tokens.append(self.eos_id)
        if max_length > 0:
            tokens = tokens[:max_length]
        return torch.tensor(tokens, dtype=torch.int, device=device)
