"""The transformers face: a ``PreTrainedModel`` built on the meta device gets its buffers as ``from_pretrained``
gives them (:mod:`.architecture`). Importing it registers the architecture; transformers is not imported."""

from lightning_lowmem.transformers.architecture import TRANSFORMERS, TransformersArchitecture
from lightning_lowmem.transformers.conversion_mapping import TRANSFORMERS_MAPPING  # noqa: F401  (registers it)
from lightning_lowmem.transformers.conversions import GGUF_TO_TRANSFORMERS  # noqa: F401  (registers them)

__all__ = ["TRANSFORMERS", "TransformersArchitecture"]
