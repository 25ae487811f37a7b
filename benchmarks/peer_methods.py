"""The methods ``peers.py`` compares, each run in a fresh process: how every library loads the same weights.

Each method builds and loads the model the way its library's documentation (or its own command) does; the
worker then times one first forward (1 x 16 tokens, no KV cache). The checkpoints are prepared once
(:func:`prepare`) from the same random pythia weights: a litgpt ``lit_model.pth`` and ``.safetensors`` file,
their HF GPTNeoX twin (``quantize_memory.py``), the nf4 saves of ``prequantized.py`` and a Llama-shaped GGUF
file of the same size (``gguf_files.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import prequantized
import quantize_memory
import torch
from common import MiB, write_checkpoints
from gguf_files import write_llama_gguf

TOKENS = 16
GGUF_KIND = "Q4_0"

# case -> method -> what it does (the table's words); the order is the table's
CASES: dict[str, dict[str, str]] = {
    "bf16 .pth": {
        "lowmem": "lightning_lowmem load_checkpoint",
        "lowmem mmap": "lightning_lowmem load_checkpoint(mmap=True)",
        "torch": "meta + torch.load(mmap=True) + load_state_dict(assign=True)",
        "accelerate": "init_empty_weights + load_checkpoint_and_dispatch",
        "litgpt": "litgpt generate's load (Fabric init_module + lazy_load + load_state_dict)",
        "fabric": "Fabric init_module(empty_init=True) + load_raw",
    },
    "bf16 .safetensors": {
        "lowmem": "lightning_lowmem load_checkpoint",
        "lowmem mmap": "lightning_lowmem load_checkpoint(mmap=True)",
        "torch": "meta + safetensors load_file + load_state_dict(assign=True)",
        "accelerate": "init_empty_weights + load_checkpoint_and_dispatch",
        "transformers": "from_pretrained (HF twin)",
    },
    **{case: {"lowmem": f"lightning_lowmem load_checkpoint(quantize={scheme!r})",
              "after": f"load (meta + load_file + assign), then {how}",
              "transformers": f"from_pretrained + {config} (HF twin)"}
       for case, scheme, how, config in [
           ("nf4", "bnb.nf4", "swap Linear4bit + .to()", "BitsAndBytesConfig(nf4)"),
           ("int8", "bnb.int8", "swap Linear8bitLt + .to()", "BitsAndBytesConfig(load_in_8bit)"),
           ("int8wo", "torchao.int8wo", "torchao quantize_", "TorchAoConfig(Int8WeightOnlyConfig)")]},
    "nf4 reload": {
        "lowmem": "lightning_lowmem load_checkpoint(saved nf4 directory)",
        "transformers": "from_pretrained(saved nf4 directory, HF layout)",
    },
    f"GGUF {GGUF_KIND}": {
        "lowmem": "lightning_lowmem load_checkpoint(LlamaForCausalLM(gguf_config(p)), p)",
        "transformers": "from_pretrained(gguf_file=...)",
    },
    "limits": {
        "read warm": "the .safetensors file read from the page cache into one reused 64 MiB buffer",
        "read fresh": "each tensor of the .safetensors file read into fresh memory (kept, as a load keeps it)",
        "nf4 kernel": "bitsandbytes quantize_4bit on each Linear weight already in memory",
        "int8 kernel": "bitsandbytes int8_vectorwise_quant on each Linear weight already in memory",
        "int8wo kernel": "torchao quantize_ (Int8WeightOnlyConfig) on each Linear already in memory",
        "gguf dequantize": f"each tensor of the GGUF {GGUF_KIND} file read and dequantized to bf16 (gguf.quants; "
                           "the header parsed before the clock starts)",
    },
}
NOT_ON_CPU = ("accelerate (load_and_quantize_model), litgpt generate --quantize and Fabric (BitsandbytesPrecision) "
              "quantize with bitsandbytes on CUDA only; torchao has no loader of its own")
SCHEMES = {"nf4": "bnb.nf4", "int8": "bnb.int8", "int8wo": "torchao.int8wo"}


def gguf_shape(model: str) -> dict[str, int]:
    """A Llama as large as the litgpt ``model`` config (layers, width, MLP, vocabulary), for the GGUF case."""
    from litgpt import Config

    c = Config.from_name(model)
    return dict(layers=c.n_layer, hidden=c.n_embd, intermediate=c.intermediate_size, heads=c.n_head,
                kv_heads=c.n_head, vocab=c.padded_vocab_size)


def paths(model: str, workdir: Path) -> dict[str, Path]:
    base = workdir / model
    return {"pth": base / "bf16.pth", "safetensors": base / "bf16.safetensors", "hf": base / "hf",
            "saved": base / "saved" / "bnb.nf4", "saved-hf": base / "saved-hf" / "bnb.nf4",
            "gguf": workdir / f"gguf-{model}" / f"model.{GGUF_KIND}.gguf"}


def files_read(case: str, method: str, p: dict[str, Path]) -> list[Path]:
    """The files a method reads (put in the page cache before it runs)."""
    if case.startswith("GGUF") or method == "gguf dequantize":
        return [p["gguf"]]
    if case == "nf4 reload":
        return sorted((p["saved-hf"] if method == "transformers" else p["saved"]).glob("*.safetensors"))
    if case == "bf16 .pth":
        return [p["pth"]]
    return sorted(p["hf"].glob("*.safetensors")) if method == "transformers" else [p["safetensors"]]


def prepare(model: str, workdir: Path) -> None:
    """Every checkpoint the cases read, written once (cached under ``workdir``)."""
    write_checkpoints(model, workdir, ["bf16.pth", "bf16.safetensors"])
    quantize_memory.MODEL = prequantized.MODEL = model
    quantize_memory.prepare(workdir)  # the HF GPTNeoX twin
    prequantized.prepare("bnb.nf4", workdir)  # the nf4 saves, both layouts
    write_llama_gguf(paths(model, workdir)["gguf"], GGUF_KIND, **gguf_shape(model))


# ---------------------------------------------------------------- the methods (worker side)

def _config(model: str):
    from litgpt import Config

    return Config.from_name(model)


def _lowmem(case: str, method: str, model: str, p: dict[str, Path]) -> torch.nn.Module:
    from litgpt import GPT

    from lightning_lowmem import gguf_config, init_empty, load_checkpoint

    if case.startswith("GGUF"):
        from transformers import LlamaForCausalLM

        with init_empty():
            net = LlamaForCausalLM(gguf_config(p["gguf"]))
        load_checkpoint(net, p["gguf"], dtype=torch.bfloat16, progress=False)
        return net
    with init_empty():
        net = GPT(_config(model))
    source = {"bf16 .pth": p["pth"], "nf4 reload": p["saved"]}.get(case, p["safetensors"])
    load_checkpoint(net, source, dtype=torch.bfloat16, quantize=SCHEMES.get(case), progress=False,
                    mmap=method == "lowmem mmap")
    return net


def _torch(case: str, model: str, p: dict[str, Path]) -> torch.nn.Module:
    from litgpt import GPT
    from safetensors.torch import load_file

    with torch.device("meta"):
        net = GPT(_config(model))
    state = torch.load(p["pth"], mmap=True, weights_only=True) if case == "bf16 .pth" else load_file(p["safetensors"])
    net.load_state_dict(state, assign=True)
    net.cos, net.sin = net.rope_cache(device=torch.device("cpu"))  # non-persistent buffers, left on meta
    return net


def _accelerate(case: str, model: str, p: dict[str, Path]) -> torch.nn.Module:
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from litgpt import GPT

    with init_empty_weights():
        net = GPT(_config(model))
    source = p["pth"] if case == "bf16 .pth" else p["safetensors"]
    return load_checkpoint_and_dispatch(net, str(source), device_map={"": "cpu"}, dtype=torch.bfloat16)


def _lightning(method: str, model: str, p: dict[str, Path]) -> torch.nn.Module:
    """``litgpt generate``'s load (``litgpt/generate/base.py``), or Fabric's ``load_raw``."""
    import lightning as L
    from litgpt import GPT
    from litgpt.utils import load_checkpoint

    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    with fabric.init_module(empty_init=True):
        net = GPT(_config(model))
    if method == "fabric":
        fabric.load_raw(p["pth"], net)
        return net
    net.eval()
    net = fabric.setup_module(net)
    load_checkpoint(fabric, net, p["pth"])
    return net


def _transformers(case: str, p: dict[str, Path]) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if case.startswith("GGUF"):
        return AutoModelForCausalLM.from_pretrained(p["gguf"].parent, gguf_file=p["gguf"].name, dtype=torch.bfloat16)
    if case == "nf4 reload":
        return AutoModelForCausalLM.from_pretrained(p["saved-hf"], device_map="cpu")
    return quantize_memory._build_hf(p["hf"].parent.parent, {"nf4": "nf4", "int8": "int8", "int8wo": "int8wo"}
                                     .get(case, "bf16"))


def build(case: str, method: str, model: str, workdir: Path) -> torch.nn.Module:
    """The model loaded by ``method``: what the timed block of a worker runs."""
    p = paths(model, workdir)
    quantize_memory.MODEL = model
    if method.startswith("lowmem"):
        return _lowmem(case, method, model, p)
    if method == "torch":
        return _torch(case, model, p)
    if method == "accelerate":
        return _accelerate(case, model, p)
    if method in ("litgpt", "fabric"):
        return _lightning(method, model, p)
    if method == "transformers":
        return _transformers(case, p)
    if method == "after":
        after = quantize_memory._build_after_torchao if case == "int8wo" else quantize_memory._build_after_bnb
        return after(workdir, SCHEMES[case].split(".")[1])
    raise ValueError(f"unknown method {method!r} for {case!r}")


def first_forward(net: torch.nn.Module, vocab: int) -> None:
    tokens = torch.randint(0, vocab, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        net(tokens)


# ---------------------------------------------------------------- the limits (worker side)

def limit(method: str, model: str, workdir: Path) -> float:
    """Seconds of one limit (``CASES["limits"]``); what it needs in memory first is not timed."""
    p = paths(model, workdir)
    if method == "read warm":
        return _timed(lambda: _read_reused(p["safetensors"]))
    if method == "gguf dequantize":
        import gguf

        reader = gguf.GGUFReader(p["gguf"])  # its header parse is not the limit: ours is a bounded one of its own
        return _timed(lambda: _dequantize(reader))
    from lightning_lowmem import Checkpoint

    with Checkpoint.open(p["safetensors"]) as ckpt:
        if method == "read fresh":
            kept: list[torch.Tensor] = []
            return _timed(lambda: kept.extend(ckpt.read(key) for key in ckpt.records))
        weights = [ckpt.read(key) for key, rec in ckpt.records.items()
                   if key.endswith(".weight") and len(rec.shape) == 2 and "wte" not in key and "lm_head" not in key]
    return _timed(lambda: _quantize_all(method.split()[0], weights))


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _read_reused(path: Path) -> None:
    buffer = bytearray(64 * MiB)
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        while n := os.preadv(fd, [view], offset):
            offset += n
    finally:
        os.close(fd)


def _dequantize(reader) -> None:  # noqa: ANN001 (gguf.GGUFReader, imported where used)
    import gguf

    for tensor in reader.tensors:
        torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).to(torch.bfloat16)


def _quantize_all(scheme: str, weights: list[torch.Tensor]) -> None:
    """Each weight quantized whole with its library's own call (what ``.to()`` or ``quantize_`` runs)."""
    if scheme == "int8wo":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        for w in weights:
            with torch.device("meta"):
                linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            linear.weight = torch.nn.Parameter(w, requires_grad=False)
            quantize_(linear, Int8WeightOnlyConfig())
        return
    import bitsandbytes.functional as F

    for w in weights:
        if scheme == "nf4":
            F.quantize_4bit(w, blocksize=64, quant_type="nf4")
        else:
            F.int8_vectorwise_quant(w.to(torch.float16))
