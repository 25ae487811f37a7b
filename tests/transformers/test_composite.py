"""A plain module holding transformers models (pi0's PaliGemma and Gemma expert) gets the dtype asked for every floating
tensor, except what each part's own from_pretrained keeps in float32: equal, bit for bit, to loading each part with
from_pretrained(dtype=...), with no float32 copy at the peak."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from lightning_lowmem import init_empty, load_checkpoint

transformers = pytest.importorskip("transformers")

BUILD = textwrap.dedent('''
    import torch
    from torch import nn
    from transformers import GemmaForCausalLM, PaliGemmaForConditionalGeneration
    from transformers.models.auto import CONFIG_MAPPING


    def configs(width=64, layers=2, vocab=1000, vision=32):
        """openpi's PaliGemmaWithExpertModel: sub-configs that say torch_dtype="float32", scaled down."""
        vlm = CONFIG_MAPPING["paligemma"]()
        text, sight = vlm.text_config, vlm.vision_config
        text.hidden_size, text.intermediate_size, text.num_attention_heads = width, 2 * width, 2
        text.head_dim, text.num_hidden_layers, text.num_key_value_heads = width // 2, layers, 1
        text.vocab_size, text.hidden_activation, text.torch_dtype = vocab, "gelu_pytorch_tanh", "float32"
        sight.hidden_size, sight.intermediate_size, sight.num_hidden_layers = vision, 2 * vision, 1
        sight.num_attention_heads, sight.projection_dim, sight.torch_dtype = 2, width, "float32"
        sight.image_size, sight.patch_size = 28, 14
        vlm.projection_dim = vlm.hidden_size = width
        expert = CONFIG_MAPPING["gemma"](head_dim=16, hidden_size=width // 2, intermediate_size=width, num_attention_heads=2,
                                         num_hidden_layers=layers, num_key_value_heads=1, vocab_size=vocab,
                                         hidden_activation="gelu_pytorch_tanh", torch_dtype="float32")
        return vlm, expert


    class PaliGemmaWithExpert(nn.Module):
        def __init__(self, **sizes):
            super().__init__()
            vlm, expert = configs(**sizes)
            self.paligemma = PaliGemmaForConditionalGeneration(config=vlm)
            self.gemma_expert = GemmaForCausalLM(config=expert)
            self.action_out_proj = nn.Linear(expert.hidden_size, 8)
''')
namespace: dict = {}
exec(BUILD, namespace)  # the same source runs in the fresh processes below
PaliGemmaWithExpert = namespace["PaliGemmaWithExpert"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The composite as safetensors (tied tensors once), and each transformers part written by save_pretrained."""
    from safetensors.torch import save_model

    torch.manual_seed(0)
    model = PaliGemmaWithExpert().eval()
    directory = tmp_path_factory.mktemp("pi0")
    save_model(model, directory / "model.safetensors")
    model.paligemma.save_pretrained(directory / "paligemma")
    model.gemma_expert.save_pretrained(directory / "gemma_expert")
    torch.save(model.action_out_proj.state_dict(), directory / "head.pt")
    return directory


def eager(directory, dtype: torch.dtype) -> nn.Module:
    """Each part as its own library loads it: from_pretrained(dtype=...); the plain Linear cast."""
    from transformers import GemmaForCausalLM, PaliGemmaForConditionalGeneration

    from lightning_lowmem.transformers.release import at_least

    keyword = "dtype" if at_least(4, 56) else "torch_dtype"  # how the installed release spells it
    model = PaliGemmaWithExpert()
    model.paligemma = PaliGemmaForConditionalGeneration.from_pretrained(directory / "paligemma", **{keyword: dtype})
    model.gemma_expert = GemmaForCausalLM.from_pretrained(directory / "gemma_expert", **{keyword: dtype})
    model.action_out_proj.load_state_dict(torch.load(directory / "head.pt"))
    model.action_out_proj.to(dtype)
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_module_holding_transformers_models_gets_the_dtype_asked(saved, dtype, assert_same_tensors):
    with init_empty():
        model = PaliGemmaWithExpert()
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the configs' torch_dtype="float32"
    load_checkpoint(model, saved / "model.safetensors", dtype=dtype, progress=False)
    reference = eager(saved, dtype)
    assert_same_tensors(model, reference)
    assert {p.dtype for p in model.parameters()} == {dtype}
    rope = [b for n, b in model.paligemma.named_buffers() if n.endswith("inv_freq")]
    assert rope and all(b.dtype == torch.float32 for b in rope)  # as from_pretrained keeps them


CHILD = BUILD + textwrap.dedent('''
    import json, sys
    from lightning_lowmem import MemoryMonitor, init_empty, load_checkpoint
    with init_empty():
        model = PaliGemmaWithExpert(width=1024, layers=4, vocab=32000, vision=256)
    with MemoryMonitor() as monitor:
        load_checkpoint(model, sys.argv[1], dtype=torch.bfloat16, progress=False)
    final = sum(t.nbytes for t in model.state_dict().values())
    print(json.dumps({"peak": monitor.usage.rss_peak_delta, "final": final,
                      "dtypes": sorted({str(p.dtype) for p in model.parameters()})}))
''')


@pytest.mark.slow
def test_the_load_holds_no_float32_copy(tmp_path, child_env):
    """~127 M parameters saved in float32 (485 MiB), loaded in bf16 (242 MiB): the peak stays at the bf16 model.
    Measured on the 2-core machine, three fresh processes: peak - final 0.6 MiB. Before the parts got the dtype asked,
    the same load ended with 441 MiB, half of it float32."""
    from safetensors.torch import save_model

    torch.manual_seed(0)
    save_model(PaliGemmaWithExpert(width=1024, layers=4, vocab=32000, vision=256), tmp_path / "pi0.safetensors")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "pi0.safetensors")], capture_output=True,
                          text=True, env=child_env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["dtypes"] == ["torch.bfloat16"]
    assert got["peak"] <= got["final"] + 64 * 2**20, got


def test_a_part_cast_to_bf16_by_its_constructor_gets_rope_as_from_pretrained_computes_it(tmp_path):
    """pi0's constructor ends in ``self.to(dtype=torch.bfloat16)``: its Gemma's ``inv_freq`` is rounded to bf16 there.
    Loaded with ``dtype=torch.bfloat16``, the part gets what ``from_pretrained(dtype=torch.bfloat16)`` gives: float32,
    computed once, not the bf16-rounded values widened."""
    from safetensors.torch import save_model

    class Policy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.expert = transformers.GemmaForCausalLM(transformers.GemmaConfig(
                hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, vocab_size=100))
            self.to(dtype=torch.bfloat16)

    torch.manual_seed(0)
    save_model(Policy(), tmp_path / "policy.safetensors")
    with init_empty():
        policy = Policy()
    rounded = [b.clone() for n, b in policy.named_buffers() if n.endswith("inv_freq")]
    load_checkpoint(policy, tmp_path / "policy.safetensors", dtype=torch.bfloat16, progress=False)
    computed = transformers.GemmaForCausalLM(policy.expert.config)
    ours = [b for n, b in policy.named_buffers() if n.endswith("inv_freq")]
    theirs = [b for n, b in computed.named_buffers() if n.endswith("inv_freq")]
    assert len(ours) == len(theirs) > 0
    for got, want, before in zip(ours, theirs, rounded):
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
        assert not torch.equal(before.float(), want)  # the test can tell the rounded values apart
