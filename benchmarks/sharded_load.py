"""Per-rank memory of loading one checkpoint into a model sharded across 2 processes (FSDP2, gloo, CPU).

    python benchmarks/sharded_load.py                              # pythia-410m, then pythia-1b
    python benchmarks/sharded_load.py --models pythia-410m --methods lowmem_fsdp lowmem_fsdp-nf4
    python benchmarks/sharded_load.py --models pythia-70m --methods lowmem_fsdp-nf4 mp-resume lowmem_fsdp-resume \
        --world 4                                                  # a quick run
    python benchmarks/sharded_load.py --arithmetic --models Llama-3.1-70B --world 64  # from the code, runs nothing

Random bf16 weights with litgpt's architecture are written once (``benchmarks/common.py``, cached in
--workdir) as ``bf16.safetensors`` and ``bf16.pth`` (a bare state dict, as litgpt's ``lit_model.pth``;
Lightning's and torch's loaders read torch files). Each method runs in 2 fresh processes that form one
gloo process group, each rank measuring itself:

- ``fsdp1``: Lightning's ``FSDPStrategy`` (FSDP1): ``init_module(empty_init=True)`` + ``setup`` + ``load_raw``,
- ``mp-load_raw``: Lightning's ``ModelParallelStrategy`` (FSDP2, each block ``fully_shard``-ed):
  ``init_module(empty_init=True)`` + ``setup`` (``to_empty`` + ``reset_parameters``) + ``load_raw(bf16.pth)``,
- ``torch-set_model_state_dict``: meta model, ``fully_shard``, ``to_empty``, then torch's
  ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``, rank 0 holding
  ``torch.load(bf16.pth, mmap=True)``,
- ``dcp-hf``: meta model, ``fully_shard``, ``to_empty``, then ``torch.distributed.checkpoint.load`` of the sharded
  state dict with ``HuggingFaceStorageReader`` over the safetensors file,
- ``lowmem_fsdp`` / ``lowmem_fsdp-pth``: ``Fabric(strategy="lowmem_fsdp")``: ``init_module()`` + ``setup`` +
  ``load_raw`` of ``bf16.safetensors`` / ``bf16.pth``,
- ``lowmem_fsdp-nf4``: the same with ``quantize="torchao.nf4"`` (QLoRA's frozen base): each rank reads and
  quantizes its own rows of each weight,
- ``mp-resume`` / ``lowmem_fsdp-resume``: ``fabric.load(adamw.ckpt, {"model": model, "optimizer": optimizer})`` of
  one full checkpoint holding the model and AdamW state (random, keyed by parameter name as ``fabric.save`` with
  ``save_distributed_checkpoint=False`` writes it) with Lightning's ``ModelParallelStrategy`` / ``lowmem_fsdp``,
  after ``setup`` and ``setup_optimizers``; "own shard" then counts the optimizer's shard too.

Every process imports torch, lightning, litgpt, torchao and lightning_lowmem and joins the process group
first, then measures from its RSS just before it builds the model: the peak RSS (the kernel's high-water
mark) until the model is loaded, the bytes of its own shards, the bytes it read (``read``/``pread`` system
calls, ``rchar`` in ``/proc/self/io``, plus the growth of its file-backed RSS: pages of mapped files it
touched; the memory monitors' reads of ``/proc/self/status``, about 0.3 MiB a second, count too, so for
lowmem_fsdp the weights' bytes its own ``LoadReport.bytes_read`` counts are given beside), and the wall seconds of build + setup + load. Each method starts with its checkpoint file read
once into the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import ROOT, WORKDIR, MiB, environment, markdown, warm_page_cache, write_checkpoints

METHODS = ["fsdp1", "mp-load_raw", "torch-set_model_state_dict", "dcp-hf", "lowmem_fsdp", "lowmem_fsdp-pth",
           "lowmem_fsdp-nf4", "mp-resume", "lowmem_fsdp-resume"]
CHECKPOINT_OF = {"fsdp1": "bf16.pth", "mp-load_raw": "bf16.pth", "torch-set_model_state_dict": "bf16.pth",
                 "dcp-hf": "bf16.safetensors", "lowmem_fsdp": "bf16.safetensors", "lowmem_fsdp-pth": "bf16.pth",
                 "lowmem_fsdp-nf4": "bf16.safetensors", "mp-resume": "adamw.ckpt", "lowmem_fsdp-resume": "adamw.ckpt"}
MARGIN = 64 * MiB


# ---------------------------------------------------------------- one rank

def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def rank_main(method: str, model_name: str, paths: dict[str, Path]) -> dict:
    """Load with ``method`` on this rank and return what it measured."""
    import lightning  # noqa: F401  (every method pays the same imports before measuring)
    import litgpt
    import torchao.quantization  # noqa: F401

    import lightning_lowmem.memory.monitor as monitor
    from lightning_lowmem.ranks.shard_fill import shard_nbytes

    config = litgpt.Config.from_name(model_name)
    setup = SETUPS[method.split("-")[0] if method.startswith("lowmem") else method]
    try:
        ready = setup(method, config)  # the process group joined, the strategy ready
    except Exception as e:  # noqa: BLE001  (a strategy Lightning refuses here is a result)
        return {"error": f"{type(e).__name__}: {e}"}
    file_start, rchar_start = _status("RssFile"), _rchar()
    monitor._reset_peak_rss()
    with monitor.MemoryMonitor() as mon:
        monitor._reset_peak_rss = lambda: True  # the loader's own monitors must not reset the high-water mark
        model, optimizer = ready(paths[CHECKPOINT_OF[method]])
    import torch.distributed as dist

    result = {"peak": max(mon.usage.rss_peak, _status("VmHWM")) - mon.usage.rss_start,
              "shard": shard_nbytes(model) + _optimizer_nbytes(optimizer),
              "read": _rchar() - rchar_start + max(mon.usage.file_peak - file_start, 0), "seconds": mon.usage.seconds,
              "reported": REPORTED.get("bytes_read")}
    dist.barrier()
    return result


def _optimizer_nbytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of this rank's part of the optimizer's state tensors."""
    if optimizer is None:
        return 0
    local = [getattr(v, "_local_tensor", v) for state in optimizer.state.values() for v in state.values()]
    return sum(t.nbytes for t in local if isinstance(t, torch.Tensor))


def _fabric(strategy: object) -> object:
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                      precision="bf16-true")
    fabric.launch()
    return fabric


def _lightning(method: str, config: object):
    from lightning.fabric.strategies import ModelParallelStrategy
    from litgpt import GPT

    from lightning_lowmem.placement import shard_model

    world = int(os.environ["WORLD_SIZE"])
    strategy = "fsdp" if method == "fsdp1" else ModelParallelStrategy(shard_model, world, 1)
    fabric = _fabric(strategy)

    def load(path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        with fabric.init_module(empty_init=True):
            model = GPT(config)
        model = fabric.setup(model)
        return _load(fabric, method, model, path)

    return load


REPORTED: dict[str, int] = {}
"""What lowmem_fsdp's own report says it read (``LoadReport.bytes_read``: the weights' bytes, not the optimizer's)."""


def _load(fabric: object, method: str, model: torch.nn.Module,
          path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
    """``load_raw`` the weights, or (``-resume``) ``fabric.load`` the weights and an AdamW's state."""
    optimizer = None
    if method.endswith("resume"):
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
        fabric.load(path, {"model": model, "optimizer": optimizer})
    else:
        fabric.load_raw(path, model)
    reports = getattr(fabric.strategy, "reports", None)
    if reports:
        REPORTED["bytes_read"] = reports[-1].bytes_read
    return model.module, optimizer


def _lowmem(method: str, config: object):
    from litgpt import GPT

    from lightning_lowmem import LowMemFSDPStrategy

    fabric = _fabric(LowMemFSDPStrategy(quantize="torchao.nf4" if method.endswith("nf4") else None))

    def load(path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        with fabric.init_module():
            model = GPT(config)
        model = fabric.setup(model)
        return _load(fabric, method, model, path)

    return load


def _torch(method: str, config: object):
    import torch.distributed as dist
    from litgpt import GPT
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_lowmem.placement import shard_model

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def load(path: Path) -> tuple[torch.nn.Module, None]:
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("meta"):
            model = GPT(config)
        torch.set_default_dtype(torch.float32)
        model = shard_model(model, mesh).to_empty(device="cpu")
        if method == "dcp-hf":
            _dcp_hf(model, path)
        else:
            _set_model_state_dict(model, path)
        return model, None

    return load


def _set_model_state_dict(model: torch.nn.Module, path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = torch.load(path, mmap=True, weights_only=True) if dist.get_rank() == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _dcp_hf(model: torch.nn.Module, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    directory = path.parent / "dcp-hf"  # the safetensors file alone (the reader reads every file in its directory)
    directory.mkdir(exist_ok=True)
    link = directory / "model.safetensors"
    if not link.exists():
        link.symlink_to(path)
    state = get_model_state_dict(model)
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(directory)))


SETUPS = {"fsdp1": _lightning, "mp-load_raw": _lightning, "mp-resume": _lightning, "torch-set_model_state_dict": _torch, "dcp-hf": _torch,
          "lowmem_fsdp": _lowmem}


# ---------------------------------------------------------------- the driver

def run_ranks(method: str, model_name: str, workdir: Path, world: int, timeout: float) -> list[dict]:
    """``method`` in ``world`` fresh processes forming one gloo group; each rank's JSON result."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "NODE_RANK": "0"}
        out = open(logs / f"{method}-{rank}.out", "w")
        err = open(logs / f"{method}-{rank}.err", "w")
        args = [sys.executable, __file__, "--rank-of", method, "--models", model_name, "--workdir", str(workdir)]
        procs.append((subprocess.Popen(args, stdout=out, stderr=err, env=env), out, err))
    deadline, results = time.monotonic() + timeout, []
    for rank, (proc, out, err) in enumerate(procs):
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for other, _, _ in procs:
                other.kill()
            proc.wait()
        out.close()
        err.close()
        lines = [line for line in (logs / f"{method}-{rank}.out").read_text().splitlines() if line.startswith("{")]
        tail = ((logs / f"{method}-{rank}.err").read_text().strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        results.append(json.loads(lines[-1]) if lines else {"error": tail[:160]})
    return results


def bounds(model_name: str) -> dict[str, int]:
    """The largest tensor and the largest quantized (``torchao.nf4``) Linear weight, in bf16 bytes."""
    from litgpt import GPT, Config

    with torch.device("meta"):
        model = GPT(Config.from_name(model_name))
    largest = max(p.numel() * 2 for p in model.parameters())
    linear = max(m.weight.numel() * 2 for n, m in model.named_modules()
                 if type(m) is torch.nn.Linear and n != "lm_head")
    return {"largest": largest, "linear": linear}


def table(rows: list[tuple[str, str, list[dict]]], world: int) -> str:
    each = "rank " + " / ".join(str(r) for r in range(world))
    header = ["model", "method", "checkpoint", f"peak above imports MiB, {each} (1 run)",
              f"own shard MiB, {each}", f"peak / shard, {each}", f"bytes read MiB, {each} (1 run)",
              f"load s, {each} (1 run, wall)", "bound MiB, rank 0 (within?)"]
    out = []
    for model_name, method, ranks in rows:
        if any("error" in r for r in ranks):
            error = next(r["error"] for r in ranks if "error" in r)
            out.append([model_name, method, CHECKPOINT_OF[method], error[:110], "", "", "", "", ""])
            continue
        b = bounds(model_name)
        bound = ""
        if method.startswith("lowmem"):  # nf4: its rows of one weight, cast, quantized; else: one tensor
            extra = b["linear"] if method.endswith("nf4") else b["largest"]
            limit = ranks[0]["shard"] + extra + MARGIN
            bound = f"{limit / MiB:.0f} ({'yes' if ranks[0]['peak'] <= limit else 'NO'})"
        pair = lambda key, scale=MiB, fmt=".0f": " / ".join(f"{r[key] / scale:{fmt}}" for r in ranks)  # noqa: E731
        out.append([model_name, method, CHECKPOINT_OF[method], pair("peak"), pair("shard"),
                    " / ".join(f"{r['peak'] / r['shard']:.2f}" for r in ranks), pair("read") + _reported(ranks),
                    pair("seconds", 1, ".1f"), bound])
    return markdown(header, out)


def _reported(ranks: list[dict]) -> str:
    """`` (report: a / b)``: the weights' bytes lowmem_fsdp's reports counted, when they did."""
    if any(r.get("reported") is None for r in ranks):
        return ""
    return " (report: " + " / ".join(f"{r['reported'] / MiB:.0f}" for r in ranks) + ")"


def write_resume(model_name: str, workdir: Path) -> Path:
    """``adamw.ckpt``: the model's random bf16 weights and an AdamW state of random moments (bf16, as a bf16-true run
    keeps them) and step 10, keyed by parameter name as ``fabric.save`` writes a full checkpoint; written once."""
    from litgpt import GPT, Config

    path = workdir / model_name / "adamw.ckpt"
    if path.exists():
        return path
    state = torch.load(write_checkpoints(model_name, workdir, ["bf16.pth"])["bf16.pth"], weights_only=True)
    with torch.device("meta"):
        meta = GPT(Config.from_name(model_name))
    names = [n for n, _ in meta.named_parameters()]
    groups = torch.optim.AdamW(meta.parameters(), lr=1e-4).state_dict()["param_groups"]
    gen = torch.Generator().manual_seed(1)
    moments = {n: {"step": torch.tensor(10.0),
                   "exp_avg": (torch.randn(state[n].shape, generator=gen) * 1e-3).to(torch.bfloat16),
                   "exp_avg_sq": (torch.rand(state[n].shape, generator=gen) * 1e-6).to(torch.bfloat16)} for n in names}
    optimizer = {"state": moments, "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups]}
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"model": state, "optimizer": optimizer, "step": 10}, tmp)
    tmp.rename(path)
    return path


def _paths(model_name: str, workdir: Path, methods: list[str]) -> dict[str, Path]:
    paths = write_checkpoints(model_name, workdir, ["bf16.safetensors", "bf16.pth"])
    if any(CHECKPOINT_OF[m] == "adamw.ckpt" for m in methods):
        paths["adamw.ckpt"] = write_resume(model_name, workdir)
    return paths


def arithmetic(model_name: str, world: int) -> str:
    """Per-rank bytes of a ``world``-rank load of ``model_name`` in bf16, from the code rather than measured: each
    tensor's rows as ``torch.chunk`` gives rank 0 (the largest piece), the Linears ``torchao.nf4`` quantizes under
    ``world`` shards as ``quantize_for_sharding`` chooses them and their 4-bit sizes as the scheme states them, and
    an AdamW's two moments (bf16, as a bf16-true run keeps them) the size of the parameter shard each."""
    from litgpt import GPT, Config

    from lightning_lowmem import LoadOptions, init_empty
    from lightning_lowmem.engine import quantize_for_sharding
    from lightning_lowmem.quantize import make_scheme

    torch.set_default_dtype(torch.bfloat16)
    with init_empty():
        model = GPT(Config.from_name(model_name))
    torch.set_default_dtype(torch.float32)
    names = {n for n, _ in model.named_parameters()}
    selection = quantize_for_sharding(model, LoadOptions(quantize="torchao.nf4"), count=world)
    quantized = set(selection.chosen.values())
    nf4 = make_scheme("torchao.nf4")
    file = shard = nf4_shard = whole_reads = largest = 0
    for name in names:
        param = model.get_parameter(name)
        shape = tuple(param.shape)
        rows = -(-shape[0] // world)
        own = rows * (param.numel() // shape[0]) * 2
        file, shard, largest = file + param.numel() * 2, shard + own, max(largest, param.numel() * 2)
        nf4_shard += nf4.stored_nbytes((shape[0] // world, *shape[1:])) if name in quantized else own
        whole_reads += param.numel() * 2 if name in quantized else own
    lines = [f"{model_name} at {world} ranks (arithmetic, rank 0): file {file / 2**30:.1f} GiB, "
             f"{len(quantized)} Linears in torchao.nf4",
             f"  bf16: reads {shard / MiB:.0f} MiB, holds {shard / MiB:.0f} MiB",
             f"  nf4:  reads {shard / MiB:.0f} MiB (each weight whole: {whole_reads / 2**30:.1f} GiB), "
             f"holds {nf4_shard / MiB:.0f} MiB",
             f"  resume bf16 + AdamW: holds {3 * shard / MiB:.0f} MiB (parameters {shard / MiB:.0f} + optimizer "
             f"{2 * shard / MiB:.0f}); its bound adds the largest tensor, {largest / MiB:.0f} MiB, and 64 MiB; the whole "
             f"optimizer state is {2 * file / 2**30:.1f} GiB"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["pythia-410m", "pythia-1b"])
    parser.add_argument("--methods", nargs="*", default=METHODS, choices=METHODS)
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per method")
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)
    parser.add_argument("--arithmetic", action="store_true",
                        help="print the per-rank bytes of a --world-rank load of each model, from the code; run nothing")
    args = parser.parse_args()
    if args.arithmetic:
        print("\n".join(arithmetic(model_name, args.world) for model_name in args.models))
        return
    if args.rank_of:
        paths = _paths(args.models[0], args.workdir, [args.rank_of])
        print(json.dumps(rank_main(args.rank_of, args.models[0], paths)), flush=True)
        return
    rows = []
    for model_name in args.models:
        paths = _paths(model_name, args.workdir, args.methods)
        for method in args.methods:
            warm_page_cache(paths[CHECKPOINT_OF[method]])  # every method starts with its file in the page cache
            rows.append((model_name, method, run_ranks(method, model_name, args.workdir, args.world, args.timeout)))
            print(f"  ran {model_name} / {method}: {rows[-1][2]}", file=sys.stderr, flush=True)
    print(environment(["lightning", "litgpt", "torchao"]))
    print(f"{args.world} processes (gloo, CPU), random bf16 weights; bound: own shard (-resume: + its optimizer "
          f"shard) + the largest tensor (nf4: + the largest quantized weight in bf16) + 64 MiB\n")
    print(table(rows, args.world))


if __name__ == "__main__":
    main()
