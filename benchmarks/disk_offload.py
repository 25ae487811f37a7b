"""Bigger than memory: layers read from the checkpoint file for each token, against the model in RAM and accelerate.

Model: litgpt's ``pythia-1.4b`` config (1.41 B parameters, 2.83 GB in bf16; ``--quick``: ``pythia-160m``), random
weights (``common.random_state``, seed 0), written once under ``--workdir``: a litgpt-layout safetensors file with
its ``model_config.yaml``, and its HF GPTNeoX twin (``common.write_hf_twin``: the same weights, ``config.json``).
CPU, bf16, batch 1, greedy; a ``--prompt``-token prefill, then ``--tokens`` decode steps, each timed alone.

Methods, each in a fresh process, all of them once per round, rounds interleaved:

* ``in RAM (lowmem)``: ``load_for_generation(dir)``: the whole model in memory, litgpt's ``GPT``;
* ``in RAM (transformers)``: ``GPTNeoXForCausalLM.from_pretrained(hf twin)``: the reference for accelerate;
* ``lowmem disk``: ``load_for_generation(dir, max_memory={"cpu": budget}, disk_offload=True)``: the layers that
  fit no budget stay in the file and are read for each forward, the next one read meanwhile;
* ``lowmem disk (HF file)``: the same from the HF twin (GPT-NeoX's ``query_key_value`` reordered as read);
* ``accelerate``: ``from_pretrained(hf twin, device_map=infer_auto_device_map(max_memory={"cpu": budget}),
  offload_folder=...)``: transformers 5 reads the layers mapped to ``"disk"`` from the safetensors file through
  accelerate's hooks, one at a time, when their forward starts;
* ``read speed``: ``formats.read_speed.measure_read_speed`` over the whole litgpt file (buffered, as the disk tier
  reads): the read bound of a budget is its bytes streamed per token over this speed.

Budgets: 1/2, 1/5 and 1/10 of the bf16 weights. Cache states (``--cache``): ``warm`` (the files read by the parent
before each method: the page cache holds them, reads cost a copy) and ``cold`` (``echo 1 > /proc/sys/vm/drop_caches``
before the load and before every timed token, untimed: every token reads from the storage; needs root).

Columns: seconds per decode token (median over rounds of each run's median, and the range of those), peak RSS
(``VmHWM``) and peak above the RSS before the load, bytes read per token (what the method reads from the file:
streamed; and what the process read from the storage, ``/proc/self/io`` ``read_bytes``), and whether the greedy
tokens equal the in-RAM run of the same library. Under the table: s/token over max(read bound, in-RAM s/token;
the warm in-RAM run, compute alone, for both tables: a full overlap of reading and computing) and over their sum
(no overlap), and accelerate's s/token over lowmem's.

    python benchmarks/disk_offload.py --quick            # pythia-160m, 1 round, 4 tokens: checks the script
    python benchmarks/disk_offload.py                    # pythia-1.4b, 3 rounds, warm and cold

A before/after of a change: ``--against DIR`` (another checkout of lightning_lowmem) runs its ``lowmem disk`` too,
from its own code (its copy of this script), interleaved with this one's in every round; ``--fractions`` and
``--methods`` pick a subset::

    python benchmarks/disk_offload.py --against ../main --fractions 5 --methods ram lowmem --no_hf_file --cache warm
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from common import WORKDIR, MiB, current_rss, environment, markdown, median, peak_rss, run_fresh, spread, \
    warm_page_cache, write_checkpoints, write_hf_twin

FRACTIONS = (2, 5, 10)
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


# ---------------------------------------------------------------- checkpoints

def prepare(workdir: Path, model_name: str) -> tuple[Path, Path]:
    """The litgpt directory (``bf16.safetensors`` + ``model_config.yaml``) and its HF twin, written unless cached."""
    from litgpt import Config
    from litgpt.utils import save_config

    lit_path = write_checkpoints(model_name, workdir, ["bf16.safetensors"])["bf16.safetensors"]
    lit_dir, hf_dir = lit_path.parent, lit_path.parent / "hf"
    if not (lit_dir / "model_config.yaml").exists():
        save_config(Config.from_name(model_name), lit_dir)
    if not (hf_dir / "config.json").exists():
        write_hf_twin(model_name, lit_path, hf_dir)
    return lit_dir, hf_dir


def weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


# ---------------------------------------------------------------- the child: one method, one fresh process

def drop_caches() -> None:
    """Drop the clean page cache (root only): the next reads come from the storage."""
    os.sync()
    DROP_CACHES.write_text("1")


def storage_read_bytes() -> int:
    """Bytes this process has made the storage read (``/proc/self/io``'s ``read_bytes``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def load(method: str, directory: Path, budget: int | None) -> tuple[torch.nn.Module, dict]:
    """The model of ``method`` and what it says about itself: ``family`` and ``streamed`` (bytes read per forward)."""
    if method in ("ram", "lowmem", "lowmem-hf"):
        from lightning_lowmem.litgpt.generation import load_for_generation

        disk = {"max_memory": {"cpu": budget}, "disk_offload": True} if budget else {}
        model, _, report = load_for_generation(directory, **disk)
        streamed = report.disk.read_nbytes if report.disk is not None else 0
        return model.eval(), {"family": "litgpt", "streamed": streamed, "report": report}
    from transformers import AutoModelForCausalLM

    if method == "ram-hf":
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval(), \
            {"family": "hf", "streamed": 0}
    device_map = accelerate_map(directory, budget)
    offload = tempfile.mkdtemp(prefix="accelerate-offload-")
    atexit.register(shutil.rmtree, offload, ignore_errors=True)  # empty when the weights are read from the file
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, device_map=device_map,
                                                 offload_folder=offload)
    on_disk = [name for name, where in device_map.items() if where == "disk"]
    streamed = sum(t.numel() * t.element_size() for name, t in _meta_state(directory).items()
                   if any(name == m or name.startswith(f"{m}.") for m in on_disk))
    return model.eval(), {"family": "hf", "streamed": streamed, "offload_files": len(os.listdir(offload))}


def _meta_state(directory: Path) -> dict[str, torch.Tensor]:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.bfloat16
                                                ).state_dict()


def accelerate_map(directory: Path, budget: int) -> dict[str, str]:
    """``infer_auto_device_map`` for a CPU budget of ``budget`` (the rest on ``"disk"``). A map that puts everything
    on disk is spelled out per block with the final norm on the CPU: transformers 5.3 dispatches (installs the
    hooks that read offloaded weights) only a map with two or more devices, and ``{"": "disk"}`` leaves the model
    on meta."""
    from accelerate import infer_auto_device_map, init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.bfloat16)
    device_map = dict(infer_auto_device_map(meta, max_memory={"cpu": budget}, dtype=torch.bfloat16,
                                            no_split_module_classes=meta._no_split_modules))
    if set(device_map.values()) == {"disk"}:
        device_map = dict.fromkeys(_units(meta, meta._no_split_modules), "disk")
        device_map[next(n for n in device_map if n.endswith("final_layer_norm"))] = "cpu"
    return device_map


def _units(module: torch.nn.Module, blocks: list[str], prefix: str = "") -> list[str]:
    """Module names down to the blocks (``blocks``: class names) or leaves."""
    out = []
    for name, child in module.named_children():
        if type(child).__name__ in blocks or not list(child.children()):
            out.append(prefix + name)
        else:
            out += _units(child, blocks, f"{prefix}{name}.")
    return out


def decode(model: torch.nn.Module, family: str, prompt: torch.Tensor, tokens: int, cold: bool) -> dict:
    """A prefill, then ``tokens`` greedy steps, each timed alone (the page cache dropped before each when ``cold``)."""
    seconds, storage, new = [], [], []
    with torch.inference_mode():
        if family == "litgpt":
            from lightning_lowmem import setup_kv_cache

            setup_kv_cache(model, 1, prompt.numel() + tokens + 1, device="cpu")
            step = _litgpt_step(model, prompt)
        else:
            step = _hf_step(model, prompt)
        token = step(None)
        for _ in range(tokens):
            if cold:
                drop_caches()
            read, t0 = storage_read_bytes(), time.perf_counter()
            token = step(token)
            seconds.append(time.perf_counter() - t0)
            storage.append(storage_read_bytes() - read)
            new.append(int(token))
    return {"seconds": seconds, "storage": median(storage), "tokens": new}


def _litgpt_step(model: torch.nn.Module, prompt: torch.Tensor):
    position = [prompt.numel()]

    def step(token: torch.Tensor | None) -> torch.Tensor:
        if token is None:
            logits = model(prompt[None], input_pos=torch.arange(prompt.numel()))
        else:
            logits = model(token.view(1, 1), input_pos=torch.tensor([position[0]]))
            position[0] += 1
        return logits[0, -1].argmax()
    return step


def _hf_step(model: torch.nn.Module, prompt: torch.Tensor):
    past = [None]

    def step(token: torch.Tensor | None) -> torch.Tensor:
        ids = prompt[None] if token is None else token.view(1, 1)
        out = model(input_ids=ids, past_key_values=past[0], use_cache=True)
        past[0] = out.past_key_values
        return out.logits[0, -1].argmax()
    return step


def child(args: argparse.Namespace) -> dict:
    """Run ``args.child`` (a method) in this fresh process; what it measured."""
    lit_dir, hf_dir = prepare(args.workdir, args.model)
    cold = args.child_cache == "cold"
    if args.child == "read-speed":
        from lightning_lowmem.formats.read_speed import measure_read_speed

        files = weight_files(lit_dir)
        if cold:
            drop_caches()
        speed = measure_read_speed(files, nbytes=sum(f.stat().st_size for f in files), direct=False)
        return {"bandwidth": speed.bytes_per_second}
    directory = hf_dir if args.child in ("ram-hf", "accelerate", "lowmem-hf") else lit_dir
    if cold:
        drop_caches()
    before = current_rss()
    model, info = load(args.child, directory, args.budget or None)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.prompt,), generator=generator)
    report = info.pop("report", None)
    result = decode(model, info["family"], prompt, args.tokens, cold)
    if report is not None and report.disk is not None:
        report.disk.close()
    return {**result, **info, "s_per_token": median(result["seconds"]), "peak": peak_rss(),
            "peak_above": peak_rss() - before}


# ---------------------------------------------------------------- the parent: rounds, then the table

def methods(quick_hf: bool, against: bool = False, fractions: tuple[int, ...] = FRACTIONS,
            only: list[str] | None = None) -> list[tuple[str, int]]:
    """``(method, budget fraction denominator or 0)`` in the order each round runs them (``lowmem@``: the
    ``--against`` checkout's ``lowmem``)."""
    out = [("read-speed", 0), ("ram", 0), ("ram-hf", 0)]
    for n in fractions:
        out += [("lowmem", n), *([("lowmem@", n)] if against else []), ("accelerate", n)]
        out += [("lowmem-hf", n)] if quick_hf else []
    return [(m, n) for m, n in out if only is None or m.rstrip("@") in only or m == "read-speed"]


def run_rounds(args: argparse.Namespace, weights: int) -> dict[tuple[str, str, int], list[dict]]:
    results: dict[tuple[str, str, int], list[dict]] = {}
    files = [f for d in prepare(args.workdir, args.model) for f in weight_files(d)]
    for round_ in range(args.rounds):
        for cache in args.cache:
            for method, n in methods(args.hf_file, args.against is not None, args.fractions, args.methods):
                if cache == "warm":  # in the page cache again, whatever the cold runs dropped
                    for file in files:
                        warm_page_cache(file)
                flags = ["--child", method.rstrip("@"), "--child_cache", cache, "--budget",
                         str(weights // n if n else 0), "--workdir", str(args.workdir), "--model", args.model,
                         "--tokens", str(args.tokens), "--prompt", str(args.prompt)]
                script = args.against / "benchmarks" / "disk_offload.py" if method.endswith("@") else __file__
                result = run_fresh(script, flags, timeout=args.timeout)
                results.setdefault((cache, method, n), []).append(result)
                shown = result.get("error") or f"{result.get('s_per_token', result.get('bandwidth', 0)):.3g}"
                print(f"  round {round_ + 1} {cache:<4} {method:<10} 1/{n or '-':<3} {shown}", flush=True)
    return results


NAMES = {"ram": "in RAM (lowmem)", "ram-hf": "in RAM (transformers)", "lowmem": "lowmem disk",
         "lowmem@": "lowmem disk (--against)", "lowmem-hf": "lowmem disk (HF file)",
         "accelerate": "accelerate disk offload"}
REFERENCE = {"lowmem": "ram", "lowmem@": "ram", "lowmem-hf": "ram", "accelerate": "ram-hf", "ram": "ram",
             "ram-hf": "ram-hf"}


def table(results: dict, cache: str, weights: int, args: argparse.Namespace) -> tuple[str, list[str]]:
    rows, notes = [], []
    speed = [r["bandwidth"] for r in results.get((cache, "read-speed", 0), []) if "bandwidth" in r]
    bandwidth = median(speed) if speed else None
    ram = _ok(results, "warm", "ram", 0) or _ok(results, cache, "ram", 0)  # compute alone: the warm run when made
    for method, n in methods(True, args.against is not None, args.fractions, args.methods):
        runs = results.get((cache, method, n))
        if method == "read-speed" or runs is None:
            continue
        ok = [r for r in runs if "error" not in r]
        label = [NAMES[method], f"1/{n} ({weights // n / MiB:.0f} MiB)" if n else "-"]
        if not ok:
            rows.append([*label, f"error: {runs[0]['error']}", "", "", "", "", ""])
            continue
        per = [r["s_per_token"] for r in ok]
        ref = _ok(results, cache, REFERENCE[method], 0)
        same = "-" if not ref or method in ("ram", "ram-hf") else (
            "yes" if all(r["tokens"] == ref[0]["tokens"] for r in ok) else "no")
        streamed = median([r["streamed"] for r in ok])
        rows.append([*label, f"{median(per):.3f} ({spread(per, 3)})", f"{median([r['peak'] for r in ok]) / MiB:.0f}",
                     f"{median([r['peak_above'] for r in ok]) / MiB:.0f}", f"{streamed / MiB:.0f}",
                     f"{median([r['storage'] for r in ok]) / MiB:.0f}", same])
        if method == "lowmem" and bandwidth and ram:
            bound, compute = streamed / bandwidth, median([r["s_per_token"] for r in ram])
            notes.append(f"- 1/{n}: read bound {bound:.3f} s/token ({streamed / MiB:.0f} MiB at "
                         f"{bandwidth / MiB:.0f} MiB/s), in RAM (warm) {compute:.3f} s/token: lowmem disk / max(bound, "
                         f"in RAM) = {median(per) / max(bound, compute):.2f}, / (bound + in RAM) = "
                         f"{median(per) / (bound + compute):.2f}" + _vs_accelerate(results, cache, n, per))
        if method == "lowmem@" and _ok(results, cache, "lowmem", n):
            ours = _ok(results, cache, "lowmem", n)
            notes.append(f"- 1/{n}: this checkout / --against: s/token "
                         f"{median([r['s_per_token'] for r in ours]) / median(per):.2f}, streamed MiB/token "
                         f"{median([r['streamed'] for r in ours]) / streamed:.2f}, peak above pre-load "
                         f"{median([r['peak_above'] for r in ours]) / median([r['peak_above'] for r in ok]):.2f}")
    if bandwidth:
        notes.insert(0, f"- read speed of the file ({cache}): {bandwidth / MiB:.0f} MiB/s (median of {len(speed)})")
    header = ["method", "CPU budget", "s/token median (range)", "peak RSS MiB", "peak above pre-load MiB",
              "streamed MiB/token", "from storage MiB/token", "same tokens as in RAM"]
    return markdown(header, rows), notes


def _ok(results: dict, cache: str, method: str, n: int) -> list[dict]:
    return [r for r in results.get((cache, method, n), []) if "error" not in r]


def _vs_accelerate(results: dict, cache: str, n: int, ours: list[float]) -> str:
    theirs = [r["s_per_token"] for r in _ok(results, cache, "accelerate", n)]
    return f"; accelerate / lowmem disk = {median(theirs) / median(ours):.2f}x" if theirs else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="pythia-160m, 1 round, 4 tokens, warm and cold")
    parser.add_argument("--model", default=None, help="a litgpt pythia config name (default pythia-1.4b)")
    parser.add_argument("--workdir", type=Path, default=WORKDIR / "disk_offload")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--tokens", type=int, default=None, help="decode steps timed; default 8 (4 with --quick)")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--cache", nargs="+", default=None, choices=["warm", "cold"],
                        help="default: warm, and cold when run as root")
    parser.add_argument("--no_hf_file", dest="hf_file", action="store_false",
                        help="leave out lowmem streaming the HF twin")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for one method's process")
    parser.add_argument("--against", type=Path, default=None,
                        help="another lightning_lowmem checkout: its lowmem disk runs too, interleaved (before/after)")
    parser.add_argument("--fractions", type=int, nargs="+", default=list(FRACTIONS),
                        help="CPU budgets as fractions 1/N of the weights; default 2 5 10")
    parser.add_argument("--methods", nargs="+", default=None, choices=["ram", "ram-hf", "lowmem", "accelerate",
                                                                         "lowmem-hf"], help="default: all")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child_cache", default="warm", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model = args.model or ("pythia-160m" if args.quick else "pythia-1.4b")
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.tokens = args.tokens or (4 if args.quick else 8)
    args.cache = args.cache or (["warm", "cold"] if os.geteuid() == 0 else ["warm"])
    if args.child:
        print(json.dumps(child(args)))
        return
    started = time.perf_counter()
    lit_dir, _ = prepare(args.workdir, args.model)
    weights = sum(f.stat().st_size for f in weight_files(lit_dir))
    print(environment(["transformers", "accelerate", "litgpt", "safetensors"]))
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
          + (f"; --against {args.against}" if args.against else ""))
    print(f"model: {args.model} config, random weights, {weights / MiB:.0f} MiB of bf16 weights (file size); "
          f"CPU, batch 1, greedy, {args.prompt}-token prompt, {args.tokens} decode tokens timed each; "
          f"{args.rounds} rounds, one fresh process per method and round, interleaved; medians over rounds")
    results = run_rounds(args, weights)
    for cache in args.cache:
        text, notes = table(results, cache, weights, args)
        print(f"\n### {cache} page cache\n\n{text}\n\n" + "\n".join(notes))
    print(f"\n(the whole run took {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
