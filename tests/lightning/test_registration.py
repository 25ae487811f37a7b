"""``import lightning_lowmem`` does not import Lightning, and ``Fabric(strategy="lowmem")`` (and ``"lowmem_fsdp"``)
works in any import order.

Each case runs in a fresh interpreter: which modules an import pulls in, and what it costs,
can only be seen from a clean ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.fixture
def run(child_env):
    """``run(code)``: ``code`` in a fresh interpreter; the JSON it prints last."""
    def run_code(code: str) -> dict:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run_code


PEAK = "[int(line.split()[1]) * 1024 for line in open('/proc/self/status') if line.startswith('VmHWM')][0]"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_import_does_not_import_lightning(run):
    """Measured here: import torch 218 MiB; + lightning_lowmem 222 MiB; + lightning 414 MiB."""
    floor = run(f"import json, torch; print(json.dumps({{'peak': {PEAK}}}))")["peak"]
    got = run(f"""
import json, sys, lightning_lowmem
print(json.dumps({{"peak": {PEAK}, "lightning": sorted(m for m in sys.modules if m.split(".")[0] in
                  ("lightning", "lightning_fabric", "pytorch_lightning", "litgpt", "transformers"))}}))
""")
    assert got["lightning"] == []
    assert got["peak"] <= floor + 64 * 2**20, (got["peak"] - floor) / 2**20  # Lightning's import adds ~200 MiB


@pytest.mark.slow
@pytest.mark.parametrize("order", ["lightning_lowmem first", "lightning first"])
def test_fabric_finds_the_strategy_by_name_in_either_import_order(run, order):
    imports = "import lightning_lowmem\nimport lightning as L" if order == "lightning_lowmem first" else \
        "import lightning as L\nimport lightning_lowmem"
    got = run(f"""
import json
{imports}
import lightning.fabric.strategies as registry_module
fabric = L.Fabric(strategy="lowmem", accelerator="cpu", devices=1)
fsdp = L.Fabric(strategy="lowmem_fsdp", accelerator="cpu", devices=2)
print(json.dumps({{"strategy": type(fabric.strategy).__qualname__,
                  "same": type(fabric.strategy) is lightning_lowmem.LowMemStrategy,
                  "fsdp": type(fsdp.strategy) is lightning_lowmem.LowMemFSDPStrategy,
                  "listed": {{"lowmem", "lowmem_fsdp"}} <= set(registry_module.STRATEGY_REGISTRY.available_strategies()),
                  "loader": type(registry_module.__loader__).__name__,
                  "callback": lightning_lowmem.LowMemCallback.__module__}}))
""")
    assert got == {"strategy": "LowMemStrategy", "same": True, "fsdp": True, "listed": True,
                   "loader": "SourceFileLoader", "callback": "lightning_lowmem.lightning.callback"}


def test_unknown_attribute_is_an_attribute_error():
    import lightning_lowmem

    with pytest.raises(AttributeError, match="LowMemNothing"):
        lightning_lowmem.LowMemNothing  # noqa: B018
    assert {"LowMemStrategy", "LowMemFSDPStrategy", "LowMemCallback", "load_checkpoint"} <= set(dir(lightning_lowmem))
