"""Byte counts as people write them: ``'6GiB'`` in, ``'1.50 GiB'`` out."""

from __future__ import annotations

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


def parse_bytes(value: int | str) -> int:
    """A size given as an int of bytes or as text: ``GiB``/``MiB``/... are powers of 2, ``GB``/``MB``/... of 10.

    Example::

        >>> parse_bytes("6GiB") == 6 * 2**30
        True
        >>> parse_bytes("1.5 GiB"), parse_bytes("500MB"), parse_bytes(4096)
        (1610612736, 500000000, 4096)
    """
    if isinstance(value, int):
        return value
    text = value.strip().replace(" ", "")
    factors = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    number = text.rstrip("KMGTiBb").rstrip()
    unit = text[len(number):].upper()
    if unit not in factors or not number:
        raise ValueError(f"Cannot read {value!r} as a size: use an int of bytes or e.g. '6GiB', '500MB'.")
    return int(float(number) * factors[unit])
