"""``lightning-lowmem chat``: litgpt chat's replies for the same scripted input, the model streamed in."""

from __future__ import annotations

import re

from lightning_lowmem.cli import main

TURNS = "t5 t17 t3\nt1 t2 t3 t4 t5 t6 t7 t8 t9\nt42\n\n"  # a longer second turn: the caches grow; then shorter


def _replies(stdout: str) -> list[str]:
    return re.findall(r">> Reply: (.*)", stdout)


def test_same_replies_as_litgpt_chat(run_cli, litgpt_cli_stdout, chat_model_dir):
    proc = run_cli("chat", chat_model_dir, "--max_new_tokens", "12", "--top_k", "1", stdin=TURNS)
    assert proc.returncode == 0, proc.stderr
    expected = _replies(litgpt_cli_stdout("chat", chat_model_dir, stdin=TURNS, max_new_tokens=12, top_k=1))
    assert len(expected) == 3 and all(expected)
    assert _replies(proc.stdout) == expected
    assert "Now chatting with pythia-tiny." in proc.stdout
    assert len(re.findall(r"Time for inference: [\d.]+ sec total", proc.stderr)) == 3


def test_multiline_input_ends_with_submit(run_cli, litgpt_cli_stdout, chat_model_dir):
    lines = "t5 t17\nt3\n!submit\n!quit\n"
    proc = run_cli("chat", chat_model_dir, "--multiline", "--max_new_tokens", "6", "--top_k", "1", stdin=lines)
    assert proc.returncode == 0, proc.stderr
    expected = _replies(litgpt_cli_stdout("chat", chat_model_dir, stdin=lines, max_new_tokens=6, top_k=1,
                                          multiline=True))
    assert _replies(proc.stdout) == expected and len(expected) == 1


def test_no_tokenizer_fails_before_any_read(tmp_path, tiny_config, write_litgpt_dir, read_recorder, capsys):
    directory = write_litgpt_dir(tmp_path / "no-tokenizer", tiny_config(), tokenizer=False)
    assert main(["chat", str(directory)]) == 1
    assert "No tokenizer in" in capsys.readouterr().err and read_recorder.keys == []


def test_the_same_replies_with_the_layers_on_disk(run_cli, chat_model_dir):
    flags = ["chat", chat_model_dir, "--max_new_tokens", "12", "--top_k", "1"]
    in_memory = run_cli(*flags, stdin=TURNS)
    streamed = run_cli(*flags, "--max_memory", "cpu=30KiB", "--disk_offload", stdin=TURNS)
    assert streamed.returncode == 0, streamed.stderr
    assert _replies(streamed.stdout) == _replies(in_memory.stdout) and len(_replies(streamed.stdout)) == 3
    assert "on disk" in streamed.stderr
