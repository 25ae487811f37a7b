"""``lightning-lowmem inspect``: what a checkpoint holds and whether it fits its config, from headers alone."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

from lightning_lowmem.cli import main


@pytest.mark.slow
def test_a_good_checkpoint_matches_its_config(run_cli, tmp_path, tiny_config, write_litgpt_dir):
    directory = write_litgpt_dir(tmp_path / "tiny", tiny_config(), torch.bfloat16, tokenizer=False)
    state = torch.load(directory / "lit_model.pth")
    proc = run_cli("inspect", directory)
    assert proc.returncode == 0, proc.stderr
    for line in ("format      torch zip", f"tensors     {len(state)}", "dtypes      bfloat16",
                 "config      litgpt 'pythia-tiny' (from model_config.yaml): matches"):
        assert line in proc.stdout, proc.stdout

    got = json.loads(run_cli("inspect", directory / "lit_model.pth", "--json").stdout)
    assert got["tensors"] == len(state) and got["bytes"] == sum(t.nbytes for t in state.values())
    assert got["dtypes"] == {"bfloat16": {"tensors": len(state), "bytes": got["bytes"]}}
    assert got["format"] == "torch zip" and got["entry"] == ""
    assert got["config"] == {"name": "pythia-tiny", "source": "model_config.yaml", "family": "litgpt", "matches": True,
                             "conversion": "none: litgpt's own names", "tensors": len(state), "error": None,
                             "error_type": None}


def test_a_lightning_checkpoint_names_its_entry(tmp_path, tiny_config, tiny_gpt, write_checkpoint, capsys):
    path = write_checkpoint(tiny_gpt(tiny_config()).state_dict(), "lightning", tmp_path)
    assert main(["inspect", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["entry"] == "state_dict" and got["config"] is None and "pass --config" in got["config_note"]
    assert main(["inspect", str(path), "--config", str(_yaml(tmp_path, tiny_config()))]) == 0
    assert "weights under 'state_dict'" in capsys.readouterr().out


def test_a_corrupt_file_is_its_typed_error_and_exit_1(run_cli, tmp_path, tiny_config, tiny_gpt):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file(tiny_gpt(tiny_config()).state_dict(), path)
    path.write_bytes(path.read_bytes()[:-1000])  # truncated
    proc = run_cli("inspect", path)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("error: CheckpointFormatError: ") and "Traceback" not in proc.stderr


def test_a_checkpoint_that_does_not_fit_names_the_key_and_both_shapes(run_cli, tmp_path, tiny_config,
                                                                      write_litgpt_dir):
    directory = write_litgpt_dir(tmp_path / "tiny", tiny_config(), tokenizer=False)  # an MLP of 128
    (directory / "model_config.yaml").write_text(yaml.safe_dump(
        {**yaml.safe_load((directory / "model_config.yaml").read_text()), "intermediate_size": 96}))
    proc = run_cli("inspect", directory)
    assert proc.returncode == 1
    assert "does not match (CheckpointMismatchError" in proc.stdout and "tensors     " in proc.stdout
    assert "error: CheckpointMismatchError: " in proc.stderr
    assert "\n  'transformer.h.0.mlp.fc.weight': checkpoint [128, 32], module [96, 32]\n" in proc.stderr


def test_missing_and_unexpected_keys_as_the_load_says_them(tmp_path, tiny_config, write_litgpt_dir, read_recorder,
                                                           capsys):
    directory = write_litgpt_dir(tmp_path / "cut", tiny_config(), tokenizer=False)
    state = torch.load(directory / "lit_model.pth")
    state["transformer.extra.weight"] = state.pop("transformer.h.1.attn.proj.weight")
    torch.save(state, directory / "lit_model.pth")
    assert main(["inspect", str(directory)]) == 1
    err = capsys.readouterr().err
    assert "1 module tensors are missing from it:\n  'transformer.h.1.attn.proj.weight'" in err
    assert "1 checkpoint keys have no place in the module:\n  'transformer.extra.weight'" in err
    assert read_recorder.keys == []  # headers only


def _yaml(tmp_path, config):
    from litgpt.utils import save_config

    directory = tmp_path / "config"
    directory.mkdir()
    save_config(config, directory)
    return directory / "model_config.yaml"


def test_a_gguf_file_with_its_config_from_the_file(tiny_gguf, capsys):
    from lightning_lowmem.formats import Checkpoint

    path = tiny_gguf["Q8_0"]
    assert main(["inspect", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    with Checkpoint.open(path) as ckpt:
        stored = sum(r.nbytes for r in ckpt.records.values())
        assert got["tensors"] == len(ckpt.records)
    assert got["format"] == "GGUF" and got["bytes"] == stored < path.stat().st_size
    assert got["config"]["source"] == "the GGUF file's metadata" and got["config"]["matches"], got["config"]


def test_a_gguf_file_s_tensor_types_as_stored(tiny_gguf, capsys):
    path = tiny_gguf["Q4_0"]
    assert main(["inspect", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    q4_0 = 18 / 32  # bytes per element: an fp16 scale and 32 4-bit codes per block
    elements = 303 * 64 * 2 + 2 * (64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 3)  # embedding, head, 2 x 7 weights
    assert got["dtypes"] == {"Q4_0": {"tensors": 16, "bytes": elements * q4_0}, "F32": {"tensors": 5, "bytes": 5 * 64 * 4}}
    assert main(["inspect", str(path)]) == 0
    assert "dtypes      Q4_0: 16 tensors" in capsys.readouterr().out


HEADERS_ONLY = textwrap.dedent(
    """
    import json, sys, time
    import torch, litgpt, litgpt.config, transformers, transformers.modeling_gguf_pytorch_utils, gguf  # the imports
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    from transformers.integrations import ggml
    from lightning_lowmem import MemoryMonitor
    from lightning_lowmem.cli import main
    import lightning_lowmem.cli.estimate, lightning_lowmem.cli.inspect_checkpoint, lightning_lowmem.litgpt.gguf
    start = time.perf_counter()
    with MemoryMonitor() as mon:
        code = main(sys.argv[1:])
    print(json.dumps({"code": code, "seconds": time.perf_counter() - start, "delta": mon.usage.rss_peak_delta}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["inspect", "estimate"])
def test_inspect_and_estimate_of_a_smollm_sized_gguf_read_headers_only(smollm_gguf, child_env, command):
    """An 82 MiB SmolLM2-135M-shaped file (a 49k-token vocabulary and its merges in the header), in a fresh process,
    its imports done first. Measured (2 shared cores): +11..+16 MiB and 0.6-1.5 s after the imports (where
    transformers' parser, a name map built per submodule and a float32 read of the embedding took +540 MiB and
    15-35 s); bounds: +64 MiB, and 10 s for a machine shared with other work."""
    proc = subprocess.run([sys.executable, "-c", HEADERS_ONLY, command, str(smollm_gguf), "--json"],
                          capture_output=True, text=True, env=child_env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    got = json.loads(lines[-1])
    assert got["code"] == 0 and got["delta"] < 64 * 2**20 and got["seconds"] < 10.0, got
    if command == "inspect":
        summary = json.loads("\n".join(lines[:-1]))
        assert summary["config"]["name"] == "SmolLM2-135M-Instruct" and summary["config"]["matches"]
        assert set(summary["dtypes"]) == {"Q4_1", "F32"}


@pytest.mark.parametrize("content", ["n_layer: [1, 2\nname: x:\n  - :", "- 1\n- 2\n", "", "n_layers_typo: 3\n",
                                     "name: !!python/object/apply:os.system ['touch {marker}']\n", "n_layer: 2\x00\n"],
                         ids=["syntax", "list", "empty", "unknown field", "python tag", "nul byte"])
def test_a_broken_model_config_is_one_line_naming_the_file(run_cli, tmp_path, tiny_config, write_litgpt_dir, content):
    """A model_config.yaml that litgpt's Config.from_file cannot read showed yaml's or Config's traceback."""
    directory = write_litgpt_dir(tmp_path / "tiny", tiny_config(), tokenizer=False)
    marker = tmp_path / "ran"
    (directory / "model_config.yaml").write_text(content.format(marker=marker))
    args = ["inspect", directory] if content else ["inspect", directory / "lit_model.pth", "--config",
                                                  directory / "model_config.yaml"]  # the flag, once
    proc = run_cli(*args)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(
        f"error: CheckpointFormatError: {directory / 'model_config.yaml'} is not a litgpt config ("), proc.stderr
    assert "It must be a YAML mapping of litgpt Config's fields" in proc.stderr
    assert not marker.exists()


class _View:
    """A tensor viewed with a negative stride: in the pickle's arguments, or set after it is built (a BUILD)."""

    def __init__(self, build: bool) -> None:
        self.build = build

    def __reduce__(self):
        storage = torch.arange(8.0)._typed_storage()
        if self.build:
            return (torch._utils._rebuild_tensor_v2, (storage, 0, (4,), (1,), False, collections.OrderedDict()),
                    {"stride": (-1,)})
        return (torch._utils._rebuild_tensor_v2, (storage, 0, (4,), (-1,), False, collections.OrderedDict()))


@pytest.mark.parametrize("build", [False, True], ids=["arguments", "build state"])
def test_a_negative_stride_pth_is_exit_1_with_one_line(run_cli, tmp_path, tiny_config, write_litgpt_dir, build):
    directory = write_litgpt_dir(tmp_path / "tiny", tiny_config(), tokenizer=False)
    state = torch.load(directory / "lit_model.pth")
    torch.save({**state, "transformer.ln_f.bias": _View(build)}, directory / "lit_model.pth")
    proc = run_cli("inspect", directory)
    assert proc.returncode == 1 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and "'transformer.ln_f.bias'" in proc.stderr
    assert proc.stderr.startswith("error: UnsafeCheckpointError: " if build else "error: CheckpointFormatError: ")


def test_a_config_with_far_more_layers_than_the_file_fails_before_building_a_model(run_cli, tmp_path, tiny_config,
                                                                                  write_litgpt_dir):
    """n_layer: 100000000 beside a 1-layer checkpoint built a model on meta from the config first: minutes and
    past 1.9 GiB. The counts are checked against the file's tensors before."""
    directory = write_litgpt_dir(tmp_path / "tiny", tiny_config(n_layer=1), tokenizer=False)
    config = yaml.safe_load((directory / "model_config.yaml").read_text())
    (directory / "model_config.yaml").write_text(yaml.safe_dump({**config, "n_layer": 100_000_000}))
    proc = run_cli("inspect", directory, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert ("error: CheckpointMismatchError: The litgpt config says n_layer: 100000000, but the checkpoint's tensors "
            "hold 1 block (transformer.h.0)") in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("kind, cls, shard", [("bert", "BertModel", "40KB"), ("t5", "T5ForConditionalGeneration", None)])
def test_any_transformers_model_is_inspected_and_estimated_from_its_config_json(run_cli, tmp_path,
                                                                              write_transformers_dir, kind, cls, shard):
    """A model litgpt does not convert (BERT, sharded; T5, tied): built on meta from config.json by transformers'
    classes, its fit told as for a litgpt model; estimate counts that model."""
    directory = tmp_path / kind
    write_transformers_dir(directory, kind, max_shard_size=shard)
    proc = run_cli("inspect", directory)
    assert proc.returncode == 0, proc.stderr
    assert f"config      transformers '{cls}' (from config.json): matches" in proc.stdout
    assert "litgpt" not in proc.stdout + proc.stderr
    est = run_cli("estimate", directory, "--quantize", "bnb.nf4", "--json")
    assert est.returncode == 0, est.stderr
    got = json.loads(est.stdout)
    assert got["model"] == cls and got["weights"] > 0 and "guessed" not in " ".join(got["notes"])


def test_a_transformers_checkpoint_missing_a_tensor_does_not_match(run_cli, tmp_path, write_transformers_dir):
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "bert"
    write_transformers_dir(directory, "bert")
    state = load_file(directory / "model.safetensors")
    del state["encoder.layer.1.output.dense.weight"]
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    proc = run_cli("inspect", directory)
    assert proc.returncode == 1 and "config      transformers 'BertModel' (from config.json): does not match" \
        in proc.stdout
    assert "encoder.layer.1.output.dense.weight" in proc.stderr


def test_a_set_picked_by_weights_is_said_to_be_picked_among_the_sets(tmp_path, tiny_config, write_litgpt_dir, capsys):
    """A directory of two different weight sets, one named by --weights: not "the only weights" in it."""
    from safetensors.torch import save_file

    directory = write_litgpt_dir(tmp_path / "tiny", tiny_config(), torch.bfloat16, tokenizer=False)
    save_file({k: v.float() for k, v in torch.load(directory / "lit_model.pth").items()},
              directory / "model.safetensors")
    assert main(["inspect", str(directory), "--weights", "model.safetensors"]) == 0
    out = capsys.readouterr().out
    assert f"{directory / 'model.safetensors'}: chosen as asked ('model.safetensors') among the 2 weight sets in " \
           f"{directory}" in out and "the only weights" not in out, out
