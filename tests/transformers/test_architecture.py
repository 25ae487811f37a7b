"""A transformers PreTrainedModel built on the meta device gets its buffers as from_pretrained gives them."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem import MetaTensorError, init_empty, load_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A BertModel written by save_pretrained, with ``embeddings.position_ids`` in it as older checkpoints have."""
    from safetensors.torch import load_file, save_file

    directory = tmp_path_factory.mktemp("bert")
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=40)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(directory)
    state = load_file(directory / "model.safetensors")
    state["embeddings.position_ids"] = torch.arange(40).expand(1, -1).contiguous()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    return directory, config


@pytest.mark.parametrize("built", ["meta device", "init_empty"])
def test_bert_built_on_meta_equals_from_pretrained(bert_dir, built):
    directory, config = bert_dir
    if built == "meta device":
        with torch.device("meta"):
            model = transformers.BertModel(config)
    else:
        with init_empty():
            model = transformers.BertModel(config)
    report = load_checkpoint(model, directory, progress=False)
    reference = transformers.BertModel.from_pretrained(directory).eval()
    for (name, ours), (ref_name, theirs) in zip(model.state_dict().items(), reference.state_dict().items(),
                                                strict=True):
        assert name == ref_name and torch.equal(ours, theirs), name
    for (name, ours), (_, theirs) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        assert torch.equal(ours, theirs), name
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model.eval()(ids).last_hidden_state, reference(ids).last_hidden_state)
    if built == "meta device":  # position_ids came from the checkpoint, token_type_ids from the model's init
        assert report.recomputed == ["embeddings.token_type_ids"]


def test_a_meta_buffer_nothing_rebuilds_is_named_before_any_read(tmp_path, read_recorder):
    """A plain module (no transformers, no reset_parameters) with a meta buffer the checkpoint lacks."""
    from safetensors.torch import save_file

    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)
            self.register_buffer("scale", torch.ones(2), persistent=False)

    save_file(Plain().state_dict(), tmp_path / "plain.safetensors")
    with torch.device("meta"):
        model = Plain()
    with pytest.raises(MetaTensorError, match=r"'scale' is a buffer computed in __init__.*nothing rebuilds"):
        load_checkpoint(model, tmp_path / "plain.safetensors")
    assert read_recorder.calls == []
