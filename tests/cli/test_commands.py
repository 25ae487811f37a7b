"""The command line as installed: the console script's target, ``--help`` everywhere, exit codes, a cheap import."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
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


@pytest.mark.slow
def test_generate_and_chat_take_litgpts_flags(run_cli):
    for command in ("generate", "chat"):
        usage = run_cli(command, "--help").stdout
        for flag in ("--max_new_tokens", "--top_k", "--top_p", "--temperature", "--quantize", "--precision",
                     "--checkpoint_dir"):
            assert flag in usage, (command, flag)
    assert all(flag in run_cli("generate", "--help").stdout for flag in ("--num_samples", "--sys_prompt", "--prompt"))
    assert "--multiline" in run_cli("chat", "--help").stdout


@pytest.mark.slow
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


@pytest.mark.slow
def test_errors_speak_in_flags_not_python_keywords(run_cli, tmp_path, tiny_config, write_litgpt_dir):
    past = run_cli("estimate", "pythia-14m", "--max_seq_length", "4096")
    assert past.returncode == 2 and "--max_seq_length 4096 is past" in past.stderr
    assert "max_seq_length=" not in past.stderr
    name = run_cli("estimate", "pythia-14m", "--config", "pythia-14mm")
    assert name.returncode == 2 and "--config pythia-14mm is neither a model_config.yaml" in name.stderr
    assert "config=" not in name.stderr
    directory = write_litgpt_dir(tmp_path / "tiny", tiny_config(), tokenizer=False)
    pick = run_cli("inspect", directory, "--weights", "model.safetensors")
    assert pick.returncode == 2 and "--weights model.safetensors names none of the weight sets" in pick.stderr
    assert "prefer=" not in pick.stderr and "(--weights)" not in pick.stderr


def _interrupt_when(command: list[str], env: dict, ready, what: str, poll: float) -> subprocess.CompletedProcess:
    """``command`` in a fresh process, sent SIGINT (Ctrl-C) once ``ready(pid)`` is true (checked every ``poll`` s)."""
    import signal
    import time

    # A shell's background job (`cmd &` without job control) ignores SIGINT, and a child inherits that: Python then
    # installs no KeyboardInterrupt handler. The child gets the default disposition back, as in a terminal.
    proc = subprocess.Popen([sys.executable, "-m", "lightning_lowmem", *command], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # an fd closed while listed, a process gone
                if ready(proc.pid):
                    break
            time.sleep(poll)
        assert proc.poll() is None, f"the command ended before it {what}"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _interrupt_while_reading(command: list[str], checkpoint: Path, env: dict) -> subprocess.CompletedProcess:
    """``command`` in a fresh process, sent SIGINT (Ctrl-C) once it has ``checkpoint`` open."""
    import os

    def has_open(pid: int) -> bool:
        return any(os.path.realpath(fd) == str(checkpoint) for fd in Path(f"/proc/{pid}/fd").iterdir())

    return _interrupt_when(command, env, has_open, "opened the checkpoint", 0.005)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to see when the checkpoint is open")
def test_ctrl_c_during_a_load_is_one_line_and_exit_130(peak_model_dir, child_env, tmp_path):
    """A real SIGINT while the weights are read: no traceback, one line, 130; quantize leaves no --out behind."""
    checkpoint = (peak_model_dir / "lit_model.pth").resolve()
    for command in (["generate", peak_model_dir, "--prompt", "t1 t2", "--quantize", "bnb.nf4"],
                    ["quantize", peak_model_dir, "--quantize", "bnb.nf4", "--out", tmp_path / "out"]):
        proc = _interrupt_while_reading([str(c) for c in command], checkpoint, child_env)
        assert proc.returncode == 130, proc.stderr
        assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == "interrupted (Ctrl-C): stopped; nothing half-written was " \
                                                       "left behind"
        assert proc.stderr.count("interrupted") == 1
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def _interrupt_once_loaded(command: list[str], library: str, env: dict) -> subprocess.CompletedProcess:
    """``command`` in a fresh process, sent SIGINT as soon as ``library`` (a shared object's name) is mapped into it:
    in the middle of the imports that load it."""
    return _interrupt_when(command, env, lambda pid: library in Path(f"/proc/{pid}/maps").read_text(),
                           f"loaded {library}", 0.002)


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc to see what the command has loaded")
@pytest.mark.parametrize("library", [
    "_multiarray_umath", "libtorch_cpu",
    pytest.param("_flapack", marks=pytest.mark.skipif(importlib.util.find_spec("scipy") is None,
                                                      reason="scipy is not installed (nothing installs it for the "
                                                             "tests; litgpt's imports load it only where it is)")),
], ids=["numpy", "torch", "scipy (under litgpt)"])
def test_ctrl_c_while_the_command_imports_is_one_line_and_exit_130(child_env, library):
    """A real SIGINT while numpy, torch (the package's own imports) or litgpt's (scipy, under the command's
    import of litgpt) load: the one line and 130, no traceback and no other error (numpy made a RecursionError of
    one)."""
    from lightning_lowmem.interrupts import LINE

    proc = _interrupt_once_loaded(["estimate", "pythia-14m", "--max_seq_length", "64"], library, child_env)
    assert (proc.returncode, proc.stderr, proc.stdout) == (130, LINE + "\n", "")


NOISE = ("Failed to load", "_pytree", "register_constant", "No module named 'kernels'", "Detected no triton")


@pytest.mark.slow
def test_a_quantized_gguf_command_prints_no_third_party_noise(run_cli, child_env, gguf_chat_model):
    from lightning_lowmem.quantize.cpu_speed import cpu_speed_note

    """The lines torchao, torch and bitsandbytes log on import, present when those are imported plainly here, are
    absent from the command's stderr, which holds only its own report."""
    plain = subprocess.run([sys.executable, "-c", "import transformers.modeling_utils, bitsandbytes"],
                           capture_output=True, text=True, env=child_env)
    heard = [n for n in NOISE if n in plain.stderr]
    if not heard:
        pytest.skip("these builds of torchao, torch and bitsandbytes log nothing on import here")
    for scheme in ("bnb.nf4", "torchao.int8wo"):
        proc = run_cli("generate", gguf_chat_model, "--prompt", "hi", "--max_new_tokens", "2", "--quantize", scheme)
        assert proc.returncode == 0, proc.stderr
        assert not [n for n in NOISE if n in proc.stderr], proc.stderr
        own = proc.stderr
        note = cpu_speed_note(scheme, "cpu")  # the library's own line where a scheme decodes slowly on a CPU
        if note is not None:
            first, own = own.split("\n", 1)
            assert note in first, proc.stderr
        assert own.startswith("Loaded ") and "Memory: weights" in own, proc.stderr


BAD_FLAGS = [  # (subcommand, flags, what the one line names): each exit 2, one line, no traceback
    ("generate", ["--max_memory", "gpu=1GiB"], "--max_memory"),
    ("generate", ["--max_memory", "disk=1GiB", "--disk_offload"], "--max_memory"),
    ("generate", ["--max_memory", "cpu=-1GiB"], "max_memory['cpu']"),
    ("generate", ["--max_memory", "cpu=1e400GiB"], "max_memory['cpu']"),
    ("generate", ["--max_memory", "cpu=1GiB,cpu=2GiB"], "twice"),
    ("generate", ["--max_memory", "cuda:x=1GiB"], "--max_memory"),
    ("generate", ["--temperature", "nan"], "temperature"),
    ("generate", ["--temperature", "-1"], "temperature"),
    ("generate", ["--top_k", "0"], "top_k"),
    ("generate", ["--top_p", "2"], "top_p"),
    ("generate", ["--max_new_tokens", "0"], "--max_new_tokens"),
    ("generate", ["--num_samples", "1.5"], "--num_samples"),
    ("generate", ["--precision", "fp8"], "precision"),
    ("generate", ["--device", "gpu"], "device"),
    ("generate", ["--quantize", "bnb.nf5"], "bnb.nf5"),
    ("generate", ["--prompt", "t1 t2", "--max_new_tokens", "1000"], "block size"),
    ("estimate", ["--max_memory", "gpu=1GiB"], "--max_memory"),
    ("estimate", ["--max_memory", "cpu=nan"], "max_memory['cpu']"),
    ("estimate", ["--read_bandwidth", "0"], "--read_bandwidth"),
    ("inspect", ["--weights", "nothing.bin"], "nothing.bin"),
]


@pytest.mark.parametrize(("command", "flags", "named"), BAD_FLAGS, ids=lambda v: " ".join(v) if isinstance(v, list)
                         else v)
def test_a_bad_flag_value_is_one_line_and_exit_2(tmp_path_factory, tiny_config, write_litgpt_dir, capsys, command,
                                                 flags, named):
    """In the process: an error the command line does not turn into one line would be raised here instead."""
    from lightning_lowmem.cli import main

    directory = tmp_path_factory.getbasetemp() / "bad-flags" / "tiny"
    if not directory.exists():
        write_litgpt_dir(directory, tiny_config())
    code = main([command, str(directory), *flags])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(errors) == 1 and named in errors[0], err
    assert "Traceback" not in err
