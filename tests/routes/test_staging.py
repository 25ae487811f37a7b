"""The device path run on the CPU: the ring, the staged reads and their clean-up, for real, through ``ThreadCopies``.

``copies.ENGINES["cpu"]`` is set for these tests, so that a load onto the CPU takes the path a CUDA load takes
(the ring, reading threads, copies on another thread in the order issued, fences), and is compared bit for bit
with the same load without it. Ring buffers are made small so that every tensor goes through in several pieces.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref

import pytest
import torch

import lightning_lowmem.transfer.copies as copies
import lightning_lowmem.routes.staging as staging
from lightning_lowmem import CheckpointFormatError, load_checkpoint
from lightning_lowmem.transfer.copies import ThreadCopies
from lightning_lowmem.transfer.ring import Ring
from lightning_lowmem.quantize import schemes_available_on

ON_CPU = schemes_available_on(torch.device("cpu"))


class Recording(ThreadCopies):
    """ThreadCopies that counts its copies, may slow each one down or fail the ``fail_at``-th, and keeps weak
    references to the host buffers it gave and to the device tensors it made (with their bytes, in order)."""

    def __init__(self, delay: float = 0.0, fail_at: int | None = None, refuse_buffers: bool = False) -> None:
        super().__init__()
        self.delay, self.fail_at, self.refuse_buffers = delay, fail_at, refuse_buffers
        self.copies = self.buffer_bytes = 0
        self.buffers: list[weakref.ref] = []
        self.events: list[tuple[str, int, int]] = []  # ("alloc" | "free", id, bytes), in order

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        if self.refuse_buffers:
            raise RuntimeError("pinned memory refused (test)")
        buffer = super().host_buffer(nbytes)
        self.buffers.append(weakref.ref(buffer))
        self.buffer_bytes += buffer.nbytes
        return buffer

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        tensor = super().empty(shape, dtype)
        key = len(self.events)
        self.events.append(("alloc", key, tensor.nbytes))
        weakref.finalize(tensor.untyped_storage(), self.events.append, ("free", key, tensor.nbytes))
        return tensor

    def run_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copies += 1
        if self.fail_at is not None and self.copies == self.fail_at:
            raise RuntimeError("copy failed (test)")
        if self.delay:
            time.sleep(self.delay)
        super().run_copy(dst, src)


@pytest.fixture
def cpu_path(monkeypatch):
    """``cpu_path(**Recording kwargs)``: loads onto the CPU take the device path through a new :class:`Recording`
    engine (returned, and kept in ``.made``); ring buffers of at most 4 KiB."""
    made: list[Recording] = []

    def use(**kwargs) -> list[Recording]:
        monkeypatch.setitem(copies.ENGINES, "cpu", lambda device: made.append(Recording(**kwargs)) or made[-1])
        return made

    monkeypatch.setattr(staging, "SLOT_BYTES", 4096)
    return use


def _lowmem_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("lowmem-stage", "lowmem-copies"))]


def _assert_identical(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_ring_never_hands_out_a_buffer_its_copy_still_reads():
    """One buffer, a copy from it that takes 50 ms: the next reader gets the buffer only after that copy."""
    engine = Recording(delay=0.05)
    ring = Ring(engine, 1, 16)
    first, second = torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    i = ring.acquire()
    ring.buffers[i].fill_(1)
    ring.release(i, engine.copy(first, ring.buffers[i]))
    j = ring.acquire()  # waits for the slow copy
    ring.buffers[j].fill_(2)
    ring.release(j, engine.copy(second, ring.buffers[j]))
    engine.close()
    assert first.eq(1).all() and second.eq(2).all()


@pytest.mark.parametrize("kind", ["safetensors", "sharded-safetensors", "pth"])
@pytest.mark.parametrize("stored,dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                          (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
def test_staged_load_is_the_load_without_it(tmp_path, cpu_path, quant_config, tiny_gpt, meta_gpt, write_checkpoint,
                                            read_recorder, kind, stored, dtype):
    """Every tensor through the ring in pieces of at most 4 KiB (a cast that narrows made on the host, one that
    widens or keeps the size by the copy): the bytes and dtypes of the load without the device path."""
    path = write_checkpoint(tiny_gpt(quant_config, stored).state_dict(), kind, tmp_path)
    ref = meta_gpt(quant_config)
    load_checkpoint(ref, path, dtype=dtype)
    engines = cpu_path(delay=0.0005)
    model = meta_gpt(quant_config)
    report = load_checkpoint(model, path, dtype=dtype)
    _assert_identical(model, ref)
    assert report.tensors == len(ref.state_dict())
    pieces = [call for call in read_recorder.rows if call[0] == "transformer.h.0.mlp.fc.weight"]
    row = 128 * (stored.itemsize + (dtype.itemsize if dtype.itemsize < stored.itemsize else 0))
    assert len(pieces) > 1 and all(b - a <= 4096 // row for _, a, b in pieces)
    assert engines[0].copies > report.tensors and not _lowmem_threads()


@pytest.mark.parametrize("scheme", [None, "bnb.nf4"])
def test_the_estimate_counts_the_ring_the_load_allocates(cpu_path, quant_checkpoint, quant_load, meta_gpt,
                                                          quant_config, scheme):
    """The staging ring is host memory a device load adds: the estimate counts what the load's engine gave, and
    nothing for a load that takes no device path."""
    from lightning_lowmem.engine import LoadOptions, estimate_prepared, prepare_load, resolved

    def estimate():
        model, options = meta_gpt(quant_config), LoadOptions(dtype=torch.bfloat16, quantize=scheme)
        with resolved(quant_checkpoint, model, options) as source:
            prepared = prepare_load(model, source, options)
        return estimate_prepared(prepared, model="m", dtype=torch.bfloat16, batch_size=1, max_seq_length=1,
                                 prompt_length=1, with_caches=False)

    assert estimate().staging == 0
    engines = cpu_path()
    est = estimate()
    quant_load(quant_checkpoint, quantize=scheme)
    assert est.staging == engines[-1].buffer_bytes > 0
    assert est.staging == (staging.stage_workers() + 2) * 4096
    assert ("staging ring (pinned host memory, during the load)", est.staging) in est.rows()
    assert est.load_peak == est.to_dict()["load_peak"] and est.to_dict()["staging"] == est.staging


@pytest.mark.parametrize("scheme", [s for s in ["bnb.nf4", "bnb.nf4-dq", "bnb.int8", "torchao.int8wo"] if s in ON_CPU])
def test_weights_quantized_after_the_ring_are_the_bytes_without_it(cpu_path, quant_checkpoint, quant_load, scheme,
                                                                   assert_same_weights, forward_logits):
    ref, _ = quant_load(quant_checkpoint, quantize=scheme)
    engines = cpu_path()
    model, report = quant_load(quant_checkpoint, quantize=scheme)
    assert report.quantized and engines[0].copies > 0
    assert_same_weights(model, ref)
    torch.testing.assert_close(forward_logits(model), forward_logits(ref), rtol=0, atol=0)


def test_hf_q_k_v_go_straight_into_their_rows_of_qkv(tmp_path, cpu_path, write_hf_dir, meta_gpt):
    """litgpt's qkv from HF q, k and v (a stack): each part copied into its rows of the tensor on the device."""
    _, config = write_hf_dir(tmp_path, "llama-gqa")
    ref = meta_gpt(config)
    load_checkpoint(ref, tmp_path, dtype=torch.bfloat16)
    engines = cpu_path()
    model = meta_gpt(config)
    load_checkpoint(model, tmp_path, dtype=torch.bfloat16)
    _assert_identical(model, ref)
    assert engines[0].copies > 0


def test_quantized_weights_read_ahead_stay_within_the_window(monkeypatch, cpu_path, quant_checkpoint, quant_load):
    """Weights read ahead to be quantized hold at most the window (here: the largest tensor, no slack) on the
    device, the one being quantized included; the tensors kept as read cost nothing beyond the model."""
    monkeypatch.setattr(staging, "DEVICE_SLACK", 0)
    engines = cpu_path(delay=0.001)
    model, report = quant_load(quant_checkpoint, quantize="bnb.int8")
    kept = {key for what, key, _ in engines[0].events if what == "alloc"} - {
        key for what, key, _ in engines[0].events if what == "free"}
    live = peak = 0
    for what, key, nbytes in engines[0].events:
        if key not in kept:
            live += nbytes if what == "alloc" else -nbytes
            peak = max(peak, live)
    largest = max(t.numel() * 2 for t in model.state_dict().values())  # the bf16 embedding or head
    weights = {256 * 128 * 2, 128 * 128 * 3 * 2}  # an MLP weight, qkv
    assert report.quantized and max(weights) <= peak <= largest


def test_a_copy_failing_mid_ring_leaves_nothing_behind(cpu_path, quant_checkpoint, meta_gpt, quant_config):
    engines = cpu_path(fail_at=7)
    model = meta_gpt(quant_config)
    with pytest.raises(RuntimeError, match="copy failed"):
        load_checkpoint(model, quant_checkpoint, dtype=torch.bfloat16)
    assert all(p.is_meta for p in model.parameters())  # put back as it was
    gc.collect()
    assert not _lowmem_threads() and engines[0].buffers and all(ref() is None for ref in engines[0].buffers)


def test_a_file_cut_short_mid_ring_is_a_typed_error_and_nothing_is_left(tmp_path, cpu_path, quant_config, tiny_gpt,
                                                                         meta_gpt, write_checkpoint, read_recorder):
    import os

    path = write_checkpoint(tiny_gpt(quant_config, torch.bfloat16).state_dict(), "safetensors", tmp_path)
    cut = {"done": False}

    def shrink(key, start, stop):
        if key == "transformer.h.1.mlp.proj.weight" and start > 0 and not cut["done"]:
            cut["done"] = True
            os.truncate(path, os.path.getsize(path) // 2)

    read_recorder.before_rows = shrink
    engines = cpu_path()
    model = meta_gpt(quant_config)
    with pytest.raises(CheckpointFormatError, match=r"model\.safetensors (changed|ends at byte)"):  # read ahead: any
        load_checkpoint(model, path, dtype=torch.bfloat16)
    assert cut["done"] and all(p.is_meta for p in model.parameters())
    gc.collect()
    assert not _lowmem_threads() and all(ref() is None for ref in engines[0].buffers)


def test_no_ring_memory_falls_back_to_the_load_without_it(cpu_path, quant_checkpoint, quant_load, caplog):
    ref, _ = quant_load(quant_checkpoint, quantize="bnb.int8")
    engines = cpu_path(refuse_buffers=True)
    with caplog.at_level(logging.WARNING, logger="lightning_lowmem.routes.staging"):
        model, report = quant_load(quant_checkpoint, quantize="bnb.int8")
    assert engines and engines[0].copies == 0 and "pageable copies instead" in caplog.text
    _assert_identical(model, ref)
    assert not _lowmem_threads()


def test_without_an_engine_the_load_takes_no_device_path(quant_checkpoint, quant_load):
    """A CPU load (no engine for "cpu", as shipped): no stager thread ever runs."""
    seen: set[str] = set()
    real = staging.Stager.__init__

    def spy(self, *args, **kwargs):
        seen.add("stager")
        real(self, *args, **kwargs)

    staging.Stager.__init__ = spy
    try:
        quant_load(quant_checkpoint)
    finally:
        staging.Stager.__init__ = real
    assert not seen and "cpu" not in copies.ENGINES


# ---------------------------------------------------------------- on a GPU (skipped without one)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def todays_path(monkeypatch):
    """``todays_path()``: from here on, loads take no device path and quantize by blocks of rows on the GPU too: the
    load as it was before the device path existed."""
    import lightning_lowmem.quantize.rows as rows

    def use() -> None:
        monkeypatch.setattr(copies, "ENGINES", {})
        monkeypatch.setattr(rows, "by_blocks", lambda device: True)

    return use


def _pinned_bytes() -> tuple[int, int]:
    """Pinned host bytes held by torch's caching host allocator (cached ones included: ``allocated_bytes``), and
    pinned by the library's pools (``transfer.pinned``): the library pins through its pools only."""
    from lightning_lowmem.transfer import pinned

    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0), pinned.registered_nbytes()


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kind", ["safetensors", "pth", "sharded-safetensors"])
@pytest.mark.parametrize("stored,dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                          (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
def test_cuda_device_path_gives_todays_bytes_and_logits(tmp_path, monkeypatch, todays_path, quant_config, tiny_gpt,
                                                         meta_gpt, write_checkpoint, forward_logits, kind, stored,
                                                         dtype):
    monkeypatch.setattr(staging, "SLOT_BYTES", 4096)  # every tensor in pieces
    path = write_checkpoint(tiny_gpt(quant_config, stored).state_dict(), kind, tmp_path)
    before = _pinned_bytes()
    model = meta_gpt(quant_config)
    load_checkpoint(model, path, dtype=dtype, device="cuda")
    assert _pinned_bytes() == before and not _lowmem_threads()  # the ring went with the load, unpinned
    todays_path()
    ref = meta_gpt(quant_config)
    load_checkpoint(ref, path, dtype=dtype, device="cuda")
    _assert_identical(model, ref)
    assert all(t.device.type == "cuda" for t in model.state_dict().values())
    torch.testing.assert_close(forward_logits(model), forward_logits(ref), rtol=0, atol=0)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.int8", "torchao.int8wo", "torchao.int8dq",
                                    "torchao.int4wo", "torchao.nf4"])
def test_cuda_weights_quantized_whole_on_the_device_are_todays_bytes(todays_path, quant_checkpoint, quant_load,
                                                                     assert_same_weights, forward_logits, scheme):
    if scheme not in schemes_available_on(torch.device("cuda")):
        pytest.skip(f"{scheme} has no kernel on this GPU")
    model, report = quant_load(quant_checkpoint, quantize=scheme, device="cuda")
    todays_path()
    ref, _ = quant_load(quant_checkpoint, quantize=scheme, device="cuda")
    assert report.quantized
    assert_same_weights(model, ref)
    torch.testing.assert_close(forward_logits(model), forward_logits(ref), rtol=0, atol=0)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("scheme", [None, "bnb.nf4"])
def test_cuda_peak_is_the_model_and_the_largest_tensor(tmp_path, tiny_config, tiny_gpt, meta_gpt, write_checkpoint,
                                                        scheme):
    """GPU peak during the load, as the caching allocator reserved it, <= the final model + its largest tensor +
    64 MiB (a model large enough that reading ahead would pass that: 6 layers of 1024 dims, 12 MiB MLP weights in
    bf16)."""
    from lightning_lowmem.quantize import module_nbytes

    config = tiny_config("gqa", n_layer=6, n_embd=1024, n_head=8, intermediate_size=2816, vocab_size=4096,
                         padded_vocab_size=4096)
    path = write_checkpoint(tiny_gpt(config, torch.bfloat16).state_dict(), "safetensors", tmp_path)
    model = meta_gpt(config)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved()
    load_checkpoint(model, path, dtype=torch.bfloat16, device="cuda", quantize=scheme)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved() - before  # what the allocator took from the GPU, not only what it handed out
    largest = max(t.numel() * t.element_size() for t in tiny_gpt(config, torch.bfloat16).state_dict().values())
    assert peak <= module_nbytes(model) + largest + 64 * 2**20, (peak, module_nbytes(model), largest)


@pytest.mark.cuda
@cuda
def test_cuda_a_read_failing_mid_ring_leaves_no_thread_and_no_pinned_memory(tmp_path, quant_config, tiny_gpt, meta_gpt,
                                                                           write_checkpoint, read_recorder, monkeypatch):
    import os

    monkeypatch.setattr(staging, "SLOT_BYTES", 4096)
    path = write_checkpoint(tiny_gpt(quant_config, torch.bfloat16).state_dict(), "safetensors", tmp_path)
    read_recorder.before_rows = lambda key, start, stop: (
        os.truncate(path, os.path.getsize(path) // 2) if key.endswith("h.1.mlp.fc.weight") and start else None)
    before = _pinned_bytes()
    model = meta_gpt(quant_config)
    with pytest.raises(CheckpointFormatError, match=r"model\.safetensors"):
        load_checkpoint(model, path, dtype=torch.bfloat16, device="cuda")
    assert all(p.is_meta for p in model.parameters())
    assert _pinned_bytes() == before and not _lowmem_threads()


@pytest.mark.cuda
@cuda
def test_cuda_pinned_memory_refused_falls_back(monkeypatch, todays_path, quant_checkpoint, quant_load, caplog):
    def refuse(self, nbytes):
        raise RuntimeError("pinned memory refused (test)")

    monkeypatch.setattr(copies.CudaCopies, "host_buffer", refuse)
    with caplog.at_level(logging.WARNING, logger="lightning_lowmem.routes.staging"):
        model, _ = quant_load(quant_checkpoint, device="cuda")
    assert "pageable copies instead" in caplog.text
    todays_path()
    ref, _ = quant_load(quant_checkpoint, device="cuda")
    _assert_identical(model, ref)


class DelayedCopies(copies.CudaCopies):
    """A side stream that sleeps before each copy (~1 ms of GPU time): a buffer reused, or a tensor used, before its
    copy is done would show as other bytes."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor):
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(1_000_000)
        return super().copy(dst, src)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("scheme", [None, "bnb.nf4", "bnb.int8"])
def test_cuda_a_delayed_side_stream_with_reused_buffers_gives_todays_bytes(monkeypatch, todays_path, quant_checkpoint,
                                                                           quant_load, assert_same_weights, scheme):
    """Every piece through a ring of 4 KiB buffers, each copy held back on the side stream: the ring hands a buffer
    out again only after its copy (a blocking event), and the load's stream waits for each tensor's last copy before
    it quantizes or installs it."""
    monkeypatch.setattr(staging, "SLOT_BYTES", 4096)
    monkeypatch.setitem(copies.ENGINES, "cuda", DelayedCopies)
    model, _ = quant_load(quant_checkpoint, quantize=scheme, device="cuda")
    todays_path()
    ref, _ = quant_load(quant_checkpoint, quantize=scheme, device="cuda")
    if scheme is None:
        _assert_identical(model, ref)
    else:
        assert_same_weights(model, ref)


@pytest.mark.cuda
@cuda
def test_cuda_a_load_leaves_other_users_cached_pinned_memory_alone(quant_checkpoint, quant_load):
    """A DataLoader's pinned batch, freed into torch's pinned cache before the load, is still cached after it: the
    load pins through its own pool and empties no process-wide cache."""
    batch = torch.empty(8 * 2**20, dtype=torch.uint8, pin_memory=True)
    del batch  # cached by torch's host allocator, for the next pinned allocation of its user
    cached = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    assert cached >= 8 * 2**20
    quant_load(quant_checkpoint, device="cuda")
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == cached
