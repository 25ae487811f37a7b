"""``lightning-lowmem quantize``: a copy that loads as stored, holds what quantize-on-load makes bit for bit, and
generates the same text; an HF directory converted without quantizing; a copy over its own source refused."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

from lightning_lowmem.cli import main

PROMPT = "t5 t17 t3 t99 t42 t8"


@pytest.fixture(scope="module")
def wide_chat_dir(tmp_path_factory, tiny_config, write_litgpt_dir):
    """``chat_model_dir``'s model 128 wide: bitsandbytes' CPU kernel for one token at a time needs Linears at least
    one 64-element block wide."""
    from litgpt.prompts import save_prompt_style

    directory = write_litgpt_dir(tmp_path_factory.mktemp("chat") / "tiny-chat", tiny_config(n_embd=128),
                                 torch.bfloat16)
    save_prompt_style("alpaca", directory)
    return directory


@pytest.mark.parametrize("scheme", ["bnb.nf4", "torchao.int8wo"])
def test_the_copy_loads_as_stored_and_generates_what_quantize_on_load_generates(tmp_path, wide_chat_dir, capsys,
                                                                                 scheme):
    from lightning_lowmem.saving import module_state
    from lightning_lowmem.litgpt.generation import load_for_generation

    out = tmp_path / "copy"
    assert main(["quantize", str(wide_chat_dir), "--quantize", scheme, "--out", str(out), "--device", "cpu"]) == 0
    listed = capsys.readouterr().out
    for name in ("model.safetensors", "model_config.yaml", "tokenizer.json", "tokenizer_config.json",
                 "prompt_style.yaml"):
        assert (out / name).is_file() and str(out / name) in listed, name

    on_load, _, _ = load_for_generation(wide_chat_dir, quantize=scheme, device="cpu")
    copy, _, report = load_for_generation(out, device="cpu")
    assert report.prequantized and set(report.prequantized.values()) == {scheme}
    assert report.quantized_bytes_before == 0  # nothing quantized again
    want, got = ({t.key: t.get() for t in module_state(m).tensors} for m in (on_load, copy))
    assert want.keys() == got.keys() and any(k.endswith(".absmax") or k.endswith("_qdata") for k in want)
    assert all(torch.equal(want[k], got[k]) for k in want)

    flags = ["--prompt", PROMPT, "--max_new_tokens", "8", "--top_k", "1", "--device", "cpu"]
    assert main(["generate", str(wide_chat_dir), *flags, "--quantize", scheme]) == 0
    expected = capsys.readouterr().out
    assert main(["generate", str(out), *flags]) == 0  # no --quantize: the file says the scheme
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.int8", "torchao.int8wo"])
def test_the_copy_reads_back_with_the_buffers_and_caches_quantize_on_load_gives(tmp_path, wide_chat_dir, capsys,
                                                                                 scheme):
    """Not only the saved tensors: the RoPE tables a generation computes with (float32 under bitsandbytes, as litgpt's
    generate leaves them; bf16 otherwise), their sizes, and the tokens of a longer generation."""
    from lightning_lowmem import estimate_memory, generate
    from lightning_lowmem.litgpt.generation import load_for_generation
    from lightning_lowmem.litgpt.kv_cache import unwrap_model

    out = tmp_path / "copy"
    assert main(["quantize", str(wide_chat_dir), "--quantize", scheme, "--out", str(out), "--device", "cpu"]) == 0
    capsys.readouterr()
    on_load = generate(wide_chat_dir, PROMPT, quantize=scheme, max_new_tokens=30, top_k=1, device="cpu")
    copy = generate(out, PROMPT, max_new_tokens=30, top_k=1, device="cpu")
    assert copy.new_tokens[0].tolist() == on_load.new_tokens[0].tolist()
    assert (copy.memory.kv_cache, copy.memory.mask, copy.memory.rope) == \
        (on_load.memory.kv_cache, on_load.memory.mask, on_load.memory.rope)
    models = [load_for_generation(path, device="cpu", **kwargs)[0] for path, kwargs in
              ((wide_chat_dir, dict(quantize=scheme)), (out, {}))]
    for model in models:
        generate(model, on_load.tokens[0][:on_load.prompt_length], max_new_tokens=3, top_k=1)  # tables as generated
    want, got = (dict(unwrap_model(m).named_buffers()) for m in models)
    assert want.keys() == got.keys() and {"cos", "sin"} <= want.keys()
    assert all(want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]) for k in want)
    assert want["cos"].dtype == (torch.float32 if scheme.startswith("bnb.") else torch.bfloat16)
    length = on_load.tokens[0].numel()
    estimates = [estimate_memory(path, max_seq_length=length, **kwargs).rope for path, kwargs in
                 ((wide_chat_dir, dict(quantize=scheme)), (out, {}))]
    assert estimates == [on_load.memory.rope] * 2


def test_without_quantize_an_hf_directory_becomes_litgpts_names_in_safetensors(tmp_path, pythia_14m_hf_dir, capsys):
    from safetensors import safe_open

    directory, hf = pythia_14m_hf_dir
    out = tmp_path / "lit"
    assert main(["quantize", str(directory), "--out", str(out), "--precision", "32-true", "--device", "cpu"]) == 0
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "transformer.h.0.attn.qkv.weight" in keys and not any(k.startswith("gpt_neox.") for k in keys)
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "5 17 3 99", "--max_new_tokens", "5", "--top_k", "1",
                 "--precision", "32-true", "--device", "cpu"]) == 0
    expected = hf.generate(torch.tensor([[5, 17, 3, 99]]), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert capsys.readouterr().out.split() == [str(t) for t in expected[0, 4:].tolist()]  # the reply's ids


def test_a_copy_over_its_own_checkpoint_is_refused_before_any_read(chat_model_dir, read_recorder, capsys):
    before = sorted(p.name for p in chat_model_dir.iterdir())
    assert main(["quantize", str(chat_model_dir), "--quantize", "bnb.nf4", "--out", str(chat_model_dir)]) == 2
    assert "the checkpoint's own directory" in capsys.readouterr().err
    assert read_recorder.keys == [] and sorted(p.name for p in chat_model_dir.iterdir()) == before


def test_a_bad_shard_size_is_refused_before_any_read(tmp_path, chat_model_dir, read_recorder, capsys):
    assert main(["quantize", str(chat_model_dir), "--out", str(tmp_path / "x"), "--max_shard_size", "five"]) == 2
    assert "five" in capsys.readouterr().err and read_recorder.keys == []


@pytest.mark.parametrize("scheme", [None, "bnb.nf4"])
def test_a_copy_of_a_tied_model_reloads_in_every_face(tmp_path, write_gguf, capsys, scheme):
    """A GGUF whose output head is its embedding: the copy writes the tensor once and records the tie, and
    generate, inspect and load_checkpoint read it back tied (it failed: 'transformer.wte.weight' missing)."""
    from lightning_lowmem import load_checkpoint
    from lightning_lowmem.litgpt.checkpoint_dir import LitgptCheckpoint, build_meta_gpt

    path = tmp_path / "tied.gguf"
    write_gguf(path, "Q8_0", hidden=128, intermediate=256, tie=True, vocab=False, vocab_size=300)
    out = tmp_path / "copy"
    quantize = ["--quantize", scheme] if scheme else []
    assert main(["quantize", str(path), *quantize, "--out", str(out), "--device", "cpu"]) == 0
    flags = ["--prompt", "5 17 3", "--max_new_tokens", "4", "--top_k", "1", "--device", "cpu"]
    capsys.readouterr()
    assert main(["generate", str(path), *flags, *quantize]) == 0
    expected = capsys.readouterr().out.split()[-4:]
    assert main(["generate", str(out), *flags]) == 0
    assert capsys.readouterr().out.split()[-4:] == expected
    assert main(["inspect", str(out)]) == 0, capsys.readouterr().err
    assert "matches" in capsys.readouterr().out
    model = build_meta_gpt(LitgptCheckpoint.find(out).config)
    load_checkpoint(model, out, progress=False)
    assert model.lm_head.weight is model.transformer.wte.weight
def _one_line(capsys) -> str:
    """stderr of the command: one line (after the load report, when the load ran), and no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: "), err
    return err.strip().splitlines()[-1]


def _readonly_directory(tmp_path, mount_tmpfs):
    if os.geteuid() != 0:  # permissions stop a user; root needs a read-only file system
        (tmp_path / "ro").mkdir(mode=0o555)
        return tmp_path / "ro"
    return mount_tmpfs("64k", readonly=True)


def test_out_that_is_a_file_is_refused_before_any_read(tmp_path, chat_model_dir, read_recorder, capsys):
    (tmp_path / "copy").write_text("mine")
    assert main(["quantize", str(chat_model_dir), "--out", str(tmp_path / "copy")]) == 2
    assert "is a file" in capsys.readouterr().err and read_recorder.keys == []
    assert (tmp_path / "copy").read_text() == "mine"


def test_out_that_cannot_be_written_is_one_line_before_any_read(tmp_path, mount_tmpfs, chat_model_dir, read_recorder,
                                                                capsys):
    readonly = _readonly_directory(tmp_path, mount_tmpfs)
    assert main(["quantize", str(chat_model_dir), "--out", str(readonly / "copy")]) == 1
    line = _one_line(capsys)
    assert line.startswith("error: SaveError:") and str(readonly) in line and read_recorder.keys == []
    assert ("read-only file system" if os.geteuid() == 0 else "not writable") in line


def test_out_on_a_disk_too_small_is_one_line_before_any_read(mount_tmpfs, chat_model_dir, read_recorder, capsys):
    disk = mount_tmpfs("32k")
    assert main(["quantize", str(chat_model_dir), "--out", str(disk / "copy")]) == 1
    line = _one_line(capsys)
    assert re.search(rf"{re.escape(str(disk / 'copy'))}: the save needs .* \(\d+ bytes\) .* which has .* \(\d+ bytes\) "
                     "free", line), line
    assert read_recorder.keys == [] and list(disk.iterdir()) == []


def test_a_disk_that_fills_during_the_save_is_one_line_and_the_old_copy_stays(mount_tmpfs, fill_disk, monkeypatch,
                                                                              chat_model_dir, capsys):
    from lightning_lowmem.saving import atomic_file

    disk = mount_tmpfs("1m")
    out = disk / "copy"
    assert main(["quantize", str(chat_model_dir), "--out", str(out), "--device", "cpu"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(atomic_file, "_on_step", lambda label: fill_disk(disk) if label == "staged" else None)
    assert main(["quantize", str(chat_model_dir), "--out", str(out), "--precision", "32-true", "--device", "cpu"]) == 1
    line = _one_line(capsys)
    assert f"failed at {out / 'model.safetensors'}: No space left on device" in line and "needs" in line, line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in disk.iterdir()) == ["copy", "filler"]


def test_weight_files_it_did_not_write_in_out_stop_it_before_any_read_unless_overwrite(tmp_path, chat_model_dir,
                                                                                       read_recorder, capsys):
    out = tmp_path / "copy"
    out.mkdir()
    shutil.copyfile(chat_model_dir / "lit_model.pth", out / "lit_model.pth")  # generate would load this one first
    assert main(["quantize", str(chat_model_dir), "--out", str(out), "--device", "cpu"]) == 1
    line = _one_line(capsys)
    assert line.startswith("error: ForeignWeightsError:") and "'lit_model.pth'" in line and "--overwrite" in line
    assert read_recorder.keys == [] and sorted(p.name for p in out.iterdir()) == ["lit_model.pth"]

    assert main(["quantize", str(chat_model_dir), "--out", str(out), "--device", "cpu", "--overwrite"]) == 0
    assert not (out / "lit_model.pth").exists() and (out / "model.safetensors").is_file()


def test_a_quantized_copy_of_a_gguf_chat_model_answers_as_the_file_does(tmp_path, write_gguf, monkeypatch, capsys):
    """The copy carries the file's tokenizer (written from its vocabulary, read by litgpt and transformers), its chat
    template and its end-of-turn tokens: generate on the copy styles, encodes and answers as on the file (it exited 2
    for want of a tokenizer, and with one copied in by hand applied no template)."""
    import litgpt.generate.base
    import transformers

    from lightning_lowmem.cli.prompts import prompt_style_for
    from lightning_lowmem.litgpt.checkpoint_dir import LitgptCheckpoint

    path = tmp_path / "chat.Q8_0.gguf"
    write_gguf(path, "Q8_0", vocab="bpe", tie=True, hidden=128, intermediate=256, name="tiny chat")
    out = tmp_path / "copy"
    assert main(["quantize", str(path), "--quantize", "bnb.nf4", "--out", str(out), "--device", "cpu"]) == 0
    listed = capsys.readouterr().out
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "prompt_style.yaml"):
        assert str(out / name) in listed, name

    seen, real = [], litgpt.generate.base.generate

    def spy(model, prompt, *args, **kwargs):
        seen.append(prompt.tolist())
        return real(model, prompt, *args, **kwargs)

    monkeypatch.setattr(litgpt.generate.base, "generate", spy)
    flags = ["--prompt", "What is the capital of France?", "--sys_prompt", "Be brief.", "--max_new_tokens", "6",
             "--top_k", "1", "--device", "cpu"]
    assert main(["generate", str(path), *flags, "--quantize", "bnb.nf4"]) == 0
    expected = capsys.readouterr().out
    assert main(["generate", str(out), *flags]) == 0  # no --quantize: the copy says its scheme
    assert capsys.readouterr().out == expected
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    reference = transformers.AutoTokenizer.from_pretrained(out)  # the copy's files, read by transformers
    ids = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert seen == [ids, ids]
    source, copy = LitgptCheckpoint.find(path), LitgptCheckpoint.find(out)
    assert copy.config.name == source.config.name
    styles = [prompt_style_for(c.directory, c.config, c.gguf, c.tokenizer) for c in (source, copy)]
    assert styles[0].stop_tokens(source.tokenizer) == styles[1].stop_tokens(copy.tokenizer)
