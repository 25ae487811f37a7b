"""``lightning-lowmem chat``: litgpt chat's replies for the same scripted input, the model streamed in."""

from __future__ import annotations

import re

import pytest

from lightning_lowmem.cli import main

TURNS = "t5 t17 t3\nt1 t2 t3 t4 t5 t6 t7 t8 t9\nt42\n\n"  # a longer second turn: the caches grow; then shorter


def _replies(stdout: str) -> list[str]:
    return re.findall(r">> Reply: (.*)", stdout)


def _ids(text: str) -> list[int]:
    return [int(i) for i in re.findall(r"t(\d+)", text)]


def test_same_replies_as_generate_turn_by_turn(run_cli, chat_model_dir):
    """One generation loop: each turn's reply is what ``generate()`` gives for that prompt (litgpt's chat loop computes
    RoPE as ``generate`` does, in bf16 here: litgpt's own chat computes it in float32 and answers otherwise here)."""
    from lightning_lowmem import generate

    proc = run_cli("chat", chat_model_dir, "--max_new_tokens", "12", "--top_k", "1", stdin=TURNS)
    assert proc.returncode == 0, proc.stderr
    replies = [_ids(r) for r in _replies(proc.stdout)]
    expected = [generate(chat_model_dir, turn, max_new_tokens=12, top_k=1).new_tokens[0].tolist()
                for turn in TURNS.split("\n")[:3]]
    assert len(replies) == 3 and all(replies)
    assert replies == expected
    assert "Now chatting with pythia-tiny." in proc.stdout
    assert len(re.findall(r"Time for inference: [\d.]+ sec total", proc.stderr)) == 3


def test_same_replies_as_litgpt_chat_in_float32(run_cli, litgpt_cli_stdout, chat_model_dir):
    """In float32 (where litgpt's chat and generate compute RoPE alike) the replies are litgpt chat's, reply for reply."""
    flags = dict(max_new_tokens=12, top_k=1, precision="32-true")
    proc = run_cli("chat", chat_model_dir, *[f"--{k}={v}" for k, v in flags.items()], stdin=TURNS)
    assert proc.returncode == 0, proc.stderr
    expected = _replies(litgpt_cli_stdout("chat", chat_model_dir, stdin=TURNS, **flags))
    assert len(expected) == 3 and all(expected)
    assert _replies(proc.stdout) == expected


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


@pytest.mark.slow
def test_the_same_replies_with_the_layers_on_disk(run_cli, chat_model_dir):
    flags = ["chat", chat_model_dir, "--max_new_tokens", "12", "--top_k", "1"]
    in_memory = run_cli(*flags, stdin=TURNS)
    streamed = run_cli(*flags, "--max_memory", "cpu=30KiB", "--disk_offload", stdin=TURNS)
    assert streamed.returncode == 0, streamed.stderr
    assert _replies(streamed.stdout) == _replies(in_memory.stdout) and len(_replies(streamed.stdout)) == 3
    assert "on disk" in streamed.stderr


def test_a_gguf_chat_model_is_prompted_with_its_own_template(gguf_chat_model, monkeypatch, capsys):
    """The file's chat template, rendered and encoded as transformers' apply_chat_template(tokenize=True) does: its
    first <|im_start|> (the file's BOS, not added to plain prompts) kept."""
    import io

    import litgpt.chat.base
    import transformers

    question = "What is the capital of France?"
    seen, real = [], litgpt.chat.base.generate

    def spy(model, prompt, *args, **kwargs):
        seen.append(prompt.tolist())
        return real(model, prompt, *args, **kwargs)

    monkeypatch.setattr(litgpt.chat.base, "generate", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO(question + "\n\n"))
    assert main(["chat", str(gguf_chat_model), "--max_new_tokens", "4", "--top_k", "1"]) == 0
    reference = transformers.AutoTokenizer.from_pretrained(gguf_chat_model.parent, gguf_file=gguf_chat_model.name)
    want = reference.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True)["input_ids"]
    assert seen == [want] and want[0] == 1
    assert ">> Reply: " in capsys.readouterr().out


@pytest.mark.slow
def test_compile_gives_the_same_replies_over_turns_of_other_lengths(run_cli, chat_model_dir):
    """The compiled decode step serves every turn (a longer one grows the caches, a shorter one reuses them)."""
    flags = ["--max_new_tokens", "12", "--top_k", "1"]
    eager = run_cli("chat", chat_model_dir, *flags, stdin=TURNS)
    compiled = run_cli("chat", chat_model_dir, *flags, "--compile", stdin=TURNS)
    assert compiled.returncode == 0, compiled.stderr
    assert _replies(compiled.stdout) == _replies(eager.stdout) and len(_replies(eager.stdout)) == 3
    assert "compile=True" not in compiled.stderr


def test_the_report_is_in_the_file_before_the_chat_starts(chat_model_dir, monkeypatch, tmp_path):
    """``2> file``: the load report is in the file when the chat loop starts, not at exit."""
    import io
    import sys

    import litgpt.chat.base

    err_path, seen = tmp_path / "err", []
    monkeypatch.setattr(litgpt.chat.base, "interact", lambda **kwargs: seen.append(err_path.read_text()))
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    with open(err_path, "w") as err:
        monkeypatch.setattr(sys, "stderr", err)
        assert main(["chat", str(chat_model_dir)]) == 0
    assert len(seen) == 1 and "Loaded " in seen[0]
