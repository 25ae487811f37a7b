"""``lightning-lowmem generate``: litgpt generate's text from the same weights, HF directories of any name, and a
prompt the checkpoint cannot take refused before any weight is read."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_lowmem.cli import main

PROMPT = "t5 t17 t3 t99 t42 t8"


@pytest.mark.parametrize("flags", [["--top_k", "1"], ["--num_samples", "2"]], ids=["greedy", "sampled-seeded"])
def test_same_text_as_litgpt_generate(run_cli, litgpt_cli_stdout, chat_model_dir, flags):
    """Prompt style (Alpaca, from prompt_style.yaml) with --sys_prompt, seed 1234, litgpt's default precision."""
    flags = ["--prompt", PROMPT, "--sys_prompt", "t9 t11", "--max_new_tokens", "20", *flags]
    proc = run_cli("generate", chat_model_dir, *flags)
    assert proc.returncode == 0, proc.stderr
    kwargs = {name.lstrip("-"): int(value) if value.isdigit() else value for name, value in zip(flags[::2], flags[1::2])}
    expected = litgpt_cli_stdout("generate", chat_model_dir, **kwargs).strip().splitlines()[-kwargs.get("num_samples", 1):]
    replies = proc.stdout.strip().splitlines()
    assert len(replies) == len(expected) and all(replies)
    # litgpt prints the styled prompt and the reply; this prints the reply (as litgpt's LLM.generate returns it)
    assert all(whole.endswith(" " + reply) for whole, reply in zip(expected, replies))
    assert expected[0].startswith("t9 t0 t0")  # "t9 t11### Instruction:" styled as litgpt styles it
    assert not replies[0].startswith("t9 t0 t0")
    assert len(re.findall(r"Time for inference \d: [\d.]+ sec total, [\d.]+ tokens/sec", proc.stderr)) == len(expected)
    assert "KV cache" in proc.stderr and "peak RSS" in proc.stderr


def test_hf_directory_of_any_name_finds_its_config_in_config_json(run_cli, pythia_14m_hf_dir):
    """A GPT-NeoX of pythia-14m's shapes, saved by transformers under a name litgpt does not know."""
    directory, hf = pythia_14m_hf_dir
    assert not (directory / "model_config.yaml").exists()
    proc = run_cli("generate", directory, "--prompt", "5 17 3 99", "--max_new_tokens", "5", "--top_k", "1",
                   "--precision", "32-true")
    assert proc.returncode == 0, proc.stderr
    expected = hf.generate(torch.tensor([[5, 17, 3, 99]]), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert proc.stdout.split() == [str(t) for t in expected[0, 4:].tolist()]  # the new ids, not the prompt's


def test_text_prompt_without_a_tokenizer_fails_before_any_read(tmp_path, tiny_config, write_litgpt_dir, read_recorder,
                                                               capsys):
    directory = write_litgpt_dir(tmp_path / "no-tokenizer", tiny_config(), tokenizer=False)
    assert main(["generate", str(directory), "--prompt", "What do llamas eat?"]) == 2
    assert "token ids like '1 2 3'" in capsys.readouterr().err
    assert read_recorder.keys == []
    assert main(["generate", str(directory), "--prompt", "1 2 3", "--max_new_tokens", "2", "--top_k", "1"]) == 0
    assert len(capsys.readouterr().out.split()) == 2 and read_recorder.keys  # ids: read, and the 2 new ones printed


def test_request_past_the_block_size_fails_before_any_read(tmp_path, tiny_config, write_litgpt_dir, read_recorder,
                                                           capsys):
    directory = write_litgpt_dir(tmp_path / "short", tiny_config(), tokenizer=False)
    assert main(["generate", str(directory), "--prompt", "1 2 3 4 5 6", "--max_new_tokens", "64"]) == 2
    assert "block size (context length) is 64" in capsys.readouterr().err and read_recorder.keys == []


def test_a_missing_checkpoint_is_exit_1(tmp_path, capsys):
    assert main(["generate", "--checkpoint_dir", str(tmp_path / "nowhere"), "--prompt", "1 2"]) == 1
    assert "CheckpointNotFoundError" in capsys.readouterr().err


def test_a_gguf_file_generates_what_generate_gives(tiny_gguf, capsys):
    from lightning_lowmem import generate

    path = tiny_gguf["Q8_0"]
    want = generate(path, "hello world", max_new_tokens=4, temperature=0.0, precision="32-true")
    assert main(["generate", str(path), "--prompt", "hello world", "--max_new_tokens", "4", "--top_k", "1",
                 "--precision", "32-true"]) == 0
    assert capsys.readouterr().out.strip() == want.texts[0].strip()


def test_a_model_over_its_budget_streams_its_layers_from_disk_and_says_so(chat_model_dir, capsys):
    """``--max_memory cpu=... --disk_offload``: the same tokens as the model in memory; the report names the layers
    on disk."""
    flags = ["generate", str(chat_model_dir), "--prompt", PROMPT, "--max_new_tokens", "12", "--top_k", "1"]
    assert main(flags) == 0
    expected = capsys.readouterr().out
    assert main([*flags, "--max_memory", "cpu=110KiB", "--disk_offload"]) == 0
    out, err = capsys.readouterr()
    assert out == expected
    assert re.search(r"placement: .* on disk \(0 layers offloaded, \d on disk\)", err) and "per forward" in err


def test_disk_offload_without_budgets_or_with_a_device_is_a_bad_argument(chat_model_dir, capsys):
    assert main(["generate", str(chat_model_dir), "--prompt", "t1", "--disk_offload"]) == 2
    assert "--disk_offload needs --max_memory" in capsys.readouterr().err
    assert main(["generate", str(chat_model_dir), "--prompt", "t1", "--device", "cpu", "--max_memory", "cpu=1GiB"]) == 2
    assert "--device or --max_memory, not both" in capsys.readouterr().err


def test_a_gguf_chat_model_is_prompted_with_its_own_template(gguf_chat_model, monkeypatch, capsys):
    """``--prompt`` and ``--sys_prompt`` through the file's chat template; the ids are transformers'
    apply_chat_template(tokenize=True) ids, and the text printed is the decoded reply alone."""
    import litgpt.generate.base
    import transformers

    seen, real = [], litgpt.generate.base.generate

    def spy(model, prompt, *args, **kwargs):
        seen.append(prompt.tolist())
        return real(model, prompt, *args, **kwargs)

    monkeypatch.setattr(litgpt.generate.base, "generate", spy)
    assert main(["generate", str(gguf_chat_model), "--prompt", "Hello world", "--sys_prompt", "Be brief.",
                 "--max_new_tokens", "3", "--top_k", "1"]) == 0
    reference = transformers.AutoTokenizer.from_pretrained(gguf_chat_model.parent, gguf_file=gguf_chat_model.name)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    prompt = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert seen == [prompt]
    printed = capsys.readouterr().out
    assert "Be brief." not in printed and printed.strip()


@pytest.mark.slow
def test_compile_gives_the_same_text(run_cli, chat_model_dir):
    """litgpt's spelling (--compile true) and the bare flag; the decode step compiled, the greedy text unchanged."""
    flags = ["--prompt", PROMPT, "--max_new_tokens", "12", "--top_k", "1"]
    eager = run_cli("generate", chat_model_dir, *flags)
    compiled = run_cli("generate", chat_model_dir, *flags, "--compile", "true")
    assert eager.returncode == compiled.returncode == 0, compiled.stderr
    assert compiled.stdout == eager.stdout and "compile=True" not in compiled.stderr


@pytest.mark.parametrize(("flags", "value"), [([], False), (["--compile"], True), (["--compile", "true"], True),
                                              (["--compile=False"], False)])
def test_compile_flag_as_litgpt_spells_it(flags, value):
    from lightning_lowmem.cli.commands import build_parser

    assert build_parser().parse_args(["generate", "ckpt", *flags]).compile is value


def test_a_compile_value_that_is_not_a_bool_is_exit_2(capsys):
    assert main(["generate", "ckpt", "--compile", "maybe"]) == 2
    assert "expected true or false, got 'maybe'" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["gguf_chat_model", "chat_model_dir"], ids=["gguf-chat-template", "alpaca-yaml"])
def test_the_api_and_the_command_give_one_request_the_same_tokens(request, monkeypatch, capsys, where):
    """generate() styles a text prompt as the command does (a GGUF file's chat template; a directory's
    prompt_style.yaml), with the command's defaults: the same tokens for one request. prompt_style=None sends the
    text as given."""
    import litgpt.generate.base

    from lightning_lowmem import generate
    from lightning_lowmem.litgpt.checkpoint_dir import LitgptCheckpoint

    checkpoint = request.getfixturevalue(where)
    question = "What is the capital of France?" if where == "gguf_chat_model" else PROMPT
    outputs, real = [], litgpt.generate.base.generate

    def spy(model, prompt, *args, **kwargs):
        outputs.append(real(model, prompt, *args, **kwargs).tolist())
        return torch.tensor(outputs[-1])

    monkeypatch.setattr(litgpt.generate.base, "generate", spy)
    assert main(["generate", str(checkpoint), "--prompt", question, "--sys_prompt", "Be brief.",
                 "--max_new_tokens", "8", "--device", "cpu"]) == 0  # sampled (litgpt's defaults), seed 1234
    command = outputs[-1]
    api = generate(checkpoint, question, sys_prompt="Be brief.", max_new_tokens=8)
    assert api.tokens[0].tolist() == command and api.texts[0] in capsys.readouterr().out
    raw = generate(checkpoint, question, max_new_tokens=2, prompt_style=None)
    tokenizer = LitgptCheckpoint.find(checkpoint).tokenizer
    assert raw.tokens[0][:raw.prompt_length].tolist() == tokenizer.encode(question).tolist() != \
        command[:api.prompt_length]


def test_the_report_and_each_sample_are_in_the_files_when_written(chat_model_dir, monkeypatch, tmp_path):
    """``2> file``: the load report is in the file before generation starts, each sample's reply and time before the
    next sample starts (flushed as written, not at exit), with stdout and stderr as block-buffered files."""
    import sys

    import litgpt.generate.base

    out_path, err_path = tmp_path / "out", tmp_path / "err"
    seen, real = [], litgpt.generate.base.generate

    def spy(*args, **kwargs):
        seen.append((out_path.read_text(), err_path.read_text()))
        return real(*args, **kwargs)

    monkeypatch.setattr(litgpt.generate.base, "generate", spy)
    with open(out_path, "w") as out, open(err_path, "w") as err:
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        code = main(["generate", str(chat_model_dir), "--prompt", PROMPT, "--max_new_tokens", "5", "--num_samples",
                     "2"])
    assert code == 0 and len(seen) == 2
    (out_1, err_1), (out_2, err_2) = seen
    assert "Loaded " in err_1 and out_1 == "" and "Time for inference" not in err_1
    assert len(out_2.splitlines()) == 1 and "Time for inference 1:" in err_2 and "Time for inference 2" not in err_2
