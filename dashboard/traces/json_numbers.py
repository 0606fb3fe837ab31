"""OTLP/JSON integer fields (span times, status codes) read as protobuf's JSON parser reads them.

Python's ``int()`` is laxer than that parser: it turns ``true`` into 1, truncates ``1.5`` and takes
``" 12"`` or ``"1_000"``. A trace file with such values is wrong, and the replay app must say so
rather than show a time the writer never wrote.
"""

from __future__ import annotations

import re
from typing import Any

_DECIMAL = re.compile(r"-?[0-9]+")


def json_integer(value: Any) -> int:
    """The integer an OTLP/JSON int64/fixed64 field holds: a JSON integer, an integral JSON number
    (``1e3``) or a decimal string (``"1700000000000000000"``, how OTLP/JSON writes 64-bit integers).

    Raises ``ValueError`` for anything else: booleans, fractions, infinities, other strings, other types."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not value.is_integer():  # also NaN and infinities
            raise ValueError(f"{value!r} is not a whole number")
        return int(value)
    if isinstance(value, str) and _DECIMAL.fullmatch(value):
        return int(value)
    raise ValueError(f"{value!r} is not an integer")
