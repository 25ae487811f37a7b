"""A checkpoint's prompt style: ``prompt_style.yaml`` picks one of the known styles by name and never names code.

litgpt's own ``load_prompt_style`` imports the module a ``class_path`` names and calls what it finds there; a
directory holding ``evil.py`` and ``class_path: ck.evil.Style``, run from its parent, would run ``evil.py``. These
tests run the command line and the Python API in a fresh process from the checkpoint's parent, as a user would.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_lowmem.errors import CheckpointFormatError, UnsafeCheckpointError
from lightning_lowmem.litgpt.prompt_style import known_prompt_styles, prompt_style_for

EVIL = """\
from pathlib import Path

Path(__file__).resolve().parent.parent.joinpath("IMPORTED").write_text("evil.py ran")


class Style:
    def apply(self, prompt, **kwargs):
        Path(__file__).resolve().parent.parent.joinpath("CALLED").write_text("Style.apply ran")
        return prompt

    def stop_tokens(self, tokenizer):
        return ([tokenizer.eos_id],)
"""

API = """\
from lightning_lowmem import UnsafeCheckpointError, generate
try:
    generate("ck", "t1 t2 t3", max_new_tokens=1)
except UnsafeCheckpointError as e:
    print("refused:", e)
"""


@pytest.fixture
def hostile_dir(tmp_path, tiny_config, write_litgpt_dir):
    """``hostile_dir(class_path)``: ``tmp_path/ck``, a tiny litgpt checkpoint with a tokenizer, ``evil.py`` beside
    its weights and a ``prompt_style.yaml`` naming ``class_path``; returns ``tmp_path``."""
    def make(class_path: str) -> Path:
        directory = write_litgpt_dir(tmp_path / "ck", tiny_config())
        (directory / "evil.py").write_text(EVIL)
        (directory / "prompt_style.yaml").write_text(f"class_path: {class_path}\n")
        return tmp_path

    return make


def _run(face: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = ([sys.executable, "-m", "lightning_lowmem", "generate", "ck", "--prompt", "t1 t2 t3",
                "--max_new_tokens", "1"] if face == "cli" else [sys.executable, "-c", API])
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


@pytest.mark.parametrize("face", ["cli", "api"])
def test_a_module_beside_the_checkpoint_is_never_imported(hostile_dir, child_env, face):
    parent = hostile_dir("ck.evil.Style")
    proc = _run(face, parent, child_env)
    assert not (parent / "IMPORTED").exists() and not (parent / "CALLED").exists(), proc.stderr
    said = proc.stderr if face == "cli" else proc.stdout
    assert "prompt_style.yaml" in said and "class_path" in said and "ck.evil.Style" in said, (proc.stdout, proc.stderr)
    if face == "cli":
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("error: UnsafeCheckpointError: ")
    else:
        assert proc.returncode == 0 and proc.stdout.startswith("refused:"), proc.stderr


@pytest.mark.parametrize("face", ["cli", "api"])
def test_a_stdlib_callable_is_never_called(hostile_dir, child_env, tmp_path_factory, face):
    """``class_path: tempfile.mkdtemp``: litgpt's loader would make a directory in TMPDIR, then fail."""
    parent = hostile_dir("tempfile.mkdtemp")
    tmpdir = tmp_path_factory.mktemp("tmpdir")
    proc = _run(face, parent, {**child_env, "TMPDIR": str(tmpdir)})
    made = [p.name for p in tmpdir.iterdir() if p.name.startswith("tmp")]  # mkdtemp's names (torch puts its own)
    assert made == [], proc.stderr
    said = proc.stderr if face == "cli" else proc.stdout
    assert "tempfile.mkdtemp" in said and "class_path" in said, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr


def test_every_litgpt_style_is_found_by_the_name_litgpt_saves(tmp_path, tiny_config):
    from litgpt.prompts import prompt_styles, save_prompt_style

    config = tiny_config()
    for name, cls in prompt_styles.items():
        save_prompt_style(name, tmp_path)
        assert type(prompt_style_for(tmp_path, config)) is cls, name
    assert f"{cls.__module__}.{cls.__name__}" in known_prompt_styles()


@pytest.mark.parametrize("text, says", [
    ("class_path: [1, 2]\n", "class_path"),
    ("- alpaca\n", "mapping"),
    ("class_path: 'litgpt.prompts.Alpaca\n", "YAML"),
])
def test_a_file_that_is_no_prompt_style_is_a_format_error(tmp_path, tiny_config, text, says):
    (tmp_path / "prompt_style.yaml").write_text(text)
    with pytest.raises(CheckpointFormatError, match=says) as raised:
        prompt_style_for(tmp_path, tiny_config())
    assert str(tmp_path / "prompt_style.yaml") in str(raised.value)


def test_a_model_config_naming_code_is_refused_by_its_key(tmp_path, tiny_config, write_litgpt_dir):
    """litgpt takes ``mlp_class_name`` and ``norm_class_name`` by ``getattr`` on ``litgpt.model`` and ``torch.nn``:
    only the classes its own configs name are taken."""
    from lightning_lowmem import generate

    directory = write_litgpt_dir(tmp_path / "ck", tiny_config())
    text = (directory / "model_config.yaml").read_text()
    for key, value in (("mlp_class_name", "torch"), ("norm_class_name", "Module")):
        (directory / "model_config.yaml").write_text(
            "\n".join(f"{key}: {value}" if line.startswith(f"{key}:") else line for line in text.splitlines()))
        with pytest.raises(UnsafeCheckpointError, match=key) as raised:
            generate(directory, [1, 2, 3], max_new_tokens=1)
        assert "model_config.yaml" in str(raised.value) and value in str(raised.value)
    assert torch.is_tensor(generate(directory.parent / "ck", [1, 2], max_new_tokens=1, config=tiny_config()).tokens[0])
