"""A GGUF file's chat template as a litgpt prompt style: rendered as transformers renders it, and the ids of a
templated prompt equal transformers' apply_chat_template(tokenize=True) for the file's own tokenizer."""

from __future__ import annotations

import pytest

from lightning_lowmem.litgpt.chat_template import ChatTemplate, chat_template_style
from lightning_lowmem.litgpt.checkpoint_dir import LitgptCheckpoint

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def reference(gguf_chat_model):
    """transformers' own tokenizer of the GGUF file (``from_pretrained(gguf_file=...)``)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(gguf_chat_model.parent, gguf_file=gguf_chat_model.name)


@pytest.mark.parametrize("sys_prompt", [None, "Answer in one word."])
def test_the_ids_of_a_templated_prompt_are_transformers_ids(gguf_chat_model, reference, sys_prompt):
    found = LitgptCheckpoint.find(gguf_chat_model)
    style = chat_template_style(found.gguf.chat_template, found.tokenizer)
    assert isinstance(style, ChatTemplate)
    messages = ([{"role": "system", "content": sys_prompt}] if sys_prompt else []) + [
        {"role": "user", "content": QUESTION}]
    want = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    text = style.apply(QUESTION, sys_prompt=sys_prompt)
    assert text == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = found.tokenizer.encode(text).tolist()
    assert ids == want
    assert ids[0] == found.tokenizer.bos_id == 1  # the template's first <|im_start|>: the file's BOS, kept
    assert style.stop_tokens(found.tokenizer) == ([2],)  # <|im_end|>


def test_plain_text_is_encoded_as_litgpt_encodes_it(gguf_chat_model):
    tokenizer = LitgptCheckpoint.find(gguf_chat_model).tokenizer
    ids = tokenizer.encode("<|im_start|>hello").tolist()  # add_bos_token is false: litgpt drops a leading BOS
    assert ids[0] != 1 and tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"


def test_no_template_or_no_tokenizer_gives_no_style(tiny_gguf):
    found = LitgptCheckpoint.find(tiny_gguf["Q8_0"])
    assert found.gguf.chat_template is None and chat_template_style(None, found.tokenizer) is None
    assert chat_template_style("{{ messages }}", None) is None


HOSTILE = {
    "sandbox-escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "huge-loop": "{% for i in range(10**9) %}x{% endfor %}",
    "raises": "{{ raise_exception('refused by the template') }}",
    "syntax": "{% for %}",
    "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
}


@pytest.fixture(scope="module")
def hostile_gguf(tmp_path_factory, write_gguf):
    """``hostile_gguf[name]``: the tiny chat model with the chat template ``HOSTILE[name]``."""
    directory = tmp_path_factory.mktemp("hostile")
    paths = {}
    for name, template in HOSTILE.items():
        paths[name] = directory / name / "chat.Q8_0.gguf"
        write_gguf(paths[name], "Q8_0", vocab="bpe", tie=True, fields={"tokenizer.chat_template": template})
    return paths


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_is_a_typed_error_naming_the_file_before_any_read(hostile_gguf, read_recorder, name):
    from lightning_lowmem import CheckpointFormatError, generate

    path = hostile_gguf[name]
    with pytest.raises(CheckpointFormatError, match="chat template") as raised:
        generate(path, "hello", max_new_tokens=1)
    assert str(path) in str(raised.value) and "prompt_style=None" in str(raised.value)
    assert read_recorder.keys == []  # refused before any weight is read
    assert generate(path, "hello", max_new_tokens=1, prompt_style=None).tokens  # the prompt as given still runs


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_on_the_command_line_is_one_line_and_exit_1(hostile_gguf, capsys, name):
    from lightning_lowmem.cli import main

    assert main(["generate", str(hostile_gguf[name]), "--prompt", "hello", "--max_new_tokens", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: CheckpointFormatError: ") and "chat template" in err[-1]
    assert not any("Traceback" in line for line in err)
