"""init_empty() holds any constructor: modules that move and cast themselves, compute buffers in their own methods,
use nn.init and requires_grad_; their loads equal the same constructor run eagerly, bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lightning_lowmem import assume_bf16_support, init_empty, load_checkpoint
from lightning_lowmem.building import ORIGIN, cast_buffer


class Rope(nn.Module):
    """torchtune's layout: the tables computed in ``rope_init()``, which ``__init__`` calls (not reset_parameters)."""

    def __init__(self, dim: int, max_seq_len: int, base: float = 10_000.0) -> None:
        super().__init__()
        self.dim, self.max_seq_len, self.base = dim, max_seq_len, base
        self.rope_init()

    def rope_init(self) -> None:
        theta = 1.0 / (self.base ** (torch.arange(0, self.dim, 2)[: self.dim // 2].float() / self.dim))
        self.register_buffer("theta", theta, persistent=False)
        positions = torch.arange(self.max_seq_len, dtype=theta.dtype)
        angles = torch.einsum("i, j -> ij", positions, theta).float()
        self.register_buffer("cache", torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1), persistent=False)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(64, 32)
        self.rope = Rope(8, 48)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        for layer in self.layers:
            nn.init.xavier_uniform_(layer.weight)
        self.register_buffer("causal", torch.tril(torch.ones(48, 48, dtype=torch.bool)), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return h * self.rope.cache[: tokens.shape[-1], :, 0].sum(-1, keepdim=True).to(h.dtype)


class Model(nn.Module):
    """exo's torch engine: a wrapper whose constructor ends in ``.to(dtype=..., device="cpu")``."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.model = Decoder().to(dtype=dtype, device="cpu")
        self.model.requires_grad_(False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("exo") / "model.safetensors"
    save_file(Model(torch.float32).state_dict(), path)
    return path


def eager(dtype: torch.dtype, path) -> nn.Module:
    model = Model(dtype)
    model.load_state_dict(load_file(path))
    return model


def test_a_constructor_that_moves_and_casts_itself_builds_on_meta():
    with init_empty():
        model = Model(torch.bfloat16)
    weights = list(model.parameters())
    assert all(p.is_meta and p.dtype == torch.bfloat16 and not p.requires_grad for p in weights)
    assert model.model.rope.cache.device.type == "cpu" and model.model.rope.cache.dtype == torch.bfloat16
    assert model.model.causal.dtype == torch.bool


@pytest.mark.parametrize("move", [
    lambda m: m.cpu(), lambda m: m.to("cpu"), lambda m: m.to(device="cpu", dtype=torch.float16), lambda m: m.half(),
    lambda m: m.to(torch.bfloat16).float(), lambda m: m.to(torch.device("cpu"), torch.float64),
])
def test_every_move_and_cast_keeps_parameters_on_meta_in_the_dtype_asked(move):
    with init_empty():
        layer = nn.Linear(4, 4)
        layer.register_buffer("scale", torch.arange(4.0), persistent=False)
        move(layer)
    with torch.device("cpu"):
        eager_layer = move(nn.Linear(4, 4))
    assert layer.weight.is_meta and layer.weight.dtype == eager_layer.weight.dtype
    assert layer.scale.device.type == "cpu"


def test_a_tensor_method_on_a_meta_parameter_stays_on_meta():
    with init_empty():
        layer = nn.Linear(4, 4)
        moved = layer.weight.to("cpu", torch.float16)
        copied = layer.weight.cpu()
    assert moved.is_meta and moved.dtype == torch.float16 and copied.is_meta


def test_outside_the_block_torch_refuses_as_before():
    with init_empty():
        layer = nn.Linear(4, 4)
    with pytest.raises(NotImplementedError, match="meta tensor"):
        layer.weight.to("cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_load_equals_the_same_constructor_run_eagerly(saved, dtype, assert_same_tensors):
    with init_empty():
        model = Model(dtype)
    load_checkpoint(model, saved, progress=False)
    assert_same_tensors(model, eager(dtype, saved))
    assert not any(hasattr(b, ORIGIN) for b in model.buffers())  # what the fallback needed is gone after the load


def test_under_the_fp16_fallback_buffers_are_rounded_once_as_the_fp16_constructor_gives_them(saved, assert_same_tensors):
    """A device without bf16: the wrapper asked for bf16 gets fp16; its RoPE table is cast from the constructor's
    float32 values, as the same constructor run with fp16 gives it, not from the bf16 copy (rounded twice)."""
    with init_empty():
        model = Model(torch.bfloat16)
    twice = model.model.rope.cache.to(torch.float16)
    with assume_bf16_support("cpu", False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_checkpoint(model, saved, progress=False)
    reference = eager(torch.float16, saved)
    assert_same_tensors(model, reference)
    assert not torch.equal(twice, reference.model.rope.cache)  # the test can tell the two roundings apart
    tokens = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.model(tokens), reference.model(tokens))


def test_a_buffer_cast_outside_init_empty_has_no_origin():
    table = torch.tensor([1.0 + 2**-9]).to(torch.bfloat16)
    assert not hasattr(table, ORIGIN)
    with assume_bf16_support("cpu", False):
        assert cast_buffer(table, "cpu", torch.bfloat16).item() == 1.0  # rounded from the bf16 it holds


def test_a_failed_load_keeps_what_the_fallback_needs(saved, tmp_path, assert_same_tensors):
    """A load that fails leaves the module as it was, the constructor's values included: the next load still
    rounds once."""
    bad = tmp_path / "bad.safetensors"
    save_file({k: v for k, v in load_file(saved).items() if "layers.1" not in k}, bad)
    with init_empty():
        model = Model(torch.bfloat16)
    with pytest.raises(Exception):
        load_checkpoint(model, bad, progress=False)
    assert hasattr(model.model.rope.cache, ORIGIN)
    with assume_bf16_support("cpu", False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_checkpoint(model, saved, progress=False)
    assert_same_tensors(model, eager(torch.float16, saved))


def test_building_on_meta_fills_nothing(child_env):
    """nn.init on a meta parameter has nothing to fill: skipped, so torch's meta normal_ does not import torch._dynamo
    (73 MiB and a second per process). Real buffers are still filled as the constructor asks."""
    import json
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import json, resource, sys, torch
        from torch import nn
        from lightning_lowmem import init_empty
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with init_empty():
            embedding = nn.Embedding(257152, 256)
            linear = nn.Linear(256, 256)
            nn.init.trunc_normal_(linear.weight, std=0.02)
            buffer = torch.zeros(4)
            nn.init.normal_(buffer)
        print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "meta": embedding.weight.is_meta,
                          "filled": bool(buffer.abs().sum() > 0),
                          "kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {**got, "dynamo": False, "meta": True, "filled": True} and got["kib"] < 16 * 1024, got


def test_only_casts_to_bf16_remember_and_a_load_without_fallback_drops_them_before_reading(saved):
    with init_empty():
        wide = torch.arange(4, dtype=torch.float64) / 3
        narrowed = wide.float()  # not to bf16: nothing to remember
        model = Model(torch.bfloat16)
    assert not hasattr(narrowed, ORIGIN) and hasattr(model.model.rope.cache, ORIGIN)
    seen = []

    def spy(name, tensor):
        seen.append(hasattr(model.model.rope.cache, ORIGIN))
        return tensor

    load_checkpoint(model, saved, transform=spy, progress=False)
    assert seen and not any(seen)  # gone before the first tensor was read: the device has bf16
