"""Exit codes, and how an error is told on stderr.

* 0: done.
* 1: a checkpoint error: missing, unreadable, unsafe, or not fitting its config (a config file that cannot be
  read included); a memory budget that cannot hold the model; a device that is not there; an output
  directory that cannot be written (not writable, too little free space, a full disk, weight files there
  this library did not write: ``SaveError``) (any other ``LowMemError``).
* 2: a bad argument: a flag argparse refuses, an unknown quantization scheme, a prompt the
  checkpoint cannot take, no litgpt config found (``ValueError`` / ``TypeError``).
"""

from __future__ import annotations

import sys

from lightning_lowmem.errors import LowMemError, UnsupportedQuantizationError

EXIT_OK = 0
EXIT_CHECKPOINT = 1
EXIT_ARGUMENT = 2

EXIT_CODES = """exit codes:
  0  done
  1  a checkpoint error (missing, unreadable, or not fitting its config; a config file that cannot be read),
     a memory budget or a device error, or --out cannot be written (not writable, too little free space,
     weight files it did not write)
  2  a bad argument (a flag, a quantization scheme, a prompt the checkpoint cannot take, or no litgpt config
     found: pass --config)"""


def exit_code(error: BaseException) -> int | None:
    """The exit code of an error the command line reports in one line, or None for any other (a bug: traceback).

    Example::

        >>> from lightning_lowmem.errors import CheckpointFormatError
        >>> exit_code(CheckpointFormatError("truncated")), exit_code(ValueError("top_p")), exit_code(KeyError("x"))
        (1, 2, None)
    """
    if isinstance(error, UnsupportedQuantizationError):
        return EXIT_ARGUMENT
    if isinstance(error, LowMemError):
        return EXIT_CHECKPOINT
    if isinstance(error, (ValueError, TypeError)):
        return EXIT_ARGUMENT
    return None


def print_error(error: BaseException) -> None:
    """``error: <type>: <message>`` on stderr."""
    print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
