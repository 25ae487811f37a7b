"""``save_checkpoint``: a model saved as it is, full precision or quantized, and loaded back as stored.

Round trips: quantize on load -> save -> reload into a fresh meta-built model gives the same tensors (codes,
scales, quantization state) bit for bit and the same logits. Interop: transformers' ``from_pretrained`` reads
the saved directory of a transformers model and gives the same logits.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open

from lightning_lowmem import MetaTensorError, init_empty, load_checkpoint, save_checkpoint
from lightning_lowmem.saving import module_state
from lightning_lowmem.memory import format_bytes
from lightning_lowmem.quantize import module_nbytes

SCHEMES = ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8", "torchao.int8wo", "torchao.int8dq"]
MiB = 2**20


def _stored_state(model) -> dict[str, torch.Tensor]:
    """What the model holds, as saved: each quantized module's codes, scales and quant state, every other tensor."""
    return module_state(model).materialized()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_round_trip_is_bit_identical(quant_checkpoint, quant_load, assert_same_weights, forward_logits, read_recorder,
                                     tmp_path, scheme):
    model, _ = quant_load(quant_checkpoint, quantize=scheme, progress=False)
    files = save_checkpoint(model, tmp_path)
    assert [p.name for p in files] == ["model.safetensors"]
    with safe_open(files[0], "pt") as f:
        assert f.metadata()["format"] == "pt" and f.metadata()["lightning_lowmem.quantize"] == scheme

    read_recorder.calls.clear()
    again, report = quant_load(tmp_path, progress=False)
    assert report.prequantized == report.quantized and len(report.quantized) == 8 and not report.requantized
    assert not read_recorder.rows  # read as stored, nothing quantized again
    assert_same_weights(again, model)
    want, got = _stored_state(model), _stored_state(again)
    assert want.keys() == got.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    assert module_nbytes(again) == module_nbytes(model)
    torch.testing.assert_close(forward_logits(again), forward_logits(model), rtol=0, atol=0)


def test_a_full_precision_model_is_saved_as_save_file_writes_it(quant_checkpoint, quant_load, tmp_path):
    model, _ = quant_load(quant_checkpoint, progress=False)
    save_checkpoint(model, tmp_path)
    assert (tmp_path / "model_config.yaml").is_file()  # a litgpt GPT: its config beside, as litgpt writes it
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "lightning_lowmem.writer": "lightning_lowmem"}  # marks our saves
        assert set(f.keys()) == set(model.state_dict())
        assert all(torch.equal(f.get_tensor(k), v) for k, v in model.state_dict().items())


def test_tied_weights_are_saved_once(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    save_checkpoint(model, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert list(f.keys()) == ["0.weight"]
    with init_empty():
        again = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    again[1].weight = again[0].weight
    load_checkpoint(again, tmp_path, progress=False)
    assert torch.equal(again[1].weight, model[0].weight) and again[1].weight is again[0].weight


@pytest.mark.parametrize("scheme", ["bnb.nf4-dq", "torchao.int8wo"])
def test_past_max_shard_size_the_files_are_named_as_save_pretrained_names_them(quant_checkpoint, quant_load,
                                                                               forward_logits, tmp_path, scheme):
    model, _ = quant_load(quant_checkpoint, quantize=scheme, progress=False)
    save_checkpoint(model, tmp_path)  # an earlier, unsharded save: replaced
    files = save_checkpoint(model, tmp_path, max_shard_size="40KB")
    names = [p.name for p in files]
    n = len(names) - 1
    assert n > 3 and names == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)] + [
        "model.safetensors.index.json"]
    assert not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(names[:-1])
    for path in files[:-1]:
        with safe_open(path, "pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
            assert f.metadata()["lightning_lowmem.quantize"] == scheme  # every shard carries the metadata
            assert len(sizes) == 1 or path.stat().st_size < 40_000 + 4096
    again, report = quant_load(tmp_path / "model.safetensors.index.json", progress=False)
    assert len(report.files) == n and len(report.prequantized) == 8
    torch.testing.assert_close(forward_logits(again), forward_logits(model), rtol=0, atol=0)


def test_a_model_on_meta_is_an_error(meta_gpt, quant_config, tmp_path):
    with pytest.raises(MetaTensorError, match="still on the meta device.*Load its weights first"):
        save_checkpoint(meta_gpt(quant_config), tmp_path)
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="writes a directory"):
        save_checkpoint(torch.nn.Linear(2, 2), tmp_path / "model.safetensors")


@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.nf4-dq"])
def test_a_4bit_model_that_ran_on_cpu_saves_its_codes_exactly(quant_checkpoint, quant_load, forward_logits, tmp_path,
                                                              scheme):
    model, _ = quant_load(quant_checkpoint, quantize=scheme, progress=False)
    before = _stored_state(model)
    model.eval()
    forward_logits(model)  # bitsandbytes repacks each 4-bit weight for its CPU kernel here (AVX512-bf16)
    repacked = getattr(model.transformer.h[0].attn.qkv.weight.quant_state, "packing_format_for_cpu", False)
    with pytest.warns(UserWarning, match="rounded its scales to bf16") if repacked else contextlib.nullcontext():
        save_checkpoint(model, tmp_path)
    assert getattr(model.transformer.h[0].attn.qkv.weight.quant_state, "packing_format_for_cpu", False) == repacked
    again, _ = quant_load(tmp_path, progress=False)
    after = _stored_state(again)
    codes = [k for k in before if k.endswith(".weight") and before[k].dtype == torch.uint8]
    assert codes and all(torch.equal(after[k], before[k]) for k in codes)
    absmax = [k for k in before if k.endswith("weight.absmax")]
    if scheme == "bnb.nf4":
        assert all(torch.allclose(after[k], before[k], rtol=2**-8, atol=0) for k in absmax)
    torch.testing.assert_close(forward_logits(again), forward_logits(model), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_transformers_reads_what_was_saved(hf_prequantized, meta_hf_model, hf_from_pretrained, forward_logits,
                                           tmp_path, scheme):
    full = hf_prequantized(scheme).parent / "full"
    model = meta_hf_model(full)
    load_checkpoint(model, full, quantize=scheme, progress=False)  # in the dtypes the model was built in
    save_checkpoint(model, tmp_path, max_shard_size="100KB")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == scheme.split(".")[0].replace("bnb", "bitsandbytes")
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"  # torch_dtype before transformers 4.56
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in model.config.to_dict()  # the model's own config is left as it was
    reference = hf_from_pretrained(tmp_path, torch.bfloat16)  # the dtype the model was built in
    torch.testing.assert_close(forward_logits(reference), forward_logits(model), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.nf4-dq", "bnb.int8", "torchao.int8wo"])
def test_cuda_round_trip(quant_checkpoint, quant_load, assert_same_weights, forward_logits, tmp_path, scheme):
    model, _ = quant_load(quant_checkpoint, quantize=scheme, device="cuda", progress=False)
    save_checkpoint(model, tmp_path)  # each tensor copied to the CPU as it is written
    again, report = quant_load(tmp_path, device="cuda", progress=False)
    assert len(report.prequantized) == 8
    # bitsandbytes packs a 4-bit quant state's JSON into a CPU tensor whatever the device (QuantState.as_dict)
    off = {k: t.device.type for k, t in _stored_state(again).items()
           if t.device.type != "cuda" and ".quant_state.bitsandbytes__" not in k}
    assert not off, off
    assert_same_weights(again, model)
    torch.testing.assert_close(forward_logits(again), forward_logits(model), rtol=0, atol=0)


CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from litgpt import GPT, Config
    from lightning_lowmem import MemoryMonitor, init_empty, load_checkpoint
    from lightning_lowmem.quantize import module_nbytes
    path, config_file = sys.argv[1], sys.argv[2]
    with init_empty():
        model = GPT(Config.from_file(config_file))
    with MemoryMonitor() as mon:
        report = load_checkpoint(model, path, dtype=torch.bfloat16, progress=False)
    print(json.dumps({"peak": mon.usage.rss_peak_delta, "final": module_nbytes(model),
                      "stored": len(report.prequantized), "quantized": len(report.quantized)}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.int8", "torchao.int8wo"])
def test_a_reload_in_a_fresh_process_peaks_at_the_quantized_model(large_checkpoint, meta_gpt, child_env, tmp_path,
                                                                  scheme):
    """Measured (2 cores, the 304 MiB bf16 model; largest tensor 32 MiB): the reload peaked 47 MiB above the final
    model for bnb.nf4 (132 MiB) and bnb.int8 (185 MiB), of which importing bitsandbytes is ~46 MiB, and 13 MiB
    for torchao.int8wo (185 MiB)."""
    path, config = large_checkpoint
    model = meta_gpt(config)
    load_checkpoint(model, path, dtype=torch.bfloat16, quantize=scheme, progress=False)
    save_checkpoint(model, tmp_path)
    largest = max(t.nbytes for t in _stored_state(model).values())
    del model
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(path.parent / "model_config.yaml")],
                          capture_output=True, text=True, env=child_env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["stored"] == out["quantized"] == 40
    assert out["peak"] <= out["final"] + largest + 64 * MiB, (out, largest)


# ---------------------------------------------------------------- saves that cannot corrupt: kills, full disks, links

TRANSITIONS = {  # A's max_shard_size, B's max_shard_size, B's layers (A has 2): B saved over A
    "3 shards over 3": ("50KB", "50KB", 2),
    "3 shards over 1 file": ("5GB", "70KB", 3),  # B's config differs too: model_config.yaml switches with the weights
    "1 file over 3 shards": ("50KB", "5GB", 2),
}


@pytest.fixture
def model_pair(tiny_config, tiny_gpt):
    """``model_pair(b_layers) -> (A, B)``: two tiny litgpt GPTs with different weights (B with ``b_layers``)."""
    def make(b_layers: int = 2):
        return tiny_gpt(tiny_config(), seed=0), tiny_gpt(tiny_config(n_layer=b_layers), seed=1)

    return make


@pytest.fixture
def loaded_from(meta_gpt):
    """``loaded_from(directory)``: what a fresh meta-built GPT (from the directory's own ``model_config.yaml``) holds
    after ``load_checkpoint(model, directory)``, as ``save_checkpoint`` would write it."""
    def load(directory) -> dict[str, torch.Tensor]:
        from litgpt import Config

        model = meta_gpt(Config.from_file(directory / "model_config.yaml"))
        load_checkpoint(model, directory, progress=False)
        return _stored_state(model)

    return load


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _steps(save, monkeypatch) -> list[str]:
    """The boundaries ``save()`` passes, in order (the save really runs)."""
    from lightning_lowmem.saving import atomic_file

    labels: list[str] = []
    monkeypatch.setattr(atomic_file, "_on_step", labels.append)
    save()
    monkeypatch.setattr(atomic_file, "_on_step", None)
    return labels


@pytest.mark.slow
@pytest.mark.parametrize("transition", TRANSITIONS)
def test_a_save_killed_at_any_step_leaves_the_old_checkpoint_or_the_new_one(model_pair, loaded_from, killed_at,
                                                                            monkeypatch, tmp_path, transition):
    """SIGKILL after each boundary of B's save over A (a file written, carried over, sealed, switched, the old
    removed): the directory loads as exactly A or exactly B, other files in it survive, and the next save
    clears what the kill left."""
    import shutil

    a_size, b_size, b_layers = TRANSITIONS[transition]
    a, b = model_pair(b_layers)
    want_a, want_b = _stored_state(a), _stored_state(b)
    pristine = tmp_path / "pristine"
    save_checkpoint(a, pristine, max_shard_size=a_size)
    (pristine / "README.md").write_text("mine")
    (pristine / "tokenizer.json").symlink_to("../tokenizer-blob.json")
    directory = tmp_path / "ckpt"

    def fresh_a() -> None:
        shutil.rmtree(directory, ignore_errors=True)
        shutil.copytree(pristine, directory, symlinks=True)

    fresh_a()
    steps = _steps(lambda: save_checkpoint(b, directory, max_shard_size=b_size), monkeypatch)
    assert steps[0] == "staged" and "switched" in steps and sum(s.startswith("wrote model") for s in steps) >= 1
    seen = []
    for n, label in enumerate(steps):
        fresh_a()
        assert killed_at(n, lambda: save_checkpoint(b, directory, max_shard_size=b_size)), label
        got = loaded_from(directory)
        assert _same(got, want_a) or _same(got, want_b), f"killed after {label!r}: a mix of A and B"
        seen.append("B" if _same(got, want_b) else "A")
        assert (directory / "README.md").read_text() == "mine", label
        assert os.readlink(directory / "tokenizer.json") == "../tokenizer-blob.json", label
        leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".lowmem-")]
        assert len(leftovers) == (0 if label == "removed the old content" else 1), (label, leftovers)
        assert not any(p.name.startswith(".lowmem-") for p in directory.iterdir()), label
    switched = steps.index("switched")
    assert seen == ["A"] * switched + ["B"] * (len(steps) - switched)  # B from the exchange on, not a step before
    fresh_a()
    assert killed_at(steps.index("sealed"), lambda: save_checkpoint(b, directory, max_shard_size=b_size))
    save_checkpoint(b, directory, max_shard_size=b_size)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "pristine"]  # the next save cleared the leftover
    assert _same(loaded_from(directory), want_b)


def test_a_save_that_cannot_fit_is_refused_before_anything_is_written(mount_tmpfs, model_pair, loaded_from):
    from lightning_lowmem import SaveError

    disk = mount_tmpfs("256k")
    a, b = model_pair(3)
    directory = disk / "ckpt"
    save_checkpoint(a, directory, max_shard_size="50KB")  # 132 KiB; B needs 183 KiB more beside it
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    with pytest.raises(SaveError, match=r"needs .* \(\d+ bytes\) on the file system of .* which has .* free") as e:
        save_checkpoint(b, directory, max_shard_size="50KB")
    assert e.value.needed > e.value.available and e.value.errno == 28 and str(directory) in str(e.value)
    assert sorted(p.name for p in disk.iterdir()) == ["ckpt"]  # nothing written beside it
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert _same(loaded_from(directory), _stored_state(a))


@pytest.mark.slow
def test_a_disk_that_fills_during_the_save_leaves_the_old_checkpoint(mount_tmpfs, fill_disk, model_pair, loaded_from,
                                                                     monkeypatch, tmp_path):
    """Another program fills the disk after each boundary of the save: the save fails with a SaveError naming the
    file it was writing and the bytes needed and free, the directory loads as A, and nothing is left beside it."""
    from lightning_lowmem import SaveError
    from lightning_lowmem.saving import atomic_file

    disk = mount_tmpfs("1m")
    a, b = model_pair(2)
    directory = disk / "ckpt"
    save_checkpoint(b, tmp_path / "b", max_shard_size="50KB")
    steps = _steps(lambda: save_checkpoint(b, tmp_path / "b", max_shard_size="50KB"), monkeypatch)
    save_checkpoint(a, directory, max_shard_size="50KB")
    for n, label in enumerate(steps[:steps.index("carried")]):
        monkeypatch.setattr(atomic_file, "_on_step", lambda step, n=n: fill_disk(disk) if step == steps[n] else None)
        with pytest.raises(SaveError) as e:
            save_checkpoint(b, directory, max_shard_size="50KB")
        monkeypatch.setattr(atomic_file, "_on_step", None)
        message = str(e.value)
        assert e.value.errno == 28 and "No space left on device" in message and "holds what it held before" in message
        assert f"needs {format_bytes(e.value.needed)} ({e.value.needed} bytes) in all" in message, label
        following = steps[n + 1].removeprefix("wrote ") if steps[n + 1].startswith("wrote ") else "model_config.yaml"
        assert e.value.path == str(directory / following) and f"failed at {directory / following}:" in message, (
            label, message)  # the file's name in the directory, not the temporary one (litgpt's config writer too)
        assert sorted(p.name for p in disk.iterdir()) == ["ckpt", "filler"], label
        assert _same(loaded_from(directory), _stored_state(a)), label
        (disk / "filler").unlink()
    save_checkpoint(b, directory, max_shard_size="50KB")
    assert _same(loaded_from(directory), _stored_state(b))


def _tree(root) -> dict[str, bytes | str]:
    """Every entry under ``root``: a file's bytes, a link's target text."""
    return {str(p.relative_to(root)): (f"-> {os.readlink(p)}" if p.is_symlink() else p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_symlink() or p.is_file()}


def test_links_planted_at_temporary_and_final_names_are_neither_followed_nor_left(model_pair, loaded_from,
                                                                                  monkeypatch, tmp_path):
    from lightning_lowmem.saving import temporaries

    a, b = model_pair()
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("victim.bin", "victim.yaml", "victim.partial", "victim.temp"):
        (outside / name).write_bytes(b"precious " + name.encode())
    save_checkpoint(a, outside / "theirs")  # a save of ours elsewhere: a link to it counts as ours
    before = _tree(outside)
    directory = tmp_path / "out"
    save_checkpoint(a, directory, max_shard_size="50KB")
    (directory / "model.safetensors").symlink_to(outside / "theirs" / "model.safetensors")
    (directory / "model_config.yaml").unlink()
    (directory / "model_config.yaml").symlink_to(outside / "victim.yaml")
    (directory / ".model.safetensors.partial").symlink_to(outside / "victim.partial")  # the old writer's temporary
    names = iter(["0badc0de", "0badc0de", "5afe5afe"])  # the first temporary name is taken by a planted link
    monkeypatch.setattr(temporaries.secrets, "token_hex", lambda n: next(names))
    (tmp_path / ".lowmem-0badc0de.out").symlink_to(outside / "victim.temp")

    save_checkpoint(b, directory)
    assert _tree(outside) == before  # no target written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "outside"]  # the planted temporary link removed
    assert sorted(p.name for p in directory.iterdir()) == ["model.safetensors", "model_config.yaml"]
    assert not any(p.is_symlink() for p in directory.iterdir())
    assert _same(loaded_from(directory), _stored_state(b))


def test_a_save_into_a_hugging_face_cache_snapshot_replaces_its_links_and_leaves_every_blob_intact(
        model_pair, loaded_from, tmp_path):
    """``snapshots/<rev>/`` holds links into ``blobs/``: the save writes new files in place of the links (the HF
    weights are not ours: ``overwrite=True``), the tokenizer link stays a link, and no blob changes."""
    from safetensors.torch import save_file

    from lightning_lowmem import ForeignWeightsError

    a, b = model_pair()
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in a.state_dict().items() if "mask" not in k}
    keys = sorted(state)
    files = {f"model-0000{i + 1}-of-00002.safetensors": keys[i::2] for i in range(2)}
    for i, (name, part) in enumerate(files.items()):
        save_file({k: state[k] for k in part}, blobs / f"blob{i}", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in files.items() for k in part}}
    (blobs / "blob-index").write_text(json.dumps(index))
    (blobs / "blob-tokenizer").write_text("{}")
    for name, blob in [*zip(files, ("blob0", "blob1")), ("model.safetensors.index.json", "blob-index"),
                       ("tokenizer.json", "blob-tokenizer")]:
        (snapshot / name).symlink_to(f"../../blobs/{blob}")
    blobs_before = _tree(blobs)

    with pytest.raises(ForeignWeightsError, match="did not write: 'model-00001-of-00002.safetensors'"):
        save_checkpoint(b, snapshot, max_shard_size="50KB")
    save_checkpoint(b, snapshot, max_shard_size="50KB", overwrite=True)
    assert _tree(blobs) == blobs_before
    assert os.readlink(snapshot / "tokenizer.json") == "../../blobs/blob-tokenizer"
    weights = sorted(p.name for p in snapshot.iterdir() if p.name.startswith("model"))
    assert weights == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + [
        "model.safetensors.index.json", "model_config.yaml"]
    assert not any((snapshot / name).is_symlink() for name in weights)
    assert _same(loaded_from(snapshot), _stored_state(b))


def test_weight_files_it_did_not_write_stop_the_save_unless_overwrite(model_pair, loaded_from, tmp_path):
    from safetensors.torch import save_file

    from lightning_lowmem import ForeignWeightsError

    a, b = model_pair()
    directory = tmp_path / "out"
    save_checkpoint(a, directory, max_shard_size="50KB")  # ours: replaced by the next save without asking
    torch.save(a.state_dict(), directory / "lit_model.pth")
    torch.save({}, directory / "pytorch_model.bin")
    save_file({"w": torch.ones(2)}, directory / "adapter.safetensors")
    (directory / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    (directory / "README.md").write_text("mine")
    before = _tree(tmp_path)
    with pytest.raises(ForeignWeightsError) as e:
        save_checkpoint(b, directory)
    assert e.value.files == ["adapter.safetensors", "lit_model.pth", "model.gguf", "pytorch_model.bin"]
    assert "two weight sets" in str(e.value) and "overwrite=True" in str(e.value) and "--overwrite" in str(e.value)
    assert _tree(tmp_path) == before  # nothing written, nothing removed

    assert [p.name for p in save_checkpoint(b, directory, overwrite=True)] == ["model.safetensors"]
    assert sorted(p.name for p in directory.iterdir()) == ["README.md", "model.safetensors", "model_config.yaml"]
    assert _same(loaded_from(directory), _stored_state(b))
