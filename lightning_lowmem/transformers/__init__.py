"""The transformers face: a ``PreTrainedModel`` built on the meta device gets its buffers as ``from_pretrained``
gives them (:mod:`.architecture`). Importing it registers the architecture; transformers is not imported."""

from lightning_lowmem.transformers.architecture import TRANSFORMERS, TransformersArchitecture

__all__ = ["TRANSFORMERS", "TransformersArchitecture"]
