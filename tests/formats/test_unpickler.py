"""The inert unpickler: attributes set on a tensor after it is built (BUILD) are refused, records torch checks are
checked, and what a pickle builds stays bounded by its size (containers copied again and again, tuples nested on
themselves as keys, values built from containers)."""

from __future__ import annotations

import collections
import zipfile
from pathlib import Path

import pytest
import torch

from lightning_lowmem import (
    Checkpoint,
    CheckpointFormatError,
    MemoryMonitor,
    UnsafeCheckpointError,
    load_checkpoint,
)
from lightning_lowmem.formats.state_entry import choosing_entry

MiB = 2**20


class _Built:
    """A tensor of 4 elements at offset 4 of an 8-element storage whose other half is 9s, with a BUILD state."""

    def __init__(self, state) -> None:
        self.state = state

    def __reduce__(self):
        storage = torch.tensor([9.0, 9, 9, 9, 1, 2, 3, 4])._typed_storage()
        return (torch._utils._rebuild_tensor_v2, (storage, 4, (4,), (1,), False, collections.OrderedDict()),
                self.state)


@pytest.mark.parametrize("state", [{"offset": 0}, {"offset": -64}, {"stride": (-1,)}, {"storage": None},
                                   {"shape": None}, 5, ({}, {"offset": 0})])
def test_a_build_state_on_a_tensor_is_refused_naming_the_file_and_the_key(tmp_path, state):
    path = tmp_path / "built.pt"
    torch.save({"w": _Built(state), "b": torch.ones(4)}, path)
    with pytest.raises(Exception):
        torch.load(path, weights_only=True)  # torch refuses these files too
    with pytest.raises(UnsafeCheckpointError, match=r"built\.pt: .*attributes on tensor 'w'.*nothing was applied"):
        Checkpoint.open(path)
    layer = torch.nn.Linear(4, 1)
    before = layer.weight.detach().clone()
    with pytest.raises(UnsafeCheckpointError):
        load_checkpoint(layer, path, strict=False)
    assert torch.equal(layer.weight, before)


def test_a_build_state_on_a_tensor_beside_the_weights_is_refused(tmp_path):
    path = tmp_path / "beside.ckpt"
    torch.save({"model": torch.nn.Linear(4, 1).state_dict(), "optimizer": {"m": [_Built({"offset": -64})]}}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"beside\.ckpt: .*in the entries beside the weights"):
        Checkpoint.open(path)


def test_a_state_dicts_metadata_is_kept_as_torch_keeps_it(tmp_path):
    state = torch.nn.Linear(4, 1).state_dict()
    torch.save({"model": state, "ema": state}, tmp_path / "meta.ckpt")
    with choosing_entry(lambda path, found: "model"), Checkpoint.open(tmp_path / "meta.ckpt") as ckpt:
        rest, inert = ckpt.other_entries()
    assert rest["ema"]._metadata == state._metadata and not inert
    assert torch.equal(rest["ema"]["weight"], state["weight"])


def _rezip(source: Path, target: Path, name: str, content: bytes) -> None:
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, content if info.filename.endswith(name) else src.read(info))


@pytest.mark.parametrize("content", [b"xx", b"", b"-64", b"0", b"6 4", b"\xd9\xa4"])
def test_a_storage_alignment_that_is_not_a_positive_number_is_a_typed_error(tmp_path, content):
    torch.save({"w": torch.ones(2)}, tmp_path / "src.pt")
    _rezip(tmp_path / "src.pt", tmp_path / "aligned.pt", ".storage_alignment", content)
    if content == b"xx":
        with pytest.raises(ValueError):
            torch.load(tmp_path / "aligned.pt", weights_only=True)
    with pytest.raises(CheckpointFormatError, match=r"aligned\.pt: its record '.*\.storage_alignment' holds"):
        Checkpoint.open(tmp_path / "aligned.pt")
    _rezip(tmp_path / "src.pt", tmp_path / "fine.pt", ".storage_alignment", b"4096")
    with Checkpoint.open(tmp_path / "fine.pt") as ckpt:
        assert torch.equal(ckpt.read("w"), torch.ones(2))


class _View:
    """A tensor whose view has the given offset, shape and stride, as the pickle's arguments (no BUILD)."""

    def __init__(self, offset, shape, stride) -> None:
        self.args = offset, shape, stride

    def __reduce__(self):
        storage = torch.arange(8.0)._typed_storage()
        return (torch._utils._rebuild_tensor_v2, (storage, *self.args, False, collections.OrderedDict()))


@pytest.mark.parametrize("args", [(0, (4,), (-1,)), (-4, (4,), (1,)), (0, (2**62,), (1,)), (0, (4, 2), (1,)),
                                  (0, (4,), (1.5,))])
def test_a_view_with_impossible_numbers_is_a_typed_error_naming_the_key(tmp_path, args):
    torch.save({"w": _View(*args)}, tmp_path / "view.pt")
    with pytest.raises(CheckpointFormatError, match=r"view\.pt: tensor 'w' cannot be read: its (offset|shape)"):
        Checkpoint.open(tmp_path / "view.pt")


def test_an_empty_view_past_its_storage_beside_the_weights_is_a_typed_error(tmp_path):
    torch.save({"model": {"w": torch.ones(2)}, "empty": _View(2**40, (0,), (1,))}, tmp_path / "empty.ckpt")
    with choosing_entry(lambda path, found: "model"), Checkpoint.open(tmp_path / "empty.ckpt") as ckpt:
        with pytest.raises(CheckpointFormatError, match="reaches element"):
            ckpt.other_entries()


def test_a_broadcast_view_beside_the_weights_is_a_view_as_torch_gives_it(tmp_path):
    torch.save({"model": {"w": torch.ones(2)}, "big": _View(0, (2**40,), (0,))}, tmp_path / "expand.ckpt")
    with MemoryMonitor() as monitor, choosing_entry(lambda path, found: "model"), \
            Checkpoint.open(tmp_path / "expand.ckpt") as ckpt:
        big = ckpt.other_entries()[0]["big"]
    assert big.shape == (2**40,) and big.stride() == (0,) and big[123].item() == 0.0
    assert monitor.usage.rss_peak_delta < 64 * MiB


class _Copy:
    """``list(shared)``: a few bytes of pickle for a copy of a list the pickle holds once."""

    def __init__(self, shared: list) -> None:
        self.shared = shared

    def __reduce__(self):
        return (list, (self.shared,))


class _Call:
    """``func(arg)`` in the pickle."""

    def __init__(self, func, arg) -> None:
        self.func, self.arg = func, arg

    def __reduce__(self):
        return (self.func, (self.arg,))


def _nested_tuple(depth: int) -> tuple:
    x: tuple = (0,)
    for _ in range(depth):
        x = (x, x)
    return x


def _nested_list(depth: int) -> list:
    x: list = [0]
    for _ in range(depth):
        x = [x, x]
    return x


@pytest.mark.parametrize("kind", ["copies", "tuple key", "str of a nested list"])
def test_what_a_pickle_builds_is_bounded_by_its_size(tmp_path, kind):
    """Before the bound: 1000 copies of a 50,000-item list took +390 MiB; hashing a tuple nested 26 times on itself
    visits 2**26 tuples; ``builtins.str`` (protocol 4 names it so) of a list nested 24 times on itself made a
    117 MB string."""
    shared = list(range(50_000))
    extra = {"copies": lambda: [_Copy(shared) for _ in range(1000)],
             "tuple key": lambda: {_nested_tuple(26): 1},
             "str of a nested list": lambda: _Call(str, _nested_list(24))}[kind]()
    layer = torch.nn.Linear(4, 1)
    torch.save({"model": layer.state_dict(), "extra": extra}, tmp_path / "bounded.ckpt", pickle_protocol=4)
    assert (tmp_path / "bounded.ckpt").stat().st_size < 2**20
    with MemoryMonitor() as monitor:
        try:
            with Checkpoint.open(tmp_path / "bounded.ckpt") as ckpt:
                rest, inert = ckpt.other_entries()
            assert kind == "str of a nested list" and inert == ["extra"]  # not built, and named
        except CheckpointFormatError as e:
            assert kind != "str of a nested list" and "far more items than its bytes hold" in str(e)
    assert monitor.usage.rss_peak_delta < 64 * MiB
