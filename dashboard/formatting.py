"""How numbers read on the pages (decimal units: 1 GB = 1e9 bytes, as in GB/s). Pure."""

from __future__ import annotations

import math
import os

MISSING = "–"


def _missing(value) -> bool:
    try:
        return value is None or math.isnan(float(value))
    except (TypeError, ValueError):
        return True


def percent(ratio, digits: int = 1) -> str:
    return MISSING if _missing(ratio) else f"{float(ratio) * 100:.{digits}f}%"


def millis(value, digits: int = 2) -> str:
    return MISSING if _missing(value) else f"{float(value):.{digits}f} ms"


def data_size(n_bytes) -> str:
    if _missing(n_bytes):
        return MISSING
    value = float(n_bytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        # Rounded before the unit is chosen, as in `duration`: 999,999 bytes are "1 MB", not "1e+03 kB"
        shown = f"{value:.0f}" if unit == "B" else f"{value:.3g}"
        if abs(float(shown)) < 1000:
            return f"{shown} {unit}"
        if unit == "TB":  # no larger unit: whole terabytes, not "2e+03 TB"
            return f"{value:,.0f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def count(n) -> str:
    return MISSING if _missing(n) else f"{int(n):,}"


def duration(seconds) -> str:
    """A span of time in the units that read best: "850 ms", "42.5 s", "3 min 5 s", "3 h 2 min", "1.1 d"."""
    if _missing(seconds):
        return MISSING
    s = float(seconds)
    # Rounded before the unit is chosen: 0.9996 s is "1.0 s", not "1e+03 ms"; 59.97 s is "1 min 0 s", not "60.0 s".
    ms = f"{s * 1e3:.3g}"
    if abs(float(ms)) < 1000:
        return f"{ms} ms"
    if abs(round(s, 1)) < 60:
        return f"{s:.1f} s"
    whole = round(s)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    if whole < 86400:
        return f"{whole // 3600} h {whole % 3600 // 60} min"
    return f"{s / 86400:.1f} d"


def names(values, limit: int = 5) -> str:
    """The first `limit` values, comma-separated, then how many more: "a, b, c and 4 more"."""
    values = [str(v) for v in values]
    more = f" and {len(values) - limit} more" if len(values) > limit else ""
    return ", ".join(values[:limit]) + more


def printable_path(path: str) -> str:
    """A path as text any terminal or page can show: the bytes of a name that are not UTF-8 as ``\\xff``
    (as ``ls -b`` shows them), not the surrogates Python decodes them to."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")
