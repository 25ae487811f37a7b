"""torch zip files (torch.save): views and shared storages, records found through the zip directory, data cut
short or damaged, pickles that would run code or allocate without bound, and typed errors for everything odd."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch

from lightning_lowmem import (
    Checkpoint,
    CheckpointFormatError,
    CheckpointMismatchError,
    MemoryMonitor,
    UnsafeCheckpointError,
    load_checkpoint,
)


def test_views_and_shared_storage_in_torch_files(tmp_path):
    base = torch.randn(8, 6)
    state = {"full": base, "rows": base[2:5], "transposed": base.t()}
    torch.save(state, tmp_path / "views.pt")
    with Checkpoint.open(tmp_path / "views.pt") as ckpt:
        for key, tensor in state.items():
            out = ckpt.read(key)
            assert torch.equal(out, tensor)
            assert out.untyped_storage().nbytes() == tensor.numel() * 4 or key == "transposed"


def test_torch_file_with_data_cut_short_is_caught_from_headers(tmp_path):
    """A zip whose central directory survives but whose data is cut is caught before reading."""
    import zipfile

    torch.save({"w": torch.randn(1000)}, tmp_path / "src.pt")
    with zipfile.ZipFile(tmp_path / "src.pt") as src, zipfile.ZipFile(tmp_path / "cut.pt", "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, data[:100] if info.filename.endswith("data/0") else data)
    with pytest.raises(CheckpointFormatError, match=r"'w'.*truncated"):
        Checkpoint.open(tmp_path / "cut.pt")


def test_pickle_that_runs_code_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save(Payload(), tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"evil\.pt holds no state dict.*'posix\.system'.*nothing was run"):
        load_checkpoint(torch.nn.Linear(2, 1), tmp_path / "evil.pt")
    state = torch.nn.Linear(2, 1).state_dict()
    torch.save({**state, "payload": Payload()}, tmp_path / "beside.pt")  # an object beside the weights
    layer = torch.nn.Linear(2, 1)
    load_checkpoint(layer, tmp_path / "beside.pt")  # the object is not a weight: not built, not loaded
    assert torch.equal(layer.weight, state["weight"])
    assert not marker.exists()


# ---------------------------------------------------------------- records found through the zip directory

def _rezip(source: Path, target: Path, compress: int = zipfile.ZIP_STORED, edit=None) -> None:
    """``source``'s records written again by Python's zipfile (no alignment padding), ``edit(name, bytes)`` applied."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", compression=compress) as dst:
        for info in src.infolist():
            data = src.read(info)
            data = edit(info.filename, data) if edit is not None else data
            if data is not None:
                dst.writestr(info.filename, data)


def test_a_file_rewritten_by_zipfile_reads_as_torch_reads_it(tmp_path):
    state = {"w": torch.randn(33, 7), "b": torch.arange(5.0), "i": torch.tensor([3, 1, 4])}
    torch.save(state, tmp_path / "src.pt")
    _rezip(tmp_path / "src.pt", tmp_path / "rezipped.pt")  # same members, another layout
    assert torch.load(tmp_path / "rezipped.pt", weights_only=True)["w"].equal(state["w"])
    with Checkpoint.open(tmp_path / "rezipped.pt") as ckpt:
        for key, tensor in state.items():
            assert torch.equal(ckpt.read(key), tensor), key


def test_compressed_records_are_refused_not_read_as_garbage(tmp_path):
    torch.save({"w": torch.randn(64)}, tmp_path / "src.pt")
    _rezip(tmp_path / "src.pt", tmp_path / "deflated.pt", compress=zipfile.ZIP_DEFLATED)
    assert torch.load(tmp_path / "deflated.pt", weights_only=True)["w"].numel() == 64  # torch reads it
    with pytest.raises(CheckpointFormatError, match=r"deflated\.pt: record '.*' is compressed.*torch\.save"):
        Checkpoint.open(tmp_path / "deflated.pt")


def test_a_missing_record_and_a_short_record_are_errors(tmp_path):
    torch.save({"w": torch.randn(10), "v": torch.randn(4)}, tmp_path / "src.pt")
    _rezip(tmp_path / "src.pt", tmp_path / "missing.pt", edit=lambda name, data: None if name.endswith("data/1") else data)
    with pytest.raises(CheckpointFormatError, match=r"missing\.pt has no record '.*data/1', which tensor 'v' refers to"):
        Checkpoint.open(tmp_path / "missing.pt")
    _rezip(tmp_path / "src.pt", tmp_path / "short.pt", edit=lambda name, data: data[:8] if name.endswith("data/0") else data)
    with pytest.raises(CheckpointFormatError, match=r"tensor 'w'.*holds 8 bytes.*10 x torch.float32 = 40 bytes"):
        Checkpoint.open(tmp_path / "short.pt")


def test_a_view_reaching_past_its_storage_is_an_error(tmp_path):
    torch.save({"w": torch.randn(10)}, tmp_path / "src.pt")
    def grow(name: str, data: bytes) -> bytes:  # size (10,) -> (20,) in the pickle: BININT1 10, TUPLE1
        return data.replace(b"K\n\x85", b"K\x14\x85", 1) if name.endswith("data.pkl") else data
    _rezip(tmp_path / "src.pt", tmp_path / "past.pt", edit=grow)
    with pytest.raises(CheckpointFormatError, match=r"tensor 'w' \(shape \[20\].*reaches element 19 of a storage of 10"):
        Checkpoint.open(tmp_path / "past.pt")


def test_damaged_tensor_bytes_fail_their_crc(tmp_path):
    torch.save({"w": torch.randn(100, 8)}, tmp_path / "src.pt")
    data = bytearray((tmp_path / "src.pt").read_bytes())
    with zipfile.ZipFile(tmp_path / "src.pt") as z:
        info = z.getinfo("src/data/0")
    data[info.header_offset + 30 + len(info.filename) + len(info.extra) + 100] ^= 0x55
    (tmp_path / "flipped.pt").write_bytes(bytes(data))
    for read in (lambda c: c.read("w"), lambda c: [c.read_rows("w", 0, 50), c.read_rows("w", 50, 100)],
                 lambda c: [c.read_rows("w", 60, 100), c.read_rows("w", 0, 30), c.read_rows("w", 30, 60)]):
        with Checkpoint.open(tmp_path / "flipped.pt") as ckpt, pytest.raises(CheckpointFormatError, match="CRC-32"):
            read(ckpt)
    with Checkpoint.open(tmp_path / "src.pt") as ckpt:  # the intact file, read out of order: nothing left unchecked
        ckpt.read_rows("w", 60, 100), ckpt.read_rows("w", 0, 30), ckpt.read_rows("w", 30, 60)
        ckpt.read_rows("w", 0, 10)
        assert [(u.name, u.pieces[0].nbytes) for u in ckpt.unchecked()] == [("src/data/0", 10 * 8 * 4)]


# ---------------------------------------------------------------- memory the file cannot justify

def test_a_small_zip_that_inflates_without_bound_is_refused_before_inflating(tmp_path):
    torch.save({"w": torch.randn(4)}, tmp_path / "src.pt")
    bomb = b"\0" * (512 * 2**20)
    for record in ("byteorder", "data.pkl"):
        _rezip(tmp_path / "src.pt", tmp_path / f"bomb-{record}.pt", compress=zipfile.ZIP_DEFLATED,
               edit=lambda name, data: bomb if name.endswith(record) else data)
        assert (tmp_path / f"bomb-{record}.pt").stat().st_size < 2**20
        with MemoryMonitor() as monitor, pytest.raises(CheckpointFormatError, match="compressed"):
            Checkpoint.open(tmp_path / f"bomb-{record}.pt")
        assert monitor.usage.rss_peak_delta < 64 * 2**20


class _Huge:
    def __reduce__(self):
        return (bytearray, (2**30,))  # allowed by torch's weights_only unpickler


def test_a_pickle_asking_for_a_gigabyte_allocates_nothing(tmp_path):
    layer = torch.nn.Linear(4, 2)
    torch.save({"state_dict": layer.state_dict(), "hyper_parameters": {"buffer": _Huge()}}, tmp_path / "huge.ckpt")
    assert (tmp_path / "huge.ckpt").stat().st_size < 10_000
    target = torch.nn.Linear(4, 2)
    with MemoryMonitor() as monitor:
        load_checkpoint(target, tmp_path / "huge.ckpt")
    assert monitor.usage.rss_peak_delta < 64 * 2**20
    assert torch.equal(target.weight, layer.weight)


# ---------------------------------------------------------------- typed errors, never raw crashes

@pytest.mark.parametrize("kind", ["meta", "sparse", "quantized"])
def test_a_tensor_that_cannot_be_read_is_named(tmp_path, kind):
    value = {"meta": torch.empty(3, device="meta"), "sparse": torch.eye(3).to_sparse(),
             "quantized": torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8)}[kind]
    torch.save({"w": torch.ones(2), "odd": value}, tmp_path / f"{kind}.pt")
    with pytest.raises(CheckpointFormatError, match=rf"{kind}\.pt.*(tensor 'odd' is a kind|storage)"):
        Checkpoint.open(tmp_path / f"{kind}.pt")


def test_an_int_key_is_a_typed_error(tmp_path):
    torch.save({0: torch.ones(2), "w": torch.ones(2)}, tmp_path / "intkey.pt")
    with pytest.raises(CheckpointFormatError, match=r"intkey\.pt: the state dict has the key 0 \(int\)"):
        Checkpoint.open(tmp_path / "intkey.pt")


class _DuckTensor(dict):
    """Looks like a tensor to code that trusts attributes."""

    shape = (2,)
    dtype = torch.float32

    def numel(self):
        return 2


def test_an_object_posing_as_a_tensor_is_not_loaded(tmp_path):
    torch.save({"weight": _DuckTensor(), "bias": torch.ones(2)}, tmp_path / "duck.pt")
    with Checkpoint.open(tmp_path / "duck.pt") as ckpt:
        assert list(ckpt.records) == ["bias"]
    with pytest.raises(CheckpointMismatchError, match="'weight'"):
        load_checkpoint(torch.nn.Linear(3, 2), tmp_path / "duck.pt")


@pytest.mark.parametrize("content", [b"\xff\xfe\x00", b"big\x00", "l\u00e9ttle".encode()])
def test_a_malformed_byteorder_record_is_a_typed_error(tmp_path, content):
    torch.save({"w": torch.ones(2)}, tmp_path / "src.pt")
    _rezip(tmp_path / "src.pt", tmp_path / "order.pt", edit=lambda n, d: content if n.endswith("byteorder") else d)
    with pytest.raises(CheckpointFormatError, match=r"order\.pt says its byte order is"):
        Checkpoint.open(tmp_path / "order.pt")


def test_entries_left_unread_are_read_whole_or_by_rows(tmp_path):
    from lightning_lowmem.formats.entry_tensor import EntryTensor
    from lightning_lowmem.formats.state_entry import choosing_entry

    state = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    torch.save({"model": {"w": torch.ones(2)}, "optimizer": {"state": {"w": {"exp_avg": state}}}, "n": torch.ones(3)},
               tmp_path / "f.ckpt")
    with choosing_entry(lambda path, found: "model"), Checkpoint.open(tmp_path / "f.ckpt") as ckpt:
        rest, _ = ckpt.other_entries(frozenset({"optimizer"}))
        handle = rest["optimizer"]["state"]["w"]["exp_avg"]
        assert isinstance(handle, EntryTensor) and handle.shape == (6, 4) and handle.nbytes == state.nbytes
        assert torch.equal(rest["n"], torch.ones(3))  # other entries read as before
        assert torch.equal(handle.read_rows(2, 5), state[2:5]) and torch.equal(handle.read(), state)
        out = torch.empty(1, 4)
        assert handle.read_rows(5, 6, out=out) is out and torch.equal(out, state[5:])
        with pytest.raises(IndexError):
            handle.read_rows(4, 7)
