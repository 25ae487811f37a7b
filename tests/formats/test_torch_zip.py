"""torch zip files (torch.save): views and shared storages, data cut short, pickles that would run code."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_lowmem import Checkpoint, CheckpointFormatError, UnsafeCheckpointError, load_checkpoint


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

    torch.save({"w": torch.ones(2), "payload": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"evil\.pt.*GLOBAL.*system.*add_safe_globals"):
        load_checkpoint(torch.nn.Linear(2, 1), tmp_path / "evil.pt")
    assert not marker.exists()
