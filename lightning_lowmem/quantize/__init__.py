"""Quantize on load: each ``nn.Linear`` weight is quantized the moment it is read.

Placeholder until the schemes land: only ``quantize=None`` is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_lowmem.errors import UnsupportedQuantizationError


@dataclass(frozen=True)
class QuantizeSpec:
    scheme: str
    skip: tuple[str, ...] | None

    @classmethod
    def parse(cls, quantize: str | None, skip_quantize: list[str] | None) -> QuantizeSpec | None:
        if quantize is None:
            return None
        raise UnsupportedQuantizationError(f"Unknown quantization scheme {quantize!r}.")


def prepare_quantization(module: nn.Module, spec: QuantizeSpec | None, plan: object, device: torch.device):
    return None
