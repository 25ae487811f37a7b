"""A memory picture: one or several timelines drawn to a PNG file.

Each timeline gets its own panel (same axes for all): anonymous RSS and file-backed RSS above their
values at the start of the block, stacked, in MiB; device memory allocated as a line when a CUDA device
was watched; marks as vertical lines; the model's size as a horizontal line when given.

matplotlib is an optional dependency (``pip install matplotlib``, or the ``plot`` extra); it is imported
when a picture is drawn, and drawn with its non-interactive Agg canvas, leaving pyplot's state alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

from lightning_lowmem.memory.timeline import Timeline
from lightning_lowmem.memory.units import format_bytes

_MIB = 2**20
_ANON, _FILE, _DEVICE, _MARK = "tab:blue", "tab:orange", "tab:green", "0.35"


def save_timeline(
    timelines: Mapping[str, Timeline] | Timeline,
    path: str | PathLike[str],
    title: str | None = None,
    model_bytes: int | None = None,
    model_label: str = "final model",
    dpi: int = 120,
) -> Path:
    """Draw timelines as a PNG file, one panel each, and return its path.

    Example::

        >>> import tempfile, torch
        >>> from lightning_lowmem.memory import MemoryMonitor, save_timeline
        >>> with MemoryMonitor(timeline=True) as mon:
        ...     x = torch.ones(2**22)
        ...     mon.mark("allocated")
        >>> png = save_timeline({"ones": mon.usage.timeline}, tempfile.mkdtemp() + "/memory.png",
        ...                     title="torch.ones", model_bytes=x.nbytes)
        >>> png.read_bytes()[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
        True

    Args:
        timelines: a timeline, or panel titles mapped to timelines (drawn top to bottom in this order).
        path: the PNG file to write; its folder is created.
        title: the title over all panels, e.g. the model and the machine.
        model_bytes: the model's size, drawn as a horizontal line in every panel.
        model_label: the legend's name for that line.
        dpi: dots per inch (the figure is 9 inches wide).

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: no timeline was given.
    """
    Figure, FigureCanvasAgg = _matplotlib()
    if isinstance(timelines, Timeline):
        timelines = {"": timelines}
    if not timelines:
        raise ValueError("save_timeline() got no timeline: give a Timeline or a mapping of names to timelines "
                         "(MemoryMonitor(timeline=True) records one in usage.timeline).")
    fig = Figure(figsize=(9, 1.2 + 2.6 * len(timelines)), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(timelines), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    for ax, (name, timeline) in zip(axes, timelines.items()):
        _draw(ax, name, timeline, model_bytes, model_label)
    axes[-1].set_xlabel("seconds since the start")
    handles, labels = axes[0].get_legend_handles_labels()  # below the panels: marks stay readable
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize="small", frameon=False)
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _matplotlib() -> tuple[Any, Any]:
    """matplotlib's ``Figure`` and ``FigureCanvasAgg``, or an ImportError that says how to install it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("Drawing a memory timeline needs matplotlib, which is not installed: "
                          "`pip install matplotlib` (or `pip install 'lightning-lowmem[plot]'`).") from e
    return Figure, FigureCanvasAgg


def _draw(ax: Any, name: str, timeline: Timeline, model_bytes: int | None, model_label: str) -> None:
    """One panel: anonymous and file-backed RSS stacked, device memory, marks and the model's size."""
    start, points = timeline.start, timeline.points
    seconds = [p.seconds for p in points]
    anon = [(p.anon - start.anon) / _MIB for p in points]
    file = [(p.file - start.file) / _MIB for p in points]
    ax.stackplot(seconds, anon, file, colors=[_ANON, _FILE], alpha=0.75,
                 labels=["anonymous RSS (allocated)", "file-backed RSS (mapped files)"])
    if points and points[0].device is not None:
        device = [((p.device or 0) - (start.device or 0)) / _MIB for p in points]
        ax.plot(seconds, device, color=_DEVICE, linewidth=1.5, label="device memory allocated")
    if model_bytes is not None:
        ax.axhline(model_bytes / _MIB, color="black", linestyle="--", linewidth=1,
                   label=f"{model_label} ({format_bytes(model_bytes)})")
    for mark in timeline.marks:
        ax.axvline(mark.seconds, color=_MARK, linestyle=":", linewidth=1)
        ax.annotate(mark.label, (mark.seconds, 1), xycoords=("data", "axes fraction"), xytext=(3, -3),
                    textcoords="offset points", rotation=90, va="top", ha="left", fontsize="small", color=_MARK,
                    bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.7})
    peak = max((a + f for a, f in zip(anon, file)), default=0.0) * _MIB
    text = f"peak +{format_bytes(peak)}" + (f", {peak / model_bytes:.2f}x the model" if model_bytes else "")
    ax.set_title(f"{name}: {text}" if name else text, loc="left", fontsize="medium")
    ax.set_ylabel("MiB above the start")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
