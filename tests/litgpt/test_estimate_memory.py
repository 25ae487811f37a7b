"""estimate_memory: from headers or a config, equal to what is allocated and loaded, never under a measured peak and at
most 10% over it.

Every size is checked against an independent outcome: what ``setup_kv_cache`` allocates, what the loader
holds (``LoadReport``), what the placement plan reserves, or a peak measured in a fresh process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_lowmem import (
    UnsupportedQuantizationError,
    cache_bytes,
    estimate_memory,
    load_checkpoint,
    placement_plan,
    setup_kv_cache,
)


def test_unknown_scheme(tiny_config):
    with pytest.raises(UnsupportedQuantizationError, match="bnb.nf5"):
        estimate_memory(tiny_config("gqa"), quantize="bnb.nf5")


@pytest.mark.parametrize("kind", ["pythia", "gqa", "sliding"])
@pytest.mark.parametrize("batch", [1, 2])
def test_caches_equal_what_setup_kv_cache_allocates(tiny_config, tiny_gpt, eager_gpt, meta_gpt, kind, batch):
    config = tiny_config(kind)
    est = estimate_memory(config, batch_size=batch, max_seq_length=30, prompt_length=10)
    model = eager_gpt(tiny_gpt(config, std=0.3), torch.bfloat16)  # RoPE tables in bf16, as generate has them
    assert setup_kv_cache(model, batch, 30) == est.caches
    held = cache_bytes(model)
    assert (est.kv_cache, est.mask, est.rope) == (held.kv, held.mask, held.rope)
    plan = placement_plan(meta_gpt(config), None, {"cpu": "8GiB"}, context=30, batch_size=batch,
                          dtype=torch.bfloat16)
    assert plan.cache_bytes == est.caches


@pytest.mark.parametrize("kind", ["pythia", "gqa", "sliding"])
def test_placement_and_estimate_reserve_the_same_cache_bytes(tiny_config, meta_gpt, kind):
    config = tiny_config(kind, block_size=256)
    est = estimate_memory(config, max_seq_length=200, dtype=torch.bfloat16)
    plan = placement_plan(meta_gpt(config), None, {"cpu": "8GiB"}, context=200, dtype=torch.bfloat16)
    assert plan.cache_bytes == est.caches


def test_weights_from_headers_equal_the_loaded_model(tmp_path, tiny_config, meta_gpt, write_litgpt_dir):
    config = tiny_config("gqa")
    directory = write_litgpt_dir(tmp_path / "fp32", config, torch.float32, tokenizer=False)
    est = estimate_memory(directory, dtype=torch.bfloat16, max_seq_length=16)
    model = meta_gpt(config, include_buffers=True)
    load_checkpoint(model, directory / "lit_model.pth", dtype=torch.bfloat16)
    assert est.weights == sum(p.numel() * p.element_size() for p in model.parameters())
    assert est.weights == estimate_memory(config, max_seq_length=16).weights  # headers == config


@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4-dq", "bnb.int8", "torchao.int8wo",
                                    "torchao.int8dq"])
def test_quantized_weights_equal_what_the_loader_holds(tmp_path, tiny_config, tiny_gpt, meta_gpt, scheme):
    from lightning_lowmem.quantize import module_nbytes

    config = tiny_config("gqa", n_embd=128, intermediate_size=256)
    reference = tiny_gpt(config, std=0.3)
    torch.save(reference.state_dict(), tmp_path / "lit_model.pth")
    model = meta_gpt(config, include_buffers=True)
    report = load_checkpoint(model, tmp_path / "lit_model.pth", dtype=torch.bfloat16, quantize=scheme)
    est = estimate_memory(tmp_path / "lit_model.pth", config=config, quantize=scheme, max_seq_length=16)
    assert est.quantized_weights == report.quantized_bytes_after
    assert est.weights == module_nbytes(model) == report.bytes_loaded
    assert est.quantized_params * 2 == report.quantized_bytes_before  # the bf16 bytes of the weights quantized
    linears = sum(isinstance(m, torch.nn.Linear) and n != "lm_head" for n, m in reference.named_modules())
    assert len(report.quantized) == linears == 10  # attn.qkv, attn.proj, mlp.fc_1/fc_2/proj x 2


def test_hf_headers_through_litgpts_key_conversion(tmp_path, tiny_config):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, rotary_pct=0.25, tie_word_embeddings=False)
                       ).save_pretrained(tmp_path / "neox")
    config = tiny_config("pythia", vocab_size=128)
    from_hf = estimate_memory(tmp_path / "neox", config=config, quantize="bnb.nf4", max_seq_length=20)
    assert from_hf.params == estimate_memory(config, max_seq_length=20).params
    assert from_hf.weights == estimate_memory(config, quantize="bnb.nf4", max_seq_length=20).weights


@pytest.mark.parametrize("tie", [False, True], ids=["lm_head", "tied"])
def test_hf_fused_qkv_headers_equal_what_the_load_holds(tmp_path, write_hf_dir, tie):
    """q, k and v fused into qkv (sizes from the headers); a head the checkpoint lacks is the embedding, held once."""
    from lightning_lowmem.litgpt.generation import load_for_generation

    _, config = write_hf_dir(tmp_path / "llama", "llama-gqa", hidden=64, tie=tie, tokenizer=False)
    _, _, report = load_for_generation(tmp_path / "llama", quantize="bnb.nf4", precision="bf16-true")
    est = estimate_memory(tmp_path / "llama", quantize="bnb.nf4", max_seq_length=20)
    assert est.quantized_weights == report.quantized_bytes_after and est.weights == report.bytes_loaded
    untied = estimate_memory(config, quantize="bnb.nf4", max_seq_length=20)
    assert est.params == untied.params - (config.padded_vocab_size * config.n_embd if tie else 0)


def test_without_a_config_weights_only_and_a_note(tmp_path, tiny_config, tiny_gpt):
    torch.save(tiny_gpt(tiny_config("gqa")).state_dict(), tmp_path / "model.pt")
    est = estimate_memory(tmp_path / "model.pt")
    assert est.weights > 0 and est.kv_cache == 0 and "not estimated" in str(est)


def test_past_the_block_size_and_the_table(tiny_config):
    with pytest.raises(ValueError, match="block size"):
        estimate_memory(tiny_config("gqa"), max_seq_length=65)
    table = str(estimate_memory(tiny_config("gqa"), max_seq_length=40, prompt_length=8))
    for label in ("weights", "KV cache (1 x 40 positions)", "mask", "RoPE", "load transient", "peak"):
        assert label in table


@pytest.mark.parametrize(("arguments", "error", "match"), [
    ({"max_seq_length": 0}, ValueError, "max_seq_length must be an int >= 1 or None, got 0"),
    ({"max_seq_length": 40.0}, TypeError, "max_seq_length must be an int >= 1 or None, got 40.0"),
    ({"prompt_length": -8}, ValueError, "prompt_length must be an int >= 1 or None, got -8"),
    ({"prompt_length": True}, TypeError, "prompt_length must be an int"),
    ({"max_seq_length": 8, "prompt_length": 40}, ValueError, "prompt_length=40 is above max_seq_length=8"),
    ({"runtime": -1}, ValueError, "runtime must be an int >= 0, got -1"),
    ({"read_bandwidth": 0}, ValueError, "read_bandwidth must be a finite number > 0.0 or None, got 0"),
    ({"read_bandwidth": float("nan")}, ValueError, "read_bandwidth must be a finite number"),
])
def test_the_estimates_own_arguments_are_checked(tiny_config, arguments, error, match):
    with pytest.raises(error, match=match):
        estimate_memory(tiny_config("gqa"), **arguments)


@pytest.mark.parametrize("scheme", ["bnb.nf4", "bnb.int8"])
def test_a_library_import_transformers_holds_already_is_not_counted_twice(tmp_path, write_transformers_dir, tiny_config,
                                                                           tiny_gpt, scheme):
    """A model transformers built has imported transformers' classes, which import part of what bitsandbytes
    imports: the estimate counts only the rest of the library's import. A litgpt model read from lit_model.pth
    counts the whole import."""
    from lightning_lowmem.quantize.schemes import make_scheme

    library = make_scheme(scheme)
    write_transformers_dir(tmp_path / "bert", "bert")
    beside = estimate_memory(tmp_path / "bert", quantize=scheme)
    torch.save(tiny_gpt(tiny_config("pythia")).state_dict(), tmp_path / "lit_model.pth")
    alone = estimate_memory(tmp_path / "lit_model.pth", config=tiny_config("pythia"), quantize=scheme,
                            max_seq_length=20)
    assert alone.library_import == library.library_import_bytes and alone.library == library.library_bytes
    shared = library.library_import_in_transformers
    assert 0 < shared <= library.library_import_bytes
    assert (beside.library_import, beside.library) == (library.library_import_bytes - shared,
                                                       library.library_bytes - shared)
    assert ("importing" in " ".join(beside.notes)) == (beside.library_import > 0)
    assert f"importing {scheme}'s library" in " ".join(alone.notes)


_IMPORTS = """
import json, sys
def rss():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
import torch, litgpt, lightning, lightning_lowmem
if sys.argv[2] == "beside":
    import transformers
    from transformers.models.bert import modeling_bert
before = rss()
__import__(sys.argv[1])
print(json.dumps(rss() - before))
"""


@pytest.mark.slow
@pytest.mark.parametrize("scheme,module", [("bnb.nf4", "bitsandbytes.functional"), ("torchao.int8wo",
                                                                                        "torchao.quantization")])
def test_a_library_import_is_at_most_what_the_estimate_counts_alone_and_beside_transformers(child_env, scheme,
                                                                                            module):
    """Measured in fresh processes: importing the scheme's library after torch, litgpt and Lightning adds at most
    ``library_import_bytes``; after transformers' model classes, at most that less
    ``library_import_in_transformers``."""
    import json
    import subprocess
    import sys

    from lightning_lowmem.quantize.schemes import make_scheme

    library = make_scheme(scheme)
    for where, counted in (("alone", library.library_import_bytes),
                           ("beside", library.library_import_bytes - library.library_import_in_transformers)):
        proc = subprocess.run([sys.executable, "-c", _IMPORTS, module, where], capture_output=True, text=True,
                              env=child_env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        added = json.loads(proc.stdout.strip().splitlines()[-1])
        assert added <= counted, (where, added / 2**20, counted / 2**20)


@pytest.mark.slow
def test_estimate_is_not_under_the_measured_peak_and_within_10_percent(peak_model_dir, measure_in_fresh_process):
    """A 45M-parameter bf16 model (87 MiB), 64 + 50 tokens, lightning_lowmem.generate() in a fresh process. Within 10%
    less the term the estimate takes at its upper bound (the freed heap a generation may keep), as the table's test."""
    measured = measure_in_fresh_process(peak_model_dir, "entry-point")["model_peak"]
    est = estimate_memory(peak_model_dir, max_seq_length=114, prompt_length=64)
    assert measured <= est.peak and est.peak - est.heap <= 1.10 * measured, (measured, str(est))


SCHEMES = ("none", "bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8", "torchao.int8wo", "torchao.int8dq",
           "torchao.nf4")
"""Every scheme that runs on a CPU (benchmarks/estimate_accuracy.py's)."""


@pytest.mark.slow
@pytest.mark.parametrize("rows", ["sizes", "long generations"])
def test_the_estimate_is_never_under_the_peak_of_fresh_processes(tmp_path_factory, child_env, rows):
    """benchmarks/estimate_accuracy.py's rows, one fresh process per row. ``sizes``: those most at risk across the
    model sizes of the table (SmolLM2-135M's shapes from a bf16 lit_model.pth and from a Q4_1 GGUF file, pythia-160m's
    from a lit_model.pth, through generate(), 64 + 50 tokens: not quantized, bnb.nf4, bnb.int8, torchao.int8dq);
    ``long generations``: SmolLM2's lit_model.pth, 64 + 200 tokens, every scheme. Measured peak <= estimate, and the
    estimate less the terms it takes at their upper bound (the notes name them: a library's import, the freed heap a
    quantizing load may find and a generation keeps, transformers' classes) within 1.10 x measured. The whole table
    is docs/generation.md's."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    flags = (["--sources", "litgpt-bf16", "litgpt-gguf", "pythia-160m", "--schemes", "none", "bnb.nf4", "bnb.int8",
              "torchao.int8dq", "--long", "0"] if rows == "sizes" else
             ["--sources", "litgpt-bf16", "--schemes", *SCHEMES, "--long", "200", "--long-only"])
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "estimate_accuracy.py"), "--json", "--jobs", "1",
                           *flags, "--workdir", str(tmp_path_factory.mktemp("estimate-accuracy"))], capture_output=True,
                          text=True, env=child_env, timeout=5400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    assert len(measured) == (12 if rows == "sizes" else len(SCHEMES))
    assert not [row for row in measured if "error" in row["measured"]], measured
    table, failed = [], []
    for row in measured:
        for phase in ("load", "generate"):
            est, got, bound = row["estimate"][phase], row["measured"][phase], row["estimate"]["bounds"][phase]
            table.append(f"{row['source']:12} {row['scheme']:15} {row['new']:4} {phase:8} estimate {est / 2**20:7.1f} "
                         f"MiB (upper-bound terms {bound / 2**20:5.1f}), measured {got / 2**20:7.1f} MiB: "
                         f"{est / got:.3f}")
            if not got <= est or not est - bound <= 1.10 * got:
                failed.append(table[-1])
    assert not failed, "\n".join(["under the peak, or over it by more than its upper-bound terms + 10%:", *failed,
                                   "", "all:", *table])


def test_estimate_carries_the_placement_plan():
    """With max_memory the estimate prints where each layer goes, the same plan a load would use."""
    from litgpt import GPT, Config

    from lightning_lowmem import MemoryBudgetError, init_empty

    config = Config.from_name("pythia-160m")
    budget = {"cuda:0": "150MiB", "cpu": "4GiB"}
    est = estimate_memory(config, max_memory=budget, max_seq_length=128)
    assert est.placement is not None and est.placement.offloaded
    with init_empty():
        model = GPT(config)
    direct = placement_plan(model, None, budget, context=128, dtype=torch.bfloat16)
    assert est.placement.weights_per_device() == direct.weights_per_device()
    assert "cuda:0" in str(est) and "cpu" in str(est)
    with pytest.raises(MemoryBudgetError):
        estimate_memory(config, max_memory={"cuda:0": "1MiB", "cpu": "4GiB"}, max_seq_length=128)


def test_a_litgpt_model_name_is_its_config_and_anything_else_is_not_found():
    from litgpt import Config

    from lightning_lowmem import CheckpointNotFoundError

    by_name = estimate_memory("pythia-160m", quantize="bnb.nf4", max_seq_length=256)
    assert by_name.to_dict() == estimate_memory(Config.from_name("pythia-160m"), quantize="bnb.nf4",
                                                max_seq_length=256).to_dict()
    with pytest.raises(CheckpointNotFoundError, match="'pythia-160mm' is neither an existing checkpoint path nor a "
                                                      "litgpt model name"):
        estimate_memory("pythia-160mm")


def test_an_hf_directory_of_any_name_is_estimated_with_its_litgpt_config(pythia_14m_hf_dir):
    """No model_config.yaml, a name litgpt does not know: the litgpt config comes from config.json's shapes."""
    directory, _ = pythia_14m_hf_dir
    est = estimate_memory(directory, max_seq_length=64)
    by_name = estimate_memory("pythia-14m", max_seq_length=64)
    assert est.model == "pythia-14m" and not [note for note in est.notes if "freed heap a generation" not in note]
    assert (est.weights, est.kv_cache, est.mask, est.rope) == (by_name.weights, by_name.kv_cache, by_name.mask,
                                                               by_name.rope)


@pytest.mark.parametrize("scheme", ["bnb.nf4-dq", "bnb.int8", "torchao.int8wo"])
def test_prequantized_checkpoints_are_counted_at_their_stored_bytes(tmp_path, tiny_config, tiny_gpt, meta_gpt,
                                                                    hf_prequantized, scheme):
    """A saved quantized litgpt checkpoint, and an HF one whose q, k, v are fused and quantized again."""
    from lightning_lowmem import save_checkpoint
    from lightning_lowmem.litgpt.generation import load_for_generation
    from lightning_lowmem.quantize import module_nbytes

    config = tiny_config("gqa", n_embd=128, intermediate_size=256)
    torch.save(tiny_gpt(config, std=0.3).state_dict(), tmp_path / "lit_model.pth")
    model = meta_gpt(config, include_buffers=True)
    load_checkpoint(model, tmp_path / "lit_model.pth", dtype=torch.bfloat16, quantize=scheme)
    save_checkpoint(model, tmp_path / "saved")
    est = estimate_memory(tmp_path / "saved", max_seq_length=16)
    assert est.quantize == scheme and est.weights == module_nbytes(model) and est.quantized_params > 0
    assert est.library > 0  # the scheme's library is imported to load it

    directory = hf_prequantized(scheme)
    _, _, report = load_for_generation(directory, precision="bf16-true")
    est = estimate_memory(directory, max_seq_length=16)
    assert est.weights == report.bytes_loaded and est.quantized_weights > 0


def test_a_directory_of_two_weight_sets_is_estimated_from_the_one_generate_loads(tmp_path, tiny_config,
                                                                                  write_litgpt_dir):
    """Beside a safetensors copy of the same tensors under the same names, the first in the documented order is read
    (either would do); beside a copy that differs (another dtype), the estimate raises as generate does, and
    ``prefer=`` picks."""
    import safetensors.torch

    from lightning_lowmem import AmbiguousCheckpointError, LoadOptions

    directory = write_litgpt_dir(tmp_path / "pythia-tiny", tiny_config(), dtype=torch.float32, tokenizer=False)
    state = torch.load(directory / "lit_model.pth", weights_only=True)
    safetensors.torch.save_file(state, directory / "model.safetensors")
    config = tiny_config()
    by_dir = estimate_memory(directory, config=config, max_seq_length=16).to_dict()
    assert by_dir.pop("source").startswith(f"{directory / 'model.safetensors'}: the first in the documented order")
    by_file = estimate_memory(directory / "lit_model.pth", config=config, max_seq_length=16).to_dict()
    assert by_file.pop("source") == f"{directory / 'lit_model.pth'}: the file given" and by_dir == by_file
    safetensors.torch.save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, directory / "model.safetensors")
    with pytest.raises(AmbiguousCheckpointError, match=r"model.safetensors and lit_model.pth.*--weights"):
        estimate_memory(directory, config=config, max_seq_length=16)
    picked = estimate_memory(directory, config=config, max_seq_length=16, options=LoadOptions(prefer="lit_model.pth"))
    assert {k: v for k, v in picked.to_dict().items() if k != "source"} == by_dir

@pytest.mark.parametrize("kind", ["bert", "t5"])
def test_a_transformers_model_is_estimated_as_its_load_holds_it(tmp_path, write_transformers_dir, kind):
    """No litgpt config: the model config.json describes, built on meta, is what the estimate counts, and what a load
    of it holds."""
    from lightning_lowmem import init_empty, load_checkpoint
    from lightning_lowmem.transformers.auto_model import meta_model

    directory = tmp_path / kind
    write_transformers_dir(directory, kind)
    est = estimate_memory(directory, quantize="bnb.nf4")
    model, name = meta_model(directory)
    assert est.model == name and any("built on meta" in note for note in est.notes)
    persistent = set(model.state_dict())
    report = load_checkpoint(model, directory, dtype=torch.bfloat16, quantize="bnb.nf4")
    rebuilt = sum(b.nbytes for n, b in model.named_buffers() if n not in persistent)  # BERT's position_ids
    assert est.weights == report.bytes_loaded - rebuilt


def test_with_layers_on_disk_the_estimate_tells_what_a_generation_reads_and_holds(tmp_path, tiny_config,
                                                                                  write_litgpt_dir):
    """The layers on disk, the bytes each token reads and the read buffers, before any read: what the disk tier of the
    same load then reads and allocates; the read speed is given, or measured on the file."""
    from lightning_lowmem import generate

    directory = write_litgpt_dir(tmp_path / "eight", tiny_config(n_layer=8, n_embd=64), torch.bfloat16)
    budget = {"cpu": "150KiB"}
    full = estimate_memory(directory, max_seq_length=22, prompt_length=6)
    est = estimate_memory(directory, max_seq_length=22, prompt_length=6, max_memory=budget, disk_offload=True,
                          read_bandwidth=2**30)
    assert est.disk_weights > 0 and est.weights + est.disk_weights == full.weights
    assert est.seconds_per_token == pytest.approx(est.disk_read / 2**30) and "s/token" in str(est)
    assert est.generate_peak == full.generate_peak - est.disk_weights + est.disk_buffers
    result = generate(directory, [5, 17, 3, 99, 42, 8], max_new_tokens=16, temperature=0.0, max_memory=budget,
                      disk_offload=True)
    tier, placement = result.load_report.disk, result.load_report.placement
    assert placement.weights_per_device() == est.placement.weights_per_device()
    assert tier.read_nbytes == est.disk_read == tier.stats.bytes_read // tier.stats.reads * len(tier.units)
    assert result.load_report.bytes_loaded == est.weights
    tensors = sum(len(unit.targets) for unit in tier.units.values())
    assert est.disk_buffers <= tier.buffer_bytes <= est.disk_buffers + 2 * 64 * tensors  # up to 64-byte alignment
    measured = estimate_memory(directory, max_seq_length=22, max_memory=budget, disk_offload=True)
    assert measured.read_bandwidth > 0 and any("measured" in note for note in measured.notes)
    assert estimate_memory(directory, max_seq_length=22, max_memory={"cpu": "1GiB"}, disk_offload=True).disk_read == 0


def test_without_lengths_the_estimate_sizes_generates_defaults_and_says_so(tiny_config):
    """Not the model's whole context: a 64-token prompt + generate's 50 new tokens (within the block size), with a
    note saying so."""
    config = tiny_config("gqa", block_size=4096)
    est = estimate_memory(config)
    given = estimate_memory(config, max_seq_length=64 + 50, prompt_length=64)
    assert (est.max_seq_length, est.prompt_length, est.kv_cache, est.peak) == \
        (given.max_seq_length, given.prompt_length, given.kv_cache, given.peak)
    assert any("no lengths given" in note and "50 new tokens" in note for note in est.notes), est.notes
    assert not any("no lengths given" in note for note in given.notes)
    short = estimate_memory(tiny_config("gqa"))  # block size 64: the whole of it, 50 of them new
    assert (short.max_seq_length, short.prompt_length) == (64, 14)
    alone = estimate_memory(config, prompt_length=10)  # a prompt alone: 50 new tokens after it
    assert (alone.max_seq_length, alone.prompt_length) == (60, 10)


def test_a_directorys_tokenizer_is_counted_as_a_fresh_process_holds_it(tmp_path, tiny_config, write_litgpt_dir,
                                                                        child_env):
    """generate() builds the directory's tokenizer and keeps it while it generates: the estimate counts it, at least
    what reading it adds to a fresh process (heap handed back, as generate() does), at most 2 MiB more for a 50k-entry
    vocabulary."""
    import json
    import subprocess
    import sys

    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = write_litgpt_dir(tmp_path / "tiny", tiny_config(), tokenizer=False)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(50_000)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    est = estimate_memory(directory, max_seq_length=40, prompt_length=8)
    code = ("import sys; from pathlib import Path; import torch, litgpt, lightning_lowmem\n"
            "from lightning_lowmem.litgpt.checkpoint_dir import LitgptCheckpoint\n"
            "rss = lambda: next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmRSS'))\n"
            "before = rss(); found = LitgptCheckpoint.find(Path(sys.argv[1])); print(rss() - before)")
    held = int(subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True, text=True,
                              env=child_env, check=True).stdout.split()[-1])
    assert held <= est.tokenizer <= held + 2 * 2**20 and "tokenizer" in str(est), (held, est.tokenizer)
    assert estimate_memory(directory, max_seq_length=40, prompt_length=8).peak == est.peak


@pytest.mark.slow
def test_a_long_generation_is_not_under_the_estimate(tmp_path, tiny_config, write_litgpt_dir, child_env):
    """1,400 new tokens from a model whose key-value heads serve 8 query heads each (2 x 2048, 32 heads, 4 groups):
    each step repeats the keys and values over every position filled (12 MiB a layer at the end), which the estimate
    counts as a step's activations, and the freed heap those steps leave is handed back as it grows. Measured in a
    fresh process, above its imports."""
    import json
    import subprocess
    import sys

    config = tiny_config("gqa", n_layer=2, n_embd=2048, n_head=32, n_query_groups=4, intermediate_size=512,
                         vocab_size=1024, padded_vocab_size=1024, block_size=2048)
    directory = write_litgpt_dir(tmp_path / "wide", config, torch.bfloat16, tokenizer=False)
    code = ("import json, sys, torch, litgpt, litgpt.generate.base, lightning, lightning_lowmem\n"
            "from lightning_lowmem.memory import MemoryMonitor\n"
            "with MemoryMonitor() as monitor:\n"
            "    lightning_lowmem.generate(sys.argv[1], list(range(1, 65)), max_new_tokens=1400, top_k=1)\n"
            "print(json.dumps(monitor.usage.rss_peak_delta))")
    proc = subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True, text=True, env=child_env,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    est = estimate_memory(directory, max_seq_length=64 + 1400, prompt_length=64)
    assert est.activations >= 2 * 32 * 1464 * 64 * 2  # a step's keys and values, repeated for each query head
    assert measured <= est.peak, (measured / 2**20, str(est))


def test_generate_hands_back_the_freed_heap_while_it_generates(tmp_path, tiny_config, write_litgpt_dir, monkeypatch):
    """A hook on the model during the generation only, handing the free heap back past 8 MiB."""
    import lightning_lowmem.memory.heap as heap
    from lightning_lowmem import generate
    from lightning_lowmem.litgpt.generation import load_for_generation

    calls = []
    monkeypatch.setattr(heap, "release_free_heap", lambda min_free=0: calls.append(min_free) or False)
    model, _, _ = load_for_generation(write_litgpt_dir(tmp_path / "tiny", tiny_config(), tokenizer=False))
    hooks = dict(model._forward_hooks)
    generate(model, [1, 2, 3], max_new_tokens=5, top_k=1)
    assert calls == [heap.GENERATION_TRIM_AT] * 5  # one forward for the prompt, one for each new token but the last
    assert dict(model._forward_hooks) == hooks
