"""How numbers read on the pages (decimal units: 1 GB = 1e9 bytes, as in GB/s). Pure."""

from __future__ import annotations

import math

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
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def count(n) -> str:
    return MISSING if _missing(n) else f"{int(n):,}"
