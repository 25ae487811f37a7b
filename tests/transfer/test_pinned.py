"""The host pool: blocks of whole pages, counted as the placement and the estimate count them, pinned for CUDA only
by the library itself (never through torch's process-wide pinned cache), pinning refused logged once."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
import torch

import lightning_lowmem
from lightning_lowmem import dispatch, estimate_memory, load_checkpoint
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


SCHEMES = [None, "bnb.nf4", "bnb.nf4-dq", "bnb.int8", "torchao.int8wo", "torchao.nf4"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_offloaded_layers_blocks_are_what_the_placement_and_the_estimate_count(quant_config, quant_checkpoint,
                                                                                  meta_gpt, scheme):
    """The estimate's placement for a GPU of ~half the model, and the model loaded on this CPU and dispatched by that
    placement (the CPU playing the GPU): the offload's blocks of host memory take exactly the bytes the placement
    counted against the CPU's budget, and the estimate shows."""
    whole = estimate_memory(quant_checkpoint, config=quant_config, quantize=scheme, max_seq_length=16)
    budgets = {"cuda:0": whole.caches + whole.activations + whole.weights // 2, "cpu": "1GiB"}
    est = estimate_memory(quant_checkpoint, config=quant_config, quantize=scheme, max_memory=budgets,
                          max_seq_length=16)
    placement = est.placement
    assert placement.offloaded and est.pinned == placement.pinned_bytes
    offloaded = sum(layer.nbytes for layer in placement.offloaded)
    assert 0 < placement.pinned_bytes - offloaded < len(placement.offloaded) * (PAGE + 64 * 40)
    assert placement.used_per_device()["cpu"] == placement.pinned_bytes
    assert est.generate_peak - est.pinning == est.weights + est.library + est.imports + est.tokenizer + est.caches \
        + est.activations + est.dequantized + est.runtime + est.heap + est.disk_buffers

    model = meta_gpt(quant_config)
    load_checkpoint(model, quant_checkpoint, dtype=torch.bfloat16, quantize=scheme, progress=False)
    handle = dispatch(model, placement, device="cpu")
    assert handle.pinned_bytes == placement.pinned_bytes
    assert handle.offloaded_bytes == offloaded  # the weights themselves: what the placement counts as weights
    handle.remove()


def test_the_disk_tiers_buffers_are_what_the_placement_and_the_estimate_count(quant_config, quant_checkpoint,
                                                                              meta_gpt):
    budgets = {"cpu": "150KiB"}
    est = estimate_memory(quant_checkpoint, config=quant_config, max_memory=budgets, disk_offload=True,
                          max_seq_length=16, read_bandwidth=1e9)
    model = meta_gpt(quant_config)
    report = load_checkpoint(model, quant_checkpoint, dtype=torch.bfloat16, max_memory=budgets, disk_offload=True,
                             progress=False)
    assert report.placement.on_disk
    assert report.disk.buffer_bytes == report.placement.disk_buffer_bytes == est.placement.disk_buffer_bytes
    assert est.disk_buffers >= est.placement.disk_buffer_bytes  # and the largest tensor cast as it is read
    report.disk.close()
