"""The transfer layer: how tensors reach a device from host memory, for the load and for the runtime alike.

``pinned`` is the host memory copies are made from (blocks pinned for CUDA, carved into tensors, counted in the
bytes they take), ``copies`` the copy engines (a CUDA side stream, a thread for the CPU: one stream convention),
``ring`` the few reused buffers a load's reads land in. The load's device path (``routes/staging.py``), the offloaded
layers' masters (``runtime/host_copies.py``) and the disk tier's read buffers (``runtime/layer_buffers.py``) all go
through them; the placement and the estimate count their bytes with ``pinned.lay_out`` and ``pinned.block_nbytes``.
"""

from lightning_lowmem.transfer.copies import ENGINES, CopyEngine, CudaCopies, Fence, ThreadCopies, engine_for
from lightning_lowmem.transfer.pinned import HostPool, block_nbytes, lay_out

__all__ = ["ENGINES", "CopyEngine", "CudaCopies", "Fence", "HostPool", "ThreadCopies", "block_nbytes", "engine_for",
           "lay_out"]
