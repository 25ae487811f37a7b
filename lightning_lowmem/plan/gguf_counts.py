"""A GGUF file's counts (layers, heads, widths, context) checked against its own tensors before any model is built.

A model is built from the metadata: ``{arch}.block_count`` layers, ``attention.head_count`` heads and
so on. Metadata that disagrees with the tensors would build the wrong model (4e9 layers on meta), or
fail deep inside a library (litgpt asserts the heads divide the width; 0 heads divide by zero). So
each count is checked first, from the header alone:

* it is a whole number (an integer type; not a string, float or bool), at least 1 (the context at
  most :data:`MAX_CONTEXT`); per-layer arrays (``head_count_kv`` of hybrid models) hold whole numbers;
* ``block_count`` = the blocks the tensors hold (``blk.0`` .. ``blk.N-1``);
* ``embedding_length`` = the token embedding's width; ``vocab_size`` = its rows;
* ``head_count`` divides the query projection's rows into heads of a whole, even size (the size a
  head-size field gives, when the family has one; else the width over the heads);
  ``head_count_kv`` divides ``head_count``, and the key projection has that many heads of that size;
* ``feed_forward_length`` = the rows of the first block's ``ffn_up``.

Tensor and field names are gguf's own (``gguf.Keys``, ``gguf.TENSOR_NAMES``).
"""

from __future__ import annotations

import re
from typing import Any

from lightning_lowmem.errors import CheckpointFormatError
from lightning_lowmem.formats.gguf_file import GGUFFile
from lightning_lowmem.formats.gguf_metadata import MetadataArray

MAX_CONTEXT = 1 << 30
"""Positions a context may declare (about 1e9; the longest real ones are about 1e7)."""
_BLOCK = re.compile(r"blk\.(\d+)\.")


def check_counts(file: GGUFFile) -> None:
    """Check the model counts in ``file``'s metadata against its tensors (see the module's docstring).

    Raises:
        CheckpointFormatError: naming the file, the key, the value and what the tensors say.
    """
    import gguf

    arch = file.fields.get("general.architecture")
    if not isinstance(arch, str):
        return  # no model to build from it; gguf_fields says so
    keys = {name: template.format(arch=arch) for name, template in (
        ("blocks", gguf.Keys.LLM.BLOCK_COUNT), ("width", gguf.Keys.LLM.EMBEDDING_LENGTH),
        ("ffn", gguf.Keys.LLM.FEED_FORWARD_LENGTH), ("context", gguf.Keys.LLM.CONTEXT_LENGTH),
        ("vocab", gguf.Keys.LLM.VOCAB_SIZE), ("heads", gguf.Keys.Attention.HEAD_COUNT),
        ("kv_heads", gguf.Keys.Attention.HEAD_COUNT_KV))}
    counts = {name: _count(file, key) for name, key in keys.items()}
    _check_blocks(file, keys["blocks"], counts["blocks"])
    embedding = _rows_and_cols(file, gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_EMBD] + ".weight")
    if embedding is not None:
        _equal(file, keys["vocab"], counts["vocab"], embedding[0], "rows of token_embd.weight")
        _equal(file, keys["width"], counts["width"], embedding[1], "columns of token_embd.weight")
    block = lambda tensor: gguf.TENSOR_NAMES[tensor].format(bid=0) + ".weight"  # noqa: E731
    ffn = _rows_and_cols(file, block(gguf.MODEL_TENSOR.FFN_UP))
    if ffn is not None:
        _equal(file, keys["ffn"], counts["ffn"], ffn[0], "rows of blk.0.ffn_up.weight")
    head_size = _head_size_field(file, arch)
    _check_heads(file, keys, counts, head_size, _rows_and_cols(file, block(gguf.MODEL_TENSOR.ATTN_Q)),
                 _rows_and_cols(file, block(gguf.MODEL_TENSOR.ATTN_K)))


def _count(file: GGUFFile, key: str) -> int | list[int] | None:
    """Field ``key`` as a count: a whole number >= 1 (per-layer arrays: whole numbers >= 0), or None when absent."""
    if key in file.layout.arrays:
        array = file.layout.arrays[key]
        values = array.values.tolist() if array.values is not None and array.values.dtype.kind in "iu" else None
        if values is None or any(v < 0 for v in values):
            raise _not_a_count(file, key, f"an array of {_kind(array)}")
        return values
    value = file.fields.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise _not_a_count(file, key, f"{value!r} (a {type(value).__name__})")
    limit = MAX_CONTEXT if key.endswith(".context_length") else None
    if value < 1 or (limit is not None and value > limit):
        raise CheckpointFormatError(
            f"{file.path}: {key} = {value}, which no model has (it must be at least 1"
            + (f" and at most {limit}" if limit else "") + "). The file's metadata is damaged: convert it again.")
    return value


def _kind(array: MetadataArray) -> str:
    return "strings" if array.values is None else f"{array.values.dtype} numbers (some negative)"


def _not_a_count(file: GGUFFile, key: str, seen: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{file.path}: {key} is {seen}, where GGUF stores a whole number. The file's "
                                 "metadata is damaged: convert it again.")


def _rows_and_cols(file: GGUFFile, name: str) -> tuple[int, int] | None:
    """(rows, columns) of 2-d tensor ``name`` in torch's order, or None when the file has none."""
    rec = file.records().get(name)
    return (rec.shape[0], rec.shape[1]) if rec is not None and len(rec.shape) == 2 else None


def _mismatch(file: GGUFFile, key: str, value: Any, tensors: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{file.path}: {key} = {value}, but {tensors}. The file's metadata does not fit its "
                                 "tensors: convert it again.")


def _equal(file: GGUFFile, key: str, value: int | list[int] | None, seen: int, what: str) -> None:
    if isinstance(value, int) and value != seen:
        raise _mismatch(file, key, value, f"the file's {what}: {seen}")


def _check_blocks(file: GGUFFile, key: str, value: int | list[int] | None) -> None:
    found = {int(m.group(1)) for t in file.layout.tensors if (m := _BLOCK.match(t.name))}
    blocks = max(found) + 1 if found else 0
    if isinstance(value, list):
        raise _not_a_count(file, key, "an array")
    if value is not None and value != blocks:
        held = f"the tensors hold blocks blk.0 .. blk.{blocks - 1} ({blocks})" if blocks else "no tensor is a block's"
        raise _mismatch(file, key, value, held)


def _head_size_field(file: GGUFFile, arch: str) -> tuple[str, int] | None:
    """``(key, value)`` of the field transformers takes the head size from for this family (its ``head_dim``)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    for field, name in GGUF_CONFIG_MAPPING.get(arch, {}).items():
        key = f"{arch}.{field}"
        if name == "head_dim" and key in file.fields:
            value = _count(file, key)
            return (key, value) if isinstance(value, int) else None
    return None


def _check_heads(file: GGUFFile, keys: dict[str, str], counts: dict[str, Any], head_size: tuple[str, int] | None,
                 q: tuple[int, int] | None, k: tuple[int, int] | None) -> None:
    heads, kv_heads, width = counts["heads"], counts["kv_heads"], counts["width"]
    if not isinstance(heads, int):
        return  # absent, or one per layer (hybrid models): nothing one number says of the tensors
    if isinstance(kv_heads, int) and heads % kv_heads:
        raise _mismatch(file, keys["kv_heads"], kv_heads, f"{keys['heads']} = {heads} is not a multiple of it")
    if head_size is None and isinstance(width, int) and width % heads:
        raise _mismatch(file, keys["heads"], heads, f"{keys['width']} = {width} does not divide into that many heads")
    if q is None:
        return
    size = head_size[1] if head_size is not None else q[0] // heads
    if q[0] != heads * size or size % 2:
        said = f" of {head_size[0]} = {size}" if head_size is not None else ""
        raise _mismatch(file, keys["heads"], heads, f"blk.0.attn_q.weight has {q[0]} rows, which are not that many "
                                                    f"heads of one even size{said}")
    if k is not None and isinstance(kv_heads, int) and k[0] != kv_heads * size:
        raise _mismatch(file, keys["kv_heads"], kv_heads, f"blk.0.attn_k.weight has {k[0]} rows, not that many heads "
                                                          f"of {size} rows")
