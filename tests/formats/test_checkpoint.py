"""Checkpoint: every tensor of every format reads back equal, one at a time, without mapping the file."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_lowmem import Checkpoint, CheckpointFormatError

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]


@st.composite
def state_dicts(draw):
    n = draw(st.integers(1, 5))
    state = {}
    for i in range(n):
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        state[f"layer{i}.w"] = (torch.rand(shape) * 100).to(dtype)
    return state


@settings(max_examples=30, deadline=None)
@given(state=state_dicts(), kind=st.sampled_from(["safetensors", "pth", "lightning"]))
def test_every_tensor_reads_back_equal(tmp_path_factory, write_checkpoint, state, kind):
    path = write_checkpoint(state, kind, tmp_path_factory.mktemp("ckpt"))
    with Checkpoint.open(path) as ckpt:
        assert set(ckpt.records) == set(state)
        for key, tensor in state.items():
            rec = ckpt.records[key]
            assert (rec.shape, rec.dtype, rec.nbytes) == (tuple(tensor.shape), tensor.dtype,
                                                          tensor.numel() * tensor.element_size())
            assert torch.equal(ckpt.read(key), tensor)


def test_reads_do_not_map_the_file(tmp_path, write_checkpoint):
    """A tensor handed out must not keep the file mapped (it would pin all its pages)."""
    for kind in ("safetensors", "pth"):
        path = write_checkpoint({"w": torch.randn(256, 256)}, kind, tmp_path / kind)
        with Checkpoint.open(path) as ckpt:
            tensor = ckpt.read("w")
        maps = open(f"/proc/{os.getpid()}/maps").read()
        assert str(path) not in maps, kind
        assert tensor.sum().isfinite()


@pytest.mark.parametrize("kind", ["safetensors", "pth"])
def test_truncated_file(tmp_path, write_checkpoint, kind):
    path = write_checkpoint({"a": torch.randn(64, 64), "b": torch.randn(64)}, kind, tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 200])
    with pytest.raises(CheckpointFormatError, match="truncated") as err:
        Checkpoint.open(path)
    assert str(path) in str(err.value)


def test_metadata_of_safetensors_headers_and_of_a_torch_files_entry(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors", metadata={"format": "pt", "k": "v"})
    torch.save({"model": {"w": torch.ones(2), "__metadata__": {"k": "v"}}, "step": 1}, tmp_path / "m.ckpt")
    torch.save({"w": torch.ones(2), "__metadata__": {"k": 1}}, tmp_path / "bad.pt")  # not str -> str: none
    with Checkpoint.open(tmp_path / "m.safetensors") as a, Checkpoint.open(tmp_path / "m.ckpt") as b, \
            Checkpoint.open(tmp_path / "bad.pt") as c:
        assert (a.metadata, b.metadata, c.metadata) == ({"format": "pt", "k": "v"}, {"k": "v"}, {})
        assert list(b.records) == ["w"]


def _write_shards(directory, n: int, pickle: bool = False):
    """``n`` shards of one scalar tensor each, and the index naming them, as ``save_pretrained`` lays them out."""
    import json

    from safetensors.torch import save_file

    ext = "bin" if pickle else "safetensors"
    weight_map = {}
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}.{ext}"
        state = {f"p{i}": torch.tensor(float(i))}
        torch.save(state, directory / name) if pickle else save_file(state, directory / name)
        weight_map[f"p{i}"] = name
    index = directory / f"model.{ext}.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


_FEW_DESCRIPTORS = """
import resource, sys, torch
from lightning_lowmem import init_empty, load_checkpoint
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[3]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
n = int(sys.argv[2])
with init_empty():
    module = torch.nn.Module()
    for i in range(n):
        module.register_parameter(f"p{i}", torch.nn.Parameter(torch.empty(())))
report = load_checkpoint(module, sys.argv[1], progress=False)
assert all(module.get_parameter(f"p{i}").item() == i for i in range(n)) and report.tensors == n
print("loaded", n)
"""


@pytest.mark.parametrize("pickle", [False, True], ids=["safetensors", "bin"])
def test_more_shards_than_descriptors_load(tmp_path, child_env, pickle):
    """Every shard was held open at once: 300 shards under a limit of 128 descriptors failed (as 10,000 shards
    fail under the default 1024); a checkpoint now holds at most MAX_OPEN_FILES at a time."""
    import subprocess
    import sys

    index = _write_shards(tmp_path, 300, pickle)
    proc = subprocess.run([sys.executable, "-c", _FEW_DESCRIPTORS, str(index), "300", "128"], capture_output=True,
                          text=True, env=child_env, timeout=300)
    assert proc.returncode == 0 and "loaded 300" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize("how", ["replaced", "rewritten", "deleted"])
def test_a_released_shard_changed_before_it_is_read_again_is_caught(tmp_path, how):
    from safetensors.torch import save_file

    from lightning_lowmem.formats.checkpoint import MAX_OPEN_FILES

    index = _write_shards(tmp_path, MAX_OPEN_FILES + 6)
    first = tmp_path / f"model-00001-of-{MAX_OPEN_FILES + 6:05d}.safetensors"
    with Checkpoint.open(index) as ckpt:
        assert not any(f.is_open for f in ckpt.files)  # released after their headers
        assert [ckpt.read(f"p{i}").item() for i in range(MAX_OPEN_FILES + 6)] == list(range(MAX_OPEN_FILES + 6))
        assert sum(f.is_open for f in ckpt.files) == MAX_OPEN_FILES and not ckpt.files[0].is_open
        if how == "replaced":
            save_file({"p0": torch.tensor(7.0)}, tmp_path / "new.safetensors")
            os.replace(tmp_path / "new.safetensors", first)
        elif how == "rewritten":  # same inode, same size, other bytes and modification time
            data = bytearray(first.read_bytes())
            data[-4:] = torch.tensor(7.0).numpy().tobytes()
            with open(first, "r+b") as f:
                f.write(data)
            os.utime(first, ns=(0, os.stat(first).st_mtime_ns + 10**9))
        else:
            first.unlink()
        with pytest.raises(CheckpointFormatError, match=r"model-00001-of-.*\.safetensors (was|changed)"):
            ckpt.read("p0")
        with pytest.raises(CheckpointFormatError):
            ckpt.check_unchanged()


def _as_another_rank(change):
    """``headers_shared``'s ``share`` as a rank other than the first sees it: the first rank's readers made and sent
    (pickled, as ``broadcast_object_list`` sends them), then ``change()`` makes this rank's file at the same path
    another node's copy, before this rank opens it."""
    import pickle

    def share(make, send):
        first = make()
        sent = pickle.dumps(send(first))
        for f in first.files:
            f.close()
        change()
        return pickle.loads(sent)

    return share


def _write_other(path, kind: str, write_checkpoint, write_gguf_tensors, seed: int):
    import numpy as np

    torch.manual_seed(seed)
    state = {f"layer{i}.weight": torch.randn(64, 48) for i in range(3)} | {"norm": torch.ones(48)}
    if kind == "gguf":
        path.mkdir(parents=True)
        return write_gguf_tensors(path / "model.gguf", "llama", {k: v.numpy().astype(np.float32) for k, v in
                                                                 state.items()}), state
    return write_checkpoint(state, kind, path), state


@pytest.mark.parametrize("kind", ["safetensors", "pth", "gguf", "sharded-safetensors"])
def test_a_rank_loads_its_node_s_copy_and_refuses_other_bytes_of_the_same_size(
        tmp_path, kind, write_checkpoint, write_gguf_tensors):
    """Rank 0's file, then this rank's at the same path: the same bytes modified at another time open; other bytes of
    the same size and time (other weights) are a ``CheckpointDiffersError`` naming what differs."""
    import shutil

    from lightning_lowmem import CheckpointDiffersError
    from lightning_lowmem.formats.checkpoint import headers_shared

    first, state = _write_other(tmp_path / "first", kind, write_checkpoint, write_gguf_tensors, seed=0)
    other, _ = _write_other(tmp_path / "other", kind, write_checkpoint, write_gguf_tensors, seed=1)
    node = tmp_path / "node"

    def copy_of(source):
        def change():
            shutil.rmtree(node, ignore_errors=True)
            shutil.copytree(source.parent, node)
            for f in node.iterdir():
                os.utime(f, ns=(0, 10**18))  # this node's own time
        return change

    copy_of(first)()
    with headers_shared(_as_another_rank(copy_of(first))), Checkpoint.open(node / first.name) as ckpt:
        read = ckpt.read("layer1.weight")
        assert torch.equal(read.reshape(state["layer1.weight"].shape), state["layer1.weight"])
    expected = {"pth": "its headers differ (same size)"}.get(kind, "its data differs (same size and headers")
    with pytest.raises(CheckpointDiffersError, match=r"on rank 0 does not hold what .* holds on rank 0: ") as e, \
            headers_shared(_as_another_rank(copy_of(other))):
        Checkpoint.open(node / first.name)
    assert expected in str(e.value) and "copy it again" in str(e.value)


def test_a_checkpoint_of_another_file_count_on_another_rank_is_refused(tmp_path, write_checkpoint):
    """Rank 0 asked for another path (its own node's), which stands for four shards; this rank's stands for one."""
    import pickle

    from lightning_lowmem import CheckpointDiffersError
    from lightning_lowmem.formats import checkpoint

    state = {f"layer{i}.weight": torch.randn(64, 48) for i in range(3)}
    index = write_checkpoint(state, "sharded-safetensors", tmp_path / "rank0")
    single = write_checkpoint(state, "safetensors", tmp_path / "rank1")

    def share(make, send):  # what rank 0 made of its own path, sent as rank 0 sends it
        files = checkpoint._open_files(index)
        first = checkpoint._First(files, checkpoint.fingerprints(files, [1] * len(files)))
        sent = pickle.dumps(send(first)._replace(asked=str(index)))
        for f in files:
            f.close()
        return pickle.loads(sent)

    with pytest.raises(CheckpointDiffersError, match=r"stands for 1 files on rank 0 \(.*rank1.*\) and for \d on rank 0 \(.*rank0/model-00001"), \
            checkpoint.headers_shared(share):
        Checkpoint.open(single)


def test_a_fingerprint_samples_the_data_evenly_and_reads_no_more_than_asked(tmp_path):
    from safetensors.torch import save_file

    from lightning_lowmem.formats.files import SAMPLE_BYTES, sample_offsets

    assert sample_offsets(0, 3 * SAMPLE_BYTES, 8) == [0, SAMPLE_BYTES, 2 * SAMPLE_BYTES]  # a small file: all of it
    offsets = sample_offsets(10, 10 + 100 * SAMPLE_BYTES, 5)
    assert offsets[0] == 10 and offsets[-1] == 10 + 99 * SAMPLE_BYTES and len(set(offsets)) == 5
    save_file({"w": torch.arange(50_000, dtype=torch.float32)}, tmp_path / "m.safetensors")
    with Checkpoint.open(tmp_path / "m.safetensors") as ckpt:
        reads = []
        file = ckpt.files[0]
        real = file.pread
        file.pread = lambda size, offset: reads.append(size) or real(size, offset)
        print_ = file.fingerprint(4)
    assert print_.blocks == 4 and print_.size == os.path.getsize(tmp_path / "m.safetensors")
    assert sum(reads) <= 8 + 4 * SAMPLE_BYTES + 200  # the header (twice its size field) and four blocks
