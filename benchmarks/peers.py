"""Every peer side by side: load time, time to first forward and peak memory, quiet and beside a busy process.

    python benchmarks/peers.py                                   # pythia-1b, 3 rounds, quiet and busy
    python benchmarks/peers.py --quick                           # pythia-14m, 1 round: a check that everything runs
    python benchmarks/peers.py --only nf4 int8 --conditions busy --baseline /path/to/other/checkout

Cases (the same random pythia weights throughout, prepared once under ``--workdir``; see ``peer_methods.py``):
bf16 from ``lit_model.pth`` and from ``.safetensors``, quantized on load to nf4 / int8 (bitsandbytes) and
int8wo (torchao), a reload of the saved nf4 checkpoint, and a GGUF Q4_0 Llama of the same size. Methods:
lightning_lowmem, torch's own idiom (meta + mmap + ``assign=True``), accelerate, transformers, ``litgpt
generate``'s own load, Fabric's ``load_raw``, and for quantization each library's load-then-quantize path. The
limits: reading the file warm (into a reused buffer, and into fresh memory) and each quantization kernel alone.

Every run is a fresh process, the files it reads put in the page cache first. Rounds are interleaved: each round
runs every method once quiet and once with one competing process (``python -c "while True: pass"``, started and
stopped here), so a slow spell hits every method alike; the order moves (every other round a case starts at another
of its methods, and a method's baseline run goes before it in every other round), so that no method is always the
one run right after another's. Columns: the median over rounds of the load's seconds (build + load, imports
excluded) and of the time to first forward (load + one forward of 1 x 16 tokens), their range, and the highest peak
RSS above the RSS before the load (load and first forward, file-backed pages of a mapped file included), in MiB and
over the final model's bytes. The load average at the start of each round is printed, and per-round ratios of
lightning_lowmem to the methods it is held to; beside a baseline checkout, also of the CPU seconds (user and system)
of the load and the first forward: the same work, apart from the wall clock's noise.

Writes ``peers.md`` (the tables), ``peers.json`` (every run) and ``peers.png`` (a bar chart of the time to
first forward) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, WORKDIR, MiB, environment, markdown, median, spread, warm_page_cache
from peer_methods import CASES, NOT_ON_CPU, files_read, paths

CONDITIONS = ("quiet", "busy")
RATIOS = [  # (case, ours, theirs): per-round ratios printed under the tables
    ("bf16 .pth", "lowmem", "torch"), ("bf16 .pth", "lowmem", "litgpt"), ("bf16 .safetensors", "lowmem", "torch"),
    ("nf4", "lowmem", "after"), ("int8", "lowmem", "after"), ("int8wo", "lowmem", "after"),
    ("nf4 reload", "lowmem", "transformers"), ("GGUF Q4_0", "lowmem", "transformers")]


# ---------------------------------------------------------------- worker side

def worker(case: str, method: str, model: str, workdir: Path) -> dict:
    """One method in this (fresh) process: seconds to load and to first forward, peaks, final bytes."""
    import torch  # noqa: F401

    import peer_methods
    from lightning_lowmem import MemoryMonitor
    from lightning_lowmem.quantize import module_nbytes

    if case == "limits":
        return {"load": peer_methods.limit(method, model, workdir)}
    _import_for(case, method)
    before = resource.getrusage(resource.RUSAGE_SELF)
    with MemoryMonitor() as loading:
        net = peer_methods.build(case, method, model, workdir)
    with MemoryMonitor() as forward:
        peer_methods.first_forward(net, peer_methods._config(model).vocab_size)
    after = resource.getrusage(resource.RUSAGE_SELF)
    start = loading.usage.rss_start
    return {"load": loading.usage.seconds, "first_forward": loading.usage.seconds + forward.usage.seconds,
            "user": after.ru_utime - before.ru_utime, "sys": after.ru_stime - before.ru_stime,
            "peak_load": loading.usage.rss_peak - start,
            "peak": max(loading.usage.rss_peak, forward.usage.rss_peak) - start, "final": module_nbytes(net)}


def _import_for(case: str, method: str) -> None:
    """What the method needs, imported before the timed block (alike for every method of a case)."""
    import lightning  # noqa: F401
    import litgpt  # noqa: F401
    import transformers  # noqa: F401

    import lightning_lowmem  # noqa: F401

    if case in ("nf4", "int8", "nf4 reload"):
        import bitsandbytes  # noqa: F401
    if case == "int8wo":
        import torchao.quantization  # noqa: F401
    if method == "accelerate":
        import accelerate  # noqa: F401


# ---------------------------------------------------------------- parent side

def run(args: argparse.Namespace, case: str, method: str, checkout: Path) -> dict:
    """``method`` in a fresh process importing lightning_lowmem from ``checkout``; its JSON line, or an error."""
    for path in files_read(case, method, paths(args.model, args.workdir)):
        warm_page_cache(path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), str(Path(__file__).parent)])}
    command = [sys.executable, __file__, "--worker", case, method, "--model", args.model,
               "--workdir", str(args.workdir)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1][:160]}
    return json.loads(lines[-1])


class Competitor:
    """One busy process (a Python loop) while the block runs: the "busy" condition."""

    def __enter__(self) -> Competitor:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(1.0)  # on the run queue before the first method starts
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


def selected(args: argparse.Namespace, round_index: int = 0) -> list[tuple[str, str, Path]]:
    """``(case, method, checkout)`` of every run in one round: this checkout's, and the baseline's lowmem rows.

    The run right after another method's pays the kernel's cleanup after that process (measured: several times the
    system time of the same load run after its own kind), so the order moves each round: a case's methods are
    rotated every other round (no method always the first after another case's), and each method runs beside its
    baseline run, this checkout's first in even rounds and the baseline's first in odd ones (in 4 rounds, each
    follows the other twice)."""
    out = []
    for case, methods in CASES.items():
        if args.only and not any(o == case or o in case.split() for o in args.only):
            continue
        units = []
        for method in methods:
            unit = [(case, method, ROOT)]
            if args.baseline and method.startswith("lowmem"):
                unit.append((case, method + " (baseline)", args.baseline))
            units.append(unit[::-1] if round_index % 2 else unit)
        shift = round_index // 2 % len(units)
        out += [run for unit in units[shift:] + units[:shift] for run in unit]
    return out


def rounds(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """Every run: ``{condition: {(case, method): [result per round]}}``, and each round's load averages."""
    runs: dict[str, dict[tuple[str, str], list[dict]]] = {c: {} for c in args.conditions}
    loads: list[dict] = []
    for r in range(args.rounds):
        for condition in args.conditions:
            loads.append({"round": r + 1, "condition": condition, "load average": os.getloadavg()[0]})
            with Competitor() if condition == "busy" else _Quiet():
                for case, method, checkout in selected(args, r):
                    result = run(args, case, method.removesuffix(" (baseline)"), checkout)
                    runs[condition].setdefault((case, method), []).append(result)
                    print(f"round {r + 1} {condition}: {case} / {method}: {result}", file=sys.stderr, flush=True)
    return runs, loads


class _Quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# ---------------------------------------------------------------- the tables and the chart

def summary(results: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r]
    if not ok:
        return {"error": results[0]["error"]}
    out = {"load": median([r["load"] for r in ok]), "load range": spread([r["load"] for r in ok], 2), "n": len(ok)}
    if "first_forward" in ok[0]:
        out |= {"first forward": median([r["first_forward"] for r in ok]),
                "ff range": spread([r["first_forward"] for r in ok], 2),
                "peak": max(r["peak"] for r in ok), "final": ok[0]["final"]}
    return out


def table(runs: dict[tuple[str, str], list[dict]], model_bytes: int) -> str:
    header = ["case", "method", "load s (median)", "range", "first forward s (median)", "range",
              "peak MiB (max)", "peak / bf16 model"]
    rows = []
    for (case, method), results in runs.items():
        s = summary(results)
        what = CASES[case].get(method.removesuffix(" (baseline)"), method) + (" [baseline]" if "baseline" in method
                                                                             else "")
        if "error" in s:
            rows.append([case, what, f"failed: {s['error']}", "", "", "", "", ""])
        elif "first forward" not in s:
            rows.append([case, what, f"{s['load']:.2f}", s["load range"], "", "", "", ""])
        else:
            rows.append([case, what, f"{s['load']:.2f}", s["load range"], f"{s['first forward']:.2f}", s["ff range"],
                         f"{s['peak'] / MiB:.0f}", f"{s['peak'] / model_bytes:.2f}"])
    return markdown(header, rows)


def ratios(runs: dict[tuple[str, str], list[dict]]) -> list[str]:
    """Per-round ratios of lightning_lowmem's time to first forward to the methods it is held to (and to the
    baseline checkout's)."""
    pairs = RATIOS + [(case, m.removesuffix(" (baseline)"), m) for case, m in runs if m.endswith(" (baseline)")]
    lines = []
    for case, ours, theirs in pairs:
        a, b = runs.get((case, ours), []), runs.get((case, theirs), [])
        per = [x["first_forward"] / y["first_forward"] for x, y in zip(a, b)
               if "first_forward" in x and "first_forward" in y]
        if per:
            lines.append(f"{case}: {ours} / {theirs}, time to first forward: median {median(per):.2f} "
                         f"(rounds: {', '.join(f'{x:.2f}' for x in per)})")
        if not theirs.endswith(" (baseline)"):
            continue
        cpu = [(x["user"] / y["user"], x["sys"] / y["sys"]) for x, y in zip(a, b)  # the same work: its CPU seconds,
               if "user" in x and "user" in y and y["user"] > 0 and y["sys"] > 0]  # apart from the wall's noise
        if cpu:
            lines.append(f"{case}: {ours} / {theirs}, CPU seconds to first forward: user median "
                         f"{median([u for u, _ in cpu]):.2f} (rounds: {', '.join(f'{u:.2f}' for u, _ in cpu)}), "
                         f"system median {median([k for _, k in cpu]):.2f} "
                         f"(rounds: {', '.join(f'{k:.2f}' for _, k in cpu)})")
    return lines


def chart(all_runs: dict[str, dict], out: Path, title: str) -> None:
    """Time to first forward (medians), one panel per condition, one group of bars per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in CASES if c != "limits"]
    fig, axes = plt.subplots(1, len(all_runs), figsize=(7 * len(all_runs), 7), squeeze=False)
    for ax, (condition, runs) in zip(axes[0], all_runs.items()):
        labels, values, colors = [], [], []
        for case in cases:
            for (c, method), results in runs.items():
                s = summary(results)
                if c == case and "first forward" in s:
                    labels.append(f"{case}: {method}")
                    values.append(s["first forward"])
                    colors.append("tab:orange" if method.startswith("lowmem") else "tab:blue")
        ax.barh(range(len(values)), values, color=colors)
        ax.set_yticks(range(len(values)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("seconds to first forward (median)")
        ax.set_title(f"{condition}")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def report(args: argparse.Namespace, all_runs: dict[str, dict], loads: list[dict]) -> str:
    model_bytes = _safetensors_nbytes(paths(args.model, args.workdir)["safetensors"])
    lines = [environment(["lightning", "litgpt", "transformers", "accelerate", "bitsandbytes", "torchao", "gguf"]),
             f"model: {args.model} config, random weights, bf16 model {model_bytes / MiB:.0f} MiB; {args.rounds} "
             f"interleaved round(s), each case's order moved between rounds; page cache warm before each run; "
             f"a fresh process per run", "",
             "load average (1 min) at the start of each round: " + ", ".join(
                 f"{x['round']} {x['condition']} {x['load average']:.2f}" for x in loads), ""]
    for condition, runs in all_runs.items():
        lines += [f"### {condition}" + (" (one competing busy process)" if condition == "busy" else ""), "",
                  table(runs, model_bytes), "", *ratios(runs), ""]
    lines.append(f"Not on this machine: {NOT_ON_CPU}.")
    return "\n".join(lines)


def _safetensors_nbytes(path: Path) -> int:
    """Bytes of the tensors a safetensors file holds, from its header (the parent imports no lightning_lowmem)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(end - begin for key, v in header.items() if key != "__metadata__" for begin, end in [v["data_offsets"]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pythia-1b", help="litgpt config name (default: pythia-1b)")
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    parser.add_argument("--out", type=Path, default=None, help="where peers.md/.json/.png go (default: workdir)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=CONDITIONS)
    parser.add_argument("--only", nargs="*", help="cases named, or containing one of these words (nf4, bf16, ...)")
    parser.add_argument("--baseline", type=Path, help="another checkout whose lightning_lowmem rows run too")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="pythia-14m, one round: a check that every method runs")
    parser.add_argument("--from-json", type=Path, help="tables and chart again from a peers.json, nothing run")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.model, args.rounds = "pythia-14m", 1
    if args.worker:
        print(json.dumps(worker(*args.worker, args.model, args.workdir)))
        return
    if args.prepare:
        from peer_methods import prepare

        prepare(args.model, args.workdir)
        print(json.dumps({"prepared": str(args.workdir)}))
        return
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        loads, seconds = saved.pop("load averages"), saved.pop("seconds", 0.0)
        all_runs = {c: {tuple(k.split(" | ", 1)): v for k, v in runs.items()} for c, runs in saved.items()}
        args.rounds = max((r["round"] for r in loads), default=1)
        render(args, all_runs, loads, seconds, args.out or args.from_json.parent)
        return
    prepared = _prepare(args)
    if "error" in prepared:
        sys.exit(f"writing the checkpoints failed: {prepared['error']}")
    t0 = time.perf_counter()
    all_runs, loads = rounds(args)
    seconds = time.perf_counter() - t0
    out = args.out or args.workdir / "peers"
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps({c: {f"{k[0]} | {k[1]}": v for k, v in runs.items()}
                                                for c, runs in all_runs.items()}
                                               | {"load averages": loads, "seconds": seconds}, indent=1))
    render(args, all_runs, loads, seconds, out)


def render(args: argparse.Namespace, all_runs: dict[str, dict], loads: list[dict], seconds: float,
           out: Path) -> None:
    """The tables printed and written to ``out/peers.md``, the chart to ``out/peers.png``."""
    text = report(args, all_runs, loads) + f"\n\n(benchmark time {seconds:.0f} s)"
    print(text)
    (out / "peers.md").write_text(text + "\n")
    chart(all_runs, out / "peers.png", f"{args.model}: time to first forward, {args.rounds} round(s)")


def _prepare(args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent)])}
    proc = subprocess.run([sys.executable, __file__, "--prepare", "--model", args.model, "--workdir",
                           str(args.workdir)], capture_output=True, text=True, env=env)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return {}


if __name__ == "__main__":
    main()
