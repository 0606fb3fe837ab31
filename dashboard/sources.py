"""Which trace files the dashboard shows: command-line paths, else ``KVSCOPE_TRACE_FILES``. Pure."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

ENV_VAR = "KVSCOPE_TRACE_FILES"
# JSON lines (gzip too), and the Collector's zstd and protobuf files (`traces.collector_files`)
TRACE_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".zst", ".zstd", ".pb", ".binpb")


def trace_paths(argv: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """Paths given after ``--`` on the command line; when there are none, the comma-separated
    paths in ``KVSCOPE_TRACE_FILES``. A directory stands for the trace files directly inside it."""
    given = [a.strip() for a in argv if a.strip()]
    if not given:
        given = [p.strip() for p in environ.get(ENV_VAR, "").split(",") if p.strip()]
    out: list[str] = []
    for path in given:
        if os.path.isdir(path):
            out += sorted(str(p) for p in Path(path).iterdir() if p.name.endswith(TRACE_SUFFIXES))
        else:
            out.append(path)
    return out


def file_key(path: str) -> tuple[str, int, int]:
    """(path, modification time, size): changes when the file does, so caches re-read it."""
    try:
        st = os.stat(path)
    except OSError:
        return (path, -1, -1)
    return (path, st.st_mtime_ns, st.st_size)
