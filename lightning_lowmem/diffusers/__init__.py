"""The diffusers face: ``ModelMixin.from_pretrained`` inside ``init_empty()`` builds the model from its config on meta
without reading its weights (:mod:`.deferred`). Importing it registers that; diffusers is not imported."""

from lightning_lowmem.diffusers import deferred  # noqa: F401  (registers from_pretrained inside init_empty())
