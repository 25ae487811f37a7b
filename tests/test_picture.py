"""The memory picture: timelines drawn to a PNG, a clear error without matplotlib, and the demo that draws one.

The demo runs with pythia-14m's architecture in a fresh process, with and without matplotlib.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_lowmem.memory import Mark, Sample, Timeline, save_timeline

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"
MIB = 2**20


def ramp(peak_mib: int, seconds: float, device: bool = False) -> Timeline:
    """A load that climbs to ``peak_mib`` above a 300 MiB start and settles at half of it, with two marks."""
    start = Sample(0.0, 300 * MIB, 200 * MIB, 0 if device else None)
    points = []
    for i in range(101):
        s = seconds * i / 100
        held = peak_mib * MIB * (min(i, 80) / 80 if i <= 80 else 0.5)
        points.append(Sample(s, start.anon + int(held * 0.8), start.file + int(held * 0.2),
                             int(held / 2) if device else None))
    return Timeline(start=start, points=points, marks=[Mark(0.1 * seconds, "model built"),
                                                       Mark(0.8 * seconds, "weights loaded")])


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's header."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_save_timeline_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = save_timeline({"naive": ramp(1500, 3.0), "lowmem": ramp(800, 2.0, device=True)},
                         tmp_path / "pictures" / "memory.png", title="pythia-410m, 2-core CPU",
                         model_bytes=770 * MIB, dpi=100)
    assert path == tmp_path / "pictures" / "memory.png"
    assert png_size(path) == (900, round(100 * (1.2 + 2.6 * 2)))
    assert path.stat().st_size > 20_000  # two panels of areas, lines and text, not an empty canvas

    single = save_timeline(ramp(100, 1.0), tmp_path / "one.png")
    assert png_size(single)[0] == 9 * 120


def test_save_timeline_needs_a_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="no timeline"):
        save_timeline({}, tmp_path / "memory.png")


def test_without_matplotlib_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: `import` raises ImportError
    with pytest.raises(ImportError, match="pip install matplotlib"):
        save_timeline({"naive": ramp(100, 1.0)}, tmp_path / "memory.png")
    assert not (tmp_path / "memory.png").exists()


# The demo with matplotlib hidden. litgpt imports it (through torchmetrics) when it is installed, so it is hidden
# after litgpt's import; from then on, any `import matplotlib...` raises ImportError as if it were absent.
NO_MATPLOTLIB = """
import runpy, sys
import litgpt
for name in [m for m in sys.modules if m.split(".")[0] == "matplotlib"] + ["matplotlib"]:
    sys.modules[name] = None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("matplotlib", [True, False], ids=["with-matplotlib", "without-matplotlib"])
def test_the_demo_prints_the_table_and_draws_both_loads(tmp_path, child_env, matplotlib):
    if matplotlib:
        pytest.importorskip("matplotlib")
    pytest.importorskip("litgpt")
    cmd = [sys.executable] + ([str(DEMO)] if matplotlib else ["-c", NO_MATPLOTLIB, str(DEMO)])
    proc = subprocess.run(cmd + ["--model", "pythia-14m", "--cache", str(tmp_path)], capture_output=True,
                          text=True, env=child_env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "peak RSS added" in proc.stdout
    assert [line.split()[0] for line in proc.stdout.splitlines() if line.startswith(("naive ", "lowmem "))] == [
        "naive", "lowmem"]
    assert all(f"[{step}/4]" in proc.stderr for step in range(1, 5))
    png = tmp_path / "pythia-14m" / "memory.png"
    if matplotlib:
        assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 20_000
        assert str(png) in proc.stdout
    else:
        assert not png.exists()
        assert "picture skipped" in proc.stderr and "pip install matplotlib" in proc.stderr
