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
