"""litgpt's RoPE tables after a load: nothing the size of the whole context; built when first used, at that length."""

from __future__ import annotations

import torch

from lightning_lowmem import cache_bytes, load_checkpoint, setup_kv_cache


def test_rope_buffers_built_when_first_used_when_built_fully_on_meta(tmp_path, litgpt_model, write_checkpoint):
    """Built under torch.device('meta'), litgpt's cos/sin are meta; the loader leaves them empty (no table the
    size of the whole context) and the first forward builds the rows it needs (the cache guard)."""
    from litgpt import GPT

    path = write_checkpoint(litgpt_model.state_dict(), "safetensors", tmp_path)
    with torch.device("meta"):
        model = GPT(litgpt_model.config)
    load_checkpoint(model, path)
    assert model.cos.shape[0] == 0 and not model.cos.is_meta
    x = torch.randint(0, 100, (1, 8))
    torch.testing.assert_close(model.eval()(x), litgpt_model(x), rtol=0, atol=0)
    torch.testing.assert_close(model.cos, litgpt_model.cos[:8], rtol=0, atol=0)


def test_litgpt_model_loaded_by_lightning_lowmem_has_no_full_context_rope(tmp_path, tiny_config, tiny_gpt, meta_gpt):
    config = tiny_config("gqa", block_size=4096)
    reference = tiny_gpt(config, std=0.3)
    torch.save(reference.state_dict(), tmp_path / "lit_model.pth")
    model = meta_gpt(config, include_buffers=True)
    load_checkpoint(model, tmp_path / "lit_model.pth")
    assert model.cos.shape[0] == 0 and model.mask_cache is None  # nothing sized to the 4096 context

    x = torch.randint(0, 100, (1, 12))
    torch.testing.assert_close(model(x), reference(x))  # RoPE grown to 12 rows on first use
    assert model.cos.shape[0] == 12
    setup_kv_cache(model, 1, 20)
    assert model.cos.shape[0] == 20 and cache_bytes(model).length == 20
