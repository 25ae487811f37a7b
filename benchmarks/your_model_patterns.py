"""The four patterns of ``your_model.py``: small modules written here that do what research code does, their
checkpoints in each pattern's own layout, and each way of loading them.

* ``moving``: a decoder whose constructor ends in ``.to(dtype=..., device="cpu")`` and computes its RoPE table in
  a method of its own (``rope_init``), the 131072 positions of a Llama-3.2 context; safetensors in bf16.
* ``entry``: a model with its own ``Linear`` (``F.linear`` on its weight) and ``Embedding`` and a complex64 RoPE
  buffer, saved as ``torch.save({"model_state_dict": ...})`` in bf16, read back with ``torch.load(mmap=True)``.
* ``composite``: a plain module holding transformers' PaliGemma and a Gemma expert built from sub-configs that say
  ``torch_dtype="float32"``, and linear layers of its own; saved by ``safetensors.torch.save_model`` in float32 and
  in bf16, loaded in bf16.
* ``wrapper``: a module whose constructor calls ``T5EncoderModel.from_pretrained(path/text_encoder_3,
  torch_dtype=...)``; the part saved by ``save_pretrained`` (float32, 200 MB shards), loaded in bf16.

Every module is sized to a few hundred MB in bf16; each way of loading returns the model (``load``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

MiB = 2**20


# ---------------------------------------------------------------- moving: a constructor that moves and casts itself

class Rope(nn.Module):
    def __init__(self, head_dim: int, max_seq_len: int, base: float = 500_000.0) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.base = head_dim, max_seq_len, base
        self.rope_init()

    def rope_init(self) -> None:  # not reset_parameters: a meta-device build would leave the table on meta
        theta = 1.0 / self.base ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(self.max_seq_len).float(), theta)
        self.register_buffer("cache", torch.stack([angles.cos(), angles.sin()], dim=-1), persistent=False)


class Block(nn.Module):
    def __init__(self, dim: int, kv_dim: int, hidden: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, n, bias=False) for n in (dim, kv_dim, kv_dim, dim))
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)


class MovingDecoder(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = nn.Embedding(32000, 1024)
        self.rope = Rope(head_dim=64, max_seq_len=131072)
        self.blocks = nn.ModuleList(Block(1024, 256, 3072) for _ in range(12))
        self.norm = nn.RMSNorm(1024)
        self.to(dtype=dtype, device="cpu")


# ---------------------------------------------------------------- entry: its own Linear, weights under an entry

class OwnLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class OwnEmbedding(nn.Module):
    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class EntryLayer(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.qkv, self.out = OwnLinear(dim, 3 * dim), OwnLinear(dim, dim)
        self.gate, self.up, self.down = OwnLinear(dim, hidden), OwnLinear(dim, hidden), OwnLinear(hidden, dim)
        self.norm1, self.norm2 = nn.Parameter(torch.zeros(dim)), nn.Parameter(torch.zeros(dim))


class EntryModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedder = OwnEmbedding(256000, 512)
        self.layers = nn.ModuleList(EntryLayer(512, 4096) for _ in range(6))
        freqs = 1.0 / 10_000 ** (torch.arange(0, 64, 2).float() / 64)
        angles = torch.outer(torch.arange(16384).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))  # complex64, saved


# ---------------------------------------------------------------- composite: transformers parts, float32 sub-configs

class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GemmaConfig, GemmaModel, PaliGemmaConfig, PaliGemmaForConditionalGeneration

        vlm = PaliGemmaConfig()
        text = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=1, head_dim=32, vocab_size=257152, hidden_activation="gelu_pytorch_tanh")
        for name, value in text.items():
            setattr(vlm.text_config, name, value)
        vlm.text_config.torch_dtype = "float32"
        vlm.vision_config.num_hidden_layers, vlm.vision_config.intermediate_size = 2, 4304
        vlm.vision_config.projection_dim, vlm.vision_config.torch_dtype = 256, "float32"
        self.vlm = PaliGemmaForConditionalGeneration(vlm)
        self.expert = GemmaModel(GemmaConfig(**{**text, "hidden_size": 128, "intermediate_size": 512,
                                                 "vocab_size": 8}, torch_dtype="float32"))
        self.action_in, self.action_out = nn.Linear(32, 128), nn.Linear(128, 32)


# ---------------------------------------------------------------- wrapper: from_pretrained in the constructor

class TextEncoder(nn.Module):
    def __init__(self, path: str | Path, torch_dtype: torch.dtype) -> None:
        super().__init__()
        from transformers import T5EncoderModel

        self.text_encoder_3 = T5EncoderModel.from_pretrained(os.path.join(path, "text_encoder_3"),
                                                             torch_dtype=torch_dtype)


def t5_config():
    from transformers import T5Config

    return T5Config(d_model=1024, d_kv=64, num_heads=16, d_ff=2816, num_layers=8, vocab_size=32128,
                    feed_forward_proj="gated-gelu", is_encoder_decoder=False)


# ---------------------------------------------------------------- checkpoints

def files(workdir: Path) -> dict[str, Path]:
    base = workdir / "your_model"
    return {"moving": base / "moving" / "model.safetensors", "entry": base / "entry" / "model.ckpt",
            "composite-fp32": base / "composite" / "float32" / "model.safetensors",
            "composite-bf16": base / "composite" / "bfloat16" / "model.safetensors", "wrapper": base / "wrapper"}


def write(workdir: Path) -> dict[str, Path]:
    """Each pattern's checkpoint, random weights (seed 0), written once."""
    from safetensors.torch import save_file, save_model

    paths = files(workdir)
    torch.manual_seed(0)
    if not paths["moving"].exists():
        paths["moving"].parent.mkdir(parents=True, exist_ok=True)
        save_file(MovingDecoder(torch.bfloat16).state_dict(), paths["moving"])
    if not paths["entry"].exists():
        paths["entry"].parent.mkdir(parents=True, exist_ok=True)
        model = EntryModel()
        with torch.no_grad():
            for p in model.parameters():  # the constructor leaves torch.empty
                p.copy_(torch.randn_like(p) * 0.02)
        torch.save({"model_state_dict": model.to(torch.bfloat16).state_dict()}, paths["entry"])
    if not paths["composite-bf16"].exists():
        model = Policy()
        for precision in ("fp32", "bf16"):
            paths[f"composite-{precision}"].parent.mkdir(parents=True, exist_ok=True)
            dtype = torch.float32 if precision == "fp32" else torch.bfloat16
            save_model(model.to(dtype), str(paths[f"composite-{precision}"]))
    if not (paths["wrapper"] / "text_encoder_3" / "config.json").exists():
        from transformers import T5EncoderModel

        T5EncoderModel(t5_config()).save_pretrained(paths["wrapper"] / "text_encoder_3", max_shard_size="200MB")
    return paths


# ---------------------------------------------------------------- ways of loading

def import_for(method: str) -> None:
    """The libraries ``method`` uses, imported before it is measured (alike for every way of one pattern)."""
    import torch._dynamo  # noqa: F401  (torch imports it on the first normal_ of a meta tensor: 73 MiB, 1.7 s, once)

    import lightning_lowmem  # noqa: F401

    if method.startswith(("composite", "wrapper")):
        from transformers import GemmaModel, PaliGemmaForConditionalGeneration, T5EncoderModel  # noqa: F401
    if "nf4" in method or "int8" in method:
        import bitsandbytes  # noqa: F401  (its import, 120-200 MiB, is not the load's)


def load(method: str, path: Path) -> nn.Module:
    """The model of ``method`` (``pattern/way``), loaded from ``path``."""
    from lightning_lowmem import assume_bf16_support, init_empty, load_checkpoint

    pattern, way = method.split("/")
    if pattern == "moving":
        if way.startswith("naive"):  # built (initialised in float32, then cast), then load_state_dict
            from safetensors.torch import load_file

            model = MovingDecoder(torch.float16 if way == "naive-fp16" else torch.bfloat16)
            model.load_state_dict(load_file(path))
            return model
        with init_empty():
            model = MovingDecoder(torch.bfloat16)
        with assume_bf16_support("cpu", way != "lowmem-fallback"):
            load_checkpoint(model, path, dtype=torch.bfloat16, progress=False)
        return model
    if pattern == "entry":
        if way == "naive":  # the research code's own: default dtype bf16, torch.load(mmap=True), load_state_dict
            torch.set_default_dtype(torch.bfloat16)
            try:
                model = EntryModel()
                model.load_state_dict(torch.load(path, mmap=True, weights_only=True)["model_state_dict"], strict=False)
            finally:
                torch.set_default_dtype(torch.float32)
            return model
        with init_empty():
            model = EntryModel()
        quantize = {"lowmem": None, "lowmem-nf4": "bnb.nf4", "lowmem-int8": "bnb.int8"}[way]
        load_checkpoint(model, path, dtype=torch.bfloat16, quantize=quantize, progress=False)
        return model
    if pattern.startswith("composite"):
        if way == "naive":  # built in float32, safetensors.torch.load_model, then cast
            from safetensors.torch import load_model

            model = Policy()
            load_model(model, str(path))
            return model.to(torch.bfloat16)
        with init_empty():
            model = Policy()
        load_checkpoint(model, path, dtype=torch.bfloat16, progress=False)
        return model
    if pattern == "wrapper":
        if way == "naive":  # from_pretrained in the constructor reads the weights
            model = TextEncoder(path, torch.bfloat16)
        else:
            with init_empty():
                model = TextEncoder(path, torch.bfloat16)  # reads config.json only
            budget = {"max_memory": {"cpu": "64MiB"}, "disk_offload": True} if way == "lowmem-budget" else {}
            load_checkpoint(model.text_encoder_3, path / "text_encoder_3", progress=False, **budget)
        return model
    raise ValueError(method)


def encode(model: nn.Module) -> torch.Tensor:
    """One forward of the wrapper's encoder (its layers left on disk by a budget are read for it)."""
    with torch.no_grad():
        return model.text_encoder_3(input_ids=torch.arange(64).reshape(1, 64) * 37 % 32128).last_hidden_state
