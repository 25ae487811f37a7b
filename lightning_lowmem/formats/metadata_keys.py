"""The names this library writes in a checkpoint's metadata that a load reads back: shared by the write path
(``saving/``) and the read path, which never imports the write path."""

TIES_KEY = "lightning_lowmem.ties"
"""The metadata key of a save's tied tensors: JSON, each name not written -> the name it was written under."""
