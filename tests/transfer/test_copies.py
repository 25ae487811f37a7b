"""The CUDA copy engine's one stream convention, on a GPU (skipped without one): a copy never waits for the work the
consumer has queued, a thread waiting for a copy sleeps, and pinning is the pool's own (exact, refused cleanly)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from lightning_lowmem.transfer import CudaCopies, HostPool, pinned

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SECOND = 2_000_000_000  # GPU clock cycles: ~1 s at 2 GHz (torch.cuda._sleep spins the GPU that long)


@pytest.mark.cuda
@cuda
def test_cuda_a_copy_does_not_wait_for_the_consumers_queued_work():
    """Quantization kernels queued on the load's stream must not hold the next tensor's copy back: the destination is
    allocated for the side stream, which never waits for the consumer."""
    engine = CudaCopies(torch.device("cuda", torch.cuda.current_device()))
    consumer = torch.cuda.current_stream()
    torch.cuda._sleep(SECOND // 4)  # the consumer's queued work
    busy = torch.cuda.Event()
    busy.record(consumer)
    src = engine.host_buffer(2**20)
    src.fill_(7)
    dst = engine.empty((2**20,), torch.uint8)
    fence = engine.copy(dst, src)
    fence.wait()
    assert not busy.query()  # the copy is done while the consumer's kernel still runs
    engine.hand_over([dst], fence)
    assert bool(dst.eq(7).all())  # on the consumer's stream, after the copy
    engine.close()


@pytest.mark.cuda
@cuda
def test_cuda_waiting_for_a_copy_sleeps_instead_of_spinning_a_core():
    engine = CudaCopies(torch.device("cuda", torch.cuda.current_device()))
    src = engine.host_buffer(2**20)
    dst = engine.empty((2**20,), torch.uint8)
    with torch.cuda.stream(engine.stream):
        torch.cuda._sleep(SECOND // 2)  # the side stream busy for ~0.5 s before the copy
    fence = engine.copy(dst, src)
    wall, cpu = time.perf_counter(), time.process_time()
    fence.wait()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert wall > 0.1 and cpu < 0.5 * wall, (wall, cpu)  # a spinning wait burns a core for all of it
    engine.close()


@pytest.mark.cuda
@cuda
def test_cuda_the_pool_pins_exactly_its_blocks_and_unpins_them_itself():
    host_cache = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    pool = HostPool(torch.device("cuda", torch.cuda.current_device()))
    block = pool.block(3 * pinned.PAGE + 1)
    assert block.is_pinned() and pool.pinned and block.numel() == 4 * pinned.PAGE
    assert pinned.registered_nbytes() == pool.nbytes == 4 * pinned.PAGE
    device = torch.empty(block.numel(), dtype=torch.uint8, device="cuda")
    block.fill_(3)
    device.copy_(block, non_blocking=True)
    torch.cuda.synchronize()
    assert bool(device.eq(3).all())
    pool.close()
    assert pinned.registered_nbytes() == 0 and not block.is_pinned()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == host_cache  # torch's cache untouched


@pytest.mark.cuda
@cuda
def test_cuda_pinning_refused_is_logged_once_and_leaves_no_error_behind(monkeypatch, caplog):
    """cudaHostRegister refused (an invalid flag here): the blocks stay pageable, one warning, and the refusal's CUDA
    error stays in the registering thread: the next kernel of this thread runs."""
    monkeypatch.setattr(pinned, "PORTABLE", 0xFFFF)
    monkeypatch.setattr(pinned, "_refused_logged", False)
    pool = HostPool(torch.device("cuda", torch.cuda.current_device()))
    with caplog.at_level(logging.WARNING, logger="lightning_lowmem.transfer.pinned"):
        blocks = [pool.block(100), pool.block(100)]
    assert sum("was refused" in r.getMessage() for r in caplog.records) == 1
    assert not pool.pinned and not any(b.is_pinned() for b in blocks) and pool.nbytes == 2 * pinned.PAGE
    out = torch.ones(4, device="cuda") + 1
    torch.cuda.synchronize()
    assert out.sum().item() == 8
    pool.close()
