"""The load plan: which module tensor comes from which checkpoint key(s), in what dtype, on what device.

Built from headers alone (``formats``), before any weight is read; the later stages
(quantization, placement) fill in what they decide on the same plan, and the
streaming loop, the placement plan and the estimate all read it.
"""

from lightning_lowmem.plan.combine import Combine
from lightning_lowmem.plan.gguf import GGUFConversion, gguf_config, gguf_to_transformers
from lightning_lowmem.plan.keys import KeyMap, apply_key_map, guess_prefix
from lightning_lowmem.plan.plan import (
    LoadPlan,
    StoredForm,
    Target,
    make_plan,
    module_records,
    records_as_themselves,
)
from lightning_lowmem.plan.transform import RowTransform, row_block

__all__ = [
    "Combine",
    "GGUFConversion",
    "KeyMap",
    "LoadPlan",
    "RowTransform",
    "StoredForm",
    "Target",
    "apply_key_map",
    "gguf_config",
    "gguf_to_transformers",
    "guess_prefix",
    "make_plan",
    "module_records",
    "records_as_themselves",
    "row_block",
]
