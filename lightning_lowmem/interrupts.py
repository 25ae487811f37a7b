"""Ctrl-C in the ``lightning-lowmem`` command, from its first import to its exit: one line, exit code 130.

Python turns SIGINT into a ``KeyboardInterrupt`` wherever the main thread is. In the
command's first seconds that is deep inside torch's, numpy's or litgpt's imports, which
print tracebacks of 10-60 lines, or turn the interrupt into another error (numpy: a
``RecursionError``). So:

* while the command starts (:func:`catch_while_starting`, run first thing by the
  package's ``__init__`` when this process *is* the command, ``lightning-lowmem`` or
  ``python -m lightning_lowmem``): a SIGINT prints :data:`LINE` and ends the process
  with 130 at once. Nothing has been written yet, so nothing is left half-done;
* once the command runs its subcommand (:func:`running`): a SIGINT is noted and raised
  as ``KeyboardInterrupt``, so that saves clean up (``--out`` is switched in whole or
  not at all) and litgpt's chat loop stops a reply as it does; the command prints
  :data:`LINE` for it, and for any error an interrupted import turned it into
  (:func:`interrupted`).

In any other process (a library user's, a test's) nothing is installed: SIGINT stays
Python's.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import FrameType

LINE = "interrupted (Ctrl-C): stopped; nothing half-written was left behind"
"""What the command prints on stderr when it is interrupted."""
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process that Ctrl-C ended

_seen = False


def is_the_command(argv: list[str] | None = None, orig_argv: list[str] | None = None) -> bool:
    """Whether this process is the ``lightning-lowmem`` command: its console script, or ``python -m
    lightning_lowmem`` (``sys.orig_argv``: while ``-m`` imports the package, ``sys.argv[0]`` is only ``'-m'``).

    Example::

        >>> is_the_command(["/usr/bin/lightning-lowmem", "estimate"], ["python", "/usr/bin/lightning-lowmem"])
        True
        >>> is_the_command(["-m"], ["python", "-X", "utf8", "-m", "lightning_lowmem", "estimate"])
        True
        >>> is_the_command(["-m"], ["python", "-m", "pytest", "-q"])
        False
    """
    argv = sys.argv if argv is None else argv
    orig_argv = getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv
    if argv and Path(argv[0]).name == "lightning-lowmem":
        return True
    return any(flag == "-m" and module.split(".")[0] == "lightning_lowmem"
               for flag, module in zip(orig_argv, orig_argv[1:]))


def catch_while_starting() -> None:
    """In the command (:func:`is_the_command`), where SIGINT is Python's own: a SIGINT from now on prints
    :data:`LINE` and exits 130 at once, until :func:`running`. A SIGINT ignored (a background job) stays ignored."""
    if is_the_command() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _exit_at_once)


def running() -> None:
    """The command's own work starts: a SIGINT is raised as ``KeyboardInterrupt`` again (and noted), where
    :func:`catch_while_starting` had set it to exit at once. Elsewhere (``main()`` called in a test), nothing."""
    if signal.getsignal(signal.SIGINT) is _exit_at_once:
        signal.signal(signal.SIGINT, _note_and_raise)


def interrupted() -> bool:
    """Whether a SIGINT reached the command since :func:`running`."""
    return _seen


def _exit_at_once(signum: int, frame: FrameType | None) -> None:
    os.write(2, (LINE + "\n").encode())
    os._exit(EXIT_INTERRUPTED)  # mid-import: nothing written, nothing to clean; no exception for an import to mangle


def _note_and_raise(signum: int, frame: FrameType | None) -> None:
    global _seen
    _seen = True
    raise KeyboardInterrupt
