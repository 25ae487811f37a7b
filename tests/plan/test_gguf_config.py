"""A GGUF file's transformers config and tokenizer fields from our own parse, through transformers' own tables: equal
to transformers' GGUF parser, never mapping the file, bounded by the file in a fresh process, and no SIGBUS when
another process cuts the file while it is parsed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lightning_lowmem import Checkpoint, CheckpointFormatError
from lightning_lowmem.plan.gguf_config import GROUPS, gguf_config, gguf_parsed


@pytest.mark.parametrize("which", ["spm", "bpe chat", "tied, fields over"])
def test_the_fields_equal_transformers_parse(tmp_path, tiny_gguf, gguf_chat_model, write_gguf, which):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = {"spm": tiny_gguf["F16"], "bpe chat": gguf_chat_model}.get(which)
    if path is None:
        path = tmp_path / "mistral.gguf"
        write_gguf(path, "Q4_0", tie=True, name="mistral", fields={"llama.rope.freq_base": 5e5, "x.list": [3, 4]})
    with Checkpoint.open(path) as ckpt:
        ours = gguf_parsed(ckpt)
    theirs = load_gguf_checkpoint(path, return_tensors=False)
    for group in GROUPS:
        assert ours[group] == theirs[group], group
    if which.startswith("tied"):  # transformers' renaming: a Llama file named "mistral" is a Mistral
        assert ours["config"]["model_type"] == "mistral" and ours["config"]["tie_word_embeddings"]
    assert gguf_config(path).model_type == theirs["config"]["model_type"]


def test_the_config_decodes_no_vocabulary_and_maps_nothing(gguf_chat_model, monkeypatch):
    from lightning_lowmem.formats.gguf_metadata import MetadataArray

    def refuse(self):
        raise AssertionError("the vocabulary was decoded for a config")

    monkeypatch.setattr(MetadataArray, "tolist", refuse)
    config = gguf_config(gguf_chat_model)
    assert config.vocab_size == 368 and config.tie_word_embeddings  # the token array's length, no output.weight
    assert str(gguf_chat_model) not in Path("/proc/self/maps").read_text()


def test_an_architecture_transformers_does_not_read_is_named(tmp_path, write_gguf_tensors):
    import numpy as np

    path = write_gguf_tensors(tmp_path / "rwkv.gguf", "rwkv6", {"token_embd.weight": np.zeros((8, 32), np.float32)})
    with pytest.raises(CheckpointFormatError, match=r"rwkv\.gguf is a 'rwkv6' GGUF file; transformers reads"):
        gguf_config(path)


# ---------------------------------------------------------------- fresh processes

MEASURE = textwrap.dedent(
    """
    import json, sys, time
    import transformers, transformers.modeling_gguf_pytorch_utils, litgpt, litgpt.tokenizer  # before the block
    from transformers import LlamaForCausalLM, LlamaConfig
    from lightning_lowmem import MemoryMonitor, LowMemError
    from lightning_lowmem.plan.gguf_config import gguf_config
    from lightning_lowmem.litgpt.checkpoint_dir import LitgptCheckpoint
    from lightning_lowmem.cli import main
    import lightning_lowmem.litgpt.gguf_tokenizer, lightning_lowmem.cli.inspect_checkpoint
    path = sys.argv[1]
    out = {}
    for name, step in [("gguf_config", lambda: gguf_config(path)), ("find", lambda: LitgptCheckpoint.find(path)),
                       ("inspect", lambda: main(["inspect", path]))]:
        t0 = time.perf_counter()
        with MemoryMonitor() as mon:
            try:
                step()
                error = None
            except LowMemError as e:
                error = type(e).__name__ + ": " + str(e)
        out[name] = {"delta": mon.usage.rss_peak_delta, "seconds": time.perf_counter() - t0, "error": error}
    print(json.dumps(out))
    """
)


def _measure(path: Path, child_env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True, env=child_env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_600k_element_metadata_array_costs_its_bytes(tmp_path, write_gguf, child_env):
    """600,000 strings of 7-8 bytes (an 8.9 MiB header) and 600,000 uint32s beside a tiny model. Measured (2 shared
    cores): each step +2..+20 MiB; transformers' parser took about 700 bytes per element (+800 MiB here)."""
    path = tmp_path / "arrays.gguf"
    write_gguf(path, "Q8_0", fields={"x.strings": [f"s{i:06d}" for i in range(600_000)],
                                     "x.numbers": list(range(600_000))})
    got = _measure(path, child_env)
    for step, result in got.items():
        assert result["error"] is None, (step, result)
        assert result["delta"] < 64 * 2**20, (step, got)


@pytest.mark.slow
def test_a_file_cut_by_another_process_while_parsed_never_kills_the_parser(tmp_path, write_gguf, child_env):
    """A child parses the config over and over while this process cuts the file and writes it back: every parse
    gives the config or a CheckpointFormatError; the child exits normally (gguf's memory-mapped reader took a
    SIGBUS)."""
    path = tmp_path / "racy.gguf"
    write_gguf(path, "Q8_0", fields={"x.strings": [f"s{i:06d}" for i in range(300_000)]})
    whole = path.read_bytes()
    code = textwrap.dedent("""
        import sys, time, json
        from lightning_lowmem import CheckpointFormatError, CheckpointNotFoundError
        from lightning_lowmem.plan.gguf_config import gguf_config
        counts = {"ok": 0, "typed": 0}
        end = time.monotonic() + float(sys.argv[2])
        while time.monotonic() < end:
            try:
                gguf_config(sys.argv[1])
                counts["ok"] += 1
            except (CheckpointFormatError, CheckpointNotFoundError):
                counts["typed"] += 1
        print(json.dumps(counts))
        """)
    child = subprocess.Popen([sys.executable, "-c", code, str(path), "6"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=child_env)
    try:
        time.sleep(2.0)  # the child's imports
        deadline = time.monotonic() + 4.0
        while child.poll() is None and time.monotonic() < deadline:
            with open(path, "r+b") as f:
                f.truncate(len(whole) // 3)
            time.sleep(0.002)
            with open(path, "r+b") as f:
                f.write(whole)
            time.sleep(0.002)
        stdout, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, (child.returncode, stderr[-2000:])
    counts = json.loads(stdout.strip().splitlines()[-1])
    assert counts["ok"] + counts["typed"] > 0, counts
    shutil.rmtree(tmp_path, ignore_errors=True)
