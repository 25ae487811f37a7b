"""Exit codes, and how an error is told on stderr.

* 0: done.
* 1: a checkpoint error: missing, unreadable, unsafe, or not fitting its config (a config file that cannot be
  read included); a memory budget that cannot hold the model; a device that is not there; an output
  directory that cannot be written (not writable, too little free space, a full disk, weight files there
  this library did not write: ``SaveError``) (any other ``LowMemError``).
* 2: a bad argument: a flag argparse refuses, an unknown quantization scheme, a prompt the
  checkpoint cannot take, no litgpt config found (``ValueError`` / ``TypeError``).
* 130: interrupted (Ctrl-C, ``KeyboardInterrupt``): one line, no traceback. A load leaves nothing behind; a
  ``--out`` directory is switched in whole or not at all, so it holds the old copy or the new one.

A message raised by the library speaks in Python keywords (``max_memory=``); the command line tells it in its own
flags (``--max_memory``), :func:`in_flags`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping

from lightning_lowmem.errors import LowMemError, UnsupportedQuantizationError
from lightning_lowmem.interrupts import EXIT_INTERRUPTED, LINE  # noqa: F401  (EXIT_INTERRUPTED: the command's)

EXIT_OK = 0
EXIT_CHECKPOINT = 1
EXIT_ARGUMENT = 2

_ONE = {  # what exit code 1 stands for, by what a subcommand does
    "checkpoint": "a checkpoint error (missing, unreadable, or not fitting its config; a config file that cannot "
                  "be read)",
    "budget": "a memory budget that cannot hold the model (--max_memory)",
    "device": "a device that is not there (--device)",
    "out": "--out cannot be written (not writable, too little free space, weight files it did not write)",
}
_TWO = {
    "flags": "a flag argparse refuses",
    "scheme": "an unknown quantization scheme (--quantize)",
    "prompt": "a prompt the checkpoint cannot take",
    "config": "no litgpt config found (pass --config)",
}
_WHAT = {  # subcommand -> (its reasons for 1, its reasons for 2, what an interrupt leaves)
    None: (("checkpoint", "budget", "device", "out"), ("flags", "scheme", "prompt", "config"),
           "nothing half-written is left behind"),
    "estimate": (("checkpoint", "budget"), ("flags", "scheme", "config"), "nothing was written"),
    "inspect": (("checkpoint",), ("flags", "config"), "nothing was written"),
    "generate": (("checkpoint", "budget", "device"), ("flags", "scheme", "prompt", "config"), "nothing was written"),
    "chat": (("checkpoint", "budget", "device"), ("flags", "scheme", "config"), "nothing was written"),
    "quantize": (("checkpoint", "device", "out"), ("flags", "scheme", "config"),
                 "--out holds the old copy or none, never a half-written one"),
}


def exit_codes(command: str | None = None) -> str:
    """The ``exit codes:`` paragraph of ``command``'s ``--help`` (``None``: the top-level command's, every code).

    Example::

        >>> print(exit_codes("inspect"))  # doctest: +NORMALIZE_WHITESPACE
        exit codes:
          0   done
          1   a checkpoint error (missing, unreadable, or not fitting its config; a config file that cannot be read)
          2   a bad argument: a flag argparse refuses, or no litgpt config found (pass --config)
          130 interrupted (Ctrl-C): nothing was written
    """
    ones, twos, interrupted = _WHAT[command]
    return "\n".join(["exit codes:", "  0   done", _wrapped("  1   ", _listed([_ONE[k] for k in ones])),
                      _wrapped("  2   ", "a bad argument: " + _listed([_TWO[k] for k in twos])),
                      f"  130 interrupted (Ctrl-C): {interrupted}"])


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", or " + items[-1]


def _wrapped(first: str, text: str, width: int = 110) -> str:
    import textwrap

    return textwrap.fill(text, width=width, initial_indent=first, subsequent_indent=" " * len(first))


EXIT_CODES = exit_codes()
"""The top-level command's paragraph (every code)."""


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


def in_flags(message: str, flags: Mapping[str, tuple[str, str]]) -> str:
    """``message`` with each Python keyword that stands for a flag spelled as the flag: ``flags`` maps a keyword to
    its flag and the flag's metavar (``{"max_memory": ("--max_memory", "DEVICE=SIZE,...")}``). ``kw='a'`` becomes
    ``--flag a``, ``kw=...`` ``--flag METAVAR``, a bare ``kw=`` ``--flag``; a flag the message then names twice in a
    row (``--config NAME (--config NAME)``) is named once.

    Example::

        >>> flags = {"max_seq_length": ("--max_seq_length", "N"), "config": ("--config", "NAME"),
        ...          "prefer": ("--weights", "NAME")}
        >>> in_flags("max_seq_length=300 is past; pass config=... (or --config NAME)", flags)
        '--max_seq_length 300 is past; pass --config NAME'
        >>> in_flags("prefer='model.safetensors' (--weights) names none", flags)
        '--weights model.safetensors names none'
    """
    if not flags:
        return message
    keyword = re.compile(r"(?<![\w.\-])(" + "|".join(map(re.escape, sorted(flags, key=len, reverse=True)))
                         + r")=(\.\.\.|'[^'\s]*'|\"[^\"\s]*\"|[\w/~](?:[\w:.\-/]*[\w/])?)?")

    def spelled(match: re.Match) -> str:
        flag, metavar = flags[match.group(1)]
        value = match.group(2)
        if value is None:
            return flag
        return f"{flag} {metavar if value == '...' else value.strip(chr(39) + chr(34))}"

    message = keyword.sub(spelled, message)
    # "--config NAME (or --config NAME)", "--weights x (--weights)": the flag once
    message = re.sub(r"(--(\w+)\b[^()]*?) \((?:or |command line: )?--\2\b[^()]*\)", r"\1", message)
    return re.sub(r"(--(\w+) [^\s()]+) or --\2(?: [^\s()]+)?(?=[\s).,;]|$)", r"\1", message)


def print_error(error: BaseException, flags: Mapping[str, tuple[str, str]] | None = None) -> None:
    """``error: <type>: <message>`` on stderr, Python keywords that are ``flags`` spelled as flags (:func:`in_flags`)."""
    print(f"error: {type(error).__name__}: {in_flags(str(error), flags or {})}", file=sys.stderr, flush=True)


def print_interrupted() -> None:
    """The one line a Ctrl-C leaves on stderr."""
    print(LINE, file=sys.stderr, flush=True)
