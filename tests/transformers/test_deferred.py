"""A wrapper whose constructor calls from_pretrained (Pyramid-Flow's text encoders) built inside init_empty() reads
no weights; load_checkpoint of each part then gives what from_pretrained gives, bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from lightning_lowmem import CheckpointMismatchError, MetaTensorError, init_empty, load_checkpoint

transformers = pytest.importorskip("transformers")


class TextEncoders(nn.Module):
    """Pyramid-Flow's SD3TextEncoderWithMask: CLIP and T5 encoders read by from_pretrained in the constructor."""

    def __init__(self, model_path, torch_dtype) -> None:
        super().__init__()
        self.text_encoder = transformers.CLIPTextModelWithProjection.from_pretrained(
            os.path.join(model_path, "text_encoder"), torch_dtype=torch_dtype)
        self.text_encoder_3 = transformers.T5EncoderModel.from_pretrained(
            os.path.join(model_path, "text_encoder_3"), torch_dtype=torch_dtype)
        for param in self.parameters():
            param.requires_grad = False


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pyramid")
    torch.manual_seed(0)
    transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        projection_dim=16)).save_pretrained(directory / "text_encoder")
    transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)).save_pretrained(directory / "text_encoder_3")
    return directory


def test_from_pretrained_inside_init_empty_reads_no_weight(model_path, tmp_path):
    """Every weight file is garbage: the build still succeeds, on meta, in the dtype asked; outside the block
    from_pretrained fails on them, so the test can tell."""
    import shutil

    garbage = tmp_path / "garbage"
    shutil.copytree(model_path, garbage)
    for weights in garbage.rglob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    with init_empty():
        encoders = TextEncoders(garbage, torch.bfloat16)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in encoders.parameters())
    assert encoders.text_encoder.config.name_or_path == str(garbage / "text_encoder")
    assert not encoders.text_encoder.training  # from_pretrained's eval()
    with pytest.raises(Exception):
        TextEncoders(garbage, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_each_part_loads_as_from_pretrained_gives_it(model_path, dtype, assert_same_tensors):
    with init_empty():
        encoders = TextEncoders(model_path, dtype)
    for name in ("text_encoder", "text_encoder_3"):
        load_checkpoint(getattr(encoders, name), model_path / name, progress=False)
    reference = TextEncoders(model_path, dtype)
    assert_same_tensors(encoders, reference)
    if dtype == torch.float16:  # T5 keeps its wo in float32 under fp16, as from_pretrained does
        assert encoders.text_encoder_3.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(encoders.text_encoder_3(ids).last_hidden_state, reference.text_encoder_3(ids).last_hidden_state)


def test_a_load_that_lacks_a_part_says_which_call_fills_it(model_path, tmp_path):
    from safetensors.torch import save_file

    class Pipeline(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoders = TextEncoders(model_path, torch.bfloat16)
            self.head = nn.Linear(4, 4)

    save_file(nn.Linear(4, 4).state_dict(), tmp_path / "head.safetensors")
    with init_empty():
        pipeline = Pipeline()
    where = str(model_path / "text_encoder_3")
    with pytest.raises(CheckpointMismatchError, match=rf"'encoders.text_encoder_3' was built by from_pretrained\("
                                                      rf"'{where}'\) inside init_empty\(\), which reads no weights: load "
                                                      rf"it with load_checkpoint\(model.encoders.text_encoder_3, '{where}'\)"):
        load_checkpoint(pipeline, tmp_path / "head.safetensors", key_map={"": "head."}, progress=False)
    load_checkpoint(pipeline.encoders.text_encoder, model_path / "text_encoder", progress=False)
    with pytest.raises(MetaTensorError, match="text_encoder_3' was built by from_pretrained") as error:
        load_checkpoint(pipeline, tmp_path / "head.safetensors", key_map={"": "head."}, strict=False, progress=False)
    assert "'encoders.text_encoder'" not in str(error.value)  # filled: no longer named


def test_from_pretrained_outside_init_empty_reads_as_it_always_did(model_path):
    model = transformers.T5EncoderModel.from_pretrained(model_path / "text_encoder_3")
    assert not any(p.is_meta for p in model.parameters())


def test_an_option_the_load_does_not_take_is_refused_by_name(model_path):
    with init_empty(), pytest.raises(TypeError, match=r"from_pretrained\(.*quantization_config=\.\.\.\) inside "
                                                      r"init_empty\(\).*pass quantize= to load_checkpoint"):
        transformers.T5EncoderModel.from_pretrained(model_path / "text_encoder_3", quantization_config={"x": 1})


def test_a_constructor_that_imports_transformers_itself_reads_nothing(model_path, tmp_path, child_env):
    """transformers imported only inside the block (a constructor's own lazy import): its from_pretrained is patched
    as the module is imported, before anything calls it. Weight files of garbage show any read."""
    import json
    import shutil
    import subprocess
    import sys
    import textwrap

    garbage = tmp_path / "garbage"
    shutil.copytree(model_path, garbage)
    for weights in garbage.rglob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    code = textwrap.dedent("""
        import json, sys, torch
        from torch import nn
        from lightning_lowmem import init_empty
        assert "transformers.modeling_utils" not in sys.modules

        class Encoder(nn.Module):
            def __init__(self, path):
                super().__init__()
                from transformers import T5EncoderModel  # imported when the constructor runs
                self.t5 = T5EncoderModel.from_pretrained(path, torch_dtype=torch.bfloat16)

        with init_empty():
            encoder = Encoder(sys.argv[1])
        from transformers import PreTrainedModel
        print(json.dumps({"meta": all(p.is_meta for p in encoder.parameters()),
                          "restored": "from_pretrained" in PreTrainedModel.__dict__
                                      and PreTrainedModel.from_pretrained.__func__.__name__ == "from_pretrained"}))
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(garbage / "text_encoder_3")], capture_output=True,
                          text=True, env=child_env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"meta": True, "restored": True}
