"""``benchmarks/gpu_load.py`` runs where it is meant to: without CUDA it says so and exits 0; ``--device cpu`` runs
every method end to end on a tiny Llama (so that a GPU run works the first time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_load.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_0(child_env):
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=child_env, timeout=120)
    assert proc.returncode == 0 and "No CUDA device here" in proc.stdout


@pytest.mark.slow
def test_cpu_mode_measures_every_method(tmp_path, child_env):
    out = tmp_path / "results.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--schemes", "bf16", "int8",
                           "--workdir", str(tmp_path), "--out", str(out), "--layers", "1"],
                          capture_output=True, text=True, env=child_env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = {r["what"]: r for r in map(json.loads, out.read_text().splitlines())}
    methods = [f"{s}: {m}" for s in ("bf16", "int8") for m in ("lowmem", "transformers", "torch")]
    assert set(methods) | {"limit: host memcpy", "limit: read warm"} == set(results)
    for what in methods:
        assert "error" not in results[what], results[what]
        assert 0 < results[what]["load"] <= results[what]["first_forward"]
    assert "| bf16: lowmem |" in proc.stdout and "1 layers of 256" in proc.stdout
