"""Row workers: blocks of rows quantized on threads of their own, the caller's thread settings untouched."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import lightning_lowmem.quantize.rows as rows
from lightning_lowmem.quantize import make_scheme, schemes_available_on
from lightning_lowmem.quantize.rows import RowSource, map_rows
from lightning_lowmem.quantize.workers import RowWorkers, row_workers
from lightning_lowmem.threads import in_new_thread


def test_workers_run_single_threaded_and_leave_every_other_threads_count_alone(two_threads):
    """Each worker runs its kernels on one intra-op thread; the caller's count and the count a thread started
    later gets are what they were before, during the load and after it."""
    later_before = in_new_thread(torch.get_num_threads)
    with RowWorkers(2) as workers:
        inside = list(workers.map(lambda i: torch.get_num_threads(), 4))
        assert torch.get_num_threads() == 2
        assert in_new_thread(torch.get_num_threads) == later_before
    assert inside == [1, 1, 1, 1]
    assert torch.get_num_threads() == 2
    assert in_new_thread(torch.get_num_threads) == later_before


def test_two_loads_quantizing_at_once_do_not_put_back_each_others_count(two_threads):
    """Two threads entering RowWorkers again and again, side by side (two loads at once): each put back the
    process-wide number it read, and one could read the other's workers' 1 and put that back for good."""
    errors: list[BaseException] = []

    def load() -> None:
        try:
            for _ in range(15):
                with RowWorkers(2) as workers:
                    list(workers.map(lambda i: torch.get_num_threads(), 2))
        except BaseException as e:  # noqa: BLE001  (raised below, on the test's thread)
            errors.append(e)

    loads = [threading.Thread(target=load) for _ in range(2)]
    for thread in loads:
        thread.start()
    for thread in loads:
        thread.join()
    assert not errors
    assert torch.get_num_threads() == 2 and in_new_thread(torch.get_num_threads) == 2


def test_row_workers_follow_the_callers_thread_count(two_threads):
    assert row_workers(torch.device("cpu")) == 2
    assert row_workers(torch.device("meta")) == 1
    torch.set_num_threads(1)
    assert row_workers(torch.device("cpu")) == 1
    assert RowWorkers.for_cpu().count == 1


def test_map_yields_in_order_and_a_slow_block_does_not_hold_the_other_worker():
    """Every block is queued at once: while block 0 waits, the other worker takes blocks 1, 2 and 3."""
    release = threading.Event()
    done: list[int] = []

    def block(i: int) -> int:
        if i == 0:
            assert release.wait(10)
        done.append(i)
        if i == 3:
            release.set()
        return i * 10

    with RowWorkers(2) as workers:
        assert list(workers.map(block, 4)) == [0, 10, 20, 30]
    assert done == [1, 2, 3, 0]


def test_an_error_in_a_block_stops_the_rest_and_nothing_runs_after():
    started: list[int] = []

    def block(i: int) -> None:
        started.append(i)
        if i == 1:
            raise ValueError("block 1 failed")
        time.sleep(0.01)

    with RowWorkers(2) as workers:
        with pytest.raises(ValueError, match="block 1 failed"):
            list(workers.map(block, 50))
        after = len(started)
        time.sleep(0.1)
        assert len(started) == after < 50  # the rest were cancelled, none ran on


def test_workers_refuse_work_outside_their_block_and_bad_counts():
    with pytest.raises(RuntimeError, match="outside its `with` block"):
        RowWorkers(2).submit(lambda: None)
    with pytest.raises(ValueError, match="count=0"):
        RowWorkers(0)


@pytest.mark.parametrize("scheme", [s for s in ["bnb.nf4", "bnb.int8", "torchao.int8wo"]
                                    if s in schemes_available_on(torch.device("cpu"))])
def test_blocks_quantized_on_workers_are_the_bytes_of_one_thread(scheme, monkeypatch, quantize_after_load,
                                                                 assert_same_weights):
    """Blocks of 300 elements (a ragged last one) quantized by three workers at once, in any order: the same
    bytes as the whole weight quantized by the library's own path."""
    monkeypatch.setattr(rows, "CHUNK_ELEMENTS", 300)
    torch.manual_seed(0)
    source = torch.nn.Sequential(torch.nn.Linear(100, 67)).to(torch.bfloat16)
    weight = source[0].weight.detach()
    transform = make_scheme(scheme).transform
    with torch.device("meta"):
        module = transform.replace(torch.nn.Linear(100, 67), torch.bfloat16)
    module.bias = torch.nn.Parameter(source[0].bias.detach().clone(), requires_grad=False)
    calls: list[str] = []

    def read(start: int, stop: int) -> torch.Tensor:
        calls.append(threading.current_thread().name)
        return weight[start:stop].clone()

    with RowWorkers(3) as workers:
        transform.quantize(module, RowSource(tuple(weight.shape), weight.dtype, weight.device, read, workers))
    assert set(calls) <= {f"lowmem-rows-{i}" for i in range(3)} and len(calls) > 3
    assert_same_weights(torch.nn.Sequential(module), quantize_after_load(source, scheme, skip=()))


def test_map_rows_puts_each_block_at_its_place_whatever_the_order():
    """Blocks finishing in reverse order (the last, ragged one first) still fill their own rows."""
    weight = torch.arange(10 * 4, dtype=torch.float32).view(10, 4)

    def quantize(block: torch.Tensor) -> list[torch.Tensor]:
        return [block * 2, block[:, :1].clone()]

    with RowWorkers(4) as workers:
        source = RowSource((10, 4), torch.float32, torch.device("cpu"),
                           lambda a, b: (time.sleep(0.05 * (10 - a) / 3), weight[a:b])[1], workers)
        out = map_rows(source, quantize, lengths=10, chunk_elements=12)
    torch.testing.assert_close(out[0], weight * 2, rtol=0, atol=0)
    torch.testing.assert_close(out[1], weight[:, :1], rtol=0, atol=0)
