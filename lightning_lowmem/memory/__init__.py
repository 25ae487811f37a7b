"""Memory accounting: sizes as people write them, what a block of code used, and the heap given back.

``units`` parses and prints byte counts, ``monitor`` measures peak RSS and device memory,
``heap`` returns freed heap pages to the operating system (glibc).
"""

from lightning_lowmem.memory.heap import release_free_heap, trim_after_first_forward
from lightning_lowmem.memory.monitor import MemoryMonitor, MemoryUsage, current_rss, lifetime_peak_rss
from lightning_lowmem.memory.units import format_bytes, parse_bytes

__all__ = [
    "MemoryMonitor",
    "MemoryUsage",
    "current_rss",
    "format_bytes",
    "lifetime_peak_rss",
    "parse_bytes",
    "release_free_heap",
    "trim_after_first_forward",
]
