"""Third-party noise dropped from its own loggers inside quiet(), every other message kept, nothing left behind."""

from __future__ import annotations

import logging

from lightning_lowmem.quiet import quiet, quietly


def test_only_the_listed_messages_are_dropped_and_only_inside(caplog):
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    caplog.set_level(logging.WARNING)
    with quiet():
        with quiet():  # nested: the outer block keeps the filters
            pass
        torchao.warning("Failed to load %s: %s", "_C_mxfp8.so", "Could not load this library")
        pytree.warning("%s is an Enum subclass and is now natively supported by torch.compile", "KernelPreference")
        torchao.warning("a real problem")
    torchao.warning("Failed to load outside")
    assert [r.getMessage() for r in caplog.records] == ["a real problem", "Failed to load outside"]
    assert torchao.filters == [] and pytree.filters == []


def test_quietly_wraps_a_function_and_removes_its_filters_on_error():
    @quietly
    def fails() -> None:
        assert logging.getLogger("bitsandbytes.backends.cpu.ops").filters
        raise RuntimeError("boom")

    try:
        fails()
    except RuntimeError:
        pass
    assert logging.getLogger("bitsandbytes.backends.cpu.ops").filters == []
