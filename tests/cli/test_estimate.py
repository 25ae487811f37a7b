"""``lightning-lowmem estimate``: the library's numbers, as a table or JSON."""

from __future__ import annotations

import json
import re

import pytest
import torch


def test_json_equals_estimate_memory_of_the_named_config(run_cli):
    from litgpt import Config

    from lightning_lowmem import estimate_memory

    proc = run_cli("estimate", "pythia-1b", "--quantize", "bnb.nf4", "--max_seq_length", "2048", "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    expected = estimate_memory(Config.from_name("pythia-1b"), quantize="bnb.nf4", max_seq_length=2048)
    assert got == json.loads(json.dumps(expected.to_dict()))
    for key in ("weights", "kv_cache", "mask", "rope", "activations", "caches", "load_peak", "generate_peak", "peak"):
        assert isinstance(got[key], int) and got[key] > 0, key
    assert got["peak"] == max(got["load_peak"], got["generate_peak"]) and got["placement"] is None


def test_past_the_block_size_is_a_bad_argument(run_cli):
    """pythia-1b holds 2048 positions: 4096 is refused, by the command as by the library."""
    proc = run_cli("estimate", "pythia-1b", "--quantize", "bnb.nf4", "--max_seq_length", "4096", "--json")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "ValueError: --max_seq_length 4096 is past the model's block size (2048)" in proc.stderr


@pytest.mark.slow
def test_table_and_placement_of_a_checkpoint(run_cli, tmp_path, tiny_config, write_litgpt_dir):
    from lightning_lowmem import estimate_memory

    directory = write_litgpt_dir(tmp_path / "tiny", tiny_config("gqa"), tokenizer=False)
    table = run_cli("estimate", directory, "--max_seq_length", "32", "--prompt_length", "8")
    assert table.returncode == 0, table.stderr
    assert table.stdout.strip() == str(estimate_memory(directory, max_seq_length=32, prompt_length=8))
    assert "KV cache (1 x 32 positions)" in table.stdout and "peak while generating" in table.stdout

    placed = run_cli("estimate", directory, "--max_seq_length", "32", "--precision", "32-true", "--json",
                     "--max_memory", "cuda:0=200KiB,cpu=1GiB")
    assert placed.returncode == 0, placed.stderr
    got = json.loads(placed.stdout)
    expected = estimate_memory(directory, max_seq_length=32, dtype=torch.float32,
                               max_memory={"cuda:0": "200KiB", "cpu": "1GiB"})
    assert got["placement"] == json.loads(json.dumps(expected.placement.to_dict()))
    assert set(got["placement"]["weights"]) == {"cuda:0", "cpu"} and got["placement"]["weights"]["cpu"] > 0
    assert sum(got["placement"]["weights"].values()) == got["weights"]


@pytest.mark.parametrize("argv, code, says", [
    (["no-such-model"], 1, "neither an existing checkpoint path nor a litgpt model name"),
    (["pythia-14m", "--quantize", "bnb.nf5"], 2, "UnsupportedQuantizationError: Unknown quantization scheme 'bnb.nf5'"),
    (["pythia-14m", "--max_memory", "cuda:0"], 2, "expected DEVICE=SIZE"),
], ids=["unknown-name", "unknown-scheme", "bad-budget"])
def test_errors_are_one_line_and_an_exit_code(run_cli, argv, code, says):
    proc = run_cli("estimate", *argv)
    assert proc.returncode == code and says in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_disk_offload_shows_the_layers_on_disk_the_bytes_each_token_reads_and_the_seconds(
        run_cli, tmp_path, tiny_config, write_litgpt_dir):
    from lightning_lowmem import estimate_memory

    directory = write_litgpt_dir(tmp_path / "tiny", tiny_config(n_layer=6), torch.bfloat16, tokenizer=False)
    flags = ["--max_seq_length", "32", "--prompt_length", "8", "--max_memory", "cpu=120KiB", "--disk_offload"]
    proc = run_cli("estimate", directory, *flags, "--read_bandwidth", "100MiB/s", "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    expected = estimate_memory(directory, max_seq_length=32, prompt_length=8, max_memory={"cpu": "120KiB"},
                               disk_offload=True, read_bandwidth=100 * 2**20)
    assert got == json.loads(json.dumps(expected.to_dict()))
    disk = got["placement"]["disk"]
    assert disk["layers"] >= 3 and disk["read_bytes_per_forward"] == got["disk_read"] > 0
    assert got["seconds_per_token"] == pytest.approx(got["disk_read"] / (100 * 2**20))
    table = run_cli("estimate", directory, *flags)  # the speed measured on the file
    assert table.returncode == 0, table.stderr
    assert re.search(r"reading the layers on disk: ~[\d.e-]+ s/token at", table.stdout)
    assert "read from the checkpoint file for each forward" in table.stdout and "measured" in table.stdout
    refused = run_cli("estimate", directory, "--disk_offload")
    assert refused.returncode == 2 and "--disk_offload needs --max_memory" in refused.stderr
