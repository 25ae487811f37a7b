"""QLoRA-style fine-tuning with ``L.Trainer`` and ``LowMemCallback``: 4-bit frozen base, trainable LoRA adapters.

    python examples/trainer_finetune.py                     # pythia-14m architecture, bnb.nf4 base, CPU
    python examples/trainer_finetune.py --quantize none     # bf16 base
    python examples/trainer_finetune.py --model pythia-160m --steps 60

It writes a base checkpoint first (random weights, litgpt's ``lit_model.pth``), then fine-tunes LoRA
adapters on a toy task (continue a counting sequence), saves a Lightning checkpoint that holds only
the adapters, and restores it with ``predict(ckpt_path=...)``. Both files go under ``--workdir``, by
default ~/.cache/lightning_lowmem/examples/trainer_finetune (later runs reuse the base checkpoint).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import lightning as L
import torch
from litgpt.lora import GPT, Config, mark_only_lora_as_trainable
from torch.utils.data import DataLoader

from lightning_lowmem import LowMemCallback

LORA_LINEAR = re.compile(r"(attn\.qkv|attn\.proj|mlp\.fc|mlp\.proj|lm_head)\.(weight|bias)$")


def lora_key_map(key: str) -> str:
    """Base GPT key -> key in the LightningModule: ``self.model``, whose LoRA layers wrap each Linear as ``.linear``."""
    return "model." + LORA_LINEAR.sub(r"\1.linear.\2", key)


class LoRAFinetune(L.LightningModule):
    def __init__(self, model_name: str) -> None:
        super().__init__()
        self.config = Config.from_name(model_name, lora_r=8, lora_alpha=16, lora_query=True,
                                       lora_value=True, lora_projection=True, lora_mlp=True, lora_head=True)
        self.losses: list[float] = []
        self.model: GPT | None = None

    def configure_model(self) -> None:  # runs on meta under LowMemCallback, then the base is streamed in
        if self.model is None:
            self.model = GPT(self.config)
            mark_only_lora_as_trainable(self.model)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        self.log("loss", loss, prog_bar=True)
        self.losses.append(loss.item())
        return loss

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def counting(n: int, length: int = 24) -> torch.Tensor:
    """Rows like [k, k+1, k+2, ...] (mod 1000): the next token is always the previous one + 1."""
    start = torch.randint(0, 1000, (n, 1), generator=torch.Generator().manual_seed(0))
    return (start + torch.arange(length)) % 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pythia-14m")
    parser.add_argument("--quantize", default="bnb.nf4", help='"bnb.nf4", "bnb.int8", ... or "none"')
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "lightning_lowmem" / "examples"
                        / "trainer_finetune", help="where the checkpoints are written (default: %(default)s)")
    args = parser.parse_args()
    base = args.workdir / args.model / "lit_model.pth"
    if not base.exists():
        from litgpt import GPT as BaseGPT

        base.parent.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        torch.save(BaseGPT(Config.from_name(args.model)).state_dict(), base)

    def trainer(**kwargs) -> L.Trainer:
        callback = LowMemCallback(base, quantize=None if args.quantize == "none" else args.quantize,
                                  key_map=lora_key_map)
        return L.Trainer(accelerator="auto", devices=1, precision="bf16-true", callbacks=[callback], logger=False,
                         enable_checkpointing=False, **kwargs)

    module, data = LoRAFinetune(args.model), DataLoader(counting(64), batch_size=8, shuffle=True)
    fit = trainer(max_steps=args.steps)
    fit.fit(module, data)
    print(fit.callbacks[0].report)
    print(f"loss: {module.losses[0]:.2f} at step 1, {module.losses[-1]:.2f} at step {args.steps}")

    prompts = DataLoader(counting(4, length=8), batch_size=4)
    fit.save_checkpoint(args.workdir / "adapters.ckpt")  # holds only the adapters (frozen base left out)
    restored = trainer().predict(LoRAFinetune(args.model), prompts, ckpt_path=args.workdir / "adapters.ckpt")
    print("prompts:    ", counting(4, length=8)[:, -3:].tolist())
    print("next tokens:", restored[0][:, -1].tolist())


if __name__ == "__main__":
    main()
