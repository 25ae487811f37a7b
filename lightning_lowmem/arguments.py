"""Arguments of the faces checked as they come in: whole numbers, real numbers, flags. A value of the wrong kind is
a ``TypeError``, one out of range a ``ValueError``; each names the argument, the value and what it takes.

A bool is not taken for a number (``True`` is an ``int`` to Python), nor NaN or infinity for a real.
"""

from __future__ import annotations

import math


def check_int(name: str, value: object, minimum: int = 1, *, optional: bool = False, below: int | None = None) -> None:
    """Raise unless ``value`` is an int >= ``minimum`` (and < ``below``), or None when ``optional``.

    Example::

        >>> check_int("max_new_tokens", 5)
        >>> check_int("max_new_tokens", 0)
        Traceback (most recent call last):
        ...
        ValueError: max_new_tokens must be an int >= 1, got 0.
    """
    if value is None and optional:
        return
    what = f"an int >= {minimum}" + (f" and < {below}" if below is not None else "") + (" or None" if optional else "")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {what}, got {value!r}.")
    if value < minimum or (below is not None and value >= below):
        raise ValueError(f"{name} must be {what}, got {value!r}.")


def check_real(name: str, value: object, minimum: float, maximum: float = math.inf, *, above: bool = False,
               optional: bool = False) -> float | None:
    """``value`` as a float, checked: a finite int or float in [``minimum``, ``maximum``] (above ``minimum`` when
    ``above``), or None when ``optional``.

    Example::

        >>> check_real("top_p", 1, 0.0, 1.0)
        1.0
        >>> check_real("temperature", float("nan"), 0.0)
        Traceback (most recent call last):
        ...
        ValueError: temperature must be a finite number >= 0.0, got nan.
    """
    if value is None and optional:
        return None
    bounds = (f"> {minimum}" if above else f">= {minimum}") + (f" and <= {maximum}" if maximum != math.inf else "")
    what = f"a finite number {bounds}" + (" or None" if optional else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {what}, got {value!r}.")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number < minimum or (above and number == minimum) or number > maximum:
        raise ValueError(f"{name} must be {what}, got {value!r}.")
    return number


def check_flag(name: str, value: object) -> None:
    """Raise unless ``value`` is True or False.

    Example::

        >>> check_flag("compile", "yes")
        Traceback (most recent call last):
        ...
        TypeError: compile must be True or False, got 'yes'.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}.")
