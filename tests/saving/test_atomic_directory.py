"""A directory replaced as a whole: the new content written beside it, what the old one holds beyond it carried over,
switched in by one exchange (or two renames where there is none), the old content removed."""

from __future__ import annotations

import os
import stat

import pytest

from lightning_lowmem import SaveError
from lightning_lowmem.saving import atomic_directory
from lightning_lowmem.saving.atomic_directory import switch_directory, tidy
from lightning_lowmem.saving.atomic_file import write_new


def _write(directory, name: str, data: bytes) -> None:
    with write_new(directory / name) as f:
        f.write(data)


def _listing(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture
def old(tmp_path):
    """``tmp_path/out``: an old save (``weights.bin``) with a README, a link, a folder, mode 0o750."""
    directory = tmp_path / "out"
    (directory / "notes").mkdir(parents=True)
    (directory / "weights.bin").write_bytes(b"old weights")
    (directory / "README.md").write_text("mine")
    (directory / "tokenizer.json").symlink_to("../blobs/tok")
    (directory / "notes" / "a.txt").write_text("a")
    (directory / "notes").chmod(0o700)
    directory.chmod(0o750)
    return directory


def test_the_new_content_replaces_the_old_and_the_rest_is_carried_over(old, tmp_path):
    readme = (old / "README.md").stat().st_ino
    with switch_directory(old, drop=lambda entry: entry.name == "weights.bin") as new:
        assert new.parent == tmp_path and new.name.startswith(".lowmem-") and _listing(old) != []
        _write(new, "model.safetensors", b"new weights")
        _write(new, "README.md", b"new readme")  # a name the save writes wins over the old file's
    assert _listing(old) == ["README.md", "model.safetensors", "notes", "tokenizer.json"]
    assert (old / "README.md").read_bytes() == b"new readme" and (old / "README.md").stat().st_ino != readme
    assert os.readlink(old / "tokenizer.json") == "../blobs/tok" and (old / "notes" / "a.txt").read_text() == "a"
    assert stat.S_IMODE(old.stat().st_mode) == 0o750 and stat.S_IMODE((old / "notes").stat().st_mode) == 0o700
    assert _listing(tmp_path) == ["out"]


def test_files_are_carried_over_as_hard_links(old):
    inode = (old / "README.md").stat().st_ino
    with switch_directory(old) as new:
        _write(new, "model.safetensors", b"new")
    assert (old / "README.md").stat().st_ino == inode and (old / "weights.bin").read_bytes() == b"old weights"


def test_a_failed_save_leaves_the_old_directory_and_nothing_beside_it(old, tmp_path):
    before = {p.name: p.read_bytes() for p in old.iterdir() if p.is_file()}
    with pytest.raises(RuntimeError, match="a bug"), switch_directory(old) as new:
        _write(new, "model.safetensors", b"new")
        raise RuntimeError("a bug")
    with pytest.raises(SaveError, match=r"Saving into .*out failed at .*out/model.safetensors: Disk quota "
                                        r"exceeded\. .*out holds what it held before\. The save needs") as e:
        with switch_directory(old, sizes=[100]) as new, write_new(new / "model.safetensors") as f:
            f.write(b"half")
            raise OSError(122, "Disk quota exceeded")
    assert e.value.errno == 122 and e.value.needed >= 100
    assert {p.name: p.read_bytes() for p in old.iterdir() if p.is_file()} == before and _listing(tmp_path) == ["out"]


def test_a_new_directory_is_made_and_a_link_to_a_directory_replaces_what_it_names(tmp_path):
    with switch_directory(tmp_path / "a" / "b") as new:
        _write(new, "x", b"1")
    assert (tmp_path / "a" / "b" / "x").read_bytes() == b"1"
    (tmp_path / "link").symlink_to("a/b")
    with switch_directory(tmp_path / "link") as new:
        _write(new, "x", b"2")
    assert os.readlink(tmp_path / "link") == "a/b" and (tmp_path / "a" / "b" / "x").read_bytes() == b"2"
    (tmp_path / "file").write_text("f")
    for bad in ("file", "dangling"):
        (tmp_path / "dangling").unlink(missing_ok=True)
        (tmp_path / "dangling").symlink_to("nowhere")
        with pytest.raises(ValueError, match="not a directory"), switch_directory(tmp_path / bad):
            pass


def test_without_an_exchange_two_renames_and_a_kill_between_them_is_undone_by_the_next_save(old, tmp_path,
                                                                                            monkeypatch, killed_at):
    monkeypatch.setattr(atomic_directory, "exchange", lambda a, b: False)  # not Linux, or a file system without it

    def save(data: bytes) -> None:
        with switch_directory(old) as new:
            _write(new, "weights.bin", data)

    save(b"second")
    assert (old / "weights.bin").read_bytes() == b"second" and _listing(tmp_path) == ["out"]
    assert killed_at(4, lambda: save(b"third"))  # staged, wrote, carried, sealed, moved the old directory aside
    assert not old.exists() and any(p.name.startswith(".lowmem-old-") for p in tmp_path.iterdir())
    tidy(old)  # as the next save does first
    assert (old / "weights.bin").read_bytes() == b"second" and (old / "README.md").read_text() == "mine"
    assert _listing(tmp_path) == ["out"]


def test_a_parent_that_cannot_be_written_and_a_mount_point_are_refused_before_anything_is_written(mount_tmpfs):
    readonly = mount_tmpfs("64k", readonly=True)
    with pytest.raises(SaveError, match="read-only file system.* must be writable") as e:
        with switch_directory(readonly / "out"):
            pass
    assert e.value.errno == 30
    mounted = mount_tmpfs("64k")
    (mounted / "README.md").write_text("mine")
    with pytest.raises(SaveError, match=r"is a mount point.*Save into a directory inside it"), \
            switch_directory(mounted):
        pass
    assert _listing(mounted) == ["README.md"]


@pytest.fixture
def btrfs(tmp_path):
    """A 128 MiB btrfs file system on a loop device, mounted for this test (root and btrfs-progs, else skipped)."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or not (shutil.which("mkfs.btrfs") and shutil.which("btrfs")):
        pytest.skip("needs root and btrfs-progs (mkfs.btrfs, btrfs)")
    image, point = tmp_path / "btrfs.img", tmp_path / "btrfs"
    point.mkdir()
    with open(image, "wb") as f:
        f.truncate(128 * 2**20)
    for command in (["mkfs.btrfs", "-q", str(image)], ["mount", "-o", "loop", str(image), str(point)]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot make a btrfs here: {done.stderr.strip()[-300:]}")
    yield point
    subprocess.run(["umount", str(point)], capture_output=True)


def test_a_btrfs_subvolume_is_saved_into_and_a_mount_point_inside_it_refused(btrfs):
    """A subvolume has an st_dev of its own but is no mount point: it renames like any directory."""
    import subprocess

    subprocess.run(["btrfs", "subvolume", "create", str(btrfs / "model")], check=True, capture_output=True)
    (btrfs / "model" / "README.md").write_text("mine")
    assert os.stat(btrfs / "model").st_dev != os.stat(btrfs).st_dev  # what the old check took for a mount
    with switch_directory(btrfs / "model") as new:
        _write(new, "weights.bin", b"new")
    assert _listing(btrfs / "model") == ["README.md", "weights.bin"] and _listing(btrfs) == ["model"]
    assert (btrfs / "model" / "weights.bin").read_bytes() == b"new"
    (btrfs / "mounted").mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(btrfs / "mounted")]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with pytest.raises(SaveError, match="is a mount point"), switch_directory(btrfs / "mounted"):
            pass
    finally:
        subprocess.run(["umount", str(btrfs / "mounted")])


def test_a_bind_mount_on_the_same_file_system_is_refused(tmp_path):
    """Its st_dev is its parent's (the old check let it through, and the switch then failed with EBUSY)."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    (tmp_path / "source").mkdir()
    (tmp_path / "out").mkdir()
    if subprocess.run(["mount", "--bind", str(tmp_path / "source"), str(tmp_path / "out")]).returncode:
        pytest.skip("cannot bind-mount here")
    try:
        with pytest.raises(SaveError, match=r"is a mount point.*Save into a directory inside it"), \
                switch_directory(tmp_path / "out"):
            pass
        assert _listing(tmp_path) == ["out", "source"]
    finally:
        subprocess.run(["umount", str(tmp_path / "out")])
