"""A sharded load that cannot go ahead stops every rank, before any rank reads, with the same typed error."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_lowmem.ranks.agreement import agreement, rank

MISMATCH = """
from litgpt import GPT
from lightning_lowmem import Checkpoint, init_empty, load_checkpoint
from lightning_lowmem.placement import shard_model

reads = []
for method in ("read", "read_rows"):
    real = getattr(Checkpoint, method)
    setattr(Checkpoint, method, lambda self, key, *a, _real=real, **k: reads.append(key) or _real(self, key, *a, **k))

def attempt(path):
    with init_empty():
        model = shard_model(GPT(config()), mesh)
    try:
        load_checkpoint(model, path, progress=False)
    except Exception as e:
        return dict(error=type(e).__name__, message=str(e), on_meta=all(p.is_meta for p in model.parameters()))
    return dict(error=None)

emit(both=attempt(args["wrong"]), reads_both=len(reads))
emit(one=attempt(args["wrong"] if rank == 1 else args["right"]), reads_one=len(reads))
dist.barrier()  # the ranks are still in step: nobody hangs in a collective the other never joins
emit(done=True)
"""


@pytest.mark.slow
def test_a_checkpoint_mismatch_raises_the_same_error_on_every_rank_without_hanging(
        run_ranks, shard_config, tiny_gpt, write_checkpoint, tmp_path):
    from litgpt import Config

    right = write_checkpoint(tiny_gpt(Config(**shard_config)).state_dict(), "safetensors", tmp_path / "right")
    wider = Config(**{**shard_config, "intermediate_size": 1024})
    wrong = write_checkpoint(tiny_gpt(wider).state_dict(), "safetensors", tmp_path / "wrong")
    ranks = run_ranks(MISMATCH, dict(config=shard_config, right=str(right), wrong=str(wrong)), timeout=300)
    for result in ranks:
        assert not result.timed_out and result.returncode == 0, result.stderr[-3000:]
        assert result.values["done"]
        both, one = result.values["both"], result.values["one"]
        assert both["error"] == "CheckpointMismatchError" and "mlp.fc.weight" in both["message"]
        assert one["error"] == "CheckpointDiffersError"  # rank 1's file is not rank 0's: refused before any plan
        assert both["on_meta"] and one["on_meta"]
        assert result.values["reads_both"] == result.values["reads_one"] == 0  # nothing read, anywhere
    assert "Rank 1 of 2 failed before reading" in ranks[0].values["one"]["message"]
    assert "does not hold what" in ranks[0].values["one"]["message"]


def test_without_a_process_group_the_block_runs_as_it_is():
    assert rank() == 0
    with pytest.raises(ValueError, match="own"), agreement(True):
        raise ValueError("own")
    with agreement(True):
        value = torch.ones(1)
    assert value.item() == 1


FAILURES = """
import errno, os
from litgpt import GPT
from lightning_lowmem import Checkpoint, LowMemError, init_empty, load_checkpoint
from lightning_lowmem.placement import shard_model

fault = {"key": None, "kind": None, "now": False}  # this rank's fault, injected when it reads fault["key"]
for method in ("read", "read_rows"):
    def wrapped(self, key, *a, _real=getattr(Checkpoint, method), **k):
        fault["now"] = key == fault["key"]
        if fault["now"] and fault["kind"] == "changed":  # the file modified under this rank only
            path = self.files[0].path
            os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 10**9))
        try:
            return _real(self, key, *a, **k)
        finally:
            fault["now"] = False
    setattr(Checkpoint, method, wrapped)
real_preadv = os.preadv
def preadv(fd, buffers, offset, *flags):  # the system call itself fails, as a disk or network filesystem fails
    if fault["now"] and fault["kind"] == "eio":
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    return real_preadv(fd, buffers, offset, *flags)
os.preadv = preadv

def attempt(path):
    torch.set_default_dtype(torch.bfloat16)
    with init_empty():
        model = shard_model(GPT(config()), mesh)
    torch.set_default_dtype(torch.float32)
    try:
        load_checkpoint(model, path, progress=False)
    except Exception as e:
        return dict(error=type(e).__name__, message=str(e), ours=isinstance(e, LowMemError),
                    on_meta=all(p.is_meta for p in model.parameters()))
    return dict(error=None)

for name, path, kind in args["cases"]:
    fault.update(key=args["key"] if rank == args["failing"] else None, kind=kind)
    emit(**{name: attempt(path.format(rank=rank))})
    dist.barrier()  # still in step: no rank is left in a collective another never joins
emit(done=True)
"""


def _check_every_rank_raised(ranks, name: str, error: str, failing: int) -> None:
    for result in ranks:
        assert not result.timed_out and result.returncode == 0, result.stderr[-3000:]
        assert result.values["done"]
        got = result.values[name]
        assert got["error"] == error and got["ours"] and got["on_meta"], got
        assert got["message"] == ranks[0].values[name]["message"]  # the same error, word for word, on every rank
        assert f"Rank {failing} of {len(ranks)} failed while reading its shard" in got["message"]


def test_a_read_error_on_one_rank_mid_stream_raises_the_same_error_on_every_rank(
        run_ranks, shard_config, tiny_gpt, write_checkpoint, tmp_path):
    from litgpt import Config

    path = write_checkpoint(tiny_gpt(Config(**shard_config), torch.bfloat16).state_dict(), "safetensors", tmp_path)
    ranks = run_ranks(FAILURES, dict(config=shard_config, cases=[("eio", str(path), "eio")], failing=1,
                                     key="transformer.h.1.attn.qkv.weight"), timeout=200)
    _check_every_rank_raised(ranks, "eio", "CheckpointReadError", failing=1)
    assert "Input/output error" in ranks[0].values["eio"]["message"]
    assert "transformer.h.1.attn.qkv.weight" in ranks[0].values["eio"]["message"]


def _flip_a_byte(path, tensor: torch.Tensor, tail: int) -> None:
    """Flip one bit inside ``tensor``'s bytes in the file ``path``, ``tail`` bytes from its end (its last rows)."""
    data = bytearray(path.read_bytes())
    needle = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()[-tail:]
    at = data.find(needle)
    assert at > 0 and data.find(needle, at + 1) == -1  # found once: these are the tensor's own bytes
    data[at + 1] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_stops_together_on_a_read_error_a_changed_file_and_a_damaged_record(
        world, run_ranks, shard_config, tiny_gpt, write_checkpoint, tmp_path):
    """Each fault on one rank (the last), mid-stream; and a flipped byte in a torch file, in rows only one rank reads:
    every rank raises the same error, and the ranks are still in step afterwards."""
    import shutil

    from litgpt import Config

    state = tiny_gpt(Config(**shard_config), torch.bfloat16, std=0.3).state_dict()
    good = write_checkpoint(state, "pth", tmp_path / "good")
    flipped = write_checkpoint(state, "pth", tmp_path / "flipped")
    _flip_a_byte(flipped, state["transformer.h.0.mlp.fc.weight"], tail=256)  # the last rank's rows
    for rank in range(world):  # a copy per rank: the changed one is changed under one rank only
        shutil.copy(good, tmp_path / f"copy{rank}.pth")
    cases = [("good", str(good), None), ("flipped", str(flipped), None), ("eio", str(good), "eio"),
             ("changed", str(tmp_path / "copy{rank}.pth"), "changed")]
    ranks = run_ranks(FAILURES, dict(config=shard_config, cases=cases, failing=world - 1,
                                     key="transformer.h.1.attn.qkv.weight"), world=world, timeout=300)
    _check_every_rank_raised(ranks, "eio", "CheckpointReadError", failing=world - 1)
    _check_every_rank_raised(ranks, "changed", "CheckpointFormatError", failing=world - 1)
    assert "changed" in ranks[0].values["changed"]["message"]
    for result in ranks:
        assert result.values["good"]["error"] is None  # pieces of every record, combined: their CRC-32s hold
        flip = result.values["flipped"]
        assert flip["error"] == "CheckpointFormatError" and flip["on_meta"], flip
        assert "CRC-32" in flip["message"] and "read in parts by several ranks" in flip["message"]
        assert flip["message"] == ranks[0].values["flipped"]["message"]


HEADERS = """
import os
import lightning_lowmem.formats.safetensors_file as safetensors_file
from litgpt import GPT
from lightning_lowmem import init_empty, load_checkpoint
from lightning_lowmem.formats.zip_records import ZipRecords
from lightning_lowmem.placement import shard_model

parsed, lookups = [], []
real_header, real_zip, real_stat = safetensors_file.read_header, ZipRecords.__init__, os.stat
safetensors_file.read_header = lambda file: parsed.append(file.path.name) or real_header(file)
ZipRecords.__init__ = lambda self, file: parsed.append(file.path.name) or real_zip(self, file)
def counting_stat(path, *a, **k):
    if str(path).endswith((".safetensors", ".pth")):
        lookups.append(os.path.basename(path))
    return real_stat(path, *a, **k)
os.stat = counting_stat

for name, path in args["paths"].items():
    parsed.clear(), lookups.clear()
    with init_empty():
        model = shard_model(GPT(config()), mesh)
    report = load_checkpoint(model, path, progress=False)
    weight = model.transformer.h[1].mlp.fc.weight.to_local()
    emit(**{name: dict(parsed=sorted(parsed), lookups=sorted(lookups), tensors=report.tensors,
                       sum=weight.double().sum().item())})
"""


@pytest.mark.slow
def test_headers_are_parsed_on_the_first_rank_only_and_paths_looked_up_per_file(
        run_ranks, shard_config, tiny_gpt, write_checkpoint, tmp_path):
    from litgpt import Config

    state = tiny_gpt(Config(**shard_config)).state_dict()
    paths = {"sharded": write_checkpoint(state, "sharded-safetensors", tmp_path / "sharded"),
             "pth": write_checkpoint(state, "pth", tmp_path / "pth")}
    ranks = run_ranks(HEADERS, dict(config=shard_config, paths={k: str(v) for k, v in paths.items()}), timeout=200)
    for result in ranks:
        assert not result.timed_out and result.returncode == 0, result.stderr[-3000:]
    fc = torch.chunk(state["transformer.h.1.mlp.fc.weight"], 2)
    for name, files in (("sharded", [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]),
                        ("pth", ["lit_model.pth"])):
        first, second = ranks[0].values[name], ranks[1].values[name]
        assert first["parsed"] == files and second["parsed"] == []  # rank 1 got them from rank 0
        assert first["tensors"] == second["tensors"] == len(state)
        for rank, got in enumerate((first, second)):
            assert got["sum"] == pytest.approx(fc[rank].double().sum().item(), rel=1e-12)
            # finding the path (exists, is_dir, ...) and once after the last read: per file, not per tensor
            assert all(got["lookups"].count(f) <= 6 < len(state) for f in files), got["lookups"]



COPIES = """
import ctypes, subprocess
from litgpt import GPT
from lightning_lowmem import CheckpointError, init_empty, load_checkpoint
from lightning_lowmem.placement import shard_model

if args["mounts"]:  # this rank's own node: its copy mounted at the path every rank loads, seen by this process only
    assert ctypes.CDLL(None, use_errno=True).unshare(0x00020000) == 0  # CLONE_NEWNS
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    for source, target in args["mounts"]:
        subprocess.run(["mount", "--bind", source.format(rank=rank), target], check=True)
dist.init_process_group("gloo")
from torch.distributed.device_mesh import init_device_mesh
mesh = init_device_mesh("cpu", (world,))
for name, path in args["cases"]:
    with init_empty():
        model = shard_model(GPT(config()), mesh)
    try:
        load_checkpoint(model, path.format(rank=rank), progress=False)
        emit(**{name: dict(error=None, sum=model.transformer.h[1].mlp.fc.weight.to_local().double().sum().item())})
    except Exception as e:
        emit(**{name: dict(error=type(e).__name__, message=str(e), ours=isinstance(e, CheckpointError),
                           on_meta=all(p.is_meta for p in model.parameters()))})
    dist.barrier()
"""

_KINDS = ("safetensors", "pth", "sharded-safetensors")


def _node_copies(state: dict, other: dict, kind: str, root, write_checkpoint) -> list[tuple[str, str, str]]:
    """Per-node directories of one checkpoint: ``copies`` (rank 0 and 1 hold the same bytes, modified at other times)
    and ``mixed`` (rank 1 holds a file of the same size and time, other bytes: the same model trained further).
    Returns ``(case, directory template with {rank}, file name)``."""
    import shutil

    first = write_checkpoint(state, kind, root / "first")
    second = write_checkpoint(other, kind, root / "second")
    for f, g in zip(sorted(first.parent.iterdir()), sorted(second.parent.iterdir())):
        if f.suffix != ".json":
            assert f.stat().st_size == g.stat().st_size
    for rank, (copy, mixed) in enumerate([(first, first), (first, second)]):
        shutil.copytree(copy.parent, root / f"copies{rank}")
        shutil.copytree(mixed.parent, root / f"mixed{rank}")
        for f in (root / f"copies{rank}").iterdir():
            os.utime(f, ns=(0, 10**18 + rank * 10**12))  # each node's own download: another modification time
        for f in (root / f"mixed{rank}").iterdir():
            os.utime(f, ns=(0, 10**18))  # the same size and time
    return [(case, str(root / (case + "{rank}")), first.name) for case in ("copies", "mixed")]


@pytest.mark.slow
def test_ranks_agree_on_bytes_not_times(run_ranks, shard_config, tiny_gpt, write_checkpoint, tmp_path):
    """Each node's copy of one checkpoint (same bytes, another modification time) loads; two files of the same size
    and time but other bytes refuse on every rank. Each rank reads its node's copy at the path every rank loads
    (a bind mount in its own mount namespace, as root), and at a path of its own."""
    from litgpt import Config

    state = tiny_gpt(Config(**shard_config), torch.bfloat16, std=0.3).state_dict()
    other = tiny_gpt(Config(**shard_config), torch.bfloat16, seed=1, std=0.3).state_dict()
    same_path = os.geteuid() == 0
    cases, mounts = [], []
    for kind in _KINDS:
        for case, directory, name in _node_copies(state, other, kind, tmp_path / kind, write_checkpoint):
            cases.append((f"{kind}-{case}-own-path", directory + "/" + name))
            if same_path:
                (tmp_path / kind / case).mkdir()
                mounts.append((directory, str(tmp_path / kind / case)))
                cases.append((f"{kind}-{case}-same-path", str(tmp_path / kind / case / name)))
    ranks = run_ranks(COPIES, dict(config=shard_config, cases=cases, mounts=mounts), init=False, timeout=300)
    fc = torch.chunk(state["transformer.h.1.mlp.fc.weight"], 2)
    for result in ranks:
        assert not result.timed_out and result.returncode == 0, result.stderr[-3000:]
        for kind in _KINDS:
            for where in ("own-path", "same-path")[:1 + same_path]:
                copies, mixed = result.values[f"{kind}-copies-{where}"], result.values[f"{kind}-mixed-{where}"]
                assert copies["error"] is None, copies
                assert copies["sum"] == pytest.approx(fc[result.rank].double().sum().item(), rel=1e-12)
                assert mixed["error"] == "CheckpointDiffersError" and mixed["ours"] and mixed["on_meta"], mixed
                assert mixed["message"] == ranks[0].values[f"{kind}-mixed-{where}"]["message"]  # on every rank
                assert "Rank 1 of 2 failed before reading its shard, so no rank read anything" in mixed["message"]
                assert "on rank 1 does not hold what" in mixed["message"] and "copy it again" in mixed["message"]
    messages = ranks[0].values
    for where in ("own-path", "same-path")[:1 + same_path]:
        assert "its data differs (same size and headers" in messages[f"safetensors-mixed-{where}"]["message"]
        assert "its headers differ (same size)" in messages[f"pth-mixed-{where}"]["message"]  # its CRC-32s
