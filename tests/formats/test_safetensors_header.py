"""The safetensors header, read through the file's own descriptor: accepted and refused exactly as the
``safetensors`` package accepts and refuses it, with the same tensors, and a typed error naming the file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from lightning_lowmem import Checkpoint, CheckpointFormatError
from lightning_lowmem.formats.safetensors_header import DTYPES

_STATE = {"w": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64), "s": torch.tensor(2.0, dtype=torch.bfloat16),
          "e": torch.empty(0, 7)}


def _header_of(path: Path) -> dict:
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + size])


def _write(path: Path, header: dict | str, data: bytes) -> None:
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _theirs(path: Path) -> dict | None:
    """What safetensors reads: name -> (shape, dtype, bytes), or None when it refuses the file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype(), f.get_tensor(k))
                    for k in f.keys()}
    except Exception:  # noqa: BLE001  (any refusal)
        return None


def _ours(path: Path) -> dict | None:
    try:
        with Checkpoint.open(path) as ckpt:
            return {k: (r.shape, r.dtype, ckpt.read(k)) for k, r in ckpt.records.items()}
    except CheckpointFormatError as e:
        assert str(path) in str(e)
        return None


_EDITS = st.one_of(
    st.tuples(st.sampled_from(["w", "b", "s", "e"]), st.sampled_from(["shape", "data_offsets"]), st.integers(0, 1),
              st.integers(-2, 200)),
    st.tuples(st.sampled_from(["w", "b", "s", "e"]), st.just("dtype"), st.just(0),
              st.sampled_from(["F32", "F16", "BF16", "I64", "I8", "U8", "BOOL", "F64", "X9", ""])),
    st.tuples(st.sampled_from(["w", "b", "s", "e"]), st.sampled_from(["drop", "extra"]), st.just(0), st.just(0)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(_EDITS, min_size=1, max_size=3))
def test_a_header_is_read_as_safetensors_reads_it(tmp_path, edits):
    save_file(_STATE, tmp_path / "src.safetensors")
    header, data = _header_of(tmp_path / "src.safetensors"), (tmp_path / "src.safetensors").read_bytes()
    data = data[8 + struct.unpack("<Q", data[:8])[0]:]
    for name, field, index, value in edits:
        entry = header[name]
        if field == "drop":
            entry.pop("dtype", None)
        elif field == "extra":
            entry["more"] = 1
        elif field == "dtype":
            entry["dtype"] = value
        elif index < len(entry[field]):
            entry[field][index] = value
    _write(tmp_path / "edited.safetensors", header, data)
    theirs, ours = _theirs(tmp_path / "edited.safetensors"), _ours(tmp_path / "edited.safetensors")
    if theirs is not None and any(dtype not in DTYPES for _, dtype, _ in theirs.values()):
        assert ours is None  # a dtype safetensors knows and lightning_lowmem does not load
        return
    assert (ours is None) == (theirs is None), (header, theirs and list(theirs), ours and list(ours))
    for key, (shape, _, tensor) in (theirs or {}).items():
        assert ours[key][0] == shape and torch.equal(ours[key][2], tensor)


@pytest.mark.parametrize("header, match", [
    ('{"a": [1, 2]}', "entry for 'a' is not"),
    ('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "b": 3}', "entry for 'b' is not"),
    ('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
     '"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', "'a' starts at byte 4 of the data, where the "
                                                                     "tensor before it ends at 0"),
    ('{"__metadata__": {"k": 1}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "__metadata__"),
    ('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, \xff}', "UTF-8 JSON"),
])
def test_malformed_headers_are_typed_errors(tmp_path, header, match):
    path = tmp_path / "bad.safetensors"
    text = header.encode("latin-1")
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 8)
    assert _theirs(path) is None
    with pytest.raises(CheckpointFormatError, match=match):
        Checkpoint.open(path)


def test_a_header_larger_than_safetensors_reads_is_refused_before_reading_it(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 100_000_001) + b"{" + b" " * 64)
    with pytest.raises(CheckpointFormatError, match="safetensors reads at most 100000000"):
        Checkpoint.open(path)
