"""Which trace files the dashboard shows: command-line paths, else ``KVSCOPE_TRACE_FILES``. Pure."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dashboard.formatting import names, printable_path

ENV_VAR = "KVSCOPE_TRACE_FILES"
# JSON lines (gzip too), and the Collector's zstd and protobuf files (`traces.collector_files`)
TRACE_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".zst", ".zstd", ".pb", ".binpb")


@dataclass(frozen=True)
class TracePaths:
    paths: list[str]
    empty_folders: list[str] = field(default_factory=list)  # per folder given that held no trace file: what it held


def trace_paths(argv: Sequence[str], environ: Mapping[str, str]) -> TracePaths:
    """Paths given after ``--`` on the command line; when there are none, the comma-separated
    paths in ``KVSCOPE_TRACE_FILES``. A directory stands for the trace files directly inside it
    (names ending in `TRACE_SUFFIXES`); one holding none is named, with a few of the files it holds."""
    given = [a.strip() for a in argv if a.strip()]
    if not given:
        given = [p.strip() for p in environ.get(ENV_VAR, "").split(",") if p.strip()]
    out: list[str] = []
    empty: list[str] = []
    for path in given:
        if os.path.isdir(path):
            try:
                inside = sorted(Path(path).iterdir())
            except OSError as exc:
                empty.append(f"The folder {printable_path(path)} cannot be read ({exc.strerror or exc}).")
                continue
            found = [str(p) for p in inside if p.name.endswith(TRACE_SUFFIXES)]
            out += found
            if not found:
                empty.append(_no_trace_files(printable_path(path), [printable_path(p.name) for p in inside]))
        else:
            out.append(path)
    return TracePaths(out, empty)


def _no_trace_files(folder: str, held: list[str]) -> str:
    what = f"only {names(held, 3)}, which are left out" if held else "it is empty"
    return (f"The folder {folder} holds no trace files ({what}): the dashboard reads the files in a folder whose "
            f"names end in {', '.join(TRACE_SUFFIXES)}.")


def file_key(path: str) -> tuple[str, int, int]:
    """(path, modification time, size): changes when the file does, so caches re-read it."""
    try:
        st = os.stat(path)
    except OSError:
        return (path, -1, -1)
    return (path, st.st_mtime_ns, st.st_size)
