"""A GGUF file through litgpt: config and tokenizer from the file, tensors converted by transformers' GGUF code and
then litgpt's as they stream in; generate() gives the tokens of the same weights as an HF directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lightning_lowmem import AmbiguousCheckpointError, generate
from lightning_lowmem.litgpt.checkpoint_dir import LitgptCheckpoint
from lightning_lowmem.litgpt.gguf import litgpt_config

IDS = [1, 5, 7, 300]


def test_generate_gives_the_tokens_of_the_same_weights_as_an_hf_directory(tmp_path, tiny_gguf, gguf_kind,
                                                                         gguf_from_pretrained):
    from litgpt.utils import save_config

    path = tiny_gguf[gguf_kind]
    found = LitgptCheckpoint.find(path)
    hf = gguf_from_pretrained(path)  # the file's weights, as transformers dequantizes them
    hf.save_pretrained(tmp_path / "hf")
    save_config(found.config, tmp_path / "hf")
    got = generate(path, IDS, max_new_tokens=12, temperature=0.0, precision="32-true")
    want = generate(tmp_path / "hf", IDS, max_new_tokens=12, temperature=0.0, precision="32-true")
    assert got.tokens[0].tolist() == want.tokens[0].tolist()
    expected = hf.generate(torch.tensor([IDS]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert got.tokens[0].tolist() == expected[0].tolist()[:len(got.tokens[0])]
    assert got.load_report.bytes_read < path.stat().st_size


def test_the_config_comes_from_the_file(tiny_gguf):
    config = LitgptCheckpoint.find(tiny_gguf["Q4_0"]).config
    assert str(tiny_gguf["Q4_0"]) not in Path("/proc/self/maps").read_text()  # transformers' parser let go of it
    assert (config.n_layer, config.n_embd, config.n_head, config.n_query_groups, config.head_size) == (2, 64, 4, 2, 16)
    assert (config.intermediate_size, config.padded_vocab_size, config.block_size) == (128, 303, 64)
    assert (config.norm_class_name, config.mlp_class_name, config.rope_base) == ("RMSNorm", "LLaMAMLP", 10000)
    assert config.norm_eps == pytest.approx(1e-5)  # stored as float32 in the file


def test_the_tokenizer_encodes_as_transformers_builds_it(tiny_gguf):
    import transformers

    path = tiny_gguf["Q8_0"]
    tokenizer = LitgptCheckpoint.find(path).tokenizer
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ("hello world", "the world", "xyz hello"):
        assert tokenizer.encode(text).tolist() == reference(text).input_ids, text
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)  # the file's own BOS and EOS
    ids = tokenizer.encode("hello world")
    assert tokenizer.decode(ids[1:]) == "hello world"
    result = generate(path, "hello world", max_new_tokens=4, temperature=0.0)
    assert result.tokens[0][:3].tolist() == ids.tolist()
    assert result.texts[0] == tokenizer.decode(result.new_tokens[0])  # the reply, without the prompt


def test_a_directory_holding_one_gguf_file_and_a_file_without_vocabulary(tmp_path, write_gguf, caplog):
    directory = tmp_path / "model"
    write_gguf(directory / "model.Q8_0.gguf", "Q8_0", vocab=False)
    found = LitgptCheckpoint.find(directory)
    assert found.weights == directory / "model.Q8_0.gguf" and found.tokenizer is None
    assert "give prompts as token ids" in caplog.text
    result = generate(directory, "1 5 7", max_new_tokens=3, temperature=0.0)
    assert result.tokens[0][:3].tolist() == [1, 5, 7] and result.texts is None
    with pytest.raises(ValueError, match="prompt must be token ids"):
        generate(directory, "hello", max_new_tokens=3)


def test_quantized_again_on_load(tiny_gguf):
    plain = generate(tiny_gguf["Q8_0"], IDS, max_new_tokens=1, temperature=0.0, precision="32-true")
    result = generate(tiny_gguf["Q8_0"], IDS, max_new_tokens=6, temperature=0.0, quantize="torchao.int8wo")
    assert result.load_report.quantized and len(result.tokens[0]) == len(IDS) + 6
    assert result.tokens[0][:len(IDS) + 1].tolist() == plain.tokens[0].tolist()


def test_a_family_without_a_litgpt_config_asks_for_one(tmp_path, tiny_gguf):
    import transformers

    with pytest.raises(ValueError, match=r"'gpt2'.*Pass config=NAME, its litgpt model name"):
        litgpt_config(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))
    named = litgpt_config(transformers.GPT2Config(n_layer=1), ["pythia-14m"])  # a litgpt name in the file: its config
    assert named.name == "pythia-14m"
    directory = tmp_path / "two"
    directory.mkdir()
    shutil.copy(tiny_gguf["Q8_0"], directory / "a.gguf")
    shutil.copy(tiny_gguf["Q4_0"], directory / "b.gguf")
    with pytest.raises(AmbiguousCheckpointError, match=r"a\.gguf and b\.gguf: the values of .* differ"):
        LitgptCheckpoint.find(directory)


def test_the_estimate_reads_the_file_as_generate_loads_it(tiny_gguf):
    from lightning_lowmem import estimate_memory

    est = estimate_memory(tiny_gguf["Q4_0"], max_seq_length=16, quantize="torchao.int8wo")
    result = generate(tiny_gguf["Q4_0"], IDS, max_new_tokens=12, temperature=0.0, quantize="torchao.int8wo")
    assert est.weights == result.load_report.bytes_loaded
    assert est.quantized_weights == result.load_report.quantized_bytes_after
    assert est.kv_cache == result.memory.kv_cache


def test_a_known_model_gets_litgpt_s_config_from_its_fields_and_names(smollm_gguf):
    """SmolLM2-135M-Instruct's GGUF names itself "Smollm2 135M 8k Lc100K Mix1 Ep2" (its training run): no litgpt
    name, but litgpt's SmolLM2-135M configs have its fields, and the words of its names pick one."""
    from lightning_lowmem.plan import gguf_config

    hf = gguf_config(smollm_gguf)
    run = ["Smollm2 135M 8k Lc100K Mix1 Ep2", "smollm2-135M-8k-lc100k-mix1-ep2"]
    assert litgpt_config(hf, run).name == "SmolLM2-135M"
    assert litgpt_config(hf, ["SmolLM2 135M Instruct"]).name == "SmolLM2-135M-Instruct"
    assert litgpt_config(hf, ["a fine-tune"]).name == "Llama-gguf-30x576"  # two litgpt configs fit, no name says which
    hf.rope_parameters = {**hf.rope_parameters, "rope_theta": 10000.0}
    assert litgpt_config(hf, ["SmolLM2 135M Instruct"]).name == "Llama-gguf-30x576"  # another RoPE: not SmolLM2's
    found = LitgptCheckpoint.find(smollm_gguf)  # the file's own name: "SmolLM2 135M Instruct"
    assert found.config.name == "SmolLM2-135M-Instruct" and found.gguf.chat_template
