"""A directory of several weight sets: every face reads the same one, or raises the same error, and none says
two sets are the same without comparing every byte.

Every pair of the weight formats users have side by side (litgpt's ``lit_model.pth``, HF's ``model.safetensors``,
``pytorch_model.bin`` and a sharded set, a Lightning ``.ckpt``), holding the same tensors or different ones:
``load_checkpoint``, ``estimate_memory``, ``lightning-lowmem inspect`` and ``generate`` choose the same file (with an
``UnverifiedWeightsWarning`` unless ``verify_weight_sets`` compared every byte), or all raise
``AmbiguousCheckpointError``; ``prefer=`` / ``--weights`` picks one.
"""

from __future__ import annotations

import itertools
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lightning_lowmem import (
    AmbiguousCheckpointError,
    LoadOptions,
    UnverifiedWeightsWarning,
    estimate_memory,
    generate,
    load_checkpoint,
)

FORMATS = {  # name: (the file a load opens, names: litgpt's or HF's, rank in the documented order)
    "sharded-hf": ("model.safetensors.index.json", "hf", 0),
    "safetensors-hf": ("model.safetensors", "hf", 2),
    "lit": ("lit_model.pth", "lit", 4),
    "bin-hf": ("pytorch_model.bin", "hf", 7),
    "ckpt": ("last.ckpt", "lit", 11),
}
PAIRS = list(itertools.combinations(FORMATS, 2))
HUB = {("sharded-hf", "bin-hf"), ("safetensors-hf", "bin-hf")}
"""The Hub's own layout: transformers' safetensors beside its pytorch_model.bin, read quietly where samples agree."""


@pytest.fixture(scope="module")
def states(tmp_path_factory, write_hf_dir, litgpt_converted):
    """The same weights under HF's and litgpt's names (litgpt's own conversion), a variant of each that differs,
    and the directory's config files."""
    root = tmp_path_factory.mktemp("sets")
    _, config = write_hf_dir(root / "hf", "llama", tokenizer=False)
    from safetensors.torch import load_file

    hf = load_file(root / "hf" / "model.safetensors")
    lit = torch.load(litgpt_converted(root / "hf", config, root / "lit") / "lit_model.pth")
    return {"hf": hf, "lit": lit, "hf-other": {k: v + 1 for k, v in hf.items()},
            "lit-other": {k: v + 1 for k, v in lit.items()}, "config_dir": root / "hf", "config": config}


def _write(fmt: str, directory: Path, state: dict[str, torch.Tensor]) -> None:
    if fmt == "lit":
        torch.save(state, directory / "lit_model.pth")
    elif fmt == "ckpt":
        torch.save({"state_dict": {f"model.{k}": v for k, v in state.items()}, "epoch": 0}, directory / "last.ckpt")
    elif fmt == "safetensors-hf":
        save_file(state, directory / "model.safetensors")
    elif fmt == "bin-hf":
        torch.save(state, directory / "pytorch_model.bin")
    else:  # sharded-hf: two shards and their index, as save_pretrained lays them out
        keys, weight_map = sorted(state), {}
        for i, part in enumerate((keys[::2], keys[1::2])):
            name = f"model-{i + 1:05d}-of-00002.safetensors"
            save_file({k: state[k] for k in part}, directory / name)
            weight_map.update(dict.fromkeys(part, name))
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _directory(tmp_path: Path, states: dict, first: str, second: str, same: bool) -> Path:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    shutil.copy(states["config_dir"] / "model_config.yaml", directory)
    shutil.copy(states["config_dir"] / "config.json", directory)
    _write(first, directory, states[FORMATS[first][1]])
    _write(second, directory, states[FORMATS[second][1] + ("" if same else "-other")])
    return directory


def _expected(first: str, second: str) -> str:
    """The documented rule: the first set the module (litgpt's GPT) takes as it is, else the first in the order."""
    ranked = sorted((first, second), key=lambda f: FORMATS[f][2])
    native = [f for f in ranked if FORMATS[f][1] == "lit"]
    return FORMATS[(native or ranked)[0]][0]


def _every_face(directory: Path, states: dict, capsys, config=None, callback: bool = False,
                **options) -> dict[str, str | type]:
    """Which file each face reads (its report's first words, ``+warned`` after it when it warned that it did not
    compare every byte), or the type of the error it raises; the Trainer's callback too with ``callback``."""
    from lightning_lowmem.cli.commands import main
    from lightning_lowmem.litgpt.checkpoint_dir import build_meta_gpt

    config = config or states["config"]
    load_options = LoadOptions(progress=False, **options)
    faces = {
        "load_checkpoint": lambda: load_checkpoint(build_meta_gpt(config), directory, options=load_options).source,
        "estimate_memory": lambda: estimate_memory(directory, max_seq_length=8, options=load_options).source,
        "generate": lambda: generate(directory, [1, 2, 3], max_new_tokens=1, options=load_options).load_report.source,
        "fabric": lambda: _fabric_source(directory, config, load_options),
        "inspect": lambda: _inspect_source(main, directory, capsys, options),
    }
    if callback:
        faces["callback"] = lambda: _callback_source(directory, config, load_options)
    chosen: dict[str, str | type] = {}
    for face, call in faces.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                why = call()
            except AmbiguousCheckpointError as e:
                chosen[face] = type(e)
                continue
        warned = any(issubclass(w.category, UnverifiedWeightsWarning) for w in caught)
        assert ("the same" in why) == (not warned and "compared" in why), why  # "the same" only when verified
        chosen[face] = Path(why.split(":")[0]).name + ("+warned" if warned else "")
    return chosen


def _fabric_source(directory: Path, config, options: LoadOptions) -> str:
    import lightning as L

    from lightning_lowmem import LowMemStrategy

    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=LowMemStrategy(options=options), precision="32-true")
    with fabric.init_module():
        from litgpt import GPT

        model = GPT(config)
    fabric.load_raw(directory, model)
    return fabric.strategy.reports[-1].source


def _callback_source(directory: Path, config, options: LoadOptions) -> str:
    import lightning as L
    from litgpt import GPT

    from lightning_lowmem import LowMemCallback

    class Lit(L.LightningModule):
        def configure_model(self) -> None:
            self.model = GPT(config)

        def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(batch)

    callback = LowMemCallback(directory, options=options)
    L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[callback], enable_progress_bar=False,
              enable_model_summary=False).predict(Lit(), torch.utils.data.DataLoader(torch.zeros(1, 4, dtype=torch.long)))
    return callback.report.source


def _inspect_source(main, directory: Path, capsys, options: dict) -> str:
    flags = ["--weights", options["prefer"]] if options.get("prefer") else []
    flags += ["--verify_weight_sets"] if options.get("verify_weight_sets") else []
    code = main(["inspect", str(directory), "--json", *flags])
    out = capsys.readouterr()
    if code != 0:
        if "AmbiguousCheckpointError" in out.err:
            raise AmbiguousCheckpointError(out.err)
        raise AssertionError(out.err)
    return json.loads(out.out)["chosen"]


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
@pytest.mark.parametrize("same", [True, False], ids=["same", "different"])
def test_every_face_reads_the_same_weights_or_raises_the_same_error(tmp_path, states, capsys, first, second, same):
    directory = _directory(tmp_path, states, first, second, same)
    chosen = _every_face(directory, states, capsys)
    warned = "" if (first, second) in HUB else "+warned"
    expected = _expected(first, second) + warned if same else AmbiguousCheckpointError  # never "the same" unchecked
    assert chosen == dict.fromkeys(chosen, expected), chosen
    if same:  # every byte compared when asked: the same tensors, no warning
        verified = _every_face(directory, states, capsys, verify_weight_sets=True)
        assert verified == dict.fromkeys(chosen, _expected(first, second)), verified
    else:  # prefer= (--weights) picks either one, in every face
        for fmt in (first, second):
            name = FORMATS[fmt][0]
            assert _every_face(directory, states, capsys, prefer=name) == dict.fromkeys(chosen, name)


@pytest.mark.parametrize("first", ["safetensors-hf", "sharded-hf"])
def test_the_hubs_safetensors_beside_its_pytorch_model_bin_loads_quietly(tmp_path, states, first, capfd, caplog):
    """A directory as the Hub serves it: no warning, at most one line (a log record at INFO) naming the other file,
    and the report says what was read and that the rest was not; different samples still refuse."""
    import logging

    directory = _directory(tmp_path, states, first, "bin-hf", same=True)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        report = load_checkpoint(_meta(states["config"]), directory, progress=False)
    assert [w for w in caught if issubclass(w.category, UserWarning)] == []
    lines = [r.getMessage() for r in caplog.records if "pytorch_model.bin" in r.getMessage()]
    assert len(lines) <= 1 and all("\n" not in line for line in lines)
    assert report.source.startswith(str(directory / FORMATS[first][0])) and "pytorch_model.bin" in report.source
    assert "sampled bytes" in report.source and "every byte" in report.source
    (tmp_path / "other").mkdir()
    other = _directory(tmp_path / "other", states, first, "bin-hf", same=False)
    with pytest.raises(AmbiguousCheckpointError):
        load_checkpoint(_meta(states["config"]), other, progress=False)


def test_the_ambiguity_error_names_both_sets_the_difference_and_how_to_pick(tmp_path, states):
    directory = _directory(tmp_path, states, "lit", "safetensors-hf", same=False)
    with pytest.raises(AmbiguousCheckpointError) as error:
        estimate_memory(directory, max_seq_length=8)
    message = str(error.value)
    assert "model.safetensors and lit_model.pth" in message and "the values of" in message
    assert "prefer='lit_model.pth'" in message and "--weights lit_model.pth" in message


def test_a_stale_lit_model_beside_a_quantized_copy_is_not_read_silently(tmp_path, states, meta_gpt):
    """The reported case: an older ``lit_model.pth`` and, beside it, a newer quantized ``model.safetensors``
    (``save_checkpoint`` of the same weights quantized): different tensors, so no face reads either on its own."""
    from lightning_lowmem import save_checkpoint

    source = tmp_path / "source"
    source.mkdir()
    _write("lit", source, states["lit"])
    shutil.copy(states["config_dir"] / "model_config.yaml", source)
    model = meta_gpt(states["config"])
    load_checkpoint(model, source / "lit_model.pth", quantize="bnb.nf4", progress=False)
    save_checkpoint(model, source / "nf4")
    shutil.copy(source / "lit_model.pth", source / "nf4")
    with pytest.raises(AmbiguousCheckpointError, match=r"quantized \(bnb\.nf4\) in model\.safetensors"):
        generate(source / "nf4", [1, 2, 3], max_new_tokens=1)
    report = load_checkpoint(meta_gpt(states["config"]), source / "nf4", prefer="safetensors", progress=False)
    assert report.prequantized


@pytest.fixture(scope="module")
def wide(tmp_path_factory, write_hf_dir):
    """An HF Llama with MLP weights larger than the sample (128 KiB: compared by their first row), and its config."""
    root = tmp_path_factory.mktemp("wide")
    _, config = write_hf_dir(root, "llama", hidden=128, tokenizer=False)
    from safetensors.torch import load_file

    return load_file(root / "model.safetensors"), config, root


def _rows_past_the_first(tmp_path: Path, wide) -> Path:
    """model.safetensors, and a pytorch_model.bin differing in every row of one weight but the first."""
    hf, _, root = wide
    other = dict(hf)
    weight = other["model.layers.0.mlp.gate_proj.weight"].clone()
    weight[1:] += 1
    other["model.layers.0.mlp.gate_proj.weight"] = weight
    return _hf_pair(tmp_path, root, hf, other)


def _last_element(tmp_path: Path, wide) -> Path:
    """model.safetensors, and a pytorch_model.bin differing in the last element of one weight."""
    hf, _, root = wide
    other = dict(hf)
    weight = other["model.layers.1.mlp.down_proj.weight"].clone()
    weight.view(-1)[-1] += 1
    other["model.layers.1.mlp.down_proj.weight"] = weight
    return _hf_pair(tmp_path, root, hf, other)


def _hf_pair(tmp_path: Path, root: Path, first: dict, second: dict) -> Path:
    directory = tmp_path / "pair"
    directory.mkdir(parents=True)
    for name in ("model_config.yaml", "config.json"):
        shutil.copy(root / name, directory)
    save_file(first, directory / "model.safetensors")
    torch.save(second, directory / "pytorch_model.bin")
    return directory


def test_sets_that_differ_past_the_sample_are_read_with_a_warning_or_refused_when_verified(tmp_path, wide, capsys):
    """Every row of a weight but the first, or the last element of a pytorch_model.bin: the headers and the sampled
    first rows agree. No face says "the same": each reads model.safetensors (the documented order, and the Hub's:
    quietly, as from_pretrained reads it, the report saying the rest was unread); asked to compare every byte, each
    refuses, naming the tensor."""
    for case in (_rows_past_the_first, _last_element):
        directory = case(tmp_path / case.__name__, wide)
        states = {"config": wide[1]}
        assert _every_face(directory, states, capsys, callback=True) == dict.fromkeys(
            ["load_checkpoint", "estimate_memory", "generate", "fabric", "inspect", "callback"], "model.safetensors")
        verified = _every_face(directory, states, capsys, callback=True, verify_weight_sets=True)
        assert set(verified.values()) == {AmbiguousCheckpointError}, verified
    with pytest.raises(AmbiguousCheckpointError, match=r"the bytes of 'transformer\.h\.1\.mlp\.proj\.weight' differ"):
        load_checkpoint(_meta(wide[1]), directory, verify_weight_sets=True, progress=False)


def test_sets_holding_the_same_tensors_load_and_are_called_the_same_only_when_every_byte_was_compared(tmp_path,
                                                                                                     wide, caplog):
    hf, config, root = wide
    directory = _hf_pair(tmp_path, root, hf, hf)
    report = load_checkpoint(_meta(config), directory, progress=False)  # the Hub's pair: no warning
    assert "the same" not in report.source and "the rest unread" in report.source
    shutil.copy(directory / "pytorch_model.bin", directory / "lit_model.pth")  # another pair: a warning
    with pytest.warns(UnverifiedWeightsWarning, match=r"prefer='model\.safetensors' \(command line: --weights "
                                                      r"model\.safetensors\).*verify_weight_sets=True"):
        report = load_checkpoint(_meta(config), directory, progress=False)
    assert "the same" not in report.source and "not compared byte for byte" in report.source
    (directory / "lit_model.pth").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnverifiedWeightsWarning)
        with caplog.at_level("INFO", logger="lightning_lowmem"):
            report = load_checkpoint(_meta(config), directory, verify_weight_sets=True, progress=False)
        report_pinned = load_checkpoint(_meta(config), directory, prefer="model.safetensors", progress=False)
    nbytes = sum(t.nbytes for t in hf.values())
    assert "pytorch_model.bin in" in report.source and "holds the same tensors (every byte compared" in report.source
    assert any("the same" in r.message and "compared" in r.message for r in caplog.records)
    assert report.source.startswith(str(directory / "model.safetensors")) and nbytes > 2**20
    assert report_pinned.source.endswith(f"chosen as asked ('model.safetensors') among the 2 weight sets in {directory}")


def _meta(config):
    from lightning_lowmem.litgpt.checkpoint_dir import build_meta_gpt

    return build_meta_gpt(config)


def test_litgpt_files_differing_only_in_the_fused_qkv_are_never_called_the_same(tmp_path, states, capsys):
    """lit_model.pth beside an HF model.safetensors whose q projection differs: litgpt's qkv is built from q, k, v, so
    no sample covers it. Every face reads lit_model.pth with a warning; asked to compare every byte, every face
    refuses, naming the fused tensor."""
    other = dict(states["hf"])
    other["model.layers.0.self_attn.q_proj.weight"] = other["model.layers.0.self_attn.q_proj.weight"] + 1
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for name in ("model_config.yaml", "config.json"):
        shutil.copy(states["config_dir"] / name, directory)
    _write("lit", directory, states["lit"])
    _write("safetensors-hf", directory, other)
    assert _every_face(directory, states, capsys, callback=True) == dict.fromkeys(
        ["load_checkpoint", "estimate_memory", "generate", "fabric", "inspect", "callback"], "lit_model.pth+warned")
    verified = _every_face(directory, states, capsys, callback=True, verify_weight_sets=True)
    assert set(verified.values()) == {AmbiguousCheckpointError}, verified
    with pytest.raises(AmbiguousCheckpointError, match=r"the bytes of 'transformer\.h\.0\.attn\.qkv\.weight' differ"):
        load_checkpoint(_meta(states["config"]), directory, verify_weight_sets=True, progress=False)


def test_two_nf4_saves_differing_only_in_their_linear_weights_are_never_called_the_same(tmp_path, states, meta_gpt):
    """Two fine-tunes of one base saved in nf4: their norms and embeddings agree, every Linear weight is stored
    quantized (no sample is taken of it). Read with a warning, or refused when every byte is compared."""
    from lightning_lowmem import save_checkpoint

    base = tmp_path / "base"
    base.mkdir()
    _write("lit", base, states["lit"])
    tuned = {k: v + 0.5 if k.endswith(("qkv.weight", "fc_1.weight")) else v for k, v in states["lit"].items()}
    (tmp_path / "tuned").mkdir()
    _write("lit", tmp_path / "tuned", tuned)
    for source, out in ((base, tmp_path / "one"), (tmp_path / "tuned", tmp_path / "two")):
        model = meta_gpt(states["config"])
        load_checkpoint(model, source / "lit_model.pth", quantize="bnb.nf4", progress=False)
        save_checkpoint(model, out)
    shutil.copy(tmp_path / "two" / "model.safetensors", tmp_path / "one" / "finetune.safetensors")
    with pytest.warns(UnverifiedWeightsWarning, match="finetune.safetensors may hold other values"):
        report = load_checkpoint(meta_gpt(states["config"]), tmp_path / "one", progress=False)
    assert report.prequantized and "the same" not in report.source
    with pytest.raises(AmbiguousCheckpointError, match=r"the bytes of 'transformer\.h\.0\.attn\.qkv\.weight' "
                                                       r"\(\w+\) differ"):
        load_checkpoint(meta_gpt(states["config"]), tmp_path / "one", verify_weight_sets=True, progress=False)


def test_a_stale_index_is_no_error_when_prefer_names_a_good_set(tmp_path, states, meta_gpt):
    """An index left from an older save names shards that are gone: prefer= naming the set that is there reads it;
    without prefer=, the error says the shards are missing and how to read the other set."""
    from lightning_lowmem import CheckpointNotFoundError

    directory = tmp_path / "ckpt"
    directory.mkdir()
    _write("lit", directory, states["lit"])
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    report = load_checkpoint(meta_gpt(states["config"]), directory, prefer="lit_model.pth", progress=False)
    assert report.source.endswith("chosen as asked ('lit_model.pth') among the 2 weight sets in " + str(directory))
    with pytest.raises(CheckpointNotFoundError, match=r"missing.*Or read another weight set.*prefer='lit_model\.pth'"):
        load_checkpoint(meta_gpt(states["config"]), directory, progress=False)


def test_a_stray_tensor_file_beside_the_weights_is_left_out_with_a_warning(tmp_path, states, meta_gpt):
    """A ``.pt`` holding one tensor (no state dict) beside model.safetensors: not a weight set. The weights that are
    there load, and the warning names the file (no advice to save a state_dict() instead)."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    _write("lit", directory, states["lit"])
    torch.save(torch.randn(3), directory / "stray.pt")
    with pytest.warns(UserWarning, match=r"stray\.pt holds a TensorRef.*not one of the weight sets.*left out"):
        report = load_checkpoint(meta_gpt(states["config"]), directory, progress=False)
    assert report.source == f"{directory / 'lit_model.pth'}: the only weights in {directory} (the other files there " \
                            "hold no state dict)"


@pytest.mark.parametrize("stale_head", [False, True])
def test_a_tied_head_saved_once_and_saved_twice_is_one_weight_set(tmp_path, stale_head):
    """transformers' save_pretrained writes a tied head once (model.safetensors has no lm_head.weight); a
    torch.save of the state dict beside it writes it twice. The sets are the same tensors when the copy equals
    the embedding (both ways of comparing), and different when it does not."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from lightning_lowmem import init_empty

    config = GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=300, n_positions=32)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if stale_head:
        state["lm_head.weight"][7, 5] += 1  # sampled bytes may miss it; every byte compared does not
    torch.save(state, tmp_path / "pytorch_model.bin")
    for verify in (False, True):
        with init_empty():
            loaded = GPT2LMHeadModel(config)
        if stale_head and verify:
            with pytest.raises(AmbiguousCheckpointError, match="lm_head.weight"):
                load_checkpoint(loaded, tmp_path, verify_weight_sets=True, progress=False)
            continue
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            report = load_checkpoint(loaded, tmp_path, verify_weight_sets=verify, progress=False)
        assert report.source.startswith(str(tmp_path / "model.safetensors"))
        assert ("every byte compared" in report.source) is verify
        assert loaded.lm_head.weight is loaded.transformer.wte.weight
        for key, value in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], value), key
