"""``Fabric(strategy="lowmem_fsdp")`` on 2 ranks (gloo, CPU): each rank streams its own rows into FSDP2's shards; the
model trains, saves and resumes with Lightning's own sharded checkpoints; QLoRA with ``torchao.nf4``."""

from __future__ import annotations

import pytest
import torch

from lightning_lowmem import LoadOptions

FABRIC = """
import lightning as L
from litgpt import GPT
from lightning_lowmem import MetaTensorError, init_empty, load_checkpoint

fabric = L.Fabric(accelerator="cpu", devices=world, strategy="lowmem_fsdp", precision="bf16-true")
fabric.launch()
tokens = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(1))

def build():
    with fabric.init_module():
        model = GPT(config())
        model.lm_head.weight = model.transformer.wte.weight  # tied: FSDP2 needs them in one group
    model = fabric.setup(model)
    return model, fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))

def loss_of(model):
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))

model, optimizer = build()
try:
    model(tokens)
    emit(guard=None)
except MetaTensorError as e:
    emit(guard=str(e))
fabric.load_raw(args["path"], model)
report = fabric.strategy.reports[-1]
emit(bytes_read=report.bytes_read, shard_bytes=report.shard_bytes,
     sharded=all(type(p).__name__ == "DTensor" for p in model.parameters()))
torch.set_default_dtype(torch.bfloat16)
with init_empty():
    single = GPT(config())
torch.set_default_dtype(torch.float32)
single.lm_head.weight = single.transformer.wte.weight
load_checkpoint(single, args["path"], dtype=torch.bfloat16, progress=False)
single.reset_parameters()  # litgpt's: RoPE tables in float32, as FSDP2's materialization leaves them
with torch.no_grad(), fabric.autocast():
    emit(logits_equal=torch.equal(model(tokens).to(torch.bfloat16), single(tokens)))
losses = []
for _ in range(2):
    loss = loss_of(model)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
inner = model.module
emit(losses=losses, tied=inner.lm_head.weight is inner.transformer.wte.weight)
fabric.save(args["save"], {"model": model, "optimizer": optimizer, "step": 2})
with torch.no_grad():
    expected = loss_of(model).item()
resumed, resumed_optimizer = build()
state = {"model": resumed, "optimizer": resumed_optimizer, "step": 0}
fabric.load(args["save"], state)
with torch.no_grad():
    emit(step=state["step"], resumed_loss_equal=loss_of(resumed).item() == expected)
fabric.strategy._save_distributed_checkpoint = False  # one full file, rank 0 writing it
fabric.save(args["save"] + ".ckpt", {"model": resumed, "optimizer": resumed_optimizer, "step": 3})
full, full_optimizer = build()
state = {"model": full, "optimizer": full_optimizer, "step": 0}
fabric.load(args["save"] + ".ckpt", state)  # the model entry streamed, the optimizer state as Lightning does
same_state = all(torch.equal(a[k].to_local(), b[k].to_local()) for a, b in zip(
    resumed_optimizer.state.values(), full_optimizer.state.values()) for k in ("exp_avg", "exp_avg_sq"))
losses = []
for model, optimizer in ((resumed, resumed_optimizer), (full, full_optimizer)):
    loss = loss_of(model)
    fabric.backward(loss)
    optimizer.step()
    with torch.no_grad():
        losses.append(loss_of(model).item())
emit(full_step=state["step"], full_optimizer_equal=same_state and len(full_optimizer.state) > 0,
     full_resumes=losses[0] == losses[1])
"""


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory, shard_config, tiny_gpt, write_checkpoint):
    from litgpt import Config

    state = tiny_gpt(Config(**shard_config), torch.bfloat16, std=0.3).state_dict()
    del state["lm_head.weight"]  # tied to the embedding: saved once, as transformers saves tied weights
    return write_checkpoint(state, "safetensors", tmp_path_factory.mktemp("tied"))


@pytest.mark.slow
def test_fabric_loads_trains_saves_and_resumes(run_ranks, shard_config, tied_checkpoint, tmp_path):
    ranks = run_ranks(FABRIC, dict(config=shard_config, path=str(tied_checkpoint), save=str(tmp_path / "run")),
                      init=False, timeout=400)
    for result in ranks:
        assert result.returncode == 0, result.stderr[-3000:]
        got = result.values
        assert "never loaded" in got["guard"]  # a forward over unloaded shards is an error, not garbage
        assert got["sharded"] and got["logits_equal"]
        assert 0 < got["bytes_read"] <= got["shard_bytes"]
        assert got["losses"][1] < got["losses"][0]
        assert got["tied"]
        assert got["step"] == 2 and got["resumed_loss_equal"]
        assert got["full_step"] == 3 and got["full_optimizer_equal"] and got["full_resumes"]
    assert (tmp_path / "run").is_dir()  # Lightning's sharded checkpoint: one file per rank and meta.pt


ROPE = """
import lightning as L
import safetensors.torch
from litgpt import GPT

import lightning_lowmem  # registers "lowmem_fsdp" with Fabric

fabric = L.Fabric(accelerator="cpu", devices=world, strategy="lowmem_fsdp", precision="bf16-true")
fabric.launch()
with fabric.init_module():
    model = GPT(config())
model = fabric.setup(model)  # Lightning's bf16-true converts every floating buffer: RoPE tables too
inner = model.module
after_setup = str(inner.cos.dtype)
fabric.load_raw(args["path"], model)
tokens = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    logits = model(tokens).to(torch.bfloat16)
# One process, no library: litgpt's weights loaded, converted as Lightning converts them, RoPE built again by
# litgpt's own reset_parameters() as Lightning's path does after the conversion.
reference = GPT(config())
reference.load_state_dict(safetensors.torch.load_file(args["path"]))
reference = reference.to(torch.bfloat16).eval()
reference.reset_parameters()
with torch.no_grad(), fabric.autocast():
    expected = reference(tokens).to(torch.bfloat16)
emit(after_setup=after_setup, after_forward=str(inner.cos.dtype), reference=str(reference.cos.dtype),
     logits_equal=torch.equal(logits, expected), difference=(logits.float() - expected.float()).abs().max().item())
"""


@pytest.mark.slow
def test_rope_tables_keep_float32_under_bf16_true_and_logits_equal_one_process(
        run_ranks, shard_config, tiny_gpt, write_checkpoint, tmp_path):
    from litgpt import Config

    path = write_checkpoint(tiny_gpt(Config(**shard_config), torch.bfloat16, std=0.3).state_dict(), "safetensors",
                            tmp_path)
    ranks = run_ranks(ROPE, dict(config=shard_config, path=str(path)), init=False, timeout=400)
    for result in ranks:
        assert result.returncode == 0, result.stderr[-3000:]
        got = result.values
        assert got["after_setup"] == got["after_forward"] == got["reference"] == "torch.float32", got
        assert got["logits_equal"], got["difference"]


QLORA = """
import re
import lightning as L
from litgpt.lora import GPT, Config, mark_only_lora_as_trainable
from lightning_lowmem import LowMemFSDPStrategy
from lightning_lowmem.quantize.nf4 import NF4Linear

pattern = re.compile(r"(attn\\.qkv|attn\\.proj|mlp\\.fc|mlp\\.proj|lm_head)\\.(weight|bias)$")
fabric = L.Fabric(accelerator="cpu", devices=world, precision="bf16-true",
                  strategy=LowMemFSDPStrategy(quantize="torchao.nf4",
                                              key_map=lambda key: pattern.sub(r"\\1.linear.\\2", key)))
fabric.launch()
with fabric.init_module():
    model = GPT(Config(**args["config"], lora_r=4, lora_alpha=8, lora_query=True, lora_value=True))
mark_only_lora_as_trainable(model)
model = fabric.setup(model)
optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2))
fabric.load_raw(args["path"], model)
report = fabric.strategy.reports[-1]
inner = model.module
nf4 = [n for n, m in inner.named_modules() if type(m) is NF4Linear]
base = {n: p.to_local().quantized_data.clone() for n, p in inner.named_parameters() if n.endswith("linear.weight")
        and n.rsplit(".", 1)[0] in nf4}
tokens = torch.randint(0, 101, (4, 17), generator=torch.Generator().manual_seed(2))
losses = []
for _ in range(4):
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
unchanged = all(torch.equal(p.to_local().quantized_data, base[n]) for n, p in inner.named_parameters() if n in base)
emit(nf4=len(nf4), quantized=len(report.quantized), initialized=sorted(report.missing)[:2], losses=losses,
     base_unchanged=unchanged, trainable=sorted(n for n, p in inner.named_parameters() if p.requires_grad)[:2])
"""


@pytest.mark.slow
def test_qlora_under_fsdp2_trains_the_adapters_over_frozen_nf4_shards(run_ranks, shard_config, tiny_gpt,
                                                                       write_checkpoint, tmp_path):
    from litgpt import Config

    path = write_checkpoint(tiny_gpt(Config(**shard_config), torch.bfloat16, std=0.3).state_dict(), "safetensors",
                            tmp_path)
    ranks = run_ranks(QLORA, dict(config=shard_config, path=str(path)), init=False, timeout=500)
    for result in ranks:
        assert result.returncode == 0, result.stderr[-3000:]
        got = result.values
        assert got["nf4"] == got["quantized"] == 8
        assert got["initialized"] == ["transformer.h.0.attn.qkv.lora_A", "transformer.h.0.attn.qkv.lora_B"]
        assert got["trainable"] == got["initialized"]
        assert got["base_unchanged"]
        assert got["losses"][-1] < got["losses"][0]


def test_strategy_takes_options_and_keywords():
    from lightning_lowmem.lightning.fsdp import LowMemFSDPStrategy

    strategy = LowMemFSDPStrategy(options=LoadOptions(quantize="torchao.nf4"), skip_quantize="lm_head")
    assert strategy.options.quantize.name == "torchao.nf4" and strategy.options.skip_quantize == ("lm_head",)
    with pytest.raises(ValueError, match="max_memory"):
        LowMemFSDPStrategy(options=LoadOptions(max_memory={"cpu": "1GiB"}))


def test_fabric_builds_it_by_name():
    import lightning as L

    import lightning_lowmem

    fabric = L.Fabric(strategy="lowmem_fsdp", accelerator="cpu", devices=2)
    assert type(fabric.strategy) is lightning_lowmem.LowMemFSDPStrategy


NCCL = """
import lightning as L
import safetensors.torch
from litgpt import GPT

import lightning_lowmem  # registers "lowmem_fsdp" with Fabric

fabric = L.Fabric(accelerator="cuda", devices=world, strategy="lowmem_fsdp", precision="bf16-true")
fabric.launch()
with fabric.init_module():
    model = GPT(config())
    model.lm_head.weight = model.transformer.wte.weight  # tied: FSDP2 needs them in one group
model = fabric.setup(model)
fabric.load_raw(args["path"], model)  # the ranks' agreements run on NCCL: on this rank's GPU
full = safetensors.torch.load_file(args["path"])
full["lm_head.weight"] = full["transformer.wte.weight"]
inner = model.module
own_rows = all(torch.equal(p.to_local().cpu(), torch.chunk(full[n], world)[rank]) for n, p in inner.named_parameters()
               if n in full and p.to_local().numel())
tokens = torch.randint(0, 101, (2, 17), device=fabric.device, generator=torch.Generator().manual_seed(1))
reference = GPT(config())
reference.lm_head.weight = reference.transformer.wte.weight
reference.load_state_dict(full)
reference = reference.to(torch.bfloat16).to(fabric.device).eval()
reference.reset_parameters()
with torch.no_grad(), fabric.autocast():
    logits, expected = model(tokens).to(torch.bfloat16), reference(tokens).to(torch.bfloat16)
emit(backend=str(torch.distributed.get_backend()), devices=sorted({p.device.type for p in inner.parameters()}),
     own_rows=own_rows, report_rank=fabric.strategy.reports[-1].rank,
     difference=(logits.float() - expected.float()).abs().max().item())
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fabric_loads_fsdp2_shards_on_nccl(run_ranks, shard_config, tied_checkpoint):
    """Lightning's CUDA strategy makes an NCCL-only process group: the load's agreements run there (world size 1;
    2 where there are two GPUs), each rank's shards hold the checkpoint's rows, the forward matches one process."""
    world = min(torch.cuda.device_count(), 2)
    ranks = run_ranks(NCCL, dict(config=shard_config, path=str(tied_checkpoint)), world=world, init=False,
                      timeout=400)
    for result in ranks:
        assert result.returncode == 0 and not result.timed_out, result.stderr[-3000:]
        got = result.values
        assert got["backend"] == "nccl" and got["devices"] == ["cuda"] and got["own_rows"], got
        assert got["report_rank"] == result.rank
        assert got["difference"] == 0.0, got
