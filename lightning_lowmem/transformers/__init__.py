"""The transformers face: a ``PreTrainedModel`` built on the meta device gets its buffers as ``from_pretrained``
gives them (:mod:`.architecture`); ``from_pretrained`` inside ``init_empty()`` builds on meta without reading
(:mod:`.deferred`). Importing it registers both; transformers is not imported."""

from lightning_lowmem.transformers.architecture import TRANSFORMERS, TransformersArchitecture
from lightning_lowmem.transformers.conversion_mapping import TRANSFORMERS_MAPPING  # noqa: F401  (registers it)
from lightning_lowmem.transformers.conversions import GGUF_TO_TRANSFORMERS  # noqa: F401  (registers them)
from lightning_lowmem.transformers import deferred  # noqa: F401  (registers from_pretrained inside init_empty())

__all__ = ["TRANSFORMERS", "TransformersArchitecture"]
