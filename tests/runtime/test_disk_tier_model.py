"""A model with layers on disk is still a model: a copy, a save, a cast and a second thread either work or are
refused with a typed error before anything changes, never a model with zeros where its weights were."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from lightning_lowmem import load_checkpoint, save_checkpoint


@pytest.fixture
def on_disk(tmp_path, tiny_config, tiny_gpt, meta_gpt, write_checkpoint):
    """A 6-layer GPT in bf16, most of its layers left in its safetensors file: ``(model, report, reference, path)``."""
    config = tiny_config(n_layer=6)
    reference = tiny_gpt(config, torch.bfloat16, std=0.3)
    path = write_checkpoint(reference.state_dict(), "safetensors", tmp_path / "ckpt")
    nbytes = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    model = meta_gpt(config)
    report = load_checkpoint(model, path, dtype=torch.bfloat16, max_memory={"cpu": nbytes // 5}, disk_offload=True)
    assert len(report.placement.on_disk) >= 4
    reference = reference.to(torch.bfloat16)  # RoPE tables too, as a load in bf16 leaves them
    yield model.eval(), report, reference.eval(), path
    report.disk.close()


def _tensors(model: nn.Module) -> dict[str, tuple[torch.dtype, int]]:
    return {name: (t.dtype, t.data_ptr()) for name, t in [*model.named_parameters(), *model.named_buffers()]}


X = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(3))


def test_a_deep_copy_is_refused_and_the_model_runs_on(on_disk):
    """The copy's layers on disk would be zeros, and its hooks would fill the original's modules."""
    model, report, reference, path = on_disk

    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

    before = _tensors(model)
    for what in (model, Wrapper(model), model.get_submodule(report.placement.on_disk[-1].name)):
        with pytest.raises(TypeError, match="disk_offload") as raised:
            copy.deepcopy(what)
        assert str(path) in str(raised.value) and "load" in str(raised.value)
    assert _tensors(model) == before
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference(X), rtol=0, atol=0)
    resident = copy.deepcopy(model.transformer.wte)  # a part that is not on disk copies as always
    assert torch.equal(resident.weight, model.transformer.wte.weight)


def test_its_state_dict_and_every_save_refuse_rather_than_write_stand_ins(on_disk, tmp_path):
    model, report, _, path = on_disk
    for save in (lambda: model.state_dict(), lambda: torch.save(model.state_dict(), tmp_path / "plain.pth"),
                 lambda: save_checkpoint(model, tmp_path / "out")):
        with pytest.raises(ValueError, match="disk_offload") as raised:
            save()
        assert str(path) in str(raised.value) and "nothing was written" in str(raised.value)
    assert not (tmp_path / "plain.pth").exists() and not (tmp_path / "out").exists()
    report.disk.close()  # closed: the layers are on meta, and a save says so
    assert all(t.is_meta for n, t in model.state_dict().items() if n.startswith(report.placement.on_disk[-1].name))


@pytest.mark.parametrize("cast", ["half", "float", "to-dtype", "to-device-and-dtype", "submodule", "layer-on-disk"])
def test_a_cast_raises_before_changing_anything(on_disk, cast):
    model, report, reference, path = on_disk
    layer = model.get_submodule(report.placement.on_disk[-1].name)
    calls = {"half": lambda: model.half(), "float": lambda: model.float(),
             "to-dtype": lambda: model.to(torch.float16), "to-device-and-dtype": lambda: model.to("cpu", torch.float32),
             "submodule": lambda: model.transformer.half(), "layer-on-disk": lambda: layer.to(dtype=torch.float32)}
    before = _tensors(model)
    with pytest.raises(ValueError, match="disk_offload") as raised:
        calls[cast]()
    assert str(path) in str(raised.value) and "dtype=" in str(raised.value)
    assert _tensors(model) == before
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference(X), rtol=0, atol=0)


def test_moves_and_casts_that_change_nothing_are_taken(on_disk):
    model, _, reference, _ = on_disk
    assert model.to("cpu") is model and model.to(torch.bfloat16) is model and model.bfloat16() is model
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference(X), rtol=0, atol=0)


def test_a_second_thread_is_refused_while_a_forward_runs(on_disk):
    """The first forward is held inside a resident module; a forward from another thread meanwhile is refused at once,
    and the first one finishes exact. One after the other, forwards from any thread run."""
    model, _, reference, _ = on_disk
    inside, go_on, out = threading.Event(), threading.Event(), {}

    def hold(module: nn.Module, args: tuple) -> None:
        if threading.current_thread().name == "first":
            inside.set()
            go_on.wait(10)

    def first() -> None:
        with torch.no_grad():
            out["first"] = model(X)

    handle = model.transformer.wte.register_forward_pre_hook(hold)
    thread = threading.Thread(target=first, name="first")
    thread.start()
    try:
        assert inside.wait(10)
        with pytest.raises(RuntimeError, match="one forward at a time") as raised, torch.no_grad():
            model(X)
        assert "'first'" in str(raised.value)
    finally:
        go_on.set()
        thread.join(10)
        handle.remove()
    with torch.no_grad():
        expected = reference(X)
        torch.testing.assert_close(out["first"], expected, rtol=0, atol=0)
    got = []

    def second() -> None:
        with torch.no_grad():
            got.append(model(X))

    other = threading.Thread(target=second)
    other.start()
    other.join(10)
    torch.testing.assert_close(got[0], expected, rtol=0, atol=0)


def test_two_threads_running_forwards_get_exact_outputs_or_a_refusal(on_disk):
    """Two threads, 30 forwards each, as fast as they go: never a wrong output."""
    model, _, reference, _ = on_disk
    inputs = [torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with torch.no_grad():
        expected = [reference(x) for x in inputs]
    results: list[tuple[int, object]] = []

    def run(offset: int) -> None:
        with torch.no_grad():
            for i in range(30):
                k = (i + offset) % 4
                try:
                    results.append((k, model(inputs[k])))
                except RuntimeError as e:
                    results.append((k, e))

    threads = [threading.Thread(target=run, args=(offset,)) for offset in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 60
    wrong = [k for k, got in results
             if isinstance(got, torch.Tensor) and not torch.equal(got, expected[k])]
    refused = [got for _, got in results if isinstance(got, RuntimeError)]
    assert wrong == [] and all("one forward at a time" in str(e) for e in refused)
    with torch.no_grad():
        torch.testing.assert_close(model(inputs[0]), expected[0], rtol=0, atol=0)
