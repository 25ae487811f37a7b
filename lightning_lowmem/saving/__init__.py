"""The write path: what a module holds written back as a checkpoint, atomically as a set.

``save`` is ``save_checkpoint`` (a module's tensors, a quantized one's as its scheme's layout stores them);
``safetensors_writer`` writes files one tensor at a time, sharded as ``save_pretrained`` shards them; ``save_target``
checks the directory a save writes before a byte is written; ``atomic_file`` and ``temporaries`` make files that
appear whole or not at all (locked before they are visible, fsynced, renamed into place); ``atomic_directory``
replaces a directory whole. Nothing in the read path (``formats/``, ``engine/``) imports this room; the names both
need live in ``formats/metadata_keys.py``.
"""

from lightning_lowmem.saving.save import ModuleState, module_state, save_checkpoint

__all__ = ["ModuleState", "module_state", "save_checkpoint"]
