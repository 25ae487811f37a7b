"""The README's install resolves without backtracking: pip's resolver, asked as the README asks it (``pip install
torch==<the README's> -e ".[extra]"``, in a dry run that ignores what is installed, as on a fresh machine), takes the
pinned transformers, huggingface-hub and accelerate at once, keeps torch's CPU build, and pulls no CUDA package."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PINNED = ("transformers", "huggingface-hub", "accelerate", "litgpt")


def _pins() -> dict[str, str]:
    """Each pinned package (``name==version`` in an extra) -> its version, from pyproject.toml."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins: dict[str, str] = {}
    for requirement in (r for requirements in extras.values() for r in requirements):
        name, sep, version = requirement.partition("==")
        if sep:
            assert pins.setdefault(name.lower(), version) == version, f"{name} pinned twice, differently"
    return pins


def _readme_torch() -> str:
    """The torch release the README's set-up names (``pip install torch==X ...``)."""
    found = set(re.findall(r"pip install torch==([\w.+]+)", (ROOT / "README.md").read_text()))
    assert len(found) == 1, f"the README names torch {found or 'without a pin'}: one pinned release expected"
    return found.pop()


def test_every_pip_install_in_the_readme_pins_torch():
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if re.match(r"\s*pip install ", line)]
    assert lines and all("torch" not in line or "torch==" in line for line in lines), lines
    assert all(line.lstrip().startswith("pip install torch==") or "-e ." in line for line in lines), lines
    assert set(PINNED) <= set(_pins()), _pins()


def _index_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("extra", ["examples", "test"])
def test_a_fresh_install_resolves_without_backtracking(tmp_path, extra):
    if not _index_reachable():
        pytest.skip("the package index (pypi.org) cannot be reached")
    torch_release, report = _readme_torch(), tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--report",
                           str(report), f"torch=={torch_release}", "-e", f".[{extra}]"],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "looking at multiple versions" not in log, re.findall(r".*looking at multiple versions.*", log)
    resolved = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    assert {name: resolved.get(name) for name in PINNED} == {name: _pins()[name] for name in PINNED}
    assert resolved["torch"].split("+")[0] == torch_release.split("+")[0]
    if "+cpu" in resolved["torch"]:  # the CPU build (kept here from --find-links): nothing of CUDA comes with it
        assert not [name for name in resolved if name.startswith("nvidia-")]
