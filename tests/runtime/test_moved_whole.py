"""A quantized layer moves whole: after the runtime installs a layer for its forward (offloaded to the CPU, or read
from the checkpoint file), the forward reads none of the host's tensors, only what was copied to the device.

On the CPU the device copies are host memory too, so what is checked is the identity of storages: every tensor a
forward reads is recorded (a ``TorchDispatchMode``, tensor subclasses opened into their inner tensors) and none may
be a storage the runtime keeps on the host (an offloaded layer's masters, the disk tier's read buffers). On a GPU a
forward that read one of them would run CUDA kernels on host memory: the bitsandbytes quant state, the int8 row
scales, a torchao weight's inner tensors all move with the weight. The disk tier is run with a copy engine for the
CPU (``ENGINES["cpu"]``), so that it copies each layer out of its read buffer as it does onto a GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_lowmem import MemoryBudgetError, layer_offload, load_checkpoint, placement_plan, save_checkpoint
from lightning_lowmem.transfer import copies

SCHEMES = ["bnb.nf4", "bnb.nf4-dq", "bnb.int8", "torchao.int8wo", "torchao.nf4"]
STORED = ["bnb.nf4", "bnb.nf4-dq", "bnb.int8", "torchao.int8wo"]  # the schemes a checkpoint holds as stored


def storages(tensor: object, found: set[int] | None = None) -> set[int]:
    """The storages (data pointers) ``tensor`` reads: a tensor subclass's inner tensors, a bitsandbytes weight's quant
    state and int8 scales, opened recursively."""
    found = set() if found is None else found
    if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
        return found
    if hasattr(type(tensor), "__tensor_flatten__") and type(tensor) is not nn.Parameter:
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            storages(getattr(tensor, name), found)
        return found
    found.add(tensor.untyped_storage().data_ptr())
    quant_state(getattr(tensor, "quant_state", None), found)
    for name in ("CB", "SCB"):
        storages(getattr(tensor, name, None), found)
    return found


def held(module: nn.Module) -> set[int]:
    """Every storage ``module`` holds between forwards: its tensors and what its modules keep beside them (a
    bitsandbytes module's quant state, its int8 state)."""
    found: set[int] = set()
    for mod in module.modules():
        for t in [*mod._parameters.values(), *mod._buffers.values()]:
            storages(t, found)
        state = getattr(mod, "state", None)
        for name in ("CB", "SCB"):
            storages(getattr(state, name, None), found)
        quant_state(getattr(mod, "quant_state", None), found)
    return found


def quant_state(state: object, found: set[int]) -> None:
    """The storages of a bitsandbytes ``QuantState`` (and its nested state)."""
    if state is None:
        return
    for value in vars(state).values():
        if type(value).__name__ == "QuantState":
            quant_state(value, found)
        else:
            storages(value, found)


class Reads(TorchDispatchMode):
    """Records the storage of every tensor an operation reads inside the forwards of ``modules``: from the end of the
    runtime's hooks before each (the layer installed, the next one's copies started) to its return."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.seen: set[int] = set()
        self.inside = 0
        self.handles = [h for m in modules for h in (
            m.register_forward_pre_hook(lambda *_: setattr(self, "inside", self.inside + 1)),
            m.register_forward_hook(lambda *_: setattr(self, "inside", self.inside - 1), always_call=True))]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside:
            for arg in tree_flatten((args, kwargs or {}))[0]:
                storages(arg, self.seen)
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return super().__exit__(*exc)


def forward_reads(model: nn.Module, modules: list[nn.Module], tokens: torch.Tensor) -> tuple[torch.Tensor, set[int]]:
    """The output of ``model(tokens)``, and the storages the forwards of ``modules`` read."""
    with torch.no_grad(), Reads(modules) as reads:
        out = model(tokens)
    return out, reads.seen


TOKENS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_offloaded_quantized_layer_computes_from_its_device_copies_only(quant_config, quant_checkpoint, meta_gpt,
                                                                           scheme):
    model = meta_gpt(quant_config)
    load_checkpoint(model, quant_checkpoint, dtype=torch.bfloat16, quantize=scheme, progress=False)
    resident = copy.deepcopy(model)
    handle = layer_offload(model, "cpu")
    masters = {name: held(model.get_submodule(name)) for name in handle.modules}
    assert all(masters.values())
    expected, _ = forward_reads(resident, [], TOKENS)
    for _ in range(2):  # the second forward installs again what the first released
        out, seen = forward_reads(model, list(handle.modules.values()), TOKENS)
        read_masters = {name: len(seen & own) for name, own in masters.items() if seen & own}
        assert not read_masters, f"the forward read host masters of {read_masters}"
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert {name: held(model.get_submodule(name)) for name in handle.modules} == masters  # the masters are back
    handle.remove()


@pytest.fixture
def cpu_copies(monkeypatch):
    """The CPU given a copy engine: the disk tier copies each layer out of its read buffer, as onto a GPU."""
    monkeypatch.setitem(copies.ENGINES, "cpu", copies.ThreadCopies)


@pytest.mark.parametrize("scheme", STORED)
def test_a_layer_read_from_disk_computes_from_its_device_copies_only(tmp_path, quant_config, quant_checkpoint,
                                                                      meta_gpt, scheme, cpu_copies):
    quantized = meta_gpt(quant_config)
    load_checkpoint(quantized, quant_checkpoint, dtype=torch.bfloat16, quantize=scheme, progress=False)
    save_checkpoint(quantized, tmp_path / "stored")
    resident, model = meta_gpt(quant_config), meta_gpt(quant_config)
    load_checkpoint(resident, tmp_path / "stored", dtype=torch.bfloat16, progress=False)
    report = load_checkpoint(model, tmp_path / "stored", dtype=torch.bfloat16, max_memory={"cpu": 150_000},
                             disk_offload=True, progress=False)
    tier = report.disk
    assert len(tier.units) >= 2 and tier.stored_modules()
    buffers = {tier.source.buffers.buffer(i).untyped_storage().data_ptr() for i in range(len(tier.source.buffers.sizes))}
    expected, _ = forward_reads(resident.eval(), [], TOKENS)
    for _ in range(2):
        out, seen = forward_reads(model.eval(), list(tier.modules.values()), TOKENS)
        assert not seen & buffers, "the forward read the disk tier's host read buffers"
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    tier.close()


@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.nf4-dq"])
def test_a_stored_4bit_layer_from_disk_is_rebuilt_from_its_parsed_state_without_reading_its_json_back(
        tmp_path, quant_config, quant_checkpoint, meta_gpt, scheme, cpu_copies, monkeypatch):
    """bitsandbytes' ``from_prequantized`` parses the quant state's JSON tensor again (on a GPU: a copy back to the
    host) and copies the nested offset to the device, for every 4-bit weight at every forward; the state was parsed
    with the headers, and the offset is filled on the device."""
    import bitsandbytes.functional as F

    quantized = meta_gpt(quant_config)
    load_checkpoint(quantized, quant_checkpoint, dtype=torch.bfloat16, quantize=scheme, progress=False)
    save_checkpoint(quantized, tmp_path / "stored")
    model = meta_gpt(quant_config)
    report = load_checkpoint(model, tmp_path / "stored", dtype=torch.bfloat16, max_memory={"cpu": 150_000},
                             disk_offload=True, progress=False)
    parsed = []
    real = F.unpack_tensor_to_dict
    monkeypatch.setattr(F, "unpack_tensor_to_dict", lambda t: parsed.append(t.device) or real(t))
    with torch.no_grad():
        for _ in range(2):
            model.eval()(TOKENS)
    assert report.disk.stats.reads > 0 and parsed == []
    report.disk.close()


# ---------------------------------------------------------------- on a GPU (skipped without one)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class OnDevice(TorchDispatchMode):
    """Records the devices of every tensor the forwards of ``modules`` read (``Reads``, by device)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.reads = Reads(modules)
        self.devices: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.reads.inside:
            for arg in tree_flatten((args, kwargs or {}))[0]:
                if isinstance(arg, torch.Tensor) and not arg.is_meta and arg.numel() > 1:
                    self.devices.add(arg.device.type)
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        self.reads.__exit__(*exc)
        return super().__exit__(*exc)


def stored_checkpoint(tmp_path, quant_config, quant_checkpoint, meta_gpt, scheme):
    """``scheme``'s weights saved quantized (so that the GPU and the CPU hold the same codes), or the bf16 file."""
    if scheme is None or scheme == "torchao.nf4":
        return quant_checkpoint
    quantized = meta_gpt(quant_config)
    load_checkpoint(quantized, quant_checkpoint, dtype=torch.bfloat16, quantize=scheme, progress=False)
    save_checkpoint(quantized, tmp_path / "stored")
    return tmp_path / "stored"


def cuda_schemes(schemes):
    from lightning_lowmem.quantize import schemes_available_on

    on_gpu = schemes_available_on(torch.device("cuda")) if torch.cuda.is_available() else []
    return [s for s in schemes if s is None or s in on_gpu]


def sync_warnings(run) -> int:
    """Synchronizing CUDA operations ``run()`` issues (torch's sync debug mode)."""
    import warnings

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("tier", ["cpu", "disk"])
@pytest.mark.parametrize("scheme", [None, "bnb.nf4", "bnb.nf4-dq", "bnb.int8", "torchao.int8wo", "torchao.nf4"])
@pytest.mark.parametrize("delayed", [False, True])
def test_cuda_layers_off_the_device_compute_on_it_from_their_copies_alone(
        tmp_path, monkeypatch, quant_config, quant_checkpoint, meta_gpt, tier, scheme, delayed):
    """Every scheme from the CPU tier and the disk tier onto a GPU: the forwards of the layers brought in read GPU
    tensors only, their logits are those of the model loaded whole onto the GPU, they issue no synchronizing
    operation the resident model's forward does not, and with the side stream held back before each copy (a race
    would read a buffer or a tensor too early) nothing changes."""
    if scheme not in cuda_schemes([scheme]):
        pytest.skip(f"{scheme} has no kernel on this GPU")
    if tier == "disk" and scheme == "torchao.nf4":
        pytest.skip("torchao.nf4 is not saved quantized: nothing to stream from disk")
    if delayed:
        from lightning_lowmem.transfer import copies

        class Delayed(copies.CudaCopies):
            def copy(self, dst, src):
                with torch.cuda.stream(self.stream):
                    torch.cuda._sleep(1_000_000)
                return super().copy(dst, src)

        monkeypatch.setitem(copies.ENGINES, "cuda", Delayed)
    path = stored_checkpoint(tmp_path, quant_config, quant_checkpoint, meta_gpt, scheme)
    quantize = scheme if scheme == "torchao.nf4" else None
    resident = meta_gpt(quant_config)
    load_checkpoint(resident, path, dtype=torch.bfloat16, quantize=quantize, device="cuda:0", progress=False)
    options = dict(dtype=torch.bfloat16, quantize=quantize, context=16, disk_offload=tier == "disk", progress=False)
    cpu = "1GiB" if tier == "cpu" else 1
    with pytest.raises(MemoryBudgetError) as least:  # what the GPU needs for one layer, its caches and activations
        placement_plan(meta_gpt(quant_config), path, {"cuda:0": 1, "cpu": cpu}, **options)
    model = meta_gpt(quant_config)  # twice that: the embedding and head stay, the blocks are brought in
    report = load_checkpoint(model, path, max_memory={"cuda:0": 2 * least.value.needed, "cpu": cpu}, **options)
    streamer = report.offload if tier == "cpu" else report.disk
    assert streamer is not None
    tokens = TOKENS.cuda()
    with torch.no_grad():
        expected = resident.eval()(tokens)
        model.eval()(tokens)  # the order learned, bitsandbytes' first-call work done
        with OnDevice(list(streamer.modules.values())) as seen:
            out = model(tokens)
        assert seen.devices == {"cuda"}, seen.devices
        if scheme is None or scheme.startswith("bnb.nf4") or scheme == "torchao.int8wo":
            assert sync_warnings(lambda: model(tokens)) <= sync_warnings(lambda: resident(tokens))
    tolerance = dict(rtol=2e-2, atol=2e-2) if scheme == "torchao.nf4" else dict(rtol=0, atol=0)
    torch.testing.assert_close(out, expected, **tolerance)  # nf4: quantized on the CPU for the offloaded layers
    if tier == "disk":
        report.disk.close()
