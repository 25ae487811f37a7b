"""What a tokenizer holds once built, from the counts of its vocabulary and merges, read before it is built: the
estimate counts the tokenizer ``generate()`` keeps while it generates.

The vocabulary comes from a GGUF file's arrays (:mod:`.gguf_tokenizer` builds it), or a directory's
``tokenizer.json`` (litgpt's ``Tokenizer`` reads it). A ``tokenizer.model`` (SentencePiece) is bounded by its size.
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_ENTRY_BYTES = 220
"""Resident bytes per vocabulary entry (a token or a merge) of a built tokenizer, once the heap its building freed was
handed back: 216, 188 and 229 bytes measured for byte-level BPE vocabularies of 32k, 49k and 131k tokens with their
merges; 218 for a 50k-token word-level one, 177 for SmolLM2's 49k tokens and merges (docs/benchmarks.md)."""
TOKENIZER_SETUP_BYTES = 5 * 2**20
"""What building the first one from a GGUF file costs beyond its entries (transformers' converter; measured: 5-6 MiB).
Reading a ``tokenizer.json`` costs no more than its entries (measured: 195 and 170 bytes an entry, all told)."""
SENTENCEPIECE_FILE_BYTES = 10
"""Resident bytes per byte of a ``tokenizer.model`` file: the highest per file byte measured for ``tokenizer.json``
files (9.7 for a word-level vocabulary, 4.9 for a BPE one); SentencePiece's own not measured."""


def entries_nbytes(entries: int, setup: int = TOKENIZER_SETUP_BYTES) -> int:
    """The bytes a tokenizer of ``entries`` tokens and merges holds, ``setup`` beyond them (0 for none)."""
    return entries * TOKENIZER_ENTRY_BYTES + setup if entries else 0


def directory_tokenizer_nbytes(directory: Path) -> int:
    """The bytes litgpt's ``Tokenizer`` of ``directory`` holds once built: from ``tokenizer.json``'s vocabulary and
    merges, else bounded by the size of ``tokenizer.model``; 0 without either (or with a file that is not one)."""
    path = directory / "tokenizer.json"
    if path.is_file():
        try:
            model = json.loads(path.read_text()).get("model", {})
        except (OSError, ValueError, AttributeError):
            return 0
        vocab, merges = model.get("vocab") or {}, model.get("merges") or []
        return entries_nbytes(len(vocab) + len(merges), setup=0) if isinstance(vocab, (dict, list)) else 0
    spm = directory / "tokenizer.model"
    return spm.stat().st_size * SENTENCEPIECE_FILE_BYTES if spm.is_file() else 0
