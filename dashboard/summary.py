"""`kvscope summary`: the replay app's Overview as text or JSON, for a terminal without a browser (a GPU node
over SSH) or a script. The same reader and shaping as the app (`traces`), so its figures are the Overview's."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dashboard import formatting, sources, traces

# The Overview's tables, by the columns a terminal has room for (name in the frame -> heading)
_GROUP_COLUMNS = {"group": "group", "scans": "loads", "blocks_scanned": "scanned",
                  "blocks_null_skipped": "null skipped", "null_skip_share": "null-skip share",
                  "blocks_loaded": "blocks loaded", "bytes_loaded": "bytes loaded", "load_gb_per_s": "load GB/s",
                  "bytes_stored": "bytes stored", "store_gb_per_s": "store GB/s"}
_LATENCY_COLUMNS = {"scope": "scope", "count": "count", "p50_ms": "p50 (ms)", "p95_ms": "p95 (ms)",
                    "p99_ms": "p99 (ms)", "max_ms": "max (ms)"}
_MISSES_COLUMNS = {"miss_reason": "reason", "lookups": "lookups", "tokens_not_served": "tokens not served",
                   "share": "share"}
_ENGINE_COLUMNS = {"engine": "engine", "requests": "requests", "tokens_queried": "tokens queried",
                   "tokens_hit": "tokens hit", "hit_rate": "hit rate", "requests_load_failed": "failed loads",
                   "load_p50_ms": "load p50 (ms)", "load_p95_ms": "load p95 (ms)"}
_SLOWEST_COLUMNS = {"request": "request", "t_s": "arrival (s)", "load_ms": "load time (ms)",
                    "load_copy_ms": "copying (ms)", "load_wait_ms": "before the copies (ms)",
                    "tokens_loaded": "tokens loaded", "bytes_loaded": "bytes loaded", "trace_id": "trace"}


@dataclass(frozen=True)
class Summary:
    read: traces.Traces
    requests: pd.DataFrame
    numbers: dict
    misses: pd.DataFrame
    groups: pd.DataFrame
    latency: pd.DataFrame
    slowest: pd.DataFrame
    engines: pd.DataFrame
    empty_folders: list[str] = field(default_factory=list)
    # engine index (None: none named) -> processes its lookups came from, where several (`engines_run_apart`)
    engines_run_apart: dict = field(default_factory=dict)

    @property
    def has_requests(self) -> bool:
        return not self.requests.empty


def summarize(paths: Sequence[str], environ: Mapping[str, str], slowest: int = 5) -> Summary:
    """Read ``paths`` (files or folders of them; none: ``KVSCOPE_TRACE_FILES``) as the app does, and shape what its
    Overview shows, with the ``slowest`` longest loads."""
    found = sources.trace_paths(paths, environ)
    read = traces.read_trace_files(found.paths)
    requests = traces.requests_table(read.spans, read.vllm_requests)
    spans = read.spans
    if requests.empty:
        empty = pd.DataFrame()
        return Summary(read, requests, {}, empty, empty, empty, empty, empty, found.empty_folders)
    engines = traces.engine_summary(requests)
    return Summary(read, requests, traces.overview_numbers(requests, spans), traces.misses_by_reason(spans),
                   traces.group_summary(spans, requests), traces.load_latency_quantiles(spans, requests),
                   traces.top_slow_loads(requests, slowest), engines if len(engines) > 1 else pd.DataFrame(),
                   found.empty_folders, traces.engines_run_apart(spans))


def why_empty(summary: Summary) -> str:
    """What to say when the files hold no request: no path given, folders without trace files, or files without
    kvscope lookup or load spans."""
    if summary.read.files:
        problems = _problems(summary)
        return ("the trace files hold no kvscope lookup or load spans"
                + (" that could be read" if problems else "") + f": {formatting.names(summary.read.files)}"
                + (f" ({traces.problem_lines(problems)})" if problems else "")
                + "".join(f"\n  {text}" for text in _reasons(problems)))
    if summary.empty_folders:
        return " ".join(summary.empty_folders)
    return (f"no trace files: give their paths (files or folders of them) or set {sources.ENV_VAR} "
            "(comma-separated)")


def as_text(summary: Summary) -> str:
    """The Overview in words and fixed-width tables."""
    n, read = summary.numbers, summary.read
    out = [f"{formatting.count(n['requests'])} traced requests over {formatting.duration(n['duration_s'])}, from "
           f"{len(read.files)} file(s)"]
    problems = _problems(summary)
    if problems:
        out.append(f"{len(problems)} problem(s) while reading, everything else shown: "
                   f"{traces.problem_lines(problems)}")
        out += [f"  {text}" for text in _reasons(problems)]
    out += [
        "",
        f"token hit rate  {formatting.percent(n['hit_rate'])} ({formatting.count(n['tokens_hit'])} of "
        f"{formatting.count(n['tokens_queried'])} tokens queried; {formatting.count(n['requests_with_hit'])} "
        "requests with a hit)",
        f"load time       p50 {formatting.millis(n['load_p50_ms'])}, p95 {formatting.millis(n['load_p95_ms'])}, "
        f"p99 {formatting.millis(n['load_p99_ms'])} ({formatting.count(n['loads_timed'])} timed)",
        f"host traffic    loaded {formatting.data_size(n['bytes_loaded'])}, "
        f"stored {formatting.data_size(n['bytes_stored'])}",
    ]
    out += [f"note: {text}" for text in summary.empty_folders]  # (folders given beside the files read)
    out += [f"warning: {text}" for text in _warnings(n)]
    if summary.engines_run_apart:
        out.append(f"warning: {traces.engines_run_apart_note(summary.engines_run_apart)}")
    for title, frame, columns, footnote in (
            ("by engine", summary.engines, _ENGINE_COLUMNS, None),
            # its tokens are not kvscope_missed_tokens_total's split: say how
            ("why the host tier served no more", summary.misses, _MISSES_COLUMNS, traces.MISSES_DEFINITION),
            ("KV groups", summary.groups, _GROUP_COLUMNS, None),
            ("load latency", summary.latency, _LATENCY_COLUMNS, None),
            ("slowest loads", summary.slowest, _SLOWEST_COLUMNS, None)):
        if not frame.empty:
            out += ["", f"{title}:", _table(frame, columns), *([footnote] if footnote else [])]
    return "\n".join(out) + "\n"


def as_json(summary: Summary) -> str:
    """The same figures as one JSON document: unknown values (no load timed, say) are null."""
    document = {
        "files": summary.read.files,
        "problems": [{"file": p.file, "line": p.line, "reason": p.reason, "spans_skipped": p.spans}
                     for p in _problems(summary)],
        "empty_folders": summary.empty_folders,
        "spans_read_twice": sum(p.spans or 0 for p in summary.read.problems if p.reason == traces.DUPLICATE_SPAN),
        "numbers": {key: _plain(value) for key, value in summary.numbers.items()},
        "by_engine": _records(summary.engines),
        # engine index -> processes its lookups came from, where several ("none": files naming no engine)
        "engines_run_apart": {("none" if engine is None else str(engine)): n
                              for engine, n in summary.engines_run_apart.items()},
        "misses_by_reason": _records(summary.misses),
        "groups": _records(summary.groups),
        "load_latency": _records(summary.latency),
        "slowest_loads": _records(summary.slowest),
    }
    return json.dumps(document, indent=2, allow_nan=False) + "\n"


def _problems(summary: Summary) -> list:
    """What the reader skipped; not spans read twice, which count once."""
    return [p for p in summary.read.problems if p.reason != traces.DUPLICATE_SPAN]


def _reasons(problems: list) -> list[str]:
    """What each problem is, where `problem_lines` has not said it already (it says a file's only one): a terminal
    has no table of them, as the app has."""
    one_line = len({(p.file, p.line) for p in problems}) == 1
    if len(problems) <= 1 or (one_line and len({p.reason for p in problems}) == 1):
        return []
    return traces.problem_reasons(problems)


def _warnings(n: dict) -> list[str]:
    """The Overview's warnings, shortened."""
    said = []
    if n["requests_load_failed"]:
        said.append(f"{formatting.count(n['requests_load_failed'])} request(s) had a load that failed on a worker: "
                    "vLLM recomputed their tokens")
    if n["loads_without_copies"]:
        said.append(f"{formatting.count(n['loads_without_copies'])} of {formatting.count(n['loads'])} loads have no "
                    "copy spans (a worker's trace file missing or cut short?): their load times are unknown")
    if n["transfers_short_of_workers"]:
        said.append(f"{formatting.count(n['transfers_short_of_workers'])} loads or stores have copy spans from fewer "
                    f"workers than the others ({n['workers']}): their bytes and copy times are partial")
    if n["stores_without_copies"]:
        said.append(f"{formatting.count(n['stores_without_copies'])} of {formatting.count(n['stores'])} stores have "
                    "no copy spans (a worker's trace file missing or cut short?): their bytes are in no total")
    if n["copies_without_owner"]:
        said.append(f"{formatting.count(n['copies_without_owner'])} copy span(s) belong to no load or store in these "
                    "files")
    if n["requests_deferred"]:
        said.append(f"{formatting.count(n['requests_deferred'])} request(s) waited for device KV room: "
                    f"{formatting.millis(n['deferral_wait_p50_ms'])} median, at most "
                    f"{formatting.millis(n['deferral_wait_max_ms'])}; {formatting.count(n['requests_ended_waiting'])} "
                    "ended waiting")
    return said


def _table(frame: pd.DataFrame, columns: Mapping[str, str]) -> str:
    """``frame``'s ``columns`` under their headings, each formatted as the app's column of that name is (by its
    name's convention: ``bytes_*`` sizes, ``*share`` and ``*rate`` percentages, ``*_ms``/``*_s``/GB/s three
    decimals), unknown values as –."""
    shown = frame[[c for c in columns if c in frame.columns]].copy()
    for name in shown.columns:
        if name.startswith("bytes"):
            shown[name] = shown[name].map(formatting.data_size)
        elif name.endswith(("share", "rate")):
            shown[name] = shown[name].map(formatting.percent)
        elif name.endswith(("_ms", "_s", "gb_per_s")):
            shown[name] = shown[name].map(lambda v: "–" if pd.isna(v) else f"{v:.3f}")
        elif pd.api.types.is_integer_dtype(shown[name]):
            shown[name] = shown[name].map(formatting.count)
    shown = shown.astype(object).where(shown.notna(), "–").rename(columns=dict(columns))
    return shown.to_string(index=False)


def _records(frame: pd.DataFrame) -> list[dict]:
    return [{str(k): _plain(v) for k, v in row.items()} for row in frame.to_dict("records")]


def _plain(value):
    """A JSON value: numpy numbers as Python's, NaN and NA as None."""
    if value is None or value is pd.NA or value is pd.NaT:
        return None
    if isinstance(value, (np.integer, np.bool_)):
        return value.item()
    if isinstance(value, (float, np.floating)):
        return None if math.isnan(value) else float(value)
    return value
