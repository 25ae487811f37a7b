"""max_memory: the spellings of device budgets, and which device executes and which holds the offloaded layers."""

from __future__ import annotations

import pytest

from lightning_lowmem.placement import parse_max_memory


def test_max_memory_spellings():
    parsed = parse_max_memory({"cpu": "2GiB", 0: "1GiB"})
    assert list(parsed.bytes) == ["cuda:0", "cpu"] and parsed.bytes["cuda:0"] == 2**30
    assert (parsed.execution_device, parsed.offload_device) == ("cuda:0", "cpu")
    parsed = parse_max_memory({"cpu": 100})
    assert (parsed.bytes, parsed.execution_device, parsed.offload_device) == ({"cpu": 100}, "cpu", None)
    with pytest.raises(ValueError, match="accelerators"):
        parse_max_memory({"cuda:0": "1GiB", "cuda:1": "1GiB"})
