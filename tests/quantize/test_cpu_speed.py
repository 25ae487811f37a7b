"""The CPU speed note: said where the measured table says a scheme decodes at under half of bf16's speed, with the
measured ratio and the measured scheme that is fastest while saving memory; nothing elsewhere."""

from __future__ import annotations

import pytest
import torch

import lightning_lowmem.quantize.cpu_speed as cpu_speed
from lightning_lowmem.quantize.cpu_speed import cpu_speed_note


@pytest.fixture
def table(monkeypatch):
    measured = {("bnb.nf4", False): 0.2, ("bnb.int8", False): 0.45, ("torchao.int8wo", False): 0.8,
                ("bnb.nf4", True): 0.9}
    monkeypatch.setattr(cpu_speed, "CPU_DECODE", measured)
    return measured


def test_a_slow_scheme_is_named_with_its_ratio_and_the_fastest_saving_scheme(table):
    note = cpu_speed_note("bnb.nf4", "cpu")
    assert note.startswith("on a CPU, bnb.nf4 (0.56 bytes a weight against bf16's 2) decoded at 0.20x bf16's")
    assert "(eager; measured: " in note and note.endswith("torchao.int8wo (1.00 bytes a weight against bf16's 2) "
                                                           "decoded at 0.80x.")
    assert "bnb.int8" in cpu_speed_note("bnb.int8", torch.device("cpu"))


@pytest.mark.parametrize(("scheme", "device", "compiled"), [
    ("torchao.int8wo", "cpu", False),  # at 0.8x: not slow
    ("bnb.nf4", "cpu", True),  # compiled: 0.9x
    ("bnb.nf4", "cuda", False),  # measured on a CPU only
    ("torchao.int8dq", "cpu", False),  # not measured: nothing said
    (None, "cpu", False),
])
def test_nothing_is_said_where_the_table_does_not_say_slow(table, scheme, device, compiled):
    assert cpu_speed_note(scheme, device, compiled=compiled) is None


def test_estimate_memory_carries_the_note_on_a_cpu_only(table):
    from lightning_lowmem import estimate_memory

    on_cpu = estimate_memory("pythia-14m", quantize="bnb.nf4", device="cpu", max_seq_length=32)
    assert cpu_speed_note("bnb.nf4", "cpu") in on_cpu.notes
    on_cuda = estimate_memory("pythia-14m", quantize="bnb.nf4", device="cuda", max_seq_length=32)
    assert not [note for note in on_cuda.notes if note.startswith("on a CPU")]
