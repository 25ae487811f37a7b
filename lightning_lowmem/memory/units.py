"""Byte counts as people write them: ``'6GiB'`` in, ``'1.50 GiB'`` out."""

from __future__ import annotations

import math

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: int | float) -> str:
    """A byte count in binary units.

    Example::

        >>> format_bytes(1536 * 2**20)
        '1.50 GiB'
        >>> format_bytes(100)
        '100 B'
    """
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_bytes(value: int | str, name: str = "size") -> int:
    """A size given as an int of bytes or as text: ``GiB``/``MiB``/... are powers of 2, ``GB``/``MB``/... of 10.

    Args:
        value: the size.
        name: what it is, for the messages (``"max_memory['cpu']"``).

    Raises:
        TypeError: neither an int nor a str (a bool, a float, None).
        ValueError: text that is no size, or a size below 0 or past 2**63 bytes.

    Example::

        >>> parse_bytes("6GiB") == 6 * 2**30
        True
        >>> parse_bytes("1.5 GiB"), parse_bytes("500MB"), parse_bytes(4096)
        (1610612736, 500000000, 4096)
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{name} must be an int of bytes or a size such as '6GiB' or '500MB', got {value!r}.")
    if isinstance(value, int):
        return _in_range(value, value, name)
    text = value.strip().replace(" ", "")
    factors = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    number = text.rstrip("KMGTiBb").rstrip()
    unit = text[len(number):].upper()
    try:
        amount = float(number) * factors[unit]
        if not math.isfinite(amount):
            raise ValueError(number)
    except (KeyError, ValueError):
        raise ValueError(f"Cannot read {name}={value!r} as a size: use an int of bytes or e.g. '6GiB', "
                         "'500MB'.") from None
    return _in_range(int(amount), value, name)


def _in_range(nbytes: int, value: int | str, name: str) -> int:
    if not 0 <= nbytes < 2**63:
        raise ValueError(f"{name}={value!r} is {'below 0' if nbytes < 0 else 'past 2**63'} bytes: give a size of "
                         "0 or more, e.g. '6GiB'.")
    return nbytes
