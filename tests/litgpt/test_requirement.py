"""Without litgpt: the package imports and loads checkpoints; its litgpt faces raise one clear ImportError.

Each test runs a fresh process whose ``import litgpt`` fails as it does where litgpt is not installed: a
directory first on ``PYTHONPATH`` holds a ``litgpt`` package that raises ``ModuleNotFoundError``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

INSTALL = "pip install 'lightning-lowmem[litgpt]'"

_WITHOUT_LITGPT = r"""
import json, sys, tempfile
import safetensors.torch, torch
import lightning_lowmem
from lightning_lowmem import estimate_memory, generate, init_empty, load_checkpoint, patch_litgpt

out = {}
path = tempfile.mkdtemp() + "/model.safetensors"
safetensors.torch.save_file({"0.weight": torch.ones(3, 4), "0.bias": torch.zeros(3)}, path)
with init_empty():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
report = load_checkpoint(model, path, progress=False)
out["weight_sum"] = float(model[0].weight.sum())
for name, call in [("generate", lambda: generate(path, [1, 2, 3], max_new_tokens=1)),
                   ("estimate_memory", lambda: estimate_memory("pythia-14m")),
                   ("patch_litgpt", patch_litgpt)]:
    try:
        call()
        out[name] = None
    except Exception as e:
        out[name] = [type(e).__name__, str(e)]
out["litgpt_imported"] = sys.modules.get("litgpt") is not None
print(json.dumps(out))
"""


@pytest.fixture
def without_litgpt(tmp_path: Path, child_env: dict[str, str]) -> dict[str, str]:
    """The environment of a fresh process in which ``import litgpt`` fails as if litgpt were not installed."""
    fake = tmp_path / "no-litgpt" / "litgpt"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'litgpt'\", name='litgpt')\n")
    return {**child_env, "PYTHONPATH": f"{fake.parent}{os.pathsep}{child_env['PYTHONPATH']}"}


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_package_loads_checkpoints_and_its_litgpt_faces_say_what_to_install(without_litgpt):
    done = _run(["-c", _WITHOUT_LITGPT], without_litgpt)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["weight_sum"] == 12.0  # load_checkpoint on a plain module, without litgpt
    for face in ("generate", "estimate_memory", "patch_litgpt"):
        kind, message = out[face]
        assert kind == "ImportError", (face, kind, message)
        assert f"lightning_lowmem.{face}() needs litgpt" in message and INSTALL in message, message
    assert not out["litgpt_imported"]


@pytest.mark.slow
def test_the_command_says_what_to_install_and_its_help_works_without_litgpt(without_litgpt):
    done = _run(["-m", "lightning_lowmem", "estimate", "pythia-14m"], without_litgpt)
    assert done.returncode == 1
    assert done.stderr.startswith("error: ImportError: The lightning-lowmem command needs litgpt"), done.stderr
    assert INSTALL in done.stderr and "Traceback" not in done.stderr
    helped = _run(["-m", "lightning_lowmem", "--help"], without_litgpt)
    assert helped.returncode == 0 and "estimate" in helped.stdout
