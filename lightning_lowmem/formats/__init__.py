"""Checkpoint formats: which files a path stands for, their headers, and reading one tensor at a time.

``discovery`` finds the files (a file, an index's shards, a directory's checkpoint),
``safetensors_file``, ``torch_zip`` and ``gguf_file`` read their headers and then their tensors one by one,
``checkpoint`` puts every file's records together. Nothing here knows about modules.
"""

from lightning_lowmem.formats.checkpoint import Checkpoint
from lightning_lowmem.formats.records import CheckpointFile, TensorRecord, row_span

__all__ = ["Checkpoint", "CheckpointFile", "TensorRecord", "row_span"]
