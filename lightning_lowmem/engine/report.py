"""``LoadReport``: what a load did, in numbers and in words (``print(report)``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lightning_lowmem.errors import format_names
from lightning_lowmem.memory import MemoryUsage, format_bytes
from lightning_lowmem.placement import PlacementPlan
from lightning_lowmem.runtime import DiskTier, Offload


@dataclass
class LoadReport:
    """What :func:`load_checkpoint` did.

    Attributes:
        files: the checkpoint files read.
        entry: where a torch file's state dict was (``'state_dict'``, ``'model'`` or ``''``).
        tensors: checkpoint tensors read.
        bytes_read: bytes read from the checkpoint.
        bytes_loaded: bytes of the loaded tensors in the module (after casting and quantization).
        seconds: wall time of the load.
        memory: peak host RSS (and device memory) during the load.
        skipped: checkpoint keys not loaded (``strict=False``).
        missing: module tensors not in the checkpoint (``strict=False``).
        recomputed: non-persistent buffers rebuilt after the load.
        key_note: the key prefix that was guessed, if any.
        quantized: quantized module name -> scheme: every module holding a quantized weight after the load.
        prequantized: those whose weight the checkpoint holds quantized, loaded as stored (nothing quantized).
        requantized: those whose weight is built from several weights the checkpoint holds quantized (an HF
            checkpoint's q, k, v into litgpt's qkv): dequantized, combined and quantized again.
        left_out: ``nn.Linear`` module name -> why it stayed in full precision.
        quantized_bytes_before / quantized_bytes_after: the weight bytes of the modules quantized during the
            load (not those loaded as stored).
        mapped: the tensors are views of the file's mapped pages (``mmap=True`` on a load that casts,
            moves and quantizes nothing), not copies.
        placement: the placement plan (``max_memory`` only).
        offload: the hooks that stream the offloaded layers in (``max_memory`` only, when layers are offloaded).
        disk: the disk tier (``disk_offload=True``, when layers were left in the checkpoint file): the hooks that
            read them for each forward, and the checkpoint they read, open while the model lives.
            ``report.disk.close()`` takes them off and closes the file (then those layers are on meta).
        rank: this process's rank in the default process group (0 without one).
        shard_bytes: bytes of this rank's parts of the module's DTensor parameters (0 for a module that
            holds no DTensor); ``bytes_read`` is then what this rank read.
        read_whole: sharded tensor name -> why this rank read all of it though it holds only a part (decided
            before any read; ``routes/whole_reads.py``).
        source: which weights were read, and why those (a directory's choice among its weight sets).
        conversion: how the checkpoint's names became the module's (``""``: taken as they are).
    """

    files: list[Path]
    entry: str = ""
    tensors: int = 0
    bytes_read: int = 0
    bytes_loaded: int = 0
    seconds: float = 0.0
    memory: MemoryUsage = field(default_factory=MemoryUsage)
    skipped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)
    key_note: str = ""
    quantized: dict[str, str] = field(default_factory=dict)
    prequantized: dict[str, str] = field(default_factory=dict)
    requantized: dict[str, str] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    quantized_bytes_before: int = 0
    quantized_bytes_after: int = 0
    mapped: bool = False
    placement: PlacementPlan | None = None
    offload: Offload | None = None
    disk: DiskTier | None = None
    rank: int = 0
    shard_bytes: int = 0
    read_whole: dict[str, str] = field(default_factory=dict)
    source: str = ""
    conversion: str = ""

    def summary(self) -> str:
        """The load in one line: what was read, the bytes, the time and the peak (what the Lightning faces log).

        Example::

            >>> from lightning_lowmem.memory import MemoryUsage
            >>> LoadReport([Path("lit_model.pth")], tensors=76, bytes_read=2**30, bytes_loaded=2**29, seconds=1.5,
            ...            memory=MemoryUsage(rss_start=2**30, rss_peak=2**30 + 2**29)).summary()
            'loaded 76 tensors from lit_model.pth: 1.00 GiB read, 512.00 MiB in the model, 1.50 s, peak RSS +512.00 MiB'
        """
        where = format_names((p.name for p in self.files), limit=3, quote=False)
        schemes = sorted(set(self.quantized.values()))
        how = f" ({', '.join(schemes)})" if schemes else ""
        read = "mapped, not read" if self.mapped else f"{format_bytes(self.bytes_read)} read"
        line = (f"loaded {self.tensors} tensors from {where}{how}: {read}, {format_bytes(self.bytes_loaded)} in the "
                f"model, {self.seconds:.2f} s, peak RSS +{format_bytes(self.memory.rss_peak_delta)}")
        if self.memory.device_peak is not None:
            line += f", {self.memory.device} peak +{format_bytes(self.memory.device_peak_delta or 0)}"
        return line

    def __str__(self) -> str:
        where = format_names((p.name for p in self.files), limit=3, quote=False)
        lines = [
            f"Loaded {self.tensors} tensors ({'mapped, not' if self.mapped else format_bytes(self.bytes_read)} read, "
            f"{format_bytes(self.bytes_loaded)} in the model) from {where} in {self.seconds:.2f} s",
            f"  memory: {self.memory.summary()}",
        ]
        if self.shard_bytes:
            lines[0] = f"Rank {self.rank}: " + lines[0][0].lower() + lines[0][1:] + \
                f"; its shards hold {format_bytes(self.shard_bytes)}"
        if self.prequantized:
            schemes = sorted(set(self.prequantized.values()))
            lines.append(f"  loaded {len(self.prequantized)} modules quantized as stored ({', '.join(schemes)})")
        quantized = {n: s for n, s in self.quantized.items() if n not in self.prequantized}
        if quantized:
            schemes = sorted(set(quantized.values()))
            again = f" ({len(self.requantized)} rebuilt from stored quantized parts)" if self.requantized else ""
            lines.append(f"  quantized {len(quantized)} modules with {', '.join(schemes)}{again}: "
                         f"{format_bytes(self.quantized_bytes_before)} -> {format_bytes(self.quantized_bytes_after)}")
        if self.left_out:
            lines.append("  kept in full precision: " + format_names(
                (f"{name} ({why})" for name, why in self.left_out.items()), limit=5, quote=False))
        if self.read_whole:
            lines.append(f"  read whole, this rank's part kept ({len(self.read_whole)}): " + format_names(
                (f"{name} ({why})" for name, why in self.read_whole.items()), limit=3, quote=False))
        if self.placement is not None:
            per_device = self.placement.weights_per_device()
            lines.append("  placement: " + ", ".join(f"{format_bytes(n)} on {d}" for d, n in per_device.items())
                         + f" ({len(self.placement.offloaded)} layers offloaded"
                         + (f", {len(self.placement.on_disk)} on disk" if self.placement.on_disk else "") + ")")
        if self.disk is not None:
            lines.append(f"  disk: {self.disk}")
        if self.conversion:
            lines.append(f"  names: {self.conversion}")
        if self.key_note:
            lines.append(f"  keys: {self.key_note}")
        if self.skipped:
            lines.append(f"  skipped {len(self.skipped)} checkpoint keys: {format_names(self.skipped, limit=5)}")
        if self.missing:
            lines.append(f"  missing {len(self.missing)} module tensors: {format_names(self.missing, limit=5)}")
        return "\n".join(lines)
