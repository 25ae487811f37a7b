"""The disk tier: a model several times its budget generates what the same model in memory generates, reading its
layers on disk from the checkpoint file itself for each forward; a file changed under it stops it with a typed error."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
from collections import Counter
from concurrent.futures import wait
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_lowmem import (
    CheckpointChangedError,
    CheckpointFormatError,
    LoadOptions,
    MetaTensorError,
    UnsupportedQuantizationError,
    generate,
    init_empty,
    load_checkpoint,
    save_checkpoint,
)
from lightning_lowmem.litgpt.generation import load_for_generation
from lightning_lowmem.runtime.streamer import LayerStreamer
from lightning_lowmem.threads import in_new_thread

IDS = [5, 17, 3, 99, 42, 8]


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def open_descriptors(path: Path) -> int:
    """This process's open file descriptors on ``path``."""
    fds = Path("/proc/self/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            count += os.readlink(fd) == str(path)
        except OSError:
            pass
    return count


@pytest.fixture
def eight_layers(tmp_path, tiny_config, tiny_gpt):
    """An 8-layer, 128-dim litgpt directory in bf16 (lit_model.pth + model_config.yaml), litgpt's own init (its greedy
    tokens vary, where larger weights repeat one or two): its path and bytes."""
    from litgpt.utils import save_config

    config = tiny_config("pythia", n_layer=8, n_embd=128, intermediate_size=512)
    directory = tmp_path / "bf16"
    directory.mkdir()
    state = tiny_gpt(config, torch.bfloat16).state_dict()
    torch.save(state, directory / "lit_model.pth")
    save_config(config, directory)
    return directory, state_bytes(state)


@pytest.mark.parametrize("stored", ["bf16", "nf4"])
def test_a_model_five_times_its_budget_generates_the_tokens_of_the_model_in_memory(tmp_path, eight_layers, stored):
    directory, nbytes = eight_layers
    if stored == "nf4":  # quantized once, then streamed as stored
        model, _, _ = load_for_generation(directory, quantize="bnb.nf4")
        save_checkpoint(model, tmp_path / "nf4")
        directory, nbytes = tmp_path / "nf4", (tmp_path / "nf4" / "model.safetensors").stat().st_size
    budget = nbytes // 5
    expected = generate(directory, IDS, max_new_tokens=16, temperature=0.0)
    got = generate(directory, IDS, max_new_tokens=16, temperature=0.0, max_memory={"cpu": budget}, disk_offload=True)

    assert got.tokens[0].tolist() == expected.tokens[0].tolist()
    assert len(set(got.new_tokens[0].tolist())) > 3  # tokens that vary: a wrong layer would show
    report, placement = got.load_report, got.load_report.placement
    assert len(placement.on_disk) >= 6 and placement.weights_per_device()["cpu"] <= budget
    assert report.bytes_read < nbytes / 3 and placement.disk_read_bytes > nbytes / 2
    # the prefill and 15 more forwards (the 16th token needs none): after the first forward, each layer's read started
    # while the one before it ran (the first forward learns the order)
    stats, units = report.disk.stats, len(report.disk.units)
    assert units * 16 <= stats.reads <= units * 17 + 1 and stats.prefetch_hits >= units * 15
    if stored == "nf4":
        assert set(report.prequantized.values()) == {"bnb.nf4"} and len(report.prequantized) == 8 * 4
    assert open_descriptors(report.files[0]) == 0  # generate() closed the file at its end


@pytest.fixture
def streamed(tmp_path, tiny_config, tiny_gpt, meta_gpt, write_checkpoint):
    """``streamed(kind="safetensors", source_dtype=torch.bfloat16, budget_fraction=0.2)``: a 6-layer GPT written as
    ``kind``, loaded in bf16 with its layers beyond the budget left on disk: ``(model, report, reference, path)``."""
    def make(kind: str = "safetensors", source_dtype: torch.dtype = torch.bfloat16, fraction: float = 0.2):
        config = tiny_config(n_layer=6)
        reference = tiny_gpt(config, source_dtype, std=0.3)
        path = write_checkpoint(reference.state_dict(), kind, tmp_path / kind)
        model = meta_gpt(config)
        budget = int(state_bytes(reference.state_dict()) * fraction)
        report = load_checkpoint(model, path, dtype=torch.bfloat16, max_memory={"cpu": budget}, disk_offload=True)
        reference = reference.to(torch.bfloat16)  # RoPE tables too, as model.to(dtype) and a load in bf16 leave them
        return model.eval(), report, reference, path

    return make


def test_every_checkpoint_format_streams_what_it_holds(streamed, checkpoint_format):
    model, report, reference, _ = streamed(checkpoint_format)
    assert report.placement.on_disk and report.disk is not None
    x = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        expected = reference(x)
        for _ in range(2):  # the second forward reads every layer again, into the same buffers
            torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    report.disk.close()


def test_a_checkpoint_cast_as_it_is_read_streams_the_cast_weights(streamed):
    model, report, reference, _ = streamed(source_dtype=torch.float32)
    x = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert report.placement.disk_read_bytes == 2 * report.placement.weights_per_device()["disk"]  # fp32 read
    report.disk.close()


@pytest.mark.parametrize("change", ["truncated", "rewritten"])
def test_a_file_changed_between_two_forwards_stops_the_next_one_with_a_typed_error(streamed, change):
    model, report, reference, path = streamed()
    x = torch.randint(0, 100, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
        if change == "truncated":
            os.truncate(path, path.stat().st_size // 2)
        else:  # other bytes, the same size
            data = bytearray(path.read_bytes())
            data[-1024:] = bytes(1024)
            path.write_bytes(bytes(data))
        for _ in range(2):  # and every later forward: never one on other weights
            with pytest.raises(CheckpointChangedError, match="disk_offload") as error:
                model(x)
            assert isinstance(error.value, CheckpointFormatError) and str(path) in str(error.value)
    report.disk.close()


def test_a_forward_recording_gradients_is_refused(streamed):
    model, report, _, _ = streamed()
    with pytest.raises(RuntimeError, match=r"torch.no_grad\(\)"):
        model(torch.randint(0, 100, (1, 4)))
    assert all(not p.requires_grad for module in report.disk.modules.values() for p in module.parameters())
    with torch.no_grad():  # the refused forward left nothing installed
        model(torch.randint(0, 100, (1, 4)))
    report.disk.close()


def test_close_puts_the_layers_on_disk_back_on_meta_and_closes_the_file(streamed):
    model, report, _, path = streamed()
    assert open_descriptors(path) == 1  # opened once, by the load, and kept
    on_disk = [name for name, p in model.named_parameters() if p.untyped_storage().nbytes() <= 2]
    assert on_disk and report.bytes_loaded < report.placement.weights_per_device()["disk"]
    report.disk.close()
    report.disk.close()  # again: nothing
    assert open_descriptors(path) == 0
    assert {name for name, p in model.named_parameters() if p.is_meta} == set(on_disk)
    with pytest.raises(MetaTensorError, match="disk tier was closed"), torch.no_grad():
        model(torch.randint(0, 100, (1, 4)))


@pytest.mark.parametrize("keep_report", [False, True])
def test_dropping_the_model_closes_the_file_and_stops_the_reading_thread_at_once(streamed, keep_report):
    """No collector pass: the model holds the tier, the tier holds the model weakly; a read started ahead (the first
    layer's, begun at load) ends first."""
    model, report, _, path = streamed()
    assert open_descriptors(path) == 1 and reading_threads() == 1
    gc.disable()
    try:
        del model
        if not keep_report:
            del report
        assert open_descriptors(path) == 0 and reading_threads() == 0
    finally:
        gc.enable()
    if keep_report:
        report.disk.close()  # the model is gone: nothing to put back, nothing to raise


def reading_threads() -> int:
    return sum(t.name.startswith("lowmem-disk") for t in threading.enumerate())


@pytest.mark.parametrize("threads", [1, 2])
def test_a_forward_leaves_a_core_to_a_read_running_beside_it_and_gives_it_back(streamed, threads):
    """While the next layer's read runs, the forward computes on one thread fewer (the read is a copy that takes a
    core); the caller's count is back after the forward, and a thread started during the forward gets the caller's
    count, not the lowered one. The reading thread is held by a gate here, so the read is still running when the
    first layer on disk computes."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, report, reference, _ = streamed()
        tier = report.disk
        first = next(iter(tier.modules.values()))
        gate, seen = threading.Event(), []

        def during(module: nn.Module, args: tuple) -> None:  # runs after the tier's hook on the same module
            seen.append((torch.get_num_threads(), tier._reading(), in_new_thread(torch.get_num_threads)))
            gate.set()

        handle = first.register_forward_pre_hook(during)
        x = torch.randint(0, 100, (1, 7))
        with torch.no_grad():
            tier.source.executor.submit(gate.wait)  # the reading thread is busy until the first layer on disk runs
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
            assert torch.get_num_threads() == threads
            handle.remove()
            model(x)
        assert seen == [(max(threads - 1, 1), True, threads)]
        assert torch.get_num_threads() == threads and in_new_thread(torch.get_num_threads) == threads
        # a module on disk run on its own, not through the model: all of the caller's cores, nothing to give back
        held = threading.Event()
        tier.source.executor.submit(held.wait)
        with torch.no_grad():
            first(torch.randn(1, 7, reference.config.n_embd, dtype=torch.bfloat16),
                  *[t[None, :7] for t in (model.cos, model.sin)])
        assert torch.get_num_threads() == threads
        held.set()
        tier.close()
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


class Reversed(nn.Module):
    """Blocks of a ModuleList run last to first: an order the module's own order does not tell."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks):
            x = torch.tanh(block(x))
        return x


def test_layers_are_read_ahead_in_the_order_the_forward_takes(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    reference = Reversed()
    save_file(reference.state_dict(), tmp_path / "model.safetensors")
    with init_empty():
        model = Reversed()
    report = load_checkpoint(model, tmp_path / "model.safetensors", max_memory={"cpu": 10_000}, disk_offload=True)
    assert len(report.placement.on_disk) == 6
    x = torch.randn(3, 64)
    stats = report.disk.stats
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
        assert stats.prefetch_hits == 0  # module order, guessed first: every read ahead was the wrong layer
        for _ in range(3):
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
        reads, hits = stats.reads, stats.prefetch_hits
        model(x)
    assert stats.prefetch_hits == hits + 6  # learned: each read while the one before ran
    # 6 reads; the next forward's first layer, read ahead as this one ends, may be counted on either side of a snapshot
    assert abs(stats.reads - reads - 6) <= 1
    report.disk.close()


def test_quantizing_a_full_precision_file_for_every_forward_is_refused_before_any_read(eight_layers, meta_gpt,
                                                                                      read_recorder):
    directory, nbytes = eight_layers
    with pytest.raises(UnsupportedQuantizationError, match="Quantize once, then stream the quantized copy") as error:
        generate(directory, IDS, max_new_tokens=2, quantize="bnb.nf4", max_memory={"cpu": nbytes // 20},
                 disk_offload=True)
    assert "lightning-lowmem quantize" in str(error.value)
    assert read_recorder.keys == []


def test_a_model_with_layers_on_disk_is_not_saved(streamed, tmp_path):
    model, report, _, path = streamed()
    with pytest.raises(ValueError, match="disk_offload") as error:
        save_checkpoint(model, tmp_path / "out")
    assert str(path) in str(error.value) and not (tmp_path / "out").exists()
    report.disk.close()


def test_a_converted_checkpoint_streams_through_its_conversion(tmp_path, write_hf_dir):
    """An HF Llama directory into litgpt's GPT: q, k and v combined into qkv as each layer is read."""
    write_hf_dir(tmp_path / "hf", "llama-gqa", hidden=64)
    expected = generate(tmp_path / "hf", IDS, max_new_tokens=10, temperature=0.0)
    got = generate(tmp_path / "hf", IDS, max_new_tokens=10, temperature=0.0,
                   options=LoadOptions(max_memory={"cpu": 60_000}, disk_offload=True))
    assert got.load_report.placement.on_disk
    assert got.tokens[0].tolist() == expected.tokens[0].tolist()


def test_a_gguf_file_streams_its_layers_dequantized_as_read(tiny_gguf):
    path = tiny_gguf["Q8_0"]
    expected = generate(path, IDS, max_new_tokens=10, temperature=0.0, precision="32-true")
    got = generate(path, IDS, max_new_tokens=10, temperature=0.0, precision="32-true", max_memory={"cpu": 250_000},
                   disk_offload=True)
    assert got.load_report.placement.on_disk
    assert got.tokens[0].tolist() == expected.tokens[0].tolist()


def test_a_tensor_rewritten_as_its_rows_are_read_is_rewritten_once_per_forward(tiny_gguf, forward_logits,
                                                                              monkeypatch):
    """A GGUF Llama into transformers' LlamaForCausalLM: q_proj and k_proj are built a block of rows at a time,
    each block un-permuted by the conversion's transform as read. Read again for each forward, they must not be
    un-permuted a second time (the logits of the layers on disk would differ), and they are built in place, in
    the read buffer."""
    import transformers

    from lightning_lowmem.routes import choice as routes
    from lightning_lowmem.routes.row_reads import read_built
    from lightning_lowmem.plan.gguf import gguf_config, gguf_to_transformers

    path = tiny_gguf["Q8_0"]
    models = []
    for budget in (None, {"cpu": 250_000}):
        with init_empty():
            model = transformers.LlamaForCausalLM(gguf_config(path))
        conversion = gguf_to_transformers(path, model)
        disk = {"max_memory": budget, "disk_offload": True} if budget else {}
        report = load_checkpoint(model, path, key_map=conversion.key_map, transform=conversion.transform,
                                 dtype=torch.float32, progress=False, **disk)
        models.append((model.eval(), report))
    (expected, _), (streamed, report) = models
    on_disk = sorted(m for layer in report.placement.on_disk for m in layer.modules if m.startswith("model.layers."))
    assert on_disk
    buffers = {report.disk.source.buffers.buffer(i).untyped_storage().data_ptr() for i in (0, 1)}
    built = []

    def spy(*args, **kwargs):
        out = read_built(*args, **kwargs)
        built.append(out.untyped_storage().data_ptr())
        return out

    monkeypatch.setattr(routes, "read_built", spy)
    # layer 1's read for the second forward starts during the first, with the spy in place (the read for the first
    # forward started at load, and may end before or after the spy is set)
    for _ in range(2):
        assert torch.equal(forward_logits(streamed), forward_logits(expected))
    assert built and set(built) <= buffers  # built in place in a read buffer, not in memory of its own
    report.disk.close()


@pytest.mark.cuda
def test_cuda_layers_on_disk_are_copied_to_the_device_and_match_the_model_in_memory(streamed):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model, report, reference, _ = streamed(fraction=1.0)  # the layout only; loaded again below for CUDA
    report.disk.close()
    config = reference.config
    from litgpt import GPT

    with init_empty():
        model = GPT(config)
    nbytes = state_bytes(reference.state_dict())
    report = load_checkpoint(model, report.files[0], dtype=torch.bfloat16, disk_offload=True,
                             max_memory={"cuda:0": nbytes // 3, "cpu": nbytes // 5})
    assert report.placement.on_disk and report.placement.stream_bytes >= max(
        layer.nbytes for layer in report.placement.on_disk)
    model.cuda()  # leaves the layers on disk alone
    x = torch.randint(0, 100, (1, 8))
    with torch.no_grad():
        expected = reference.cuda()(x.cuda())
        torch.testing.assert_close(model(x.cuda()), expected, rtol=0, atol=0)
        torch.testing.assert_close(model(x.cuda()), expected, rtol=0, atol=0)
    report.disk.close()


def test_a_tied_embedding_on_disk_is_read_once_per_forward(tmp_path, write_hf_dir, forward_logits, read_recorder):
    """An HF Llama whose head is its embedding (saved once), both on disk: one layer, read once per forward into a
    buffer of its own and kept from the embedding to the head. Bytes read == the plan's (the head read it again:
    512,000 bytes where the plan said 256,000 in the report behind this), outputs exact."""
    import transformers

    hf, _ = write_hf_dir(tmp_path / "hf", "llama", hidden=64, tie=True, tokenizer=False)
    with init_empty():
        model = transformers.LlamaForCausalLM(hf.config).eval()
    report = load_checkpoint(model, tmp_path / "hf", dtype=torch.float32, max_memory={"cpu": 20_000},
                             disk_offload=True, progress=False)
    placement, tier = report.placement, report.disk
    tied = [layer for layer in placement.on_disk if layer.tied]
    assert [sorted(layer.modules) for layer in tied] == [["lm_head", "model.embed_tokens"]]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expected = forward_logits(hf)
    on_disk = {t.record.key: t.record.nbytes for unit in tier.units.values() for t in unit.targets}
    assert tier.read_nbytes == placement.disk_read_bytes == sum(on_disk.values())
    assert tier.buffer_bytes == placement.disk_buffer_bytes  # the blocks the placement counted, to the byte
    torch.testing.assert_close(forward_logits(model), expected, rtol=0, atol=0)  # the first forward learns the order
    for _ in range(2):
        read_ahead_done(tier)
        read_recorder.calls.clear()
        bytes_before = tier.stats.bytes_read
        torch.testing.assert_close(forward_logits(model), expected, rtol=0, atol=0)
        read_ahead_done(tier)  # the next forward's first layer, read as this one ends: one read of each, per forward
        assert Counter(key for key, _, _ in read_recorder.calls) == dict.fromkeys(on_disk, 1)
        assert tier.stats.bytes_read - bytes_before == placement.disk_read_bytes
    tier.close()


def read_ahead_done(tier) -> None:
    """Wait until the read started ahead (if any) has ended, leaving it for the forward that takes it."""
    if tier._pending is not None:
        wait([tier._pending.future])


def hold_a_read(tier, unit) -> tuple[threading.Event, threading.Event, threading.Event]:
    """Hold ``unit``'s next read until the returned gate is set; the second event is set once its bytes are written,
    the third once the read is held."""
    gate, written, holding = threading.Event(), threading.Event(), threading.Event()
    read = tier.source._read

    def held(layer, buffer):
        if layer is unit and not gate.is_set():
            holding.set()
            gate.wait(10)
            out = read(layer, buffer)
            written.set()
            return out
        return read(layer, buffer)

    tier.source._read = held
    return gate, written, holding


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, TimeoutError])
def test_an_interrupted_forward_leaves_its_read_to_the_next_and_the_next_forwards_exact(streamed, interruption,
                                                                                      two_threads):
    """Ctrl-C (SIGINT) or a request timeout (a SIGALRM handler raising TimeoutError) while a forward waits for a
    layer's read: the error is the caller's, as it was raised (not a CheckpointChangedError), the thread count is
    back, and the read, still running, is waited for before its buffer is used again. The next forward lets that
    read write (and waits for it) once its first layer on disk is installed: a read left running would land in
    the buffer that layer computes from."""
    model, report, reference, _ = streamed()
    tier = report.disk
    x = torch.randint(0, 100, (1, 9))
    with torch.no_grad():
        expected = reference(x)
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)  # the order learned
        first, third = list(tier.units.values())[0], list(tier.units.values())[2]
        gate, written, holding = hold_a_read(tier, third)
        with raised_while_waiting(interruption, holding), pytest.raises(interruption):
            model(x)
        assert torch.get_num_threads() == 2 and in_new_thread(torch.get_num_threads) == 2
        assert tier._reading() and tier.stats.reads >= 0 and not tier._active

        def land_it(module: nn.Module, args: tuple) -> None:
            gate.set()
            written.wait(10)

        threading.Timer(1.0, gate.set).start()  # this tier waits for the read before the hook below runs
        handle = model.get_submodule(first.modules[0]).register_forward_pre_hook(land_it)
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
        handle.remove()
        for _ in range(2):
            torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    assert torch.get_num_threads() == 2
    tier.close()


def test_a_keyboard_interrupt_while_a_layer_computes_gives_the_cores_back_and_releases_it(streamed, two_threads):
    """Forward hooks do not run after a KeyboardInterrupt (torch's always_call covers Exception only): the model's
    guarded forward still gives the thread count back and puts the layer's placeholders back."""
    model, report, reference, _ = streamed()
    tier = report.disk
    x = torch.randint(0, 100, (1, 9))
    first = model.get_submodule(list(tier.units.values())[0].modules[0])
    gate, seen = threading.Event(), []

    def interrupt(module: nn.Module, args: tuple) -> None:  # after the tier's hook: installed, a read beside it
        seen.append(torch.get_num_threads())
        gate.set()
        raise KeyboardInterrupt

    with torch.no_grad():
        expected = reference(x)
        model(x)
        read_ahead_done(tier)  # the first layer's, for this forward
        handle = first.register_forward_pre_hook(interrupt)
        tier.source.executor.submit(gate.wait)  # the second layer's read waits behind this: one core left to it
        with pytest.raises(KeyboardInterrupt):
            model(x)
        handle.remove()
        assert seen == [1] and torch.get_num_threads() == 2 and in_new_thread(torch.get_num_threads) == 2
        assert not tier._active and all(p.untyped_storage().nbytes() <= 4 for p in first.parameters())
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    tier.close()


@contextlib.contextmanager
def raised_while_waiting(error: type[BaseException], holding: threading.Event):
    """``error`` raised in this (the main) thread by a signal once a read is held (``holding``) and this thread is
    seen blocked waiting for a fetch: SIGINT for a KeyboardInterrupt (Python's own handler), SIGALRM for a
    TimeoutError (a handler as request timeouts set). Sent only while the thread waits, never while it runs other
    Python code (a signal handled inside a finalizer that the collector runs there is printed and dropped, and the
    forward would go on), and again each 0.5 s the thread stays there."""
    main = threading.main_thread().ident
    signum = signal.SIGINT if error is KeyboardInterrupt else signal.SIGALRM
    done = threading.Event()

    def waiting() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code is LayerStreamer._wait_pending.__code__:
                return True
            frame = frame.f_back
        return False

    def send() -> None:
        if not holding.wait(10):
            return
        while not done.is_set():
            if waiting():
                signal.pthread_kill(main, signum)
                done.wait(0.5)
            else:
                done.wait(0.01)

    def timeout(signum, frame):
        raise TimeoutError("the request took too long")

    before = signal.signal(signal.SIGALRM, timeout) if signum == signal.SIGALRM else None
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        yield
    finally:
        done.set()
        sender.join()
        if before is not None:
            signal.signal(signal.SIGALRM, before)
