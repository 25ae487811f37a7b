"""Generation speed: tokens/s of the prefill and of the decode, per quantization scheme, with and without compile,
against litgpt's generate and transformers' generate, and against the bound the memory bus sets.

    python benchmarks/generate_speed.py                                   # pythia-410m and pythia-1b, every method
    python benchmarks/generate_speed.py --devices cuda --models pythia-1b  # a subset: one device, one model
    python benchmarks/generate_speed.py --models pythia-410m --rounds 1 --methods "lowmem bf16" "lowmem bf16 compile"
    python benchmarks/generate_speed.py --list                            # the methods
    python benchmarks/generate_speed.py --table results.jsonl             # the table of an earlier run

Methods (each one fresh process per round; the rounds interleave the methods, in a rotated order):

    lowmem SCHEME [compile]         lightning_lowmem.generate(directory, ..., quantize=SCHEME, compile=...)
    litgpt bf16 [compile]           litgpt 0.5.13's own ``litgpt generate`` (``generate/base.py:main``, its
                                    ``--compile``), in process; on CUDA also its bnb.nf4 and bnb.int8 (its
                                    BitsandbytesPrecision refuses a CPU)
    transformers SCHEME [compile]   GPTNeoXForCausalLM.from_pretrained (BitsAndBytesConfig / TorchAoConfig) and
                                    ``generate``; compile: ``cache_implementation="static"`` with its CompileConfig
                                    (transformers compiles only on CUDA unless told to; it is told to here)
    bandwidth                       the memory bus: a 1 GiB float32 tensor summed (read once), median of 5

Each method makes the same request twice (a ``--prompt``-token prompt, ``--new`` greedy tokens, batch 1): the first
pays the compile and first-call costs (its seconds are the "first request" column), the second is measured.
Prefill tokens/s is the prompt's tokens over the time to the first new token; decode tokens/s is the other new
tokens over the time after it, and "best step" the fastest of those steps (each token is read back to the host as it
is made, so the times are the device's). On a machine other work shares, the best step is the least disturbed one
(timeit's convention); the ratios to the reference are taken on it.
The bound is the bandwidth over the bytes a decode step reads: every weight but the embedding table (one row of it),
as the loaded model holds them (quantized where the scheme quantizes). Statistic: the median over the rounds, and
the median over the rounds of each method's best-step ratio to ``lowmem bf16`` in the same round. Checkpoints: litgpt's GPT with
its own random initialisation in bf16 (``common.random_state``), as ``lit_model.pth`` with a word-level tokenizer, and
the same weights in transformers' GPT-NeoX layout. Results are appended as JSON lines to ``--out`` as they come.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from common import WORKDIR, environment, markdown, median, run_fresh, write_hf_twin
from generate_memory import write_checkpoint

SCHEMES = ("bf16", "bnb.nf4", "bnb.int8", "torchao.int8wo", "torchao.int4wo")
METHODS = ([f"lowmem {s}{c}" for s in SCHEMES for c in ("", " compile")]
           + ["litgpt bf16", "litgpt bf16 compile", "litgpt bnb.nf4", "litgpt bnb.int8"]
           + [f"transformers {s}" for s in SCHEMES[:4]] + ["transformers bf16 compile", "transformers torchao.int8wo compile"]
           + ["bandwidth"])  # transformers compiles no bitsandbytes model (its quantizer says is_compileable=False)
REFERENCE = "lowmem bf16"
GiB = 2**30


# ---------------------------------------------------------------- the worker: one method in this fresh process

class Clock:
    """When each token of a request reached the host (wall time, and this process's CPU time): the prefill ends at
    the first."""

    def __init__(self) -> None:
        self.requests: list[list[tuple[float, float]]] = []

    def start(self) -> None:
        self.requests.append([(time.perf_counter(), time.process_time())])

    def token(self) -> None:
        self.requests[-1].append((time.perf_counter(), time.process_time()))

    def rates(self, prompt: int) -> dict:
        """Tokens per second of wall time over the measured request, per second of CPU time (all of this process's
        threads), and of the fastest decode step (the least disturbed by other work on a shared machine)."""
        first, last = self.requests[0], self.requests[-1]
        out = {"first_request": first[-1][0] - first[0][0], "new": len(last) - 1}
        for i, suffix in enumerate(("", "_cpu")):
            out["prefill" + suffix] = prompt / (last[1][i] - last[0][i])
            out["decode" + suffix] = (len(last) - 2) / (last[-1][i] - last[1][i])
        out["decode_best"] = 1 / min(b[0] - a[0] for a, b in zip(last[1:], last[2:]))
        return out


def clock_litgpt(clock: Clock) -> None:
    """litgpt's generate loop, timed: its ``generate`` calls ``generate_fn`` by its module-level name."""
    import litgpt.generate.base as base

    inner = base.generate_fn

    def generate_fn(*args, **kwargs):
        clock.start()
        for i, tokens in enumerate(inner(*args, **kwargs)):
            if i or not kwargs.get("include_prompt"):
                clock.token()  # the loop reads each token (token.item()) before it yields it
            yield tokens

    base.generate_fn = generate_fn


def run_lowmem(scheme: str, compile: bool, directory: Path, args: argparse.Namespace, clock: Clock) -> dict:
    import lightning_lowmem

    clock_litgpt(clock)
    result = lightning_lowmem.generate(directory, prompt_text(args.prompt), max_new_tokens=args.new, top_k=1,
                                       quantize=None if scheme == "bf16" else scheme, num_samples=2,
                                       device=args.device, compile=compile)
    from litgpt import Config

    config = Config.from_file(directory / "model_config.yaml")
    embedding = config.padded_vocab_size * config.n_embd * 2  # bf16, never quantized (not a Linear)
    return {"tokens": result.new_tokens[-1].tolist(), "step_bytes": result.memory.weights - embedding}


def run_litgpt(scheme: str, compile: bool, directory: Path, args: argparse.Namespace, clock: Clock) -> dict:
    import contextlib
    import io

    import litgpt.generate.base as base

    clock_litgpt(clock)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        base.main(directory, prompt=prompt_text(args.prompt), num_samples=2, max_new_tokens=args.new, top_k=1,
                  precision="bf16-true", compile=compile, quantize=None if scheme == "bf16" else scheme)
    text = out.getvalue().strip().splitlines()[-1].split()
    return {"tokens": [int(t[1:]) for t in text[args.prompt:]]}


def run_transformers(scheme: str, compile: bool, directory: Path, args: argparse.Namespace, clock: Clock) -> dict:
    import torch
    from transformers import GPTNeoXForCausalLM
    from transformers.generation import CompileConfig
    from transformers.generation.streamers import BaseStreamer

    class Stream(BaseStreamer):
        def put(self, value: torch.Tensor) -> None:
            value.tolist()  # read back, as litgpt's loop reads each token
            clock.token()

        def end(self) -> None:
            pass

    model = GPTNeoXForCausalLM.from_pretrained(directory / "hf", dtype=torch.bfloat16, device_map=args.device,
                                               **transformers_quantization(scheme)).eval()
    model.generation_config.eos_token_id = None  # every request makes --new tokens, as litgpt's without an eos id
    extra = {}
    if compile:
        config = CompileConfig()
        config._compile_all_devices = True  # transformers compiles only on CUDA unless told to
        extra = dict(cache_implementation="static", compile_config=config)
    ids = torch.tensor([prompt_ids(args.prompt)], device=args.device)
    for _ in range(2):
        clock.start()
        out = model.generate(ids, max_new_tokens=args.new, do_sample=False, pad_token_id=0, streamer=Stream(),
                             **extra)
        clock.requests[-1].pop(1)  # the streamer's first put is the prompt, before any forward
    return {"tokens": out[0, args.prompt:].tolist(), "step_bytes": step_bytes(model)}


def transformers_quantization(scheme: str) -> dict:
    import torch
    from transformers import BitsAndBytesConfig, TorchAoConfig

    if scheme == "bnb.nf4":
        return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                          bnb_4bit_compute_dtype=torch.bfloat16)}
    if scheme == "bnb.int8":
        return {"quantization_config": BitsAndBytesConfig(load_in_8bit=True)}
    if scheme.startswith("torchao."):
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

        config = Int8WeightOnlyConfig() if scheme == "torchao.int8wo" else Int4WeightOnlyConfig()
        return {"quantization_config": TorchAoConfig(config)}
    return {}


def run_bandwidth(args: argparse.Namespace) -> dict:
    """Bytes per second of reading a 1 GiB float32 tensor once (``sum``), median of 5, on ``--device``."""
    import torch

    x = torch.ones(GiB // 4, device=args.device)
    rates = []
    for _ in range(6):
        sync(args.device)
        t0 = time.perf_counter()
        x.sum().item()
        rates.append(GiB / (time.perf_counter() - t0))
    return {"bandwidth": median(rates[1:])}


def step_bytes(model) -> int:
    """Bytes a decode step reads: the model's tensors but the input embedding table (one row of it is read)."""
    from lightning_lowmem.quantize import module_nbytes

    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.transformer.wte
    return module_nbytes(model) - module_nbytes(embedding)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prompt_text(n: int) -> str:
    return " ".join(f"w{i}" for i in prompt_ids(n))


def prompt_ids(n: int) -> list[int]:
    return [(i * 37) % 1000 + 1 for i in range(n)]


def worker(method: str, directory: Path, args: argparse.Namespace) -> dict:
    """Run ``method`` in this process; what it measured, as a JSON-able dict."""
    load = os.getloadavg()[0]
    if method == "bandwidth":
        return {**run_bandwidth(args), "load": load}
    library, scheme, *rest = method.split()
    clock = Clock()
    run = {"lowmem": run_lowmem, "litgpt": run_litgpt, "transformers": run_transformers}[library]
    out = run(scheme, rest == ["compile"], directory, args, clock)
    return {**out, **clock.rates(args.prompt), "load": load, "load_end": os.getloadavg()[0]}


# ---------------------------------------------------------------- the parent: checkpoints, rounds, the table

def checkpoint(model: str, workdir: Path) -> Path:
    """``workdir/model``: litgpt's ``lit_model.pth`` (random bf16), its config and a word-level tokenizer, and the
    same weights as transformers' GPT-NeoX in ``hf/``; written once."""
    import torch
    from safetensors.torch import save_file

    directory = workdir / model
    if not (directory / "lit_model.pth").is_file():
        write_checkpoint(directory, model)
    if not (directory / "hf" / "config.json").is_file():
        flat = directory / "lit.safetensors"
        save_file(torch.load(directory / "lit_model.pth", weights_only=True), flat)
        write_hf_twin(model, flat, directory / "hf")
        flat.unlink()
    return directory


def run_rounds(args: argparse.Namespace) -> None:
    script = Path(__file__).resolve()
    with open(args.out, "a") as out:
        for r in range(args.rounds):
            for model in args.models:
                directory = checkpoint(model, args.workdir)
                for device in args.devices:
                    methods = args.methods or default_methods(device)
                    shift = r % len(methods)
                    for method in methods[shift:] + methods[:shift]:
                        flags = ["--worker", method, "--models", model, "--device", device, "--prompt",
                                 str(args.prompt), "--new", str(args.new), "--workdir", str(args.workdir)]
                        row = {"round": r, "model": model, "method": method, "device": device,
                               **run_fresh(script, flags, timeout=args.timeout)}
                        out.write(json.dumps(row) + "\n")
                        out.flush()
                        print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), file=sys.stderr,
                              flush=True)


def table(rows: list[dict]) -> str:
    """One markdown table per model and device: medians over the rounds, ratios to ``lowmem bf16`` per round."""
    parts = []
    for model, device in sorted({(r["model"], r["device"]) for r in rows}):
        mine = [r for r in rows if r["model"] == model and r["device"] == device]
        bandwidth = [r["bandwidth"] for r in mine if "bandwidth" in r]
        loads = [r[k] for r in mine for k in ("load", "load_end") if k in r]
        parts.append(f"### {model}, {device}" + (f": memory bus {median(bandwidth) / 1e9:.1f} GB/s (median of "
                     f"{len(bandwidth)})" if bandwidth else "") + (f", load average {min(loads):.1f}-{max(loads):.1f}"
                                                                  if loads else ""))
        parts.append(markdown(["method", "prefill tokens/s", "decode tokens/s", "decode tokens/s, best step",
                               "best step / reference", "bound tokens/s", "best step of the bound",
                               "first request s", "tokens as lowmem, same scheme, eager", "rounds"],
                              method_rows(mine, bandwidth)))
    return "\n\n".join(parts) + f"\n\nreference: {REFERENCE}, same round"


def method_rows(rows: list[dict], bandwidth: list[float]) -> list[list[str]]:
    reference = {r["round"]: r for r in rows if r["method"] == REFERENCE and "decode" in r}
    step = {r["method"].split()[1]: r["step_bytes"] for r in rows if r.get("step_bytes")}
    out = []
    for method in [m for m in METHODS if m != "bandwidth" and any(r["method"] == m for r in rows)]:
        runs = [r for r in rows if r["method"] == method]
        good = [r for r in runs if "decode" in r]
        if not good:
            out.append([method, f"error: {runs[0].get('error', '?')}"] + [""] * 7 + [str(len(runs))])
            continue
        best = median([r["decode_best"] for r in good]) if all("decode_best" in r for r in good) else None
        bound = median(bandwidth) / step[method.split()[1]] if bandwidth and method.split()[1] in step else None
        eager = {r["round"]: r["tokens"] for r in rows if r["method"] == f"lowmem {method.split()[1]}" and "tokens" in r}
        same = [r["tokens"] == eager[r["round"]] for r in good if r["round"] in eager] \
            if method != f"lowmem {method.split()[1]}" else []
        out.append([method, _median(good, "prefill", ".2f"), _median(good, "decode", ".3f"),
                    f"{best:.3f}" if best else "", _ratio(good, reference, "decode_best"),
                    f"{bound:.2f}" if bound else "", f"{best / bound:.1%}" if bound and best else "",
                    _median(good, "first_request", ".0f"),
                    ("yes" if all(same) else f"{sum(same)} of {len(same)}") if same else "", str(len(good))])
    return out


def _ratio(rows: list[dict], reference: dict[int, dict], key: str) -> str:
    """The median over the rounds of a row's ``key`` over the reference's in the same round."""
    ratios = [r[key] / reference[r["round"]][key] for r in rows if key in r and key in reference.get(r["round"], {})]
    return f"{median(ratios):.2f}x" if ratios else ""


def _median(rows: list[dict], key: str, spec: str) -> str:
    values = [r[key] for r in rows if key in r]
    return format(median(values), spec) if values else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["pythia-410m", "pythia-1b"])
    parser.add_argument("--methods", nargs="+", default=None, help="default: every method the device can run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens (default 32)")
    parser.add_argument("--new", type=int, default=32, help="new tokens per request (default 32)")
    parser.add_argument("--devices", nargs="+", default=None, help="default: cpu, and cuda when there is one")
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)  # a worker's
    parser.add_argument("--workdir", type=Path, default=WORKDIR / "generate_speed")
    parser.add_argument("--out", type=Path, default=Path("generate_speed.jsonl"))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a method may take (default 1800)")
    parser.add_argument("--table", type=Path, default=None, help="print the table of an earlier run's --out")
    parser.add_argument("--list", action="store_true", help="print the methods and exit")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker and args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # litgpt's Fabric takes a GPU when it sees one
    import torch

    args.devices = args.devices or ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if args.list:
        print("\n".join(METHODS))
        return
    if args.worker:
        print(json.dumps(worker(args.worker, args.workdir / args.models[0], args)))
        return
    if args.table is None:
        print(environment(["lightning", "litgpt", "transformers", "bitsandbytes", "torchao"]), flush=True)
        print(f"models: {', '.join(args.models)} configs, random bf16 weights; {args.prompt}-token prompt + {args.new} "
              f"greedy tokens, batch 1, on {', '.join(args.devices)}; rounds: {args.rounds}; methods: "
              f"{', '.join(args.methods or ['every one the device runs'])}", flush=True)
        for device in args.devices:
            print(f"{device}: not run: {', '.join(sorted(set(METHODS) - set(default_methods(device))))}", flush=True)
        run_rounds(args)
    rows = [json.loads(line) for line in open(args.table or args.out) if line.strip()]
    print(table(rows))


def default_methods(device: str) -> list[str]:
    """Every method but those that cannot run on ``device``: litgpt's bitsandbytes precision needs CUDA, and
    int4wo needs a kernel (``QuantScheme.unavailable_reason``: mslk on CPU here)."""
    import torch

    from lightning_lowmem.quantize import make_scheme

    int4 = make_scheme("torchao.int4wo").unavailable_reason(torch.device(device))
    return [m for m in METHODS if not (device == "cpu" and m in ("litgpt bnb.nf4", "litgpt bnb.int8"))
            and not (int4 is not None and "int4wo" in m)]


if __name__ == "__main__":
    main()
