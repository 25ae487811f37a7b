"""Memory accounting: the monitor's timeline, and the heap a quantized model's first forward gives back.

The timeline follows a 100 MiB allocation, keeps its marks in order, and stays under its cap with the
peak kept. bitsandbytes repacks 4-bit weights for its CPU kernel; int8 layers dequantize or convert
theirs; the loader hooks :func:`lightning_lowmem.memory.heap.trim_after_first_forward` on each quantized
layer, and the heap they free goes back to the OS (fresh processes).
"""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
import time

import pytest
import torch

from lightning_lowmem.memory import MemoryMonitor, Sample, Timeline

MIB = 2**20


def test_a_monitor_keeps_no_timeline_unless_asked():
    with MemoryMonitor() as mon:
        pass
    assert mon.usage.timeline is None
    with pytest.raises(RuntimeError, match="timeline=True"):
        with MemoryMonitor() as mon:
            mon.mark("nothing to put it on")


def test_the_timeline_follows_a_100_mib_allocation():
    with MemoryMonitor(timeline=True, interval=0.002) as mon:
        time.sleep(0.03)
        block = mmap.mmap(-1, 100 * MIB, flags=mmap.MAP_PRIVATE)  # anonymous, outside malloc: close() gives it back
        for page in range(0, 100 * MIB, 4096):
            block[page] = 1  # every page written
        time.sleep(0.06)
        block.close()
        time.sleep(0.06)
    timeline = mon.usage.timeline
    seconds = [p.seconds for p in timeline.points]
    assert len(seconds) >= 20
    assert seconds == sorted(seconds) and 0 <= seconds[0] and seconds[-1] <= mon.usage.seconds + 0.05
    held = [(p.anon - timeline.start.anon) / MIB for p in timeline.points]
    assert 95 <= max(held) <= 130, held  # the tensor, plus what the interpreter moved meanwhile
    assert held[0] < 20 and held[-1] < 20
    assert max(p.anon for p in timeline.points) <= mon.usage.anon_peak
    assert all(p.file > 0 for p in timeline.points) or sys.platform != "linux"  # torch's libraries at least
    assert all((p.device is None) == (mon.device is None) for p in timeline.points)


def test_marks_are_kept_in_order_within_the_block():
    with MemoryMonitor(timeline=True) as mon:
        mon.mark("first")
        time.sleep(0.02)
        mon.mark("second")
    marks = mon.usage.timeline.marks
    assert [m.label for m in marks] == ["first", "second"]
    assert 0 <= marks[0].seconds < marks[1].seconds <= mon.usage.seconds
    with pytest.raises(RuntimeError, match="inside"):
        mon.mark("after the block")


def test_the_cap_holds_and_keeps_the_peak_and_the_whole_span():
    timeline = Timeline(start=Sample(0.0, 100, 10), max_points=16)
    for i in range(1000):
        timeline.add(Sample(i / 1000, 100 + (500 if i == 537 else i % 7), 10))
        assert len(timeline.points) <= 16
    timeline.flush()
    seconds = [p.seconds for p in timeline.points]
    assert 8 <= len(seconds) <= 16 and seconds == sorted(seconds)
    assert seconds[0] < 0.1 and seconds[-1] > 0.9  # points spread over the whole block, not its start only
    assert max(p.anon for p in timeline.points) == 600

    with MemoryMonitor(timeline=True, interval=0.001, max_points=8) as mon:
        time.sleep(0.1)
    assert 2 <= len(mon.usage.timeline.points) <= 8
    with pytest.raises(ValueError, match="at least 2"):
        Timeline(max_points=1)


def test_a_timeline_travels_as_json():
    with MemoryMonitor(timeline=True) as mon:
        mon.mark("model built")
    timeline = mon.usage.timeline
    assert Timeline.from_dict(json.loads(json.dumps(timeline.to_dict()))) == timeline
    broken = timeline.to_dict() | {"anon": []}
    with pytest.raises(ValueError, match="columns"):
        Timeline.from_dict(broken)
    with pytest.raises(ValueError, match="to_dict"):
        Timeline.from_dict({"seconds": []})

FIRST_FORWARD = """
import json, sys, torch, litgpt, psutil
import bitsandbytes, torchao.quantization
from lightning_lowmem import init_empty, load_checkpoint
with init_empty():
    model = litgpt.GPT(litgpt.Config.from_file(sys.argv[1]))
load_checkpoint(model, sys.argv[2], dtype=torch.bfloat16, quantize=sys.argv[4])
if sys.argv[3] == "untrimmed":  # what bitsandbytes leaves without lightning_lowmem's hooks
    for m in model.modules():
        handle = m.__dict__.pop("_lowmem_trim_hook", None)
        handle is not None and handle.remove()
rss = psutil.Process().memory_info().rss
with torch.no_grad():
    model(torch.randint(0, 1000, (1, 16)))
print(psutil.Process().memory_info().rss - rss)
"""


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.int8", "torchao.int8wo"])
def test_first_forward_gives_its_temporaries_back(large_checkpoint, child_env, scheme):
    """A quantized layer's first CPU forward frees temporaries that would stay resident without the hooks.

    Measured here (10 layers, a 1 x 16 batch), RSS kept after the first forward without / with the
    hooks: bnb.nf4 65-92 / 11.5-12.9 MiB; bnb.int8 55-140 / 6.5-12.4 MiB; torchao.int8wo 15.5-38.9 /
    7.6-11.7 MiB. What is kept without the hooks varies with the heap's state (torchao.int8wo kept 15.5-16 MiB
    in some runs: then there is little to give back); with them it is at most 0.38x of the larger values.
    The bounds: at most 24 MiB kept, and, when more than that is kept without the hooks, at most 0.6x of it.
    """
    path, _ = large_checkpoint

    def kept(mode: str) -> int:
        proc = subprocess.run([sys.executable, "-c", FIRST_FORWARD, str(path.parent / "model_config.yaml"),
                               str(path), mode, scheme], capture_output=True, text=True, env=child_env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return int(proc.stdout.strip().splitlines()[-1])

    untrimmed, trimmed = kept("untrimmed"), kept("trimmed")
    print(scheme, "kept without / with the hooks (MiB):", round(untrimmed / 2**20, 1), round(trimmed / 2**20, 1))
    if scheme == "bnb.nf4" and untrimmed < 32 * 2**20:
        pytest.skip(f"bitsandbytes kept only {untrimmed / 2**20:.0f} MiB here: no 4-bit repack on this CPU")
    assert trimmed <= 24 * 2**20
    if untrimmed > 24 * 2**20:  # the first forward left temporaries behind: the hooks give most of them back
        assert trimmed <= 0.6 * untrimmed


def test_the_collector_is_paused_for_a_plain_load_and_runs_again_after_it_even_on_an_error(tmp_path, monkeypatch):
    import gc

    from safetensors.torch import save_file

    from lightning_lowmem import Checkpoint, CheckpointMismatchError, init_empty, load_checkpoint

    save_file({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, tmp_path / "model.safetensors")
    seen = []
    real_read = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read",
                        lambda self, *a, **kw: seen.append(gc.isenabled()) or real_read(self, *a, **kw))
    with init_empty():
        layer = torch.nn.Linear(2, 2)
    load_checkpoint(layer, tmp_path / "model.safetensors")
    assert seen == [False, False] and gc.isenabled()
    with init_empty():  # a transform may leave reference cycles: the collector keeps running
        layer = torch.nn.Linear(2, 2)
    load_checkpoint(layer, tmp_path / "model.safetensors", transform=lambda n, t: seen.append(gc.isenabled()) or t)
    assert seen[2:] == [True] * 4 and gc.isenabled()
    with pytest.raises(CheckpointMismatchError), init_empty():
        load_checkpoint(torch.nn.Linear(3, 2), tmp_path / "model.safetensors")
    assert gc.isenabled()
