"""What the engine asks of litgpt's ``GPT``: cache bytes from litgpt's own builders, activations, RoPE release.

Registered with :func:`~lightning_lowmem.placement.register_architecture` when this
package is imported (``import lightning_lowmem`` does), so the load, the placement
plan and the estimate all get the same answers for a litgpt model, or for a module
holding one (a ``LightningModule`` with ``self.model = GPT(...)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_lowmem.litgpt.guard import release_all_rope
from lightning_lowmem.litgpt.requirement import import_litgpt
from lightning_lowmem.litgpt.rope import is_litgpt_like, rope_tables
from lightning_lowmem.placement import Architecture, CacheBytes, register_architecture

_META = torch.device("meta")


class LitgptArchitecture(Architecture):
    """litgpt's ``GPT``: KV caches, mask and RoPE tables as litgpt builds them; a prefill's activations.

    Example::

        >>> from litgpt import Config
        >>> from lightning_lowmem.litgpt.checkpoint_dir import build_meta_gpt
        >>> model = build_meta_gpt(Config.from_name("pythia-1b"))
        >>> caches = LITGPT.cache_bytes(model, batch_size=1, length=64 + 50, dtype=torch.bfloat16)
        >>> caches.kv / 2**20  # 2 x 16 layers x 8 heads x 114 positions x 256 x 2 bytes
        14.25
    """

    name = "litgpt"

    def matches(self, module: nn.Module) -> bool:
        return _gpt(module) is not None

    def cache_bytes(self, module: nn.Module, batch_size: int, length: int, dtype: torch.dtype,
                    rope_dtype: torch.dtype | None = None) -> CacheBytes:
        """k/v from each block's ``build_kv_cache`` (sliding windows, latent attention as litgpt does them),
        the mask from ``build_mask_cache``, RoPE from ``rope_cache()`` in ``rope_dtype`` (default ``dtype``): all
        built on meta."""
        build_mask_cache = import_litgpt("litgpt.model", needed_by="Sizing litgpt's caches").build_mask_cache

        gpt = _gpt(module)
        cos, sin = rope_tables(gpt, length, _META)
        mask = build_mask_cache(length, device=_META)
        kv = 0
        for block in gpt.transformer.h:
            cache = block.attn.build_kv_cache(batch_size, length, gpt.rope_cache_length(), _META, dtype)
            kv += (cache.k.numel() + cache.v.numel()) * dtype.itemsize
        return CacheBytes(kv=kv, mask=mask.numel() * mask.element_size(),
                          rope=(cos.numel() + sin.numel()) * (rope_dtype or dtype).itemsize,
                          length=length, batch_size=batch_size, dtype=dtype)

    def activation_bytes(self, module: nn.Module, batch_size: int, tokens: int, dtype: torch.dtype,
                         length: int | None = None) -> int:
        """The larger of a prefill of ``tokens`` tokens and a decode step over ``length`` positions (default
        ``tokens``). A forward of T tokens attending over L positions: ``B x T x (vocab + 4 x n_embd + qkv width + MLP
        width) x itemsize`` + the attention scores ``B x n_head x T x L`` in fp32 + the fp32 logits ``B x T x vocab x
        4`` (Fabric's precision plugin returns fp32 outputs) + the keys and values litgpt repeats for each query head
        over the L positions, ``2 x B x n_head x L x head_size x itemsize``, where a key-value head serves several
        (grouped-query attention; it grows with every token decoded)."""
        config = _gpt(module).config
        qkv = (config.n_head + 2 * config.n_query_groups) * config.head_size
        mlp_factor = 1 if config.mlp_class_name == "GptNeoxMLP" else 2
        mlp = getattr(config, "intermediate_size", 4 * config.n_embd) * mlp_factor
        b, vocab = batch_size, config.padded_vocab_size
        repeats = config.n_query_groups not in (config.n_head, 1)  # litgpt's CausalSelfAttention, with a KV cache

        def forward(t: int, positions: int) -> int:
            kv = 2 * b * config.n_head * positions * config.head_size * dtype.itemsize if repeats else 0
            return (b * t * (vocab + 4 * config.n_embd + qkv + mlp) * dtype.itemsize
                    + b * config.n_head * t * positions * 4 + b * t * vocab * 4 + kv)

        return max(forward(tokens, tokens), forward(1, max(length or tokens, tokens)))

    def before_load(self, module: nn.Module, device: torch.device) -> list[str]:
        """Drop the RoPE tables to zero rows: they are built when first used, at the length used, in the dtype the
        zero-row tables have then (the load casts them as it casts every buffer; a precision plugin's conversion
        converts them); returns their names (``transformer.cos``)."""
        return [f"{name}.{table}" if name else table for name in release_all_rope(module, device)
                for table in ("cos", "sin")]

    def reset_buffers(self, module: nn.Module, device: torch.device) -> list[str]:
        """The RoPE tables as litgpt's ``reset_parameters()`` leaves them (FSDP2's materialization calls it after the
        precision plugin converted the model): zero rows in float32, the dtype ``rope_cache()`` gives them."""
        return [f"{name}.{table}" if name else table for name in release_all_rope(module, device, own=True)
                for table in ("cos", "sin")]

    def fills(self, module: nn.Module) -> set[str]:
        """The RoPE tables (released before the load, so never left on meta), and what any module recomputes."""
        rope = {f"{name}.{table}" if name else table for name, sub in module.named_modules() if is_litgpt_like(sub)
                for table in ("cos", "sin")}
        return rope | super().fills(module)


    def save_config(self, module: nn.Module, directory: Path, quantization_config: dict[str, Any] | None) -> list[Path]:
        """``model_config.yaml`` as litgpt writes it, for a ``GPT`` saved as itself: the directory then loads with
        :func:`~lightning_lowmem.generate` (which reads the scheme from the weights)."""
        if not is_litgpt_like(module):
            return []
        import_litgpt("litgpt.utils", needed_by="Writing model_config.yaml").save_config(module.config, directory)
        return [directory / "model_config.yaml"]


def _gpt(module: nn.Module) -> nn.Module | None:
    """``module`` itself or the first submodule with litgpt ``GPT``'s internals."""
    return next((m for m in module.modules() if is_litgpt_like(m)), None)


LITGPT = register_architecture(LitgptArchitecture())
