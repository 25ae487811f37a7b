"""Memory accounting: what a block of code used, on the host and on the device.

Host memory is the resident set size (RSS) of this process. RSS counts two
kinds of pages, and :class:`MemoryMonitor` reports both:

* **anonymous** pages (``RssAnon``): tensors we allocated. This is what a load
  really costs.
* **file-backed** pages (``RssFile``): pages of a memory-mapped file that were
  touched. The kernel can drop them under pressure, but they count in RSS (and
  in container limits) while the mapping is open.

The peak of total RSS comes from the kernel's high-water mark (``VmHWM``, reset
at the start of the block through ``/proc/self/clear_refs``); the split into
anonymous and file-backed is sampled by a background thread every few
milliseconds, so a very short spike in between samples can be missed there.

With ``timeline=True`` each sample is also kept, with the time and any named
events (:meth:`MemoryMonitor.mark`), as a :class:`~lightning_lowmem.memory.timeline.Timeline`
that :func:`lightning_lowmem.memory.picture.save_timeline` draws.
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType

import psutil
import torch

from lightning_lowmem.memory.timeline import MAX_POINTS, Sample, Timeline
from lightning_lowmem.memory.units import format_bytes


def _read_status() -> dict[str, int]:
    """Fields of ``/proc/self/status`` in bytes (Linux); empty elsewhere."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    fields[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return fields


def _reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark for this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss() -> int:
    """Resident set size of this process, in bytes."""
    return psutil.Process().memory_info().rss


def lifetime_peak_rss() -> int:
    """Peak RSS of this process since it started (or since the last reset), in bytes."""
    status = _read_status()
    if "VmHWM" in status:
        return status["VmHWM"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@dataclass
class MemoryUsage:
    """What :class:`MemoryMonitor` measured. All sizes in bytes.

    Attributes:
        rss_start: RSS when the block started.
        rss_end: RSS when the block ended.
        rss_peak: highest RSS during the block (kernel high-water mark when it
            could be reset, else the sampled peak).
        anon_peak: highest sampled anonymous RSS (allocated memory).
        file_peak: highest sampled file-backed RSS (touched pages of mapped files).
        device_peak: ``torch.cuda.max_memory_allocated`` during the block, or None
            without CUDA.
        device_start: ``torch.cuda.memory_allocated`` at the start, or None.
        seconds: wall time of the block.
        exact_peak: whether ``rss_peak`` is the kernel's high-water mark.
        timeline: every sample and mark of the block, when the monitor was asked for one
            (``MemoryMonitor(timeline=True)``), else None.
    """

    rss_start: int = 0
    rss_end: int = 0
    rss_peak: int = 0
    anon_start: int = 0
    anon_peak: int = 0
    file_peak: int = 0
    device_start: int | None = None
    device_peak: int | None = None
    seconds: float = 0.0
    exact_peak: bool = False
    device: str | None = field(default=None)
    timeline: Timeline | None = field(default=None, repr=False)

    @property
    def rss_peak_delta(self) -> int:
        """Peak RSS above the RSS at the start of the block."""
        return self.rss_peak - self.rss_start

    @property
    def anon_peak_delta(self) -> int:
        """Peak anonymous RSS above its value at the start of the block."""
        return self.anon_peak - self.anon_start

    @property
    def device_peak_delta(self) -> int | None:
        if self.device_peak is None or self.device_start is None:
            return None
        return self.device_peak - self.device_start

    def summary(self) -> str:
        """One line a person can read."""
        text = (
            f"peak RSS {format_bytes(self.rss_peak)} (+{format_bytes(self.rss_peak_delta)} in this block; "
            f"anonymous +{format_bytes(self.anon_peak_delta)}, file-backed peak {format_bytes(self.file_peak)})"
        )
        if self.device_peak is not None:
            delta = format_bytes(self.device_peak_delta or 0)
            text += f", {self.device} peak {format_bytes(self.device_peak)} (+{delta})"
        return text + f", {self.seconds:.2f} s"


class MemoryMonitor:
    """Measure the peak host RSS and device memory of a block of code, and optionally its timeline.

    Example::

        >>> from lightning_lowmem import MemoryMonitor
        >>> with MemoryMonitor() as mon:
        ...     x = torch.ones(2**20)
        >>> mon.usage.rss_peak >= mon.usage.rss_start
        True
        >>> with MemoryMonitor(timeline=True) as mon:
        ...     x = torch.ones(2**20)
        ...     mon.mark("allocated")
        >>> [m.label for m in mon.usage.timeline.marks], len(mon.usage.timeline.points) >= 2
        (['allocated'], True)

    Args:
        interval: seconds between samples of the anonymous / file-backed split.
        device: a CUDA device whose peak allocated memory to track; by default the
            current one when CUDA is available, else none.
        timeline: keep every sample (time, anonymous RSS, file-backed RSS, device memory
            allocated) in ``usage.timeline``, at most ``max_points`` of them (merged in pairs,
            peaks kept, past that). Off by default: without it the monitor keeps only peaks.
        max_points: the most samples the timeline keeps.
    """

    def __init__(self, interval: float = 0.005, device: torch.device | str | None = None,
                 timeline: bool = False, max_points: int = MAX_POINTS) -> None:
        self.interval = interval
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device) if device is not None else None
        self.record_timeline = timeline
        self.max_points = max_points
        self.usage = MemoryUsage()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    @property
    def _cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def _sample(self) -> None:
        status = _read_status()
        rss = status.get("VmRSS", 0) or current_rss()
        anon, file = status.get("RssAnon", rss), status.get("RssFile", 0)
        u = self.usage
        u.rss_peak = max(u.rss_peak, rss)
        u.anon_peak = max(u.anon_peak, anon)
        u.file_peak = max(u.file_peak, file)
        if u.timeline is not None:
            device = torch.cuda.memory_allocated(self.device) if self._cuda else None
            u.timeline.add(Sample(time.perf_counter() - self._t0, anon, file, device))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def mark(self, label: str) -> None:
        """Put a named event on the timeline at this moment, e.g. ``mon.mark("weights loaded")``.

        Raises:
            RuntimeError: the monitor keeps no timeline, or the block is not running.
        """
        if self.usage.timeline is None or self._thread is None or self._stop.is_set():
            raise RuntimeError(f"MemoryMonitor.mark({label!r}) needs a running timeline: call it inside "
                               "`with MemoryMonitor(timeline=True) as mon:`.")
        self.usage.timeline.mark(time.perf_counter() - self._t0, label)

    def __enter__(self) -> MemoryMonitor:
        u = self.usage = MemoryUsage()
        u.exact_peak = _reset_peak_rss()
        status = _read_status()
        u.rss_start = status.get("VmRSS", 0) or current_rss()
        u.anon_start = status.get("RssAnon", u.rss_start)
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            u.device_start = torch.cuda.memory_allocated(self.device)
            u.device = str(self.device)
        if self.record_timeline:
            start = Sample(0.0, u.anon_start, status.get("RssFile", 0), u.device_start)
            u.timeline = Timeline(start=start, max_points=self.max_points)
        self._t0 = time.perf_counter()
        self._sample()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="lowmem-monitor", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        u = self.usage
        u.seconds = time.perf_counter() - self._t0
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        if u.timeline is not None:
            u.timeline.flush()
        u.rss_end = current_rss()
        if u.exact_peak:
            u.rss_peak = max(u.rss_peak, lifetime_peak_rss())
        if self._cuda:
            torch.cuda.synchronize(self.device)
            u.device_peak = torch.cuda.max_memory_allocated(self.device)
