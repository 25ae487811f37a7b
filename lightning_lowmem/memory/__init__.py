"""Memory accounting: sizes as people write them, what a block of code used, and the heap given back.

``units`` parses and prints byte counts, ``monitor`` measures peak RSS and device memory,
``timeline`` keeps its samples and named events when asked, ``picture`` draws timelines to a PNG
(matplotlib), ``heap`` returns freed heap pages to the operating system (glibc), ``collector`` pauses
Python's garbage collector while a load builds many objects.
"""

from lightning_lowmem.memory.collector import collector_paused
from lightning_lowmem.memory.heap import release_free_heap, trim_after_first_forward
from lightning_lowmem.memory.monitor import MemoryMonitor, MemoryUsage, current_rss, lifetime_peak_rss
from lightning_lowmem.memory.picture import save_timeline
from lightning_lowmem.memory.timeline import Mark, Sample, Timeline
from lightning_lowmem.memory.units import format_bytes, parse_bytes

__all__ = [
    "Mark",
    "MemoryMonitor",
    "MemoryUsage",
    "Sample",
    "Timeline",
    "collector_paused",
    "current_rss",
    "format_bytes",
    "lifetime_peak_rss",
    "parse_bytes",
    "release_free_heap",
    "save_timeline",
    "trim_after_first_forward",
]
