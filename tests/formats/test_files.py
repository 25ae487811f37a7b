"""Files opened once and safely: a FIFO refused, no descriptor leaked on errors, a file changed during a load caught."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from lightning_lowmem import Checkpoint, CheckpointFormatError, init_empty, load_checkpoint
from lightning_lowmem.formats.files import CHECK_SECONDS


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_fifo_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    result: list[BaseException] = []

    def open_it() -> None:
        try:
            Checkpoint.open(fifo)
        except BaseException as e:  # noqa: BLE001  (recorded for the assertion)
            result.append(e)

    thread = threading.Thread(target=open_it, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "opening a FIFO waited for a writer"
    assert isinstance(result[0], CheckpointFormatError) and "FIFO" in str(result[0])


def test_a_key_in_two_shards_leaks_no_descriptor(tmp_path):
    for shard in ("s1", "s2"):
        save_file({"a": torch.ones(2)}, tmp_path / f"{shard}.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "a.again": "s2.safetensors"}}))
    before = _open_descriptors()
    for _ in range(3):
        with pytest.raises(CheckpointFormatError, match="is in both"):
            Checkpoint.open(index)
    assert _open_descriptors() == before


@pytest.mark.parametrize("how", ["rewritten", "replaced"])
def test_a_file_changed_during_the_load_is_caught_and_the_module_untouched(tmp_path, litgpt_model, meta_gpt,
                                                                         write_checkpoint, how):
    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    other = {k: v + 1 for k, v in litgpt_model.state_dict().items()}
    seen: list[str] = []

    def change_after_first(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not seen:
            if how == "rewritten":  # in place, same size: only the bytes (and the modification time) differ
                data = bytearray(path.read_bytes())
                data[-4:] = b"\x7f\x7f\x7f\x7f"
                with open(path, "r+b") as f:
                    f.write(data)
                os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 10**9))
            else:  # a new file moved over the name, as a download tool does
                save_file({k: v.contiguous() for k, v in other.items()}, tmp_path / "new.safetensors")
                os.replace(tmp_path / "new.safetensors", path)
            time.sleep(CHECK_SECONDS)  # small reads check the file at least this often (and once at the end)
        seen.append(name)
        return tensor

    model = meta_gpt(litgpt_model.config)
    expected = "changed" if how == "rewritten" else "was replaced by another file"
    with pytest.raises(CheckpointFormatError, match=rf"model\.safetensors {expected}"):
        load_checkpoint(model, path, transform=change_after_first, progress=False)
    assert 1 <= len(seen) < len(litgpt_model.state_dict())
    assert all(t.is_meta for t in model.state_dict().values())


def test_a_directory_passed_as_a_shard_is_refused(tmp_path):
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises((CheckpointFormatError, FileNotFoundError)):
        with init_empty():
            layer = torch.nn.Linear(2, 2)
        load_checkpoint(layer, tmp_path / "model.safetensors")


def test_a_file_renamed_over_the_path_right_after_the_open_is_read_through_one_descriptor(tmp_path, monkeypatch):
    """The header was read through a second open of the path (``safe_open``): a file renamed over it in between
    paired one file's header with the other's offsets (a raw KeyError at the read)."""
    import lightning_lowmem.formats.checkpoint as checkpoint_module

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(3)}, path)
    save_file({"b": torch.zeros(5), "c": torch.ones(1)}, tmp_path / "other.safetensors")
    real_open = checkpoint_module.open_regular

    def open_then_rename(name):
        fd = real_open(name)
        if (tmp_path / "other.safetensors").exists():
            os.replace(tmp_path / "other.safetensors", path)  # another file now has the name; fd is the first
        return fd

    monkeypatch.setattr(checkpoint_module, "open_regular", open_then_rename)
    with Checkpoint.open(path) as ckpt:
        assert list(ckpt.records) == ["a"]  # the header of the file that was opened, and its data
        assert torch.equal(ckpt.read("a"), torch.ones(3))
        with pytest.raises(CheckpointFormatError, match=r"model\.safetensors was replaced by another file"):
            ckpt.check_unchanged()
    save_file({"a": torch.ones(3)}, path)
    save_file({"b": torch.zeros(5), "c": torch.ones(1)}, tmp_path / "other.safetensors")
    with init_empty():
        module = torch.nn.Module()
        module.a = torch.nn.Parameter(torch.empty(3))
    with pytest.raises(CheckpointFormatError, match=r"model\.safetensors was replaced by another file"):
        load_checkpoint(module, path)  # a load checks every file once more after its last read
    assert module.a.is_meta
