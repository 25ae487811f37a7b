"""A GGUF file's counts checked against its own tensors before any model is built: metadata that disagrees with the
tensors (or is not a number) is a CheckpointFormatError naming the file, the key, the value and what the tensors
say, in every face, at once."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from lightning_lowmem import CheckpointFormatError, generate
from lightning_lowmem.cli import main
from lightning_lowmem.plan.gguf_config import gguf_config

# The tiny Llama of write_gguf: 2 blocks, 64 wide, 4 heads of 16 over 2 key-value heads, MLP 128, 303 tokens.
CONTRADICTIONS = {
    "4e9 blocks": ({"llama.block_count": 4_000_000_000},
                   r"llama\.block_count = 4000000000, but the tensors hold blocks blk\.0 \.\. blk\.1 \(2\)"),
    "blocks as text": ({"llama.block_count": "two"}, r"llama\.block_count is 'two' \(a str\), where GGUF stores"),
    "3 heads": ({"llama.attention.head_count": 3}, r"llama\.attention\.head_count_kv = 2, but "
                                                   r"llama\.attention\.head_count = 3 is not a multiple of it"),
    "0 heads": ({"llama.attention.head_count": 0}, r"llama\.attention\.head_count = 0, which no model has"),
    "0 kv heads": ({"llama.attention.head_count_kv": 0}, r"llama\.attention\.head_count_kv = 0, which no model"),
    "heads as a float": ({"llama.attention.head_count": 4.0}, r"llama\.attention\.head_count is 4\.0 \(a float\)"),
    "8 heads": ({"llama.attention.head_count": 8, "llama.attention.head_count_kv": 8},
                r"llama\.attention\.head_count = 8, but blk\.0\.attn_q\.weight has 64 rows, which are not that many "
                r"heads of one even size of llama\.rope\.dimension_count = 16"),
    "head size": ({"llama.rope.dimension_count": 8}, r"head_count = 4, but blk\.0\.attn_q\.weight has 64 rows"),
    "4 kv heads": ({"llama.attention.head_count_kv": 4},
                   r"head_count_kv = 4, but blk\.0\.attn_k\.weight has 32 rows, not that many heads of 16 rows"),
    "width": ({"llama.embedding_length": 32}, r"llama\.embedding_length = 32, but the file's columns of "
                                              r"token_embd\.weight: 64"),
    "MLP": ({"llama.feed_forward_length": 100}, r"feed_forward_length = 100, but the file's rows of "
                                                r"blk\.0\.ffn_up\.weight: 128"),
    "vocabulary": ({"llama.vocab_size": 500}, r"llama\.vocab_size = 500, but the file's rows of token_embd"),
    "no context": ({"llama.context_length": 0}, r"llama\.context_length = 0, which no model has"),
    "2**40 context": ({"llama.context_length": 2**40}, r"context_length = 1099511627776, .* at most 1073741824"),
}


@pytest.fixture(scope="module")
def contradicting(tmp_path_factory, write_gguf):
    directory = tmp_path_factory.mktemp("contradicting")
    return {case: write_gguf(directory / f"{case.replace(' ', '-')}.gguf", "Q8_0", fields=fields) and
            directory / f"{case.replace(' ', '-')}.gguf" for case, (fields, _) in CONTRADICTIONS.items()}


@pytest.mark.parametrize("case", list(CONTRADICTIONS))
def test_metadata_that_disagrees_with_the_tensors_is_named_at_once(contradicting, case, capsys):
    path, expected = contradicting[case], CONTRADICTIONS[case][1]
    with pytest.raises(CheckpointFormatError, match=expected) as info:
        gguf_config(path)
    assert path.name in str(info.value)
    import litgpt.generate.base  # noqa: F401  (generate's own import, not timed)

    start = time.perf_counter()
    with pytest.raises(CheckpointFormatError, match=expected):
        generate(path, [1, 2, 3], max_new_tokens=2)
    assert time.perf_counter() - start < 1.0
    assert main(["inspect", str(path)]) == 1
    assert "CheckpointFormatError" in capsys.readouterr().err


def test_the_file_as_written_passes(tiny_gguf):
    assert gguf_config(tiny_gguf["Q8_0"]).num_hidden_layers == 2


CHILD = textwrap.dedent(
    """
    import json, sys, time
    import litgpt, litgpt.generate.base, transformers
    from transformers import LlamaForCausalLM
    from lightning_lowmem import LowMemError, MemoryMonitor, generate
    start = time.perf_counter()
    with MemoryMonitor() as mon:
        try:
            generate(sys.argv[1], [1, 2, 3], max_new_tokens=2)
            error = None
        except LowMemError as e:
            error = type(e).__name__
    print(json.dumps({"error": error, "seconds": time.perf_counter() - start, "delta": mon.usage.rss_peak_delta}))
    """
)


@pytest.mark.slow
def test_a_huge_block_count_is_refused_in_a_fresh_process_before_any_model_is_built(contradicting, child_env):
    """Measured (2 shared cores): refused in 0.05-0.2 s, +1..+6 MiB; before the check, a model of 4e9 blocks was being
    built on meta (minutes, past 1.9 GiB)."""
    proc = subprocess.run([sys.executable, "-c", CHILD, str(contradicting["4e9 blocks"])], capture_output=True,
                          text=True, env=child_env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["error"] == "CheckpointFormatError" and got["seconds"] < 1.0 and got["delta"] < 64 * 2**20, got
