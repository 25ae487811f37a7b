"""Loads onto a GPU: every scheme x {lightning_lowmem, transformers ``from_pretrained``, the torch floor}, and the limits.

    python benchmarks/gpu_load.py                          # Llama-3-8B shapes, random bf16, in /dev/shm, every scheme
    python benchmarks/gpu_load.py --layers 8 --schemes bf16 nf4     # an 8-layer slice: a short turn on a GPU machine
    python benchmarks/gpu_load.py --device cpu             # a tiny Llama on the CPU: checks the script end to end

The checkpoint: a ``LlamaForCausalLM`` of Llama-3-8B's shapes (``--layers`` of its 32), random bf16 weights made on
the device, in safetensors shards of at most 5 GB with the index ``save_pretrained`` writes, under ``--workdir``
(default ``/dev/shm/gpu_load``: the page cache is the limit, not a disk). Methods, each in a fresh process:

    lowmem        lightning_lowmem ``load_checkpoint`` into ``LlamaForCausalLM`` built on meta (``quantize=`` the scheme)
    transformers  ``from_pretrained(device_map=<device>, dtype=bfloat16)`` with the scheme's ``BitsAndBytesConfig`` or
                  ``TorchAoConfig`` (none for ``torchao.nf4``)
    torch         the floor: meta + safetensors ``load_file(device=<device>)`` + ``load_state_dict(assign=True)``; a
                  quantized scheme then quantizes each Linear as its library documents (bitsandbytes' modules moved
                  to the device, torchao's ``quantize_``)

Columns: the load's seconds (model built + loaded; imports and CUDA's start excluded), the time to first forward
(load + one forward of 1 x 16 tokens, synchronized), the GPU's peak allocated bytes during load and forward, and
the peak host RSS above the RSS before the load (host RSS includes CUDA's libraries paged in by the first kernels:
compare methods with each other, not with the model's size). Limits: pinned and pageable host->device copies of
1 GiB, a host memcpy of 1 GiB, the shards read warm into a reused buffer, and with ``--cold`` read from a dropped
page cache (``posix_fadvise(DONTNEED)``; meaningful only when ``--workdir`` is on a disk), beside ``dd``.

Each result is appended as a JSON line to ``--out`` as it is measured (a run cut short keeps what it measured), and
the table printed at the end with the machine, the versions and the statistic (median over ``--rounds``). Without
CUDA (and without ``--device cpu``) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import GiB, MiB, environment, markdown, median, run_fresh

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1024, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=False)
SCHEMES = {"bf16": None, "nf4": "bnb.nf4", "nf4-dq": "bnb.nf4-dq", "fp4": "bnb.fp4", "int8": "bnb.int8",
           "int8wo": "torchao.int8wo", "int8dq": "torchao.int8dq", "int4wo": "torchao.int4wo", "ao-nf4": "torchao.nf4"}
METHODS = ("lowmem", "transformers", "torch")
LIMITS = ("pinned copy", "pageable copy", "host memcpy", "read warm")
SHARD_BYTES = 5 * 10**9
TOKENS = 16


# ---------------------------------------------------------------- the checkpoint

def llama_config(args: argparse.Namespace):
    from transformers import LlamaConfig

    shapes = dict(TINY if args.device == "cpu" else LLAMA_8B)
    if args.layers:
        shapes["num_hidden_layers"] = args.layers
    return LlamaConfig(**shapes)


def prepare(args: argparse.Namespace) -> Path:
    """The checkpoint under ``workdir`` (written once per shape): random bf16 weights made on the device."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    config = llama_config(args)
    where = args.workdir / f"llama-{config.num_hidden_layers}l-{config.hidden_size}d"
    if (where / "model.safetensors.index.json").exists():
        return where
    where.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shapes = {k: (v.shape, v.dtype) for k, v in LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator(args.device).manual_seed(0)
    shards: list[list[str]] = [[]]
    size = 0
    for key, (shape, _) in shapes.items():
        nbytes = shape.numel() * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    weight_map = {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        state = {k: (torch.randn(shapes[k][0], generator=generator, device=args.device, dtype=torch.bfloat16) * 0.02)
                 .cpu() for k in keys}
        save_file(state, where / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
        del state
    total = sum(s.numel() * 2 for s, _ in shapes.values())
    (where / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}))
    config.save_pretrained(where)
    return where


# ---------------------------------------------------------------- a method, in its own process

def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build(method: str, scheme: str, directory: Path, device: str):
    """The model loaded by ``method`` with ``scheme``: what the timed block runs."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(directory)
    if method == "lowmem":
        from lightning_lowmem import init_empty, load_checkpoint

        with init_empty():
            model = LlamaForCausalLM(config)
        load_checkpoint(model, directory, dtype=torch.bfloat16, device=device, quantize=SCHEMES[scheme],
                        progress=False)
        return model
    if method == "transformers":
        quantization = transformers_config(scheme)
        if SCHEMES[scheme] is not None and quantization is None:
            raise NotImplementedError(f"transformers has no configuration for {SCHEMES[scheme]}")
        return LlamaForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, device_map=device,
                                                quantization_config=quantization)
    return torch_floor(config, scheme, directory, device)


def transformers_config(scheme: str):
    import torch
    from transformers import BitsAndBytesConfig, TorchAoConfig

    name = SCHEMES[scheme] or ""
    if name.startswith("bnb.") and name != "bnb.int8":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=name[4:7], bnb_4bit_compute_dtype=torch.bfloat16,
                                  bnb_4bit_use_double_quant=name.endswith("-dq"))
    if name == "bnb.int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    if name in ("torchao.int8wo", "torchao.int8dq", "torchao.int4wo"):
        return TorchAoConfig(quant_type=torchao_config(name))
    return None


def torchao_config(name: str):
    import torchao.quantization as q

    return {"torchao.int8wo": q.Int8WeightOnlyConfig, "torchao.int8dq": q.Int8DynamicActivationInt8WeightConfig,
            "torchao.int4wo": q.Int4WeightOnlyConfig}[name]()


def torch_floor(config, scheme: str, directory: Path, device: str):
    """meta + ``load_file(device=...)`` per shard + ``assign=True``; then, quantized, each Linear as its library says."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    for shard in sorted(directory.glob("*.safetensors")):
        model.load_state_dict(load_file(shard, device=device), strict=False, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config, device=device)  # non-persistent: left on meta
    name = SCHEMES[scheme]
    if name is None:
        return model
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    if name.startswith("torchao."):
        from torchao.quantization import quantize_

        if name == "torchao.nf4":
            raise NotImplementedError("torchao.nf4 has no quantize_ config")
        quantize_(model, torchao_config(name), filter_fn=lambda m, n: n in linears)
        return model
    import bitsandbytes as bnb

    for n in linears:
        old = model.get_submodule(n)
        parent, _, leaf = n.rpartition(".")
        args = (old.in_features, old.out_features, old.bias is not None)
        if name == "bnb.int8":
            new = bnb.nn.Linear8bitLt(*args, has_fp16_weights=False, device="meta")
            new.weight = bnb.nn.Int8Params(old.weight.data.cpu(), requires_grad=False, has_fp16_weights=False)
        else:
            new = bnb.nn.Linear4bit(*args, compute_dtype=torch.bfloat16, compress_statistics=name.endswith("-dq"),
                                    quant_type=name[4:7], device="meta")
            new.weight = bnb.nn.Params4bit(old.weight.data, requires_grad=False, module=new,
                                           compress_statistics=name.endswith("-dq"), quant_type=name[4:7])
        setattr(model.get_submodule(parent), leaf, new.to(device))
    return model


def worker(method: str, scheme: str, directory: Path, device: str) -> dict:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM  # noqa: F401  (imported before the clock, for every method)

    import lightning_lowmem.engine.load  # noqa: F401
    from lightning_lowmem import MemoryMonitor

    if (SCHEMES[scheme] or "").startswith("bnb."):
        import bitsandbytes  # noqa: F401
    if (SCHEMES[scheme] or "").startswith("torchao."):
        import torchao.quantization  # noqa: F401

    if device.startswith("cuda"):
        torch.zeros(1, device=device)  # CUDA's start, outside the clock
    with MemoryMonitor(device=device if device.startswith("cuda") else None) as loading:
        model = build(method, scheme, directory, device)
        _sync(device)
    tokens = torch.randint(0, 1000, (1, TOKENS), generator=torch.Generator().manual_seed(0)).to(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(tokens)
    _sync(device)
    forward = time.perf_counter() - t0
    usage = loading.usage
    peak = torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else None
    return {"load": usage.seconds, "first_forward": usage.seconds + forward, "gpu_peak": peak,
            "host_peak": usage.rss_peak - usage.rss_start}


def limit(name: str, directory: Path, device: str) -> dict:
    """One limit row: seconds and GB/s."""
    import torch

    shards = sorted(directory.glob("*.safetensors"))
    if name == "read warm" or name == "read cold":
        if name == "read cold":
            _evict(shards)
        buffer = memoryview(bytearray(64 * MiB))
        t0, total = time.perf_counter(), 0
        for shard in shards:
            fd, offset = os.open(shard, os.O_RDONLY), 0
            try:
                while n := os.preadv(fd, [buffer], offset):
                    offset += n
            finally:
                os.close(fd)
            total += offset
        seconds = time.perf_counter() - t0
        return {"load": seconds, "gbps": total / seconds / 1e9}
    if name == "dd cold":
        _evict(shards)
        t0 = time.perf_counter()
        for shard in shards:
            subprocess.run(["dd", f"if={shard}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
        seconds = time.perf_counter() - t0
        return {"load": seconds, "gbps": sum(s.stat().st_size for s in shards) / seconds / 1e9}
    if not device.startswith("cuda") and name != "host memcpy":
        raise NotImplementedError(f"{name} needs a CUDA device")
    src = torch.empty(GiB, dtype=torch.uint8, pin_memory=name == "pinned copy").fill_(1)
    dst = torch.empty_like(src) if name == "host memcpy" else torch.empty(GiB, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=name == "pinned copy")  # warm up
    _sync(device)
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=name == "pinned copy")
    _sync(device)
    seconds = time.perf_counter() - t0
    return {"load": seconds, "gbps": GiB / seconds / 1e9}


def _evict(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---------------------------------------------------------------- the parent: runs, JSON lines, the table

def run(args: argparse.Namespace, what: list[str], directory: Path) -> dict:
    """One method or limit in a fresh process: its JSON line, or ``{"error": ...}``."""
    return run_fresh(__file__, ["--worker", *what, str(directory), "--device", args.device], timeout=args.timeout)


def runs(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """``(label, worker arguments)`` of one round."""
    limits = [n for n in LIMITS if args.device.startswith("cuda") or "copy" not in n]  # no pinned memory on a CPU
    out = [(f"limit: {name}", ["limit", name]) for name in
           (*limits, *(("read cold", "dd cold") if args.cold else ())) if args.limits]
    for scheme in args.schemes:
        out += [(f"{scheme}: {method}", ["method", method, scheme]) for method in args.methods]
    return out


def table(results: dict[str, list[dict]]) -> str:
    rows = []
    for label, got in results.items():
        ok = [r for r in got if "error" not in r]
        if not ok:
            rows.append([label, f"failed: {got[0]['error']}", "", "", "", ""])
            continue
        gpu = max((r.get("gpu_peak") or 0 for r in ok), default=0)
        rows.append([label, f"{median([r['load'] for r in ok]):.2f}",
                     f"{median([r['first_forward'] for r in ok]):.2f}" if "first_forward" in ok[0] else "",
                     f"{gpu / 1e9:.2f}" if gpu else "", f"{max(r['host_peak'] for r in ok) / 1e9:.2f}"
                     if "host_peak" in ok[0] else "", f"{median([r['gbps'] for r in ok]):.1f}" if "gbps" in ok[0]
                     else ""])
    return markdown(["what", "load s", "first forward s", "GPU peak GB", "host peak GB", "GB/s"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu: a tiny Llama, to check the script")
    parser.add_argument("--layers", type=int, default=None, help="a slice of this many layers (default: all)")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--no-limits", dest="limits", action="store_false", help="skip the limit rows")
    parser.add_argument("--cold", action="store_true", help="also read the shards from a dropped page cache, and dd")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=Path("/dev/shm/gpu_load"))
    parser.add_argument("--out", type=Path, default=None, help="JSON lines (default: workdir/gpu_load.jsonl)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *what, directory = args.worker
        fn = worker if kind == "method" else limit
        print(json.dumps(fn(*what, Path(directory), args.device)))
        return
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"No CUDA device here (torch {torch.__version__}): nothing measured. On a GPU machine run "
              "`python benchmarks/gpu_load.py`; `--device cpu` checks the script on a tiny model.")
        return
    if args.device == "cpu":
        args.workdir = args.workdir if args.workdir != Path("/dev/shm/gpu_load") else Path("/tmp/gpu_load_cpu")
    directory = prepare(args)
    out = args.out or args.workdir / "gpu_load.jsonl"
    results: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for label, what in runs(args):
            result = run(args, what, directory) | {"what": label, "round": r + 1, "load average": os.getloadavg()[0]}
            results.setdefault(label, []).append(result)
            with out.open("a") as f:
                f.write(json.dumps(result) + "\n")
            print(json.dumps(result), file=sys.stderr, flush=True)
    config = llama_config(args)
    print(environment(["transformers", "safetensors", "bitsandbytes", "torchao"]))
    print(f"device {args.device}" + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else "")
          + f"; LlamaForCausalLM, {config.num_hidden_layers} layers of {config.hidden_size}, random bf16 weights in "
          f"{directory}; median of {args.rounds} round(s), a fresh process per run; results in {out}\n")
    print(table(results))


if __name__ == "__main__":
    main()
