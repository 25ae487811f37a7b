"""What every benchmark shares: fresh processes, peak RSS, random-weight checkpoints, the machine header.

Each benchmark runs every method in a fresh Python process (:func:`run_fresh`), so one
method's memory never hides in another's peak; peaks come from the kernel's
high-water mark (``VmHWM``) through lightning_lowmem's own memory code. Checkpoints have
random weights with a real architecture (litgpt's ``GPT``, its own initialisation),
written once under ``--workdir`` in the layouts users have (:func:`write_checkpoints`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("lightning_lowmem") is None:
    # run from a checkout that is not installed: its own library. Appended, so that a child given another
    # checkout on PYTHONPATH (a baseline) keeps that one.
    sys.path.append(str(ROOT))
MiB = 2**20
GiB = 2**30
WORKDIR = Path.home() / ".cache" / "lightning_lowmem" / "bench"
LAYOUTS = ("bf16.safetensors", "bf16-sharded", "bf16.pth", "model.ckpt", "fp32.safetensors")


# ---------------------------------------------------------------- processes and memory

def run_fresh(script: str | Path, args: Sequence[str], timeout: float | None = None) -> dict:
    """Run ``python script *args`` in a fresh process; its last stdout line that is a JSON object, or
    ``{"error": <last stderr line>}``."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return {"error": tail[:160]}
    return json.loads(lines[-1])


def peak_rss() -> int:
    """This process's peak RSS so far (``VmHWM``), read by lightning_lowmem's memory code."""
    from lightning_lowmem.memory import lifetime_peak_rss

    return lifetime_peak_rss()


def current_rss() -> int:
    from lightning_lowmem.memory import current_rss as rss

    return rss()


def bare_torch_floor() -> int:
    """Peak RSS of a process that only imports torch: the floor every peak is measured against."""
    code = ("import torch; print([int(l.split()[1]) * 1024 for l in open('/proc/self/status') "
            "if l.startswith('VmHWM')][0])")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def warm_page_cache(path: Path) -> None:
    """Read a checkpoint's files once, so that every method starts with them in the page cache."""
    files = sorted(path.parent.glob("*.safetensors")) if path.name.endswith(".index.json") else [path]
    for file in files:
        with open(file, "rb") as f:
            while f.read(64 * MiB):
                pass


def touch(model: torch.nn.Module) -> None:
    """Read one byte of every page of every weight, as a first forward would (a memory-mapped load
    otherwise defers its reads, and their cost, to first use)."""
    for t in model.state_dict().values():
        for plain in _plain_tensors(t.detach()):
            if plain.numel() and not plain.is_meta:
                plain.reshape(-1).view(torch.uint8)[::4096].sum()


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data: itself, or a tensor subclass's inner tensors (torchao's)."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [p for name in names for p in _plain_tensors(getattr(t, name))]


# ---------------------------------------------------------------- checkpoints

def random_model(model_name: str, seed: int = 0) -> torch.nn.Module:
    """litgpt's ``GPT(Config.from_name(model_name))`` with its own random initialisation, built in bf16."""
    from litgpt import GPT, Config

    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: half the memory of fp32
    try:
        return GPT(Config.from_name(model_name))
    finally:
        torch.set_default_dtype(before)


def random_state(model_name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The state dict of :func:`random_model`."""
    return {k: v.contiguous() for k, v in random_model(model_name, seed).state_dict().items()}


def write_checkpoints(model_name: str, workdir: Path = WORKDIR, layouts: Iterable[str] = LAYOUTS) -> dict[str, Path]:
    """The model's random weights in each of ``layouts``, written once under ``workdir/model_name``.

    ``bf16.safetensors``; ``bf16-sharded`` (4 safetensors shards and the index ``save_pretrained`` writes);
    ``bf16.pth`` (``torch.save`` of the state dict, as litgpt's ``lit_model.pth``); ``model.ckpt`` (a Lightning
    checkpoint of a LightningModule holding the GPT as ``self.model``); ``fp32.safetensors``.
    """
    out = workdir / model_name
    paths = {"bf16.safetensors": out / "bf16.safetensors", "bf16.pth": out / "bf16.pth",
             "bf16-sharded": out / "sharded" / "model.safetensors.index.json", "model.ckpt": out / "model.ckpt",
             "fp32.safetensors": out / "fp32.safetensors"}
    wanted = {name: paths[name] for name in layouts}
    if all(p.exists() for p in wanted.values()):
        return wanted
    state = random_state(model_name)
    for name, path in wanted.items():
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            _write(name, state, path)
    return wanted


def _write(layout: str, state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    if layout == "bf16.safetensors":
        save_file(state, tmp)
    elif layout == "fp32.safetensors":
        save_file({k: v.float() for k, v in state.items()}, tmp)
    elif layout == "bf16.pth":
        torch.save(state, tmp)
    elif layout == "model.ckpt":
        import lightning

        torch.save({"state_dict": {f"model.{k}": v for k, v in state.items()}, "epoch": 0, "global_step": 0,
                    "pytorch-lightning_version": lightning.__version__}, tmp)
    elif layout == "bf16-sharded":
        _write_shards(state, path, shards=4)
        return
    else:
        raise ValueError(layout)
    os.replace(tmp, path)


def _write_shards(state: dict[str, torch.Tensor], index: Path, shards: int) -> None:
    from safetensors.torch import save_file

    keys, weight_map = list(state), {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[i::shards]}
        save_file(part, index.parent / name)
        weight_map.update(dict.fromkeys(part, name))
    index.write_text(json.dumps({"metadata": {"total_size": sum(v.nbytes for v in state.values())},
                                 "weight_map": weight_map}))


def write_hf_twin(model_name: str, lit_path: Path, hf_dir: Path) -> None:
    """The weights of a litgpt safetensors file (``write_checkpoints``) in the HF GPTNeoX layout, converted by
    litgpt's ``copy_weights_gpt_neox`` and written by ``GPTNeoXForCausalLM.save_pretrained`` (with its
    ``config.json``): the same model for transformers and accelerate."""
    from litgpt import Config
    from litgpt.scripts.convert_lit_checkpoint import copy_weights_gpt_neox
    from safetensors.torch import load_file
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    c = Config.from_name(model_name)
    hf_config = GPTNeoXConfig(
        vocab_size=c.padded_vocab_size, hidden_size=c.n_embd, num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head, intermediate_size=c.intermediate_size, rotary_pct=c.rotary_percentage,
        rotary_emb_base=c.rope_base, max_position_embeddings=c.block_size, layer_norm_eps=c.norm_eps,
        use_parallel_residual=c.parallel_residual, tie_word_embeddings=False, dtype="bfloat16")
    hf_state: dict[str, torch.Tensor] = {}
    copy_weights_gpt_neox(c, hf_state, load_file(lit_path))
    with torch.device("meta"):
        model = GPTNeoXForCausalLM(hf_config)
    model.load_state_dict(hf_state, assign=True, strict=False)
    model.save_pretrained(hf_dir)


# ---------------------------------------------------------------- statistics and the header

def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float], digits: int = 1) -> str:
    """``"low-high"`` of ``values``."""
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def environment(libraries: Sequence[str]) -> str:
    """Machine, Python and library versions: the lines every table is printed under."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    versions = []
    for name in ["torch", *libraries]:
        try:
            versions.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"machine: {platform.machine()}, {os.cpu_count()} cores, {ram:.0f} GiB RAM, {cuda}, "
            f"{platform.system()}\nversions: python {platform.python_version()}, " + ", ".join(versions))


def compare(methods: Sequence[str], run: Callable[[str], dict], repeat: int) -> dict[str, list[dict] | str]:
    """Each method run ``repeat`` times by ``run(method)`` (a fresh process each): its results, or its first error."""
    results: dict[str, list[dict] | str] = {}
    for method in methods:
        runs = [run(method) for _ in range(repeat)]
        errors = [r["error"] for r in runs if "error" in r]
        results[method] = errors[0] if errors else runs
    return results


def comparison_rows(label: Sequence[str], reference: str, ours: str, results: dict[str, list[dict] | str]
                    ) -> list[list[str]]:
    """Two table rows, the reference method's and lightning_lowmem's: ``label``, the method, median seconds (and
    range), median peak MiB (``"seconds"`` and ``"peak"`` of each run), and lightning_lowmem's over the reference."""
    rows = []
    for method in (reference, ours):
        runs = results[method]
        if isinstance(runs, str):
            rows.append([*label, method, f"error: {runs}", "", ""])
            continue
        seconds, peaks = [r["seconds"] for r in runs], [r["peak"] for r in runs]
        ratio = ""
        if method == ours and not isinstance(results[reference], str):
            ref = results[reference]
            ratio = (f"{median(seconds) / median([r['seconds'] for r in ref]):.2f}x time, "
                     f"{median(peaks) / max(median([r['peak'] for r in ref]), 1):.2f}x memory")
        rows.append([*label, method, f"{median(seconds):.2f} ({spread(seconds, 2)})", f"{median(peaks) / MiB:.0f}",
                     ratio])
    return rows


def markdown(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
