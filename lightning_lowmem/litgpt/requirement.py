"""litgpt, imported where it is used; its absence is one clear ``ImportError`` saying what needs it and what to install.

litgpt is an optional dependency (the ``litgpt`` extra): ``import lightning_lowmem`` and
:func:`~lightning_lowmem.load_checkpoint` on any module work without it; ``generate``,
``estimate_memory``, ``patch_litgpt`` and the ``lightning-lowmem`` command need it. Every import of
litgpt in the package goes through :func:`import_litgpt`, so the message is the same wherever it is
missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = "pip install 'lightning-lowmem[litgpt]'"
"""What installs litgpt at the version lightning_lowmem is tested with (the extra pins it)."""


def import_litgpt(name: str = "litgpt", *, needed_by: str) -> ModuleType:
    """The litgpt module ``name`` (``"litgpt"``, ``"litgpt.generate.base"``, ...), imported.

    Args:
        name: the module's dotted name.
        needed_by: what needs it, for the message (``"lightning_lowmem.generate()"``).

    Raises:
        ImportError: litgpt (or that module of it) cannot be imported: the message names ``needed_by`` and
            what to install. An ImportError from one of litgpt's own dependencies is raised as it is.

    Example::

        >>> import_litgpt("litgpt.config", needed_by="this example").Config.__name__
        'Config'
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and e.name != "litgpt" and not e.name.startswith("litgpt."):
            raise  # litgpt is there, one of its own dependencies is not: its message says which
        raise ImportError(f"{needed_by} needs litgpt, which cannot be imported here ({e}). Install it with "
                          f"{INSTALL}: the extra pins the litgpt version lightning_lowmem is tested with.") from e
