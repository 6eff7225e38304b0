"""Byte sizes as people write them ("300MiB", "2GB") and as meshfit prints them."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


# No machine's memory comes near an exabyte: a larger size is a typo (and 1e400GiB would not even be a
# number), refused rather than planned or budgeted with.
MAX_BYTES = 2**60
_UNIT_HELP = "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 300MiB"


def parse_bytes(value: int | float | str) -> int:
    """Parse "300MiB", "2GB", "1.5 GiB" or a plain number of bytes; decimal units are powers of 1000.
    ValueError for anything else, a negative size, or one beyond MAX_BYTES (1 EiB)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 300MiB or 2GB, got {value!r}")
    if isinstance(value, (int, float)):
        size = value  # an int stays exact (float() of a 400-digit int would overflow)
    else:
        match = _PATTERN.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"cannot read {value!r} as a size; write a number with one of the units {_UNIT_HELP}")
        size = float(match.group(1)) * _UNITS[unit]  # a float: 1e400 reads as inf, caught below
    if size != size:  # NaN
        raise ValueError(f"{value!r} is not a size; write a number with one of the units {_UNIT_HELP}")
    if size < 0:
        raise ValueError(f"a size cannot be negative (got {value})")
    if size > MAX_BYTES:
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:20]}… ({len(repr(value))} characters)"
        raise ValueError(f"{shown} is larger than any machine's memory (the limit is 1 EiB = 1024 PiB); "
                         "write a size such as 80GiB")
    return int(value) if isinstance(value, int) else int(size)


def fmt_bytes(n: int | float | None) -> str:
    """Human-readable binary size, e.g. 12.3 MiB."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def fmt_count(n: int | float) -> str:
    """A count as people say it: 812, 5.5M, 8.03B (parameters, tokens)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.3g}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{n:.0f}"


def fmt_duration(seconds: float) -> str:
    """A time as people read it, three significant figures below a minute: 789 µs, 45.6 ms, 1.23 s (plan
    tables, where a tiny model's step would otherwise read 0.00 s); then 4m05s, 2h13m (ETAs)."""
    if seconds <= 0:
        return "0 s"
    if seconds >= 59.5:
        minutes, secs = divmod(int(round(seconds)), 60)
        hours, minutes = divmod(minutes, 60)
        return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        value = seconds / scale
        if abs(value) >= 1 or unit == "ns":
            break
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    return f"{value:.{digits}f} {unit}"
