"""The transformers release installed, for the loading rules that changed between releases.

The library follows what ``from_pretrained`` of the installed release does (transformers 4.46 through 5.x). Where
a rule changed between releases, the code that follows it asks :func:`at_least` with the release that brought the
change (each such place names it), rather than guessing from what a module happens to have.

Example::

    >>> at_least(4, 46) in (True, False)
    True
"""

from __future__ import annotations

import re
from functools import cache

@cache
def installed() -> tuple[int, int] | None:
    """``(major, minor)`` of the installed transformers (``"4.57.6"`` -> ``(4, 57)``), or None when it is not
    installed. Read from the package's metadata, else from transformers when something imported it (a copy put on
    the path without metadata); transformers itself is not imported here."""
    import sys
    from importlib.metadata import PackageNotFoundError, version

    try:
        spelled_as = version("transformers")
    except PackageNotFoundError:
        spelled_as = getattr(sys.modules.get("transformers"), "__version__", "")
    found = re.match(r"(\d+)\.(\d+)", spelled_as)
    return (int(found[1]), int(found[2])) if found else None


def at_least(major: int, minor: int = 0) -> bool:
    """Whether the installed transformers is ``major.minor`` or newer (False when it is not installed)."""
    release = installed()
    return release is not None and release >= (major, minor)


def spelled() -> str:
    """The installed release as users write it (``"4.57"``), for messages; ``"not installed"`` without one."""
    release = installed()
    return "not installed" if release is None else f"{release[0]}.{release[1]}"
