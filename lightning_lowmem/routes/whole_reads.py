"""Which tensors a rank reads whole though it holds only a part of them, and why: said before any read.

A rank of a sharded model reads only its own rows of a tensor when its part is a block of whole rows that the
file can give on its own (``routes/choice.py``: shard rows, stacked, quantized shard rows). Anything else is
read whole, as the one tensor in flight, and the rank keeps its part: a part cut by columns (tensor
parallelism's ``Shard(1)``: its bytes are strided in the file, one piece per row), a tensor the conversion
rewrites whole, a tensor combined from several, a weight whose scheme quantizes a whole weight at once, a
strided view in a torch file. The load's report (``LoadReport.read_whole``) and the memory estimate's notes
list them, so that a load reading more than its share says so before it starts.
"""

from __future__ import annotations

import torch  # noqa: F401  (the example uses it)

from lightning_lowmem.routes.route import Traits
from lightning_lowmem.routes.choice import route_of
from lightning_lowmem.plan import LoadPlan, Target

READ_OWN_PART = frozenset({"shard rows", "stacked", "quantized shard rows"})
"""The routes on which a rank reads only its own part of a sharded tensor."""


def whole_reads(plan: LoadPlan, traits: Traits) -> dict[str, str]:
    """Name -> why this rank reads the whole tensor, for each sharded tensor it holds only a part of but reads whole.

    Example::

        >>> from pathlib import Path
        >>> from lightning_lowmem.formats import TensorRecord
        >>> from lightning_lowmem.plan.dtensor_part import Shard
        >>> rec = TensorRecord("w", (8, 4), torch.bfloat16, Path("model.safetensors"))
        >>> columns = Shard((8, 4), (0, 2), (8, 2))  # columns 2:4 of every row
        >>> plan = LoadPlan([Target(["w"], rec, True, torch.bfloat16, torch.device("cpu"), shard=columns)])
        >>> whole_reads(plan, Traits())["w"][:40]
        'this rank holds columns 2:4 of its 4 (te'
    """
    reasons: dict[str, str] = {}
    for target in plan.targets:
        shard = target.shard
        if shard is None or shard.fraction >= 1 or not shard.local_shape or not all(shard.local_shape):
            continue  # not sharded here, or this rank holds all of it, or none
        if route_of(target, traits).kind not in READ_OWN_PART:
            reasons[target.names[0]] = _reason(target, traits)
    return reasons


def _reason(target: Target, traits: Traits) -> str:
    shard, scheme = target.shard, target.scheme
    if shard.rows is None:
        cuts = [f"{'rows' if d == 0 else 'columns' if d == 1 else f'dim {d}'} {o}:{o + n} of its {whole}"
                for d, (o, n, whole) in enumerate(zip(shard.offset, shard.local_shape, shard.shape)) if n != whole]
        return (f"this rank holds {', '.join(cuts)} (tensor parallel): those bytes are not one span of the file, so "
                "the whole tensor is read and this rank's part kept")
    if traits.transform:
        return "the conversion rewrites the whole tensor as it is read"
    if target.parts:
        return f"it is built from {len(target.parts)} checkpoint tensors, read whole"
    if scheme is not None and not getattr(scheme, "shards_by_rows", False):
        return f"{scheme.name!r} quantizes a whole weight at once; this rank keeps its rows of the result"
    if scheme is not None:
        return (f"its rows are not one of {shard.count} equal pieces that {scheme.name!r} can quantize on their own "
                f"({scheme.shard_reason(target.record.shape, max(shard.count, 1)) or 'not a plain cut by rows'})")
    if not traits.reads_rows(target.record.key):
        return "the file stores it as a strided view, which is read whole"
    return "its rows cannot be read on their own"
