"""Offload speed and device memory: lightning_lowmem's layer offload vs accelerate, on one model.

A litgpt model (default: pythia-1b, bf16, random weights) runs under a device budget
of half its weights. On CUDA it prints, per method, the device peak and the time of a
prefill forward (``--tokens`` tokens) and of a decode step (one token with a KV cache):

    resident              the whole model on the device (reference; needs the room)
    lowmem plan           load_checkpoint(max_memory={device: model/2, "cpu": ...}): the plan keeps what
                          fits, the rest is streamed in per layer with prefetch on a side stream
    lowmem all layers     every layer offloaded, prefetch on (the same work as cpu_offload)
    lowmem no prefetch    every layer offloaded, copied in on the compute stream
    accelerate cpu_offload        accelerate.cpu_offload(model, execution_device)
    accelerate dispatch_model     infer_auto_device_map(max_memory same as the plan) + dispatch_model

Without CUDA it prints the placement plan (bytes per device, for several quantization
schemes) and says that the CUDA figures need a GPU. ``--device cpu`` runs the CUDA
procedure with the CPU as both ends on a small model, to check the script itself.

    python benchmarks/offload_speed.py                       # CUDA figures when a GPU is present
    python benchmarks/offload_speed.py --model pythia-14m --device cpu --tokens 64
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from common import environment, random_model

import lightning_lowmem
from lightning_lowmem import format_bytes, init_empty, layer_offload, load_checkpoint, placement_plan
from lightning_lowmem.placement import find_blocks


def build_reference(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A model with random bf16 weights on the CPU (``common.random_model``), and a copy of its state dict."""
    model = random_model(name).eval()
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def fresh(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A new model of the same config holding a private CPU copy of ``state``."""
    import litgpt

    with init_empty():
        new = litgpt.GPT(model.config).eval()
    new.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    return new


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model: nn.Module, device: torch.device, tokens: int, repeats: int) -> dict[str, float]:
    """Median prefill and decode-step seconds, and the device peak over both."""
    idx = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times: dict[str, list[float]] = {"prefill": [], "decode": []}
    with torch.no_grad():
        model(idx)  # warm-up
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            logits = model(idx)
            sync(device)
            times["prefill"].append(time.perf_counter() - t0)
        model.set_kv_cache(batch_size=1, max_seq_length=tokens + repeats + 1, device=device)
        model(idx, input_pos=torch.arange(tokens, device=device))
        token = logits[:, -1:].argmax(-1)
        for step in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            token = model(token, input_pos=torch.tensor([tokens + step], device=device)).argmax(-1)
            sync(device)
            times["decode"].append(time.perf_counter() - t0)
        model.clear_kv_cache()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
    return {"prefill": sorted(times["prefill"])[repeats // 2], "decode": sorted(times["decode"])[repeats // 2],
            "peak": peak}


def to_device_except(model: nn.Module, device: torch.device, layers: list[str]) -> None:
    """Everything of ``model`` but ``layers`` onto ``device`` (the offloaded layers stay on the CPU)."""
    skip = {id(t) for name in layers for t in model.get_submodule(name).parameters()}
    for mod in model.modules():
        for leaf, p in mod._parameters.items():
            if p is not None and id(p) not in skip:
                p.data = p.data.to(device)
        for leaf, b in mod._buffers.items():
            if b is not None:
                mod._buffers[leaf] = b.to(device)


def all_layers(model: nn.Module) -> list[str]:
    blocks = find_blocks(model)
    return ["transformer.wte", *(f"{blocks}.{i}" for i in range(len(model.get_submodule(blocks)))),
            "transformer.ln_f", "lm_head"]


def run_methods(args: argparse.Namespace, device: torch.device) -> None:
    reference, state = build_reference(args.model)
    weights = sum(v.numel() * v.element_size() for v in state.values())
    budget = weights // 2
    max_memory = {str(device) if device.type == "cuda" else "cuda:0": budget, "cpu": 4 * weights}
    print(f"model {args.model}: {format_bytes(weights)} of bf16 weights; device budget {format_bytes(budget)}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        from safetensors.torch import save_file

        save_file(state, path)
        methods: dict[str, Callable[[], nn.Module]] = {
            "resident": lambda: fresh(reference, state).to(device),
            "lowmem plan (budget, prefetch)": lambda: lowmem_plan(reference, path, max_memory, args, device),
            "lowmem all layers (prefetch)": lambda: lowmem_all(reference, state, device, prefetch=True),
            "lowmem all layers (no prefetch)": lambda: lowmem_all(reference, state, device, prefetch=False),
            "accelerate cpu_offload": lambda: accelerate_cpu_offload(reference, state, device),
            "accelerate dispatch_model (budget)": lambda: accelerate_dispatch(reference, state, device, budget),
        }
        rows = []
        for name, make in methods.items():
            try:
                model = make()
                result = measure(model, device, args.tokens, args.repeats)
            except Exception as e:  # one method failing must not hide the others' figures
                print(f"  {name}: failed: {type(e).__name__}: {e}", flush=True)
                continue
            rows.append((name, result))
            print(f"  {name:<38} prefill {result['prefill'] * 1e3:9.1f} ms  decode {result['decode'] * 1e3:8.1f} ms"
                  f"  peak {format_bytes(result['peak']) if result['peak'] == result['peak'] else '-'}", flush=True)
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print_table(rows, budget)


def lowmem_plan(reference: nn.Module, path: Path, max_memory: dict, args: argparse.Namespace,
                device: torch.device) -> nn.Module:
    import litgpt

    with init_empty():
        model = litgpt.GPT(reference.config).eval()
    if device.type == "cuda":
        report = load_checkpoint(model, path, dtype=torch.bfloat16, max_memory=max_memory,
                                 context=args.tokens + args.repeats + 1)
        print(report.placement)
        return model
    plan = placement_plan(model, path, max_memory, dtype=torch.bfloat16, context=args.tokens + args.repeats + 1)
    print(plan)
    load_checkpoint(model, path, device="cpu", dtype=torch.bfloat16)  # --device cpu: the plan's accelerator played by the CPU
    lightning_lowmem.dispatch(model, plan, device=device)
    return model


def lowmem_all(reference: nn.Module, state: dict, device: torch.device, prefetch: bool) -> nn.Module:
    model = fresh(reference, state)
    layers = all_layers(model)
    to_device_except(model, device, layers)
    layer_offload(model, device, layers=layers, prefetch=prefetch)
    return model


def accelerate_cpu_offload(reference: nn.Module, state: dict, device: torch.device) -> nn.Module:
    from accelerate import cpu_offload

    return cpu_offload(fresh(reference, state), execution_device=device)


def accelerate_dispatch(reference: nn.Module, state: dict, device: torch.device, budget: int) -> nn.Module:
    from accelerate import dispatch_model, infer_auto_device_map

    model = fresh(reference, state)
    index = (device.index or 0) if device.type == "cuda" else "cpu"
    device_map = infer_auto_device_map(model, max_memory={index: budget, "cpu": 10 * budget},
                                       no_split_module_classes=["Block"])
    if device.type != "cuda":  # --device cpu: nothing to dispatch to but the CPU
        device_map = {k: "cpu" for k in device_map}
    return dispatch_model(model, device_map=device_map, main_device=device)


def print_table(rows: list[tuple[str, dict[str, float]]], budget: int) -> None:
    nan = float("nan")
    base = dict(rows).get("accelerate cpu_offload", {"prefill": nan, "decode": nan})
    print("\n| method | prefill ms (median) | decode-step ms (median) | device peak | "
          "vs cpu_offload (prefill / decode) |")
    print("|---|---|---|---|---|")
    for name, r in rows:
        peak = format_bytes(r["peak"]) if r["peak"] == r["peak"] else "-"
        print(f"| {name} | {r['prefill'] * 1e3:.1f} | {r['decode'] * 1e3:.2f} | {peak} | "
              f"{base['prefill'] / r['prefill']:.2f}x / {base['decode'] / r['decode']:.2f}x |")
    print(f"(device budget for the plan and dispatch_model: {format_bytes(budget)})")


def print_plans(args: argparse.Namespace) -> None:
    """What can be shown without a GPU: the plan for a budget of half the model, per scheme."""
    import litgpt

    with init_empty():
        model = litgpt.GPT(litgpt.Config.from_name(args.model))
    weights = sum(p.numel() * 2 for p in model.parameters())
    max_memory = {"cuda:0": weights // 2, "cpu": 4 * weights}
    for quantize in (None, "bnb.int8", "bnb.nf4"):
        try:
            plan = placement_plan(model, None, max_memory, context=args.tokens, dtype=torch.bfloat16,
                                  quantize=quantize)
        except lightning_lowmem.MemoryBudgetError as e:
            print(f"quantize={quantize}: {e}\n")
            continue
        print(plan, "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pythia-1b", help="a litgpt config name")
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens of the prefill forward")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default=None, help="default: cuda when present")
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    print(environment(["accelerate", "bitsandbytes"]))
    print(f"model {args.model} in bf16 on a device budget of half its weights, {args.tokens}-token prompt\n")
    print_plans(args)
    if args.device is None and device.type != "cuda":
        print("The CUDA figures (device peak, forward time with layer offload + prefetch vs accelerate's "
              "cpu_offload and dispatch_model) need a GPU: run this script where CUDA is available.")
        return
    run_methods(args, device)


if __name__ == "__main__":
    main()
