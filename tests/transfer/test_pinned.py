"""The host pool: blocks of whole pages, counted as the placement and the estimate count them, pinned for CUDA only
by the library itself (never through torch's process-wide pinned cache), pinning refused logged once."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
import torch

import lightning_lowmem
from lightning_lowmem.transfer import HostPool, block_nbytes, lay_out, pinned

PAGE = pinned.PAGE


def test_a_block_is_whole_pages_and_the_pool_counts_what_it_holds():
    pool = HostPool("cpu")
    first, second = pool.block(1), pool.block(PAGE + 1)
    assert (first.numel(), second.numel()) == (PAGE, 2 * PAGE) == (block_nbytes(1), block_nbytes(PAGE + 1))
    assert pool.nbytes == 3 * PAGE and not pool.pinned
    view = second[:10]
    pool.release(second)
    assert pool.nbytes == PAGE and view.untyped_storage().nbytes() >= 10  # a view outlives its block's release
    pool.close()
    pool.close()
    assert pool.nbytes == 0


def test_parts_are_laid_out_64_byte_aligned_in_any_order():
    assert lay_out([1, 100, 64]) == ([0, 64, 192], 256)
    assert lay_out([64, 100, 1])[1] == lay_out([1, 100, 64])[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="pins for real where CUDA is available")
def test_pinning_refused_falls_back_to_pageable_blocks_of_the_same_bytes_logged_once(monkeypatch, caplog):
    """Here pinning is refused for real: this machine has no CUDA runtime to register host memory with."""
    monkeypatch.setattr(pinned, "_refused_logged", False)
    pool = HostPool("cuda:0", pin=True)
    with caplog.at_level(logging.WARNING, logger="lightning_lowmem.transfer.pinned"):
        blocks = [pool.block(5000), pool.block(10)]
    refusals = [r for r in caplog.records if "was refused" in r.getMessage()]
    assert len(refusals) == 1 and "pageable memory instead" in refusals[0].getMessage()
    assert [b.numel() for b in blocks] == [2 * PAGE, PAGE] and pool.nbytes == 3 * PAGE and not pool.pinned
    assert all(b.data_ptr() % PAGE == 0 for b in blocks) and pinned.registered_nbytes() == 0
    pool.close()


def test_no_module_empties_the_process_wide_pinned_cache():
    """torch's pinned cache is every user's (a DataLoader with pin_memory): the library gives back its own blocks
    only (``HostPool``), and never empties the cache."""
    calls = []
    for path in Path(lightning_lowmem.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else node.value if isinstance(node, ast.Constant) \
                else None
            if name in ("_host_emptyCache", "_accelerator_emptyHostCache", "empty_host_cache"):
                calls.append(f"{path.name}:{node.lineno}")
    assert not calls, calls
