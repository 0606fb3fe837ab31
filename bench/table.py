"""Plain-text tables for the benchmarks' console output."""

from __future__ import annotations


def render_table(rows: list[tuple[str, ...]]) -> str:
    """First row is the header; the first column is left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        lines.append("  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
