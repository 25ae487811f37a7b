"""Files written whole and never through a link: created with O_EXCL | O_NOFOLLOW, renamed over their name, and
temporaries that a killed save left removed unless a running save holds them."""

from __future__ import annotations

import os
import stat

import pytest

from lightning_lowmem import SaveError
from lightning_lowmem.saving import temporaries
from lightning_lowmem.saving.atomic_file import exchange, replace_file, write_new
from lightning_lowmem.saving.temporaries import locked, make_temporary_directory, remove_leftovers


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "outside" / "victim"
    path.parent.mkdir()
    path.write_bytes(b"precious")
    return path


def test_write_new_never_opens_what_is_at_the_name(tmp_path, victim):
    (tmp_path / "link").symlink_to(victim)
    (tmp_path / "file").write_bytes(b"mine")
    for name in ("link", "file"):
        with pytest.raises(FileExistsError), write_new(tmp_path / name) as f:
            f.write(b"new")
    assert victim.read_bytes() == b"precious" and (tmp_path / "file").read_bytes() == b"mine"
    assert (tmp_path / "link").is_symlink()


def test_write_new_leaves_no_file_when_the_write_fails(tmp_path):
    with pytest.raises(RuntimeError, match="stop"), write_new(tmp_path / "new") as f:
        f.write(b"half")
        raise RuntimeError("stop")
    assert list(tmp_path.iterdir()) == []


def test_replace_file_replaces_a_link_at_its_name_and_keeps_the_old_files_mode(tmp_path, victim):
    (tmp_path / "a.ckpt").symlink_to(victim)
    replace_file(tmp_path / "a.ckpt", lambda f: f.write(b"new"))
    assert victim.read_bytes() == b"precious" and not (tmp_path / "a.ckpt").is_symlink()
    assert (tmp_path / "a.ckpt").read_bytes() == b"new"
    (tmp_path / "a.ckpt").chmod(0o640)
    replace_file(tmp_path / "a.ckpt", lambda f: f.write(b"newer"))
    assert stat.S_IMODE((tmp_path / "a.ckpt").stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt", "outside"]


def test_replace_file_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    (tmp_path / "a.ckpt").write_bytes(b"old")

    def fail(f):
        f.write(b"half of it")
        raise OSError(28, "No space left on device")

    with pytest.raises(SaveError, match=r"Writing .*a.ckpt failed at .*\.lowmem-[0-9a-f]{8}\.a\.ckpt: No space left "
                                        r"on device\. .* holds what it held before") as e:
        replace_file(tmp_path / "a.ckpt", fail)
    assert e.value.errno == 28 and isinstance(e.value, OSError) and e.value.available is not None
    assert (tmp_path / "a.ckpt").read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["a.ckpt"]
    with pytest.raises(ValueError, match="is a directory"):
        replace_file(tmp_path, lambda f: None)


def test_a_temporary_name_taken_by_a_planted_link_is_skipped(tmp_path, victim, monkeypatch):
    names = iter(["0badc0de", "5afe5afe"])
    monkeypatch.setattr(temporaries.secrets, "token_hex", lambda n: next(names))
    (tmp_path / ".lowmem-0badc0de.out").symlink_to(victim.parent)
    made = make_temporary_directory(tmp_path, "out")
    assert made.name == ".lowmem-5afe5afe.out" and made.is_dir() and not made.is_symlink()
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim"]


def test_leftovers_are_removed_unless_a_running_save_holds_them(tmp_path, victim):
    for name in (".lowmem-00000001.out", ".lowmem-old-00000002.out", ".lowmem-00000003.out"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x")
    (tmp_path / ".lowmem-00000004.out").write_bytes(b"a killed single-file save")
    (tmp_path / ".lowmem-00000005.out").symlink_to(victim.parent)  # a link at such a name: removed, not followed
    keep = [".lowmem-00000006.other", ".lowmem-zz.out", "out", "outside"]  # another name's, not of the form, ours
    for name in keep[:3]:
        (tmp_path / name).mkdir()
    with locked(tmp_path / ".lowmem-00000003.out"):  # a save still writing there
        removed = remove_leftovers(tmp_path, "out")
    assert sorted(removed) == [".lowmem-00000001.out", ".lowmem-00000004.out", ".lowmem-00000005.out",
                               ".lowmem-old-00000002.out"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".lowmem-00000003.out", *keep])
    assert victim.read_bytes() == b"precious"


def test_exchange_swaps_two_directories_in_one_step(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "in-a").touch()
    if not exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("no renameat2(RENAME_EXCHANGE) here")
    assert os.listdir(tmp_path / "b") == ["in-a"] and os.listdir(tmp_path / "a") == []


@pytest.fixture(params=["O_TMPFILE", "created-then-locked"])
def temporary_kind(request, monkeypatch):
    """Each way a temporary is made: Linux's unnamed file linked in once locked, and the fallback (macOS, a file system
    without O_TMPFILE), forced here by the probe saying there is no O_TMPFILE."""
    from lightning_lowmem import system

    if request.param == "O_TMPFILE" and system.O_TMPFILE is None:
        pytest.skip("no O_TMPFILE here")
    if request.param != "O_TMPFILE":
        monkeypatch.setattr(system, "O_TMPFILE", None)
    return request.param


def _clean_up_before_each_lock(monkeypatch, directory, name) -> list[list[str]]:
    """Another save's clean-up of ``name``, run in ``directory`` at the worst moment: just before this save first locks
    its temporary, and again just after an unnamed file is linked in. Returns what each clean-up removed."""
    real_flock, real_link, removed = temporaries._flock, os.link, []

    def flock(fd, *, blocking):
        if blocking and not removed:  # this save, about to lock (a clean-up only ever tries without waiting)
            removed.append(remove_leftovers(directory, name))
        return real_flock(fd, blocking=blocking)

    def link(source, target, **kwargs):
        real_link(source, target, **kwargs)
        removed.append(remove_leftovers(directory, name))  # visible now, and already locked: never removed

    monkeypatch.setattr(temporaries, "_flock", flock)
    monkeypatch.setattr(os, "link", link)
    return removed


def test_a_concurrent_clean_up_never_removes_a_temporary_file_being_written(tmp_path, monkeypatch, temporary_kind):
    (tmp_path / "a.ckpt").write_bytes(b"old")
    removed = _clean_up_before_each_lock(monkeypatch, tmp_path, "a.ckpt")
    replace_file(tmp_path / "a.ckpt", lambda f: f.write(b"new"))
    assert (tmp_path / "a.ckpt").read_bytes() == b"new" and os.listdir(tmp_path) == ["a.ckpt"]
    if temporary_kind == "O_TMPFILE":
        assert removed == [[], []]  # nothing to see before the lock; locked once it has a name
    else:  # created, then removed by the clean-up before the lock: made again, and the save landed
        assert len(removed) == 1 and len(removed[0]) == 1


def test_a_concurrent_clean_up_never_removes_a_directory_being_written(tmp_path, monkeypatch):
    from lightning_lowmem.saving.atomic_directory import switch_directory

    (tmp_path / "out").mkdir()
    removed = _clean_up_before_each_lock(monkeypatch, tmp_path, "out")
    with switch_directory(tmp_path / "out") as new:
        (new / "weights.bin").write_bytes(b"new")
    assert (tmp_path / "out" / "weights.bin").read_bytes() == b"new" and os.listdir(tmp_path) == ["out"]
    assert len(removed) == 1 and len(removed[0]) == 1  # removed before its lock, made again: the save landed


def test_saves_of_one_name_from_many_threads_all_land(tmp_path, temporary_kind):
    """Every save cleans up leftovers of the same name first: none removes another's temporary."""
    import threading

    errors: list[BaseException] = []

    def saves(i: int) -> None:
        for j in range(25):
            try:
                replace_file(tmp_path / "a.ckpt", lambda f: f.write(f"{i}-{j}".encode()))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

    threads = [threading.Thread(target=saves, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and os.listdir(tmp_path) == ["a.ckpt"]
    assert (tmp_path / "a.ckpt").read_bytes().decode().split("-")[1] == "24"
