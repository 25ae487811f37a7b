"""A pipeline wrapper whose constructor calls diffusers' from_pretrained (Pyramid-Flow's DiT) built inside init_empty()
reads no weights; load_checkpoint of the part then gives what from_pretrained gives, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lowmem import init_empty, load_checkpoint

diffusers = pytest.importorskip("diffusers")

CONFIG = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
              joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
              pos_embed_max_size=16)


class Pipeline(nn.Module):
    """A wrapper that loads its DiT in its constructor, from a subfolder of the model's directory."""

    def __init__(self, model_path, torch_dtype) -> None:
        super().__init__()
        self.dit = diffusers.SD3Transformer2DModel.from_pretrained(model_path, subfolder="transformer",
                                                                   torch_dtype=torch_dtype)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sd3")
    torch.manual_seed(0)
    diffusers.SD3Transformer2DModel(**CONFIG).save_pretrained(directory / "transformer")
    return directory


def test_from_pretrained_inside_init_empty_reads_no_weight(model_path, tmp_path):
    import shutil

    garbage = tmp_path / "garbage"
    shutil.copytree(model_path, garbage)
    for weights in garbage.rglob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    with init_empty():
        pipeline = Pipeline(garbage, torch.bfloat16)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in pipeline.parameters())
    assert not pipeline.dit.training
    with pytest.raises(Exception):
        Pipeline(garbage, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_part_loads_as_from_pretrained_gives_it(model_path, dtype, assert_same_tensors):
    with init_empty():
        pipeline = Pipeline(model_path, dtype)
    load_checkpoint(pipeline.dit, model_path / "transformer", progress=False)
    reference = Pipeline(model_path, dtype)
    assert_same_tensors(pipeline, reference)


def test_a_load_of_the_wrapper_names_the_directory_that_fills_the_part(model_path, tmp_path):
    from safetensors.torch import save_file

    from lightning_lowmem import CheckpointMismatchError

    save_file({"x": torch.zeros(1)}, tmp_path / "other.safetensors")
    with init_empty():
        pipeline = Pipeline(model_path, torch.bfloat16)
    with pytest.raises(CheckpointMismatchError, match=rf"load it with load_checkpoint\(model.dit, "
                                                      rf"'{model_path / 'transformer'}'\)"):
        load_checkpoint(pipeline, tmp_path / "other.safetensors", progress=False)
