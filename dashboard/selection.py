"""Which request a page's table keeps selected while its rows change (a search, a filter). Pure.

Streamlit remembers a table's selection by row position: after the rows change, the same position
is another request. So pages remember the rows' request keys (trace id, request id) of the run the
selection was made on, and move the selection to where that request is now.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Hashable


def follow_selection(selected_rows: Sequence[int], previous_keys: Sequence[Hashable],
                     keys: Sequence[Hashable]) -> int | None:
    """The row of `keys` (the table now) holding the request selected at `selected_rows` of `previous_keys`
    (the table the selection was made on); None when nothing was selected or that request is not shown now."""
    if not selected_rows or not 0 <= selected_rows[0] < len(previous_keys):
        return None
    return row_of(keys, previous_keys[selected_rows[0]])


def row_of(keys: Sequence[Hashable], key: Hashable) -> int | None:
    """The row of `key` in `keys`, or None."""
    try:
        return list(keys).index(key)
    except ValueError:
        return None
