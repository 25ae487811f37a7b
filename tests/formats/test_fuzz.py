"""Property-based fuzzing of the checkpoint readers (hypothesis).

Small valid checkpoints (one safetensors file, a sharded safetensors set, a torch zip file holding
a Lightning-style checkpoint with an object whose unpickling would write a marker file, a GGUF
file written by gguf's GGUFWriter) are mutated: bytes of their structure flipped (headers, index,
zip directory, pickle: tensor bytes carry no checksum in safetensors or GGUF, so flipping them
would just be other weights; nor do a GGUF tensor's 4 type bytes, which say how its bytes are read:
F32 flipped to I32, or F16 to BF16, is the same bytes read as other numbers, so they are left out
like the data), the files truncated anywhere, header fields edited. Every outcome must be the exact original weights, or a
typed error (``LowMemError``) with the module untouched; always within a memory cap and a time
limit, and never with the marker file written.

``LOWMEM_FUZZ_EXAMPLES=5000 python -m pytest tests/formats/test_fuzz.py`` runs the long mode.
"""

from __future__ import annotations

import json
import os
import struct
import time
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

from lightning_lowmem import LowMemError, MemoryMonitor, init_empty, load_checkpoint

EXAMPLES = int(os.environ.get("LOWMEM_FUZZ_EXAMPLES", "60"))
MEMORY_CAP = 64 * 2**20
TIME_LIMIT = 10.0
KINDS = ("safetensors", "sharded", "torch", "gguf")


def _write_marker(path: str) -> None:
    """What unpickling the torch file's extra entry would call: proof that code ran."""
    Path(path).write_text("ran")


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (_write_marker, (self.marker,))


def _module() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 4, bias=False))


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in _module().state_dict().items()}


def _write(kind: str, directory: Path, marker: Path) -> tuple[Path, dict[Path, list[tuple[int, int]]]]:
    """A valid checkpoint of ``kind`` in ``directory``: what to load, and each file's structural byte ranges."""
    state = _state()
    if kind == "safetensors":
        save_file(state, directory / "model.safetensors")
        return directory / "model.safetensors", {directory / "model.safetensors": _safetensors_header(directory / "model.safetensors")}
    if kind == "sharded":
        keys, weight_map, ranges = list(state), {}, {}
        for i in range(2):
            name = f"model-{i + 1:05d}-of-00002.safetensors"
            save_file({k: state[k] for k in keys[i::2]}, directory / name)
            weight_map.update(dict.fromkeys(keys[i::2], name))
            ranges[directory / name] = _safetensors_header(directory / name)
        index = directory / "model.safetensors.index.json"
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        ranges[index] = [(0, index.stat().st_size)]
        return index, ranges
    if kind == "gguf":
        return _write_gguf(state, directory / "model.gguf")
    path = directory / "model.ckpt"
    torch.save({"state_dict": state, "hyper_parameters": {"payload": Payload(str(marker))}, "epoch": 1}, path)
    return path, {path: _zip_structure(path)}


def _write_gguf(state: dict[str, torch.Tensor], path: Path) -> tuple[Path, dict[Path, list[tuple[int, int]]]]:
    """``state`` in F32 with gguf's own writer; the header's byte ranges but each tensor's type (found by gguf's reader)."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("fuzz")
    for key, tensor in state.items():
        writer.add_tensor(key, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(path)
    types = sorted(t.field.offset + sum(int(part.nbytes) for part in t.field.parts[:4]) for t in reader.tensors)
    ranges, at = [], 0
    for start in types:
        ranges.append((at, start))
        at = start + 4
    ranges.append((at, reader.data_offset))
    del reader
    return path, {path: ranges}


def _safetensors_header(path: Path) -> list[tuple[int, int]]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
    return [(0, 8 + size)]


def _zip_structure(path: Path) -> list[tuple[int, int]]:
    """Every byte of a torch zip file but the tensor records' data."""
    size = path.stat().st_size
    data = []
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            if "/data/" in info.filename:
                with open(path, "rb") as f:
                    f.seek(info.header_offset + 26)
                    name, extra = struct.unpack("<HH", f.read(4))
                start = info.header_offset + 30 + name + extra
                data.append((start, start + info.file_size))
    ranges, at = [], 0
    for start, end in sorted(data):
        if start > at:
            ranges.append((at, start))
        at = end
    return ranges + ([(at, size)] if at < size else [])


@st.composite
def mutations(draw):
    kind = draw(st.sampled_from(KINDS))
    how = draw(st.sampled_from(["flip", "truncate", "edit"]))
    return kind, how, draw(st.randoms(use_true_random=False))


def _mutate(how: str, rng, ranges: dict[Path, list[tuple[int, int]]]) -> str:
    path = rng.choice(sorted(ranges))
    data = bytearray(path.read_bytes())
    if how == "truncate":
        cut = rng.randrange(0, len(data))
        path.write_bytes(bytes(data[:cut]))
        return f"{path.name} cut to {cut} bytes"
    if how == "edit" and path.suffix in (".json", ".safetensors"):
        return _edit_json(path, data, rng)
    flips = []
    for _ in range(rng.randint(1, 4)):
        start, end = rng.choice(ranges[path])
        at = rng.randrange(start, end)
        data[at] ^= rng.randrange(1, 256)
        flips.append(at)
    path.write_bytes(bytes(data))
    return f"{path.name} bytes {flips} flipped"


def _edit_json(path: Path, data: bytearray, rng) -> str:
    """Change one field of a safetensors header or an index to a plausible wrong value."""
    head = 8 + struct.unpack("<Q", data[:8])[0] if path.suffix == ".safetensors" else 0
    text = json.loads(bytes(data[8:head]) if head else bytes(data))
    table = text if head else text["weight_map"]
    key = rng.choice([k for k in table if k != "__metadata__"])
    values = ([[1], "F16", "I64", [0, 4], [2, 2, 2], [-1], "BOGUS"] if head else
              ["../outside.safetensors", "/etc/passwd", 5, None, [], "missing.safetensors", "a\\b"])
    field = rng.choice(["dtype", "shape", "data_offsets"]) if head else None
    if head:
        table[key][field] = rng.choice(values)
    else:
        table[key] = rng.choice(values)
    body = json.dumps(text).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + bytes(data[head:]) if head else body)
    return f"{path.name}: {key} {field or ''} edited"


@pytest.mark.parametrize("kind", KINDS)
def test_unmutated_files_load_exactly(tmp_path, kind):
    path, _ = _write(kind, tmp_path, tmp_path / "marker")
    with init_empty():
        module = _module()
    load_checkpoint(module, path, progress=False)
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, _state()[name])
    assert not (tmp_path / "marker").exists()


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=mutations())
def test_a_mutated_checkpoint_loads_exactly_or_fails_typed(tmp_path_factory, case):
    kind, how, rng = case
    directory = tmp_path_factory.mktemp(kind)
    marker = directory / "marker"
    path, ranges = _write(kind, directory, marker)
    what = _mutate(how, rng, ranges)
    with init_empty():
        module = _module()
    before = {name: (t, t.is_meta) for name, t in module.state_dict(keep_vars=True).items()}
    t0 = time.perf_counter()
    with MemoryMonitor() as monitor:
        try:
            load_checkpoint(module, path, progress=False)
            error = None
        except LowMemError as e:
            error = e
    seconds = time.perf_counter() - t0
    assert not marker.exists(), what
    assert seconds < TIME_LIMIT, (what, seconds)
    assert monitor.usage.rss_peak_delta < MEMORY_CAP, (what, monitor.usage.rss_peak_delta)
    if error is None:
        for name, tensor in module.state_dict().items():
            assert torch.equal(tensor, _state()[name]), (what, name)
    else:
        after = module.state_dict(keep_vars=True)
        assert all(after[name] is tensor and tensor.is_meta for name, (tensor, _) in before.items()), (what, error)
        assert str(error), what
