"""What the trace reader skipped: one `Problem` per file and line, and how the pages list them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from dashboard.formatting import names


# Not a fault: the same span in two files (a Collector's copy beside the connector's trace file, as the
# README suggests reading them together, or a file given twice) is kept once.
DUPLICATE_SPAN = "duplicate span (same ids and times as an earlier one)"


@dataclass(frozen=True)
class Problem:
    """Something the reader skipped: `line` is 1-based, 0 when it concerns the whole file."""

    file: str
    line: int
    reason: str
    spans: int | None = 0  # kvscope spans skipped because of it; None: unknown (a line or file not read)


def problems_frame(problems: Sequence[Problem]) -> pd.DataFrame:
    """Problems as a table sorted by file and line: a problem with a whole file first, its line NA (not 0,
    which no file has); spans skipped NA where unknown."""
    frame = pd.DataFrame(
        [(p.file, p.line, p.reason, p.spans) for p in problems],
        columns=["file", "line", "reason", "spans skipped"],
    )
    frame = frame.sort_values(["file", "line"], kind="stable").reset_index(drop=True)
    frame["line"] = frame["line"].astype("Int64").mask(frame["line"] == 0)
    frame["spans skipped"] = frame["spans skipped"].astype("Int64")
    return frame


def problem_lines(problems: Sequence[Problem], limit: int = 8) -> str:
    """Where the problems are, briefly: "a.jsonl lines 3, 4, 10; b.jsonl (cannot read file: No such file or
    directory)": a problem with a whole file says what it is, as the file may hold nothing else, and so
    does a file's only bad line ("c.json line 1 (no resourceSpans: ...)")."""
    by_file: dict[str, tuple[dict[int, str], dict[str, None]]] = {}  # a dict: a file can have 100k bad lines
    for p in problems:
        lines, reasons = by_file.setdefault(p.file, ({}, {}))
        if p.line:
            lines.setdefault(p.line, p.reason)
        else:
            reasons[p.reason] = None  # a dict keeps them in order, once each
    parts = []
    for file, (lines, reasons) in by_file.items():
        name = Path(file).name if not file.startswith("upload: ") else file
        where = [f"({reason})" for reason in reasons]
        if len(lines) == 1:
            (line, reason), = lines.items()
            where.append(f"line {line} ({reason})")
        elif lines:
            where.append(f"lines {names(sorted(lines), limit)}")
        parts.append(f"{name} {' '.join(where)}")
    return "; ".join(parts)


def problem_reasons(problems: Sequence[Problem], limit: int = 5) -> list[str]:
    """Each reason once, with where it occurred ("a.jsonl lines 1, 2, 3: kvscope scope version '9.9' is not
    supported ..."), for a terminal, which has no table of every problem: `problem_lines` names a bad line's
    reason only when it is its file's only one. At most `limit` reasons, then how many more."""
    where: dict[str, dict[str, list[int]]] = {}  # reason -> file -> lines (0: the whole file), in order
    for p in problems:
        where.setdefault(p.reason, {}).setdefault(p.file, []).append(p.line)
    out = []
    for reason, files in list(where.items())[:limit]:
        places = []
        for file, lines in files.items():
            name = Path(file).name if not file.startswith("upload: ") else file
            numbered = sorted({line for line in lines if line})
            places.append(name if not numbered else
                          f"{name} line{'s' if len(numbered) > 1 else ''} {names(numbered, limit)}")
        out.append(f"{'; '.join(places)}: {reason}")
    if len(where) > limit:
        out.append(f"and {len(where) - limit} more reason(s): --json lists every problem")
    return out
