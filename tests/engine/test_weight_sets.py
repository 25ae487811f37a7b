"""A directory of several weight sets: every face reads the same one, or raises the same error.

Every pair of the weight formats users have side by side (litgpt's ``lit_model.pth``, HF's ``model.safetensors``,
``pytorch_model.bin`` and a sharded set, a Lightning ``.ckpt``), holding the same tensors or different ones:
``load_checkpoint``, ``estimate_memory``, ``lightning-lowmem inspect`` and ``generate`` choose the same file, or
all raise ``AmbiguousCheckpointError``; ``prefer=`` / ``--weights`` picks one.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lightning_lowmem import AmbiguousCheckpointError, LoadOptions, estimate_memory, generate, load_checkpoint

FORMATS = {  # name: (the file a load opens, names: litgpt's or HF's, rank in the documented order)
    "sharded-hf": ("model.safetensors.index.json", "hf", 0),
    "safetensors-hf": ("model.safetensors", "hf", 2),
    "lit": ("lit_model.pth", "lit", 4),
    "bin-hf": ("pytorch_model.bin", "hf", 7),
    "ckpt": ("last.ckpt", "lit", 11),
}
PAIRS = list(itertools.combinations(FORMATS, 2))


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


def _every_face(directory: Path, states: dict, capsys, **prefer) -> dict[str, str | type]:
    """Which file each face reads (its report's first words), or the type of the error it raises."""
    from lightning_lowmem.cli.commands import main
    from lightning_lowmem.litgpt.checkpoint_dir import build_meta_gpt

    options = LoadOptions(progress=False, **prefer)
    faces = {
        "load_checkpoint": lambda: load_checkpoint(build_meta_gpt(states["config"]), directory, options=options).source,
        "estimate_memory": lambda: estimate_memory(directory, max_seq_length=8, options=options).source,
        "generate": lambda: generate(directory, [1, 2, 3], max_new_tokens=1, options=options).load_report.source,
    }
    chosen: dict[str, str | type] = {}
    for face, call in faces.items():
        try:
            chosen[face] = Path(call().split(":")[0]).name
        except AmbiguousCheckpointError as e:
            chosen[face] = type(e)
    weights = ["--weights", prefer["prefer"]] if prefer else []
    code = main(["inspect", str(directory), "--json", *weights])
    out = capsys.readouterr()
    chosen["inspect"] = Path(json.loads(out.out)["chosen"].split(":")[0]).name if code == 0 else \
        AmbiguousCheckpointError if "AmbiguousCheckpointError" in out.err else out.err
    return chosen


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
@pytest.mark.parametrize("same", [True, False], ids=["same", "different"])
def test_every_face_reads_the_same_weights_or_raises_the_same_error(tmp_path, states, capsys, first, second, same):
    directory = _directory(tmp_path, states, first, second, same)
    chosen = _every_face(directory, states, capsys)
    expected = _expected(first, second) if same else AmbiguousCheckpointError
    assert chosen == dict.fromkeys(chosen, expected), chosen
    if not same:  # prefer= (--weights) picks either one, in every face
        for fmt in (first, second):
            name = FORMATS[fmt][0]
            assert _every_face(directory, states, capsys, prefer=name) == dict.fromkeys(chosen, name)


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
