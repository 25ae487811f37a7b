"""The one thread policy: a thread's own count changes, the number a thread started later copies does not."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_lowmem.threads import in_new_thread, keeping_process_threads, own_threads, process_threads


def test_own_threads_changes_the_calling_thread_only_and_restores_it(two_threads):
    lowered = own_threads(1)
    assert torch.get_num_threads() == 1
    assert process_threads() == 2  # a thread started now copies the process-wide number, untouched
    with pytest.raises(RuntimeError, match="must run on the thread"):
        in_new_thread(lowered.restore)
    lowered.restore()
    assert torch.get_num_threads() == 2 and process_threads() == 2


def test_a_block_of_library_threads_leaves_the_process_wide_number_as_it_was(two_threads):
    with pytest.raises(KeyboardInterrupt), keeping_process_threads():
        in_new_thread(lambda: torch.set_num_threads(1))  # what a worker does as it starts
        assert process_threads() == 1  # torch.set_num_threads wrote it, as the docs say
        raise KeyboardInterrupt  # any way out puts it back
    assert process_threads() == 2 and torch.get_num_threads() == 2


def test_a_thread_of_the_library_waits_for_another_to_put_the_number_back(two_threads):
    """own_threads on one thread while another's block has the number changed: it reads the number only after the
    block put it back, so it never takes the block's 1 for the one to restore."""
    entered, seen = threading.Event(), []

    def block() -> None:
        with keeping_process_threads():
            in_new_thread(lambda: torch.set_num_threads(1))
            entered.set()
            threading.Event().wait(0.2)

    other = threading.Thread(target=block)
    other.start()
    entered.wait()
    lowered = own_threads(1)  # waits for the block
    seen.append(process_threads())
    lowered.restore()
    other.join()
    assert seen == [2] and process_threads() == 2
