"""The command line as installed: the console script's target, ``--help`` everywhere, exit codes, a cheap import."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBCOMMANDS = ["estimate", "generate", "chat", "inspect", "quantize"]


def test_the_console_script_is_cli_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"lightning-lowmem": "lightning_lowmem.cli:main"}
    module, _, name = scripts["lightning-lowmem"].partition(":")
    main = getattr(importlib.import_module(module), name)
    assert callable(main) and main(["--version"]) == 0


@pytest.mark.parametrize("argv", [[], *[[command] for command in SUBCOMMANDS]], ids=["top", *SUBCOMMANDS])
def test_help_shows_an_example(run_cli, argv):
    proc = run_cli(*argv, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "example" in proc.stdout and "lightning-lowmem " in proc.stdout and "exit codes" in proc.stdout
    for command in argv or SUBCOMMANDS:
        assert f"lightning-lowmem {command}" in proc.stdout


def test_generate_and_chat_take_litgpts_flags(run_cli):
    for command in ("generate", "chat"):
        usage = run_cli(command, "--help").stdout
        for flag in ("--max_new_tokens", "--top_k", "--top_p", "--temperature", "--quantize", "--precision",
                     "--checkpoint_dir"):
            assert flag in usage, (command, flag)
    assert all(flag in run_cli("generate", "--help").stdout for flag in ("--num_samples", "--sys_prompt", "--prompt"))
    assert "--multiline" in run_cli("chat", "--help").stdout


def test_no_subcommand_or_a_bad_flag_is_exit_2(run_cli):
    bare = run_cli()
    assert bare.returncode == 2 and "estimate" in bare.stderr
    bad = run_cli("estimate", "pythia-14m", "--max_new_tokens", "5")
    assert bad.returncode == 2 and "unrecognized arguments: --max_new_tokens" in bad.stderr
    missing = run_cli("generate")
    assert missing.returncode == 2 and "--checkpoint_dir" in missing.stderr


def test_importing_the_command_line_imports_neither_litgpt_nor_lightning(child_env):
    code = ("import sys, lightning_lowmem.cli; "
            "print(sorted(m for m in ('litgpt', 'lightning', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
