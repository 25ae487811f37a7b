"""The platforms: Linux and macOS load and save, each missing call has a fallback that runs (forced here on Linux by
the probe saying the call is missing), and Windows gets one clear error at import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_lowmem import system

IMPORT_AS = """
import os, sys
{prepare}
try:
    import lightning_lowmem
except ImportError as e:
    from lightning_lowmem.errors import LowMemError
    print("REFUSED", type(e).__name__, isinstance(e, LowMemError), e)
else:
    print("IMPORTED")
"""


@pytest.mark.parametrize(("prepare", "says"), [
    ('sys.modules["fcntl"] = None; sys.platform = "win32"', "this is win32 (it has no fcntl)"),
    ('sys.platform = "win32"', "this is win32."),
    ('sys.modules["fcntl"] = None', "this is linux (it has no fcntl)"),
    ("del os.pread", "this is linux (it has no os.pread)"),
], ids=["windows", "windows-platform", "no-fcntl", "no-pread"])
def test_windows_gets_one_clear_error_at_import(prepare, says, child_env):
    done = subprocess.run([sys.executable, "-c", IMPORT_AS.format(prepare=prepare)], capture_output=True, text=True,
                          env=child_env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("REFUSED UnsupportedPlatformError True"), done.stdout + done.stderr[-2000:]
    assert says in done.stdout and "runs on Linux and macOS" in done.stdout and "WSL2" in done.stdout


def test_linux_imports(child_env):
    done = subprocess.run([sys.executable, "-c", IMPORT_AS.format(prepare="")], capture_output=True, text=True,
                          env=child_env, timeout=120)
    assert done.stdout.strip() == "IMPORTED", done.stderr[-2000:]


@pytest.fixture
def without_linux_calls(monkeypatch):
    """The probes as on a system without Linux's calls: no preadv, no renameat2 (nor renamex_np), no O_TMPFILE, no
    /proc/self/mountinfo; reads of at most 1000 bytes at a time, so a tensor takes many."""
    monkeypatch.setattr(system, "HAS_PREADV", False)
    monkeypatch.setattr(system, "PREAD_CHUNK", 1000)
    monkeypatch.setattr(system, "_SWAP", [None])
    monkeypatch.setattr(system, "O_TMPFILE", None)
    monkeypatch.setattr(system, "MOUNTINFO", Path("/nonexistent/mountinfo"))
    reads = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: reads.append(n) or real(fd, n, offset))
    monkeypatch.setattr(os, "preadv", lambda *a: pytest.fail("os.preadv called without it"))
    return reads


@pytest.mark.parametrize("kind", ["safetensors", "pth"])
def test_without_linux_calls_a_checkpoint_loads_and_saves_the_same(tmp_path, kind, without_linux_calls,
                                                                  write_checkpoint, tiny_config, tiny_gpt):
    from safetensors.torch import load_file

    from lightning_lowmem import init_empty, load_checkpoint, save_checkpoint

    reference = tiny_gpt(tiny_config(), std=0.3)
    path = write_checkpoint(reference.state_dict(), kind, tmp_path / "in")
    with init_empty():
        model = type(reference)(reference.config)
    load_checkpoint(model, path, progress=False)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert without_linux_calls.count(1000) > len(reference.state_dict())  # tensors read 1000 bytes at a time
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "README.md").write_text("mine")
    for _ in range(2):  # a new directory, then one replaced: two renames, no exchange
        save_checkpoint(model, tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items() if k in saved)
    assert {"README.md", "model.safetensors"} <= set(os.listdir(tmp_path / "out"))
    assert (tmp_path / "out" / "README.md").read_text() == "mine"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".lowmem-")]


def test_on_a_mac_without_renamex_np_the_swap_falls_back(monkeypatch):
    """macOS before 10.12 has no renamex_np: probed on this libc (which has none either), the swap is None."""
    monkeypatch.setattr(sys, "platform", "darwin")
    assert system._probe_swap() is None
    monkeypatch.setattr(sys, "platform", "linux")
    assert system._probe_swap() is not None  # glibc 2.28 and later: renameat2


def test_mount_points_from_the_mount_table(tmp_path):
    assert system.is_mount_point(Path("/")) and system.is_mount_point(Path("/proc"))
    assert not system.is_mount_point(tmp_path)
    assert system._unescape(b"/mnt/with\\040space\\011tab") == b"/mnt/with space\ttab"


def test_without_a_mount_table_a_device_change_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(system, "MOUNTINFO", Path("/nonexistent/mountinfo"))
    assert system.is_mount_point(Path("/")) and system.is_mount_point(Path("/proc"))
    assert not system.is_mount_point(tmp_path)


def test_a_bind_mount_of_the_same_file_system_is_a_mount_point(tmp_path):
    """Its st_dev is its parent's: only the mount table tells (a rename of it fails with EBUSY)."""
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    (tmp_path / "source").mkdir()
    (tmp_path / "point").mkdir()
    if subprocess.run(["mount", "--bind", str(tmp_path / "source"), str(tmp_path / "point")]).returncode:
        pytest.skip("cannot bind-mount here")
    try:
        assert os.stat(tmp_path / "point").st_dev == os.stat(tmp_path).st_dev
        assert system.is_mount_point(tmp_path / "point") and not system.is_mount_point(tmp_path / "source")
    finally:
        subprocess.run(["umount", str(tmp_path / "point")])
