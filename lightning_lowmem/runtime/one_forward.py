"""One forward at a time through the modules a streamer runs: their buffers and installed tensors serve one forward.

A forward from a second thread while one runs is refused before it touches anything (a ``RuntimeError`` naming both
threads); forwards one after another, from any thread, run. The root's forwards may nest (a model calling itself).
"""

from __future__ import annotations

import threading


class OneForward:
    """Which thread runs a forward now, and how deep its nested forwards of the root are."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held only to check and set the thread
        self._thread: threading.Thread | None = None
        self.depth = 0  # the root's forwards this thread runs, one inside the other

    def enter(self, what: str, streaming: str) -> None:
        """This thread runs a forward of ``what``: refused while another thread runs one (a module run on its own
        included). ``streaming`` says what is moved for each forward, for the message."""
        me = threading.current_thread()
        with self._lock:
            running = self._thread
            if running is not None and running is not me and running.is_alive():
                raise RuntimeError(
                    f"A forward of {what} was started on thread {me.name!r} while thread {running.name!r} runs one. "
                    f"This model's {streaming}, into buffers and modules that one forward uses at a time: "
                    "it runs one forward at a time. Run the forwards one after another "
                    "(hold a threading.Lock around each call), or load one model per thread.")
            self._thread = me

    def leave(self) -> None:
        """The end of this thread's forward (of the root's outermost one)."""
        with self._lock:
            if self._thread is not threading.current_thread():
                return
            self.depth = max(self.depth - 1, 0)
            if not self.depth:
                self._thread = None
