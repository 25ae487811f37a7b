"""A memory timeline: what a block of code held, sample by sample, with named events.

:class:`~lightning_lowmem.memory.monitor.MemoryMonitor` fills one when asked (``timeline=True``); it
travels as JSON (:meth:`Timeline.to_dict`, :meth:`Timeline.from_dict`) and is drawn by
:func:`lightning_lowmem.memory.picture.save_timeline`.

The number of points is bounded: past ``max_points``, neighbouring points are merged in pairs, keeping
the one that held more memory (so peaks survive), and later samples are merged in buckets of the same
width, so the points stay evenly spread over the whole block.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple

MAX_POINTS = 10_000


class Sample(NamedTuple):
    """Memory at one moment. Sizes in bytes.

    Attributes:
        seconds: time since the start of the block.
        anon: anonymous RSS (``RssAnon``: allocated memory).
        file: file-backed RSS (``RssFile``: touched pages of mapped files and libraries).
        device: CUDA memory allocated on the watched device, or None when no device is watched.
    """

    seconds: float
    anon: int
    file: int
    device: int | None = None


class Mark(NamedTuple):
    """A named event on a timeline, e.g. ``Mark(0.42, "model built")``."""

    seconds: float
    label: str


def _held(sample: Sample) -> int:
    return sample.anon + sample.file + (sample.device or 0)


@dataclass
class Timeline:
    """Samples of a block's memory and its marks, at most ``max_points`` samples.

    Example::

        >>> t = Timeline(start=Sample(0.0, 100, 50), max_points=4)
        >>> for i in range(10):
        ...     t.add(Sample(i / 10, 100 + i, 50))
        >>> t.flush()
        >>> len(t.points) <= 4, max(p.anon for p in t.points)
        (True, 109)
        >>> Timeline.from_dict(t.to_dict()) == t
        True

    Args:
        start: the memory when the block started; pictures show memory above it.
        max_points: the most samples kept (at least 2).
        points: the samples, in time order.
        marks: named events, in time order.
    """

    start: Sample = Sample(0.0, 0, 0)
    max_points: int = MAX_POINTS
    points: list[Sample] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    _stride: int = field(default=1, init=False, repr=False, compare=False)
    _bucket: list[Sample] = field(default_factory=list, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_points, int) or self.max_points < 2:
            raise ValueError(f"Timeline(max_points={self.max_points!r}): give an int of at least 2 "
                             f"(the default is {MAX_POINTS}).")

    def add(self, sample: Sample) -> None:
        """Record one sample (thread-safe); merges points when there are more than ``max_points``."""
        with self._lock:
            self._bucket.append(sample)
            if len(self._bucket) >= self._stride:
                self._flush_bucket()

    def mark(self, seconds: float, label: str) -> None:
        """Record a named event at ``seconds`` since the start of the block."""
        with self._lock:
            self.marks.append(Mark(float(seconds), str(label)))

    def flush(self) -> None:
        """Keep the samples still waiting in a partly filled bucket (called when the block ends)."""
        with self._lock:
            if self._bucket:
                self._flush_bucket()

    def _flush_bucket(self) -> None:
        self.points.append(max(self._bucket, key=_held))
        self._bucket = []
        if len(self.points) > self.max_points:
            pairs = [max(self.points[i:i + 2], key=_held) for i in range(0, len(self.points), 2)]
            self.points = pairs
            self._stride *= 2

    @property
    def seconds(self) -> float:
        """The time of the last sample (0 when there is none)."""
        return self.points[-1].seconds if self.points else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the samples as columns, the start and the marks."""
        return {
            "start": list(self.start),
            "max_points": self.max_points,
            "seconds": [p.seconds for p in self.points],
            "anon": [p.anon for p in self.points],
            "file": [p.file for p in self.points],
            "device": [p.device for p in self.points],
            "marks": [list(m) for m in self.marks],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        """The timeline that :meth:`to_dict` wrote.

        Raises:
            ValueError: a key is missing or the columns have different lengths.
        """
        try:
            columns = [data[k] for k in ("seconds", "anon", "file", "device")]
            start, marks = Sample(*data["start"]), [Mark(*m) for m in data["marks"]]
        except (KeyError, TypeError) as e:
            raise ValueError(f"Not a timeline dict ({e!r}): give what Timeline.to_dict() returned.") from e
        if len({len(c) for c in columns}) > 1:
            raise ValueError("Not a timeline dict: its columns seconds, anon, file, device have lengths "
                             f"{[len(c) for c in columns]}; give what Timeline.to_dict() returned.")
        points = [Sample(*row) for row in zip(*columns)]
        return cls(start=start, max_points=data.get("max_points", MAX_POINTS), points=points, marks=marks)
