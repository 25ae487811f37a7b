"""Memory accounting and the heap: a quantized model's first forward gives its temporaries back (fresh processes).

bitsandbytes repacks 4-bit weights for its CPU kernel; int8 layers dequantize or convert theirs. The loader
hooks :func:`lightning_lowmem.memory.heap.trim_after_first_forward` on each quantized layer.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

FIRST_FORWARD = """
import json, sys, torch, litgpt, psutil
import bitsandbytes, torchao.quantization
from lightning_lowmem import init_empty, load_checkpoint
with init_empty():
    model = litgpt.GPT(litgpt.Config.from_file(sys.argv[1]))
load_checkpoint(model, sys.argv[2], dtype=torch.bfloat16, quantize=sys.argv[4])
if sys.argv[3] == "untrimmed":  # what bitsandbytes leaves without lightning_lowmem's hooks
    for m in model.modules():
        handle = m.__dict__.pop("_lowmem_trim_hook", None)
        handle is not None and handle.remove()
rss = psutil.Process().memory_info().rss
with torch.no_grad():
    model(torch.randint(0, 1000, (1, 16)))
print(psutil.Process().memory_info().rss - rss)
"""


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.int8", "torchao.int8wo"])
def test_first_forward_gives_its_temporaries_back(large_checkpoint, child_env, scheme):
    """A quantized layer's first CPU forward frees temporaries that would stay resident without the hooks.

    Measured here (10 layers, a 1 x 16 batch), RSS kept after the first forward without / with the
    hooks: bnb.nf4 65-92 / 11.5-12.9 MiB; bnb.int8 55-140 / 6.5-12.4 MiB; torchao.int8wo 30.5-38.8 /
    11.3-11.6 MiB. What is kept without the hooks varies with the heap's state; with them it is at most
    0.38x of that. The bounds: at most 24 MiB kept, and at most 0.6x of what is kept without the hooks
    (without the hooks both runs keep about the same).
    """
    path, _ = large_checkpoint

    def kept(mode: str) -> int:
        proc = subprocess.run([sys.executable, "-c", FIRST_FORWARD, str(path.parent / "model_config.yaml"),
                               str(path), mode, scheme], capture_output=True, text=True, env=child_env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return int(proc.stdout.strip().splitlines()[-1])

    untrimmed, trimmed = kept("untrimmed"), kept("trimmed")
    print(scheme, "kept without / with the hooks (MiB):", round(untrimmed / 2**20, 1), round(trimmed / 2**20, 1))
    if scheme == "bnb.nf4" and untrimmed < 32 * 2**20:
        pytest.skip(f"bitsandbytes kept only {untrimmed / 2**20:.0f} MiB here: no 4-bit repack on this CPU")
    assert trimmed <= 24 * 2**20
    assert trimmed <= 0.6 * untrimmed
