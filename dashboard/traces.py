"""kvscope trace files -> pandas frames, and the shaping behind every dashboard view.

Pure: no Streamlit, no clock, no network. The reader takes OTLP/JSON lines (one
``ExportTraceServiceRequest`` per line, as the connector and the OpenTelemetry Collector's file
exporter write them) and returns one row per kvscope span plus a list of problems (file, line,
reason) for everything it skipped. The shaping functions turn the span frame into the tables
and series the pages show; they never re-read files.

Speed: parsing costs one ``json.loads`` per line and one small loop per span that only copies
fields; converting, validating and joining are done column-wise afterwards.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

# -- span contract (DESIGN.md §2) -------------------------------------------------------------

SCOPE_NAME = "kvscope"
# Scope versions whose span schema this reader knows ("0.1" accepts 0.1, 0.1.0, 0.1.3.dev1, ...).
SUPPORTED_SCOPE_VERSIONS = ("0.1",)

LOOKUP = "kvscope.lookup"
LOAD = "kvscope.load"
SCAN = "kvscope.group.scan"
COPY = "kvscope.group.copy"
STORE = "kvscope.store"
SPAN_NAMES = (LOOKUP, LOAD, SCAN, COPY, STORE)

GROUP_KINDS = ("full_attention", "sliding_window", "mamba")
DIRECTIONS = ("load", "store")
PAST_TENSE = {"load": "loaded", "store": "stored"}  # column names: bytes_loaded, bytes_stored

# Attribute key -> (column, is integer). Every other attribute stays in the `attributes` dict.
ATTRIBUTE_COLUMNS: dict[str, tuple[str, bool]] = {
    "kvscope.request.id": ("request_id", False),
    "kvscope.tokens.queried": ("tokens_queried", True),
    "kvscope.tokens.hit": ("tokens_hit", True),
    "kvscope.tokens.local": ("tokens_local", True),
    "kvscope.tokens.external": ("tokens_external", True),
    "kvscope.groups": ("groups", True),
    "kvscope.blocks": ("blocks", True),
    "kvscope.group.index": ("group_index", True),
    "kvscope.group.kind": ("group_kind", False),
    "kvscope.group.blocks.total": ("blocks_total", True),
    "kvscope.group.blocks.null_skipped": ("blocks_null_skipped", True),
    "kvscope.group.blocks.pending": ("blocks_pending", True),
    "kvscope.group.blocks.start": ("blocks_start", True),
    "kvscope.copy.direction": ("copy_direction", False),
    "kvscope.copy.blocks": ("copy_blocks", True),
    "kvscope.copy.bytes": ("copy_bytes", True),
    "kvscope.worker.rank": ("worker_rank", True),
}

REQUIRED_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    LOOKUP: ("kvscope.request.id", "kvscope.tokens.queried", "kvscope.tokens.hit"),
    LOAD: ("kvscope.request.id", "kvscope.tokens.local", "kvscope.tokens.external", "kvscope.groups"),
    SCAN: (
        "kvscope.group.index",
        "kvscope.group.kind",
        "kvscope.group.blocks.total",
        "kvscope.group.blocks.null_skipped",
        "kvscope.group.blocks.pending",
        "kvscope.group.blocks.start",
    ),
    COPY: (
        "kvscope.group.index",
        "kvscope.group.kind",
        "kvscope.copy.direction",
        "kvscope.copy.blocks",
        "kvscope.copy.bytes",
    ),
    STORE: ("kvscope.request.id", "kvscope.groups", "kvscope.blocks"),
}

ALLOWED_VALUES: dict[str, tuple[str, ...]] = {
    "kvscope.group.kind": GROUP_KINDS,
    "kvscope.copy.direction": DIRECTIONS,
}

# `attributes` holds the attributes that have no column of their own (dict or None).
SPAN_COLUMNS = (
    "trace_id",
    "span_id",
    "parent_span_id",
    "name",
    "start_ns",
    "end_ns",
    "duration_ms",
    *(col for col, _ in ATTRIBUTE_COLUMNS.values()),
    "owner_span_id",
    "status_code",
    "attributes",
    "source_file",
    "source_line",
)

LOAD_TIME_DEFINITION = (
    "Load time of a request: from the start of its `kvscope.load` span to the end of the last "
    "`kvscope.group.copy` span with direction `load` that belongs to that load (a child of the "
    "load span, or else in the same trace). Copy spans carry the measured copy interval."
)
HIT_RATE_DEFINITION = (
    "Token hit rate: Σ `tokens.hit` / Σ `tokens.queried` over requests, using each request's "
    "last `kvscope.lookup` (a request looked up again while it waited is counted once)."
)
GROUP_HIT_RATE_DEFINITION = (
    "A lookup is joint over all KV groups (a prefix hits only where every group can serve it), so a "
    "group's hit rate is the token hit rate of the requests whose load scanned that group."
)
REPLAY_DEFINITION = (
    "Step i shows the state right before request i+1 arrives: hit rate over requests 1..i, and host "
    "traffic of the copies that had finished by then (all copies at the last step)."
)


# -- reading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """Something the reader skipped: `line` is 1-based, 0 when it concerns the whole file."""

    file: str
    line: int
    reason: str
    spans: int = 0  # kvscope spans skipped because of it


@dataclass(frozen=True)
class Traces:
    """Result of reading trace files: one row per kvscope span, and what was skipped."""

    spans: pd.DataFrame
    problems: list[Problem] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    lines: int = 0  # non-empty lines read
    other_spans: int = 0  # spans outside kvscope (e.g. vLLM's own request spans), left out

    @property
    def empty(self) -> bool:
        return self.spans.empty


@dataclass(frozen=True)
class TraceSource:
    """In-memory trace file (e.g. an upload): a label for messages and its bytes."""

    name: str
    data: bytes


@dataclass
class DecodedSpans:
    """The kvscope spans of one file, column-wise, before validation (both decoders' output).

    `values[key]` holds one entry per span: float64 with NaN for integer attributes, objects with
    None for string attributes; `invalid[key]` marks values present but not convertible.
    """

    trace_id: Sequence[Any]
    span_id: Sequence[Any]
    parent_span_id: Sequence[Any]
    name: Sequence[Any]
    start_ns: np.ndarray
    end_ns: np.ndarray
    status_code: np.ndarray
    source_line: np.ndarray
    values: dict[str, np.ndarray]
    invalid: dict[str, np.ndarray]
    extra_attributes: list[dict[str, Any] | None]
    problems: list[Problem] = field(default_factory=list)
    other_spans: int = 0
    lines: int = 0


def read_trace_files(sources: Iterable[str | os.PathLike[str] | TraceSource]) -> Traces:
    """Read trace files (paths, ``.gz`` allowed, or in-memory sources) into one span frame.

    Never raises on bad input: unreadable files, lines that are not OTLP/JSON, spans without the
    attributes their name requires, duplicate spans and unknown kvscope scope versions become
    `Problem`s, and everything else loads.
    """
    frames: list[pd.DataFrame] = []
    problems: list[Problem] = []
    files: list[str] = []
    lines = other = 0
    for source in sources:
        if isinstance(source, TraceSource):
            label, data = source.name, source.data
        else:
            label = os.fspath(source)
            try:
                data = Path(label).read_bytes()
            except OSError as exc:
                files.append(label)
                problems.append(Problem(label, 0, f"cannot read file: {exc.strerror or exc}"))
                continue
        files.append(label)
        try:
            data = _maybe_gunzip(data)
        except (OSError, EOFError) as exc:
            problems.append(Problem(label, 0, f"cannot decompress: {exc}"))
            continue
        decoded = decode_spans(label, data)
        frame, rejected = _validated_frame(decoded, label)
        frames.append(frame)
        problems += decoded.problems + rejected
        lines += decoded.lines
        other += decoded.other_spans
    spans, duplicates = _combine(frames)
    order = {name: i for i, name in enumerate(files)}
    problems = sorted(problems + duplicates, key=lambda p: (order.get(p.file, len(order)), p.line))
    return Traces(spans=spans, problems=problems, files=files, lines=lines, other_spans=other)


def decode_spans(label: str, data: bytes) -> DecodedSpans:
    """Decode one file's bytes: the Arrow decoder when the file is clean, else line by line.

    The Arrow decoder parses the whole file in C++ and unnests it column-wise; it declines
    (returns None) on anything unusual, such as a line that does not parse or a value of an
    unexpected type, and the line-by-line decoder then reports each problem with its line.
    """
    from dashboard import otlp_arrow  # noqa: PLC0415 - imported here: otlp_arrow imports this module

    lines = _split_lines(data)
    fast = otlp_arrow.decode(data, label, lines)
    return fast if fast is not None else decode_lines(label, lines)


def problems_frame(problems: Sequence[Problem]) -> pd.DataFrame:
    """Problems as a table sorted by file and line."""
    frame = pd.DataFrame(
        [(p.file, p.line, p.reason, p.spans) for p in problems],
        columns=["file", "line", "reason", "spans skipped"],
    )
    return frame.sort_values(["file", "line"], kind="stable").reset_index(drop=True)


def problem_lines(problems: Sequence[Problem], limit: int = 8) -> str:
    """Where the problems are, briefly: "a.jsonl lines 3, 4, 10; b.jsonl (whole file)"."""
    by_file: dict[str, list[int]] = {}
    for p in problems:
        by_file.setdefault(p.file, [])
        if p.line and p.line not in by_file[p.file]:
            by_file[p.file].append(p.line)
    parts = []
    for file, lines in by_file.items():
        name = Path(file).name if not file.startswith("upload: ") else file
        if not lines:
            parts.append(f"{name} (whole file)")
            continue
        shown = ", ".join(map(str, sorted(lines)[:limit]))
        more = f" and {len(lines) - limit} more" if len(lines) > limit else ""
        parts.append(f"{name} line{'s' if len(lines) > 1 else ''} {shown}{more}")
    return "; ".join(parts)


def _maybe_gunzip(data: bytes) -> bytes:
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def _split_lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")


def decode_lines(label: str, lines: Iterable[bytes]) -> DecodedSpans:
    """The line-by-line decoder: one `json.loads` per line, one small loop per span."""
    rows: list[tuple] = []
    problems: list[Problem] = []
    other = count = 0
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        count += 1
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as exc:
            problems.append(Problem(label, lineno, f"not JSON: {exc.msg} (column {exc.colno})"))
            continue
        except ValueError as exc:  # UnicodeDecodeError
            problems.append(Problem(label, lineno, f"not UTF-8 text: {_short(exc)}"))
            continue
        if not isinstance(doc, dict):
            problems.append(Problem(label, lineno, f"expected a JSON object, got {type(doc).__name__}"))
            continue
        resource_spans = doc.get("resourceSpans")
        if resource_spans is None:
            problems.append(Problem(label, lineno, _not_a_trace_export(doc)))
            continue
        try:
            line_rows, line_other, line_problems = _parse_export(resource_spans, label, lineno)
        except (AttributeError, TypeError, KeyError, ValueError) as exc:
            problems.append(Problem(label, lineno, f"not an OTLP trace export: {_short(exc)}"))
            continue
        rows += line_rows
        other += line_other
        problems += line_problems
    return _columns_from_rows(rows, problems, other, count)


def _not_a_trace_export(doc: dict) -> str:
    other = [k for k in ("resourceMetrics", "resourceLogs") if doc.get(k) is not None]
    hint = f" (a {other[0]} export)" if other else ""
    return f"no resourceSpans: not a trace export{hint}"


def unsupported_version_reason(version: Any) -> str:
    supported = ", ".join(v + ".x" for v in SUPPORTED_SCOPE_VERSIONS)
    return f"kvscope scope version {version!r} is not supported (this dashboard reads {supported})"


def _parse_export(resource_spans: list, label: str, lineno: int) -> tuple[list[tuple], int, list[Problem]]:
    """Copy the fields of every kvscope span of one line; conversion happens column-wise later."""
    rows: list[tuple] = []
    other = 0
    bad: Counter[str] = Counter()
    for rs in resource_spans:
        # "instrumentationLibrarySpans" is the pre-1.0 OTLP name some old Collectors still write.
        for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or ():
            scope = ss.get("scope") or ss.get("instrumentationLibrary") or {}
            spans = ss.get("spans") or ()
            if scope.get("name") == SCOPE_NAME and not supported_version(scope.get("version")):
                n = sum(1 for s in spans if str(s.get("name", "")).startswith("kvscope."))
                other += len(spans) - n
                bad[unsupported_version_reason(scope.get("version", ""))] += n
                continue
            for sp in spans:
                name = sp.get("name") or ""
                if not name.startswith("kvscope."):
                    other += 1
                    continue
                try:
                    attrs = {}
                    for a in sp.get("attributes") or ():
                        for value in a["value"].values():  # {"intValue": "128"}: the one entry
                            attrs[a["key"]] = value
                            break
                    status = sp.get("status")
                    rows.append((
                        sp["traceId"],
                        sp["spanId"],
                        sp.get("parentSpanId") or "",
                        name,
                        int(sp["startTimeUnixNano"]),
                        int(sp["endTimeUnixNano"]),
                        _status_code(status.get("code")) if status else 0,
                        attrs,
                        lineno,
                    ))
                except KeyError as exc:
                    bad[f"{name} span without {exc.args[0]}"] += 1
                except (AttributeError, TypeError, ValueError) as exc:
                    bad[f"malformed {name} span: {_short(exc)}"] += 1
    problems = [Problem(label, lineno, reason, n) for reason, n in bad.items()]
    return rows, other, problems


_STATUS_CODES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


def _status_code(code: Any) -> int:
    if code is None:
        return 0
    return _STATUS_CODES[code] if isinstance(code, str) else int(code)


def supported_version(version: Any) -> bool:
    return isinstance(version, str) and any(
        version == v or version.startswith(v + ".") for v in SUPPORTED_SCOPE_VERSIONS
    )


def _short(exc: BaseException, limit: int = 160) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _columns_from_rows(rows: list[tuple], problems: list[Problem], other: int, lines: int) -> DecodedSpans:
    n = len(rows)
    base = list(zip(*rows)) if rows else [()] * 9
    attrs_list: Sequence[dict[str, Any]] = base[7]
    values: dict[str, np.ndarray] = {}
    invalid: dict[str, np.ndarray] = {}
    for key, (_, is_int) in ATTRIBUTE_COLUMNS.items():
        raw = np.empty(n, dtype=object)
        raw[:] = [a.get(key) for a in attrs_list]
        present = np.not_equal(raw, None)
        if is_int:
            out = np.full(n, np.nan)
            if present.any():
                out[present] = pd.to_numeric(pd.Series(raw[present], dtype=object), errors="coerce")
            values[key] = out
            invalid[key] = present & ~_integral(out)
        else:
            out = np.full(n, None, dtype=object)
            out[present] = [v if isinstance(v, str) else json.dumps(v) for v in raw[present]]
            values[key] = out
            invalid[key] = np.zeros(n, dtype=bool)
    known = ATTRIBUTE_COLUMNS.keys()
    extras = [{k: v for k, v in a.items() if k not in known} or None for a in attrs_list]
    return DecodedSpans(
        trace_id=base[0],
        span_id=base[1],
        parent_span_id=base[2],
        name=base[3],
        start_ns=np.asarray(base[4], dtype=np.int64),
        end_ns=np.asarray(base[5], dtype=np.int64),
        status_code=np.asarray(base[6], dtype=np.int64),
        source_line=np.asarray(base[8], dtype=np.int64),
        values=values,
        invalid=invalid,
        extra_attributes=extras,
        problems=problems,
        other_spans=other,
        lines=lines,
    )


def _integral(values: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.isfinite(values) & (np.floor(values) == values)


def _empty_spans() -> pd.DataFrame:
    frame = pd.DataFrame({col: pd.Series(dtype=object) for col in SPAN_COLUMNS})
    for col in ("start_ns", "end_ns", "source_line", "status_code"):
        frame[col] = frame[col].astype("int64")
    frame["duration_ms"] = frame["duration_ms"].astype(float)
    for col, is_int in ATTRIBUTE_COLUMNS.values():
        if is_int:
            frame[col] = frame[col].astype("Int64")
    for col in ("name", "group_kind", "copy_direction", "source_file"):
        frame[col] = frame[col].astype("category")
    return frame


def _validated_frame(d: DecodedSpans, label: str) -> tuple[pd.DataFrame, list[Problem]]:
    """The spans of one file that satisfy the contract, and a problem for each kind of violation."""
    n = len(d.start_ns)
    frame = pd.DataFrame({
        "trace_id": pd.Series(d.trace_id, dtype=object),
        "span_id": pd.Series(d.span_id, dtype=object),
        "parent_span_id": pd.Series(d.parent_span_id, dtype=object),
        "name": pd.Series(d.name, dtype=object),
        "start_ns": d.start_ns,
        "end_ns": d.end_ns,
    })
    reasons: list[tuple[np.ndarray, str]] = []

    # Ids: OTLP/JSON writes lowercase hex; protobuf-JSON tools write base64. Accept both.
    for col, width in (("trace_id", 32), ("span_id", 16), ("parent_span_id", 16)):
        original = frame[col].astype(str)
        ids = original.str.lower()
        ok = ids.str.fullmatch(f"[0-9a-f]{{{width}}}").to_numpy(dtype=bool, copy=True)
        if col == "parent_span_id":
            ok |= (ids == "").to_numpy(dtype=bool)
        if not ok.all():
            fixed = original[~ok].map(lambda v, w=width: _b64_id(v, w))
            ids.loc[~ok] = fixed.fillna(ids[~ok])
            still = np.zeros(n, dtype=bool)
            still[~ok] = fixed.isna().to_numpy()
            reasons.append((still, f"span with an invalid {col.replace('_', ' ')}"))
        frame[col] = ids

    for key, (col, is_int) in ATTRIBUTE_COLUMNS.items():
        values = d.values[key]
        if d.invalid[key].any():
            reasons.append((d.invalid[key], f"{key} is not an integer"))
        if is_int:
            frame[col] = pd.array(np.where(_integral(values), values, np.nan), dtype="Int64")
            continue
        allowed = ALLOWED_VALUES.get(key)
        if allowed is not None:
            bad = np.not_equal(values, None) & ~np.isin(values, allowed)
            if bad.any():
                reasons.append((bad, f"{key} is not one of {', '.join(allowed)}"))
        frame[col] = values

    names = frame["name"].to_numpy()
    for span_name, required in REQUIRED_ATTRIBUTES.items():
        is_name = names == span_name
        if not is_name.any():
            continue
        for key in required:
            missing = is_name & frame[ATTRIBUTE_COLUMNS[key][0]].isna().to_numpy()
            if missing.any():
                reasons.append((missing, f"{span_name} span lacks {key}"))

    frame["status_code"] = d.status_code
    frame["attributes"] = pd.Series(d.extra_attributes, dtype=object)
    frame["source_file"] = label
    frame["source_line"] = d.source_line

    problems: list[Problem] = []
    bad = np.zeros(n, dtype=bool)
    for mask, reason in reasons:
        mask = mask & ~bad  # report each span once, under its first problem
        if mask.any():
            problems += _problems_at(frame, mask, reason)
            bad |= mask
    return frame[~bad], problems


def _combine(frames: list[pd.DataFrame]) -> tuple[pd.DataFrame, list[Problem]]:
    frames = [f for f in frames if len(f)]
    if not frames:
        return _empty_spans(), []
    frame = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)
    problems: list[Problem] = []
    ids = ["trace_id", "span_id"]
    dup = frame.duplicated([*ids, "name", "start_ns", "end_ns"], keep="first").to_numpy()
    if dup.any():  # the same span twice: a file read twice, or a Collector copy beside the connector's
        problems = _problems_at(frame, dup, "duplicate span (same ids and times as an earlier one)")
        frame = frame[~dup].reset_index(drop=True)
    reused = frame.duplicated(ids, keep=False).to_numpy()
    if reused.any():  # kept: different spans, but joins by id may mix them up
        problems += _problems_at(frame, reused, "traceId and spanId also used by a different span (runs whose "
                                 "id generator was seeded alike?); copies may join the wrong load", skipped=False)
    frame["duration_ms"] = (frame["end_ns"] - frame["start_ns"]) / 1e6
    for col in ("name", "group_kind", "copy_direction", "source_file"):
        frame[col] = frame[col].astype("category")
    frame["owner_span_id"] = _copy_owners(frame)
    return frame[list(SPAN_COLUMNS)], problems


def _b64_id(value: str, width: int) -> str | None:
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) * 2 == width else None


def _problems_at(frame: pd.DataFrame, mask: np.ndarray, reason: str, skipped: bool = True) -> list[Problem]:
    """One problem per (file, line) of the masked spans; `skipped` False: the spans stay, counted in the text."""
    hits = frame.loc[mask, ["source_file", "source_line"]]
    counts = hits.groupby(["source_file", "source_line"], observed=True, sort=True).size()
    if skipped:
        return [Problem(str(f), int(line), reason, int(n)) for (f, line), n in counts.items()]
    return [Problem(str(f), int(line), f"{reason} ({n} span(s), kept)") for (f, line), n in counts.items()]


def _copy_owners(spans: pd.DataFrame) -> pd.Series:
    """The load or store span each copy span belongs to ("" when none can be found).

    A copy joins the span it is a child of when that is a load (for direction load) or a store
    (direction store); otherwise the only span of that kind in its trace.
    """
    owner = pd.Series("", index=spans.index, dtype=object)
    is_copy = (spans["name"] == COPY).to_numpy()
    if not is_copy.any():
        return owner
    copies = spans.loc[is_copy, ["trace_id", "parent_span_id", "copy_direction"]]
    want = copies["copy_direction"].map({"load": LOAD, "store": STORE}).astype(object)
    owners = spans.loc[spans["name"].isin([LOAD, STORE]), ["trace_id", "span_id", "name"]]
    owners = owners.assign(name=owners["name"].astype(object))
    kind_by_id = dict(zip(owners["span_id"], owners["name"]))
    by_parent = copies["parent_span_id"].where(copies["parent_span_id"].map(kind_by_id) == want)
    per_trace = owners.groupby(["trace_id", "name"], sort=False)["span_id"].agg(["first", "size"])
    unique = per_trace.loc[per_trace["size"] == 1, "first"]
    keys = pd.MultiIndex.from_arrays([copies["trace_id"], want])
    by_trace = pd.Series(unique.reindex(keys).to_numpy(), index=copies.index)
    owner.loc[is_copy] = by_parent.fillna(by_trace).fillna("").to_numpy()
    return owner


# -- requests ---------------------------------------------------------------------------------

REQUEST_COLUMNS = (
    "request_id",
    "trace_id",
    "arrival",
    "t_s",
    "tokens_queried",
    "tokens_hit",
    "hit_rate",
    "tokens_local",
    "tokens_external",
    "groups",
    "load_ms",
    "bytes_loaded",
    "bytes_stored",
    "lookups",
    "load_span_id",
    "arrival_ns",
)


def requests_table(spans: pd.DataFrame) -> pd.DataFrame:
    """One row per request id, in arrival order (first lookup, else its load).

    Tokens queried/hit come from the request's last lookup; local/external/groups and the load
    time (see `LOAD_TIME_DEFINITION`) from its last load; bytes from the copies of its loads and
    stores. Missing parts (no load for a miss, no copy spans recorded) are NA.
    """
    lookups = spans[spans["name"] == LOOKUP].sort_values("start_ns", kind="stable")
    loads = spans[spans["name"] == LOAD].sort_values("start_ns", kind="stable")
    if lookups.empty and loads.empty:
        return _empty_requests()

    last_lookup = lookups.drop_duplicates("request_id", keep="last").set_index("request_id")
    first_lookup = lookups.groupby("request_id", sort=False)["start_ns"].min()
    lookup_count = lookups.groupby("request_id", sort=False).size()
    last_load = loads.drop_duplicates("request_id", keep="last").set_index("request_id")

    ids = pd.Index(last_lookup.index).append(pd.Index(last_load.index).difference(last_lookup.index))
    out = pd.DataFrame(index=ids)
    out.index.name = "request_id"
    out["trace_id"] = last_load["trace_id"].reindex(ids).fillna(last_lookup["trace_id"].reindex(ids))
    # Nanosecond times stay integers: as float64 they would lose up to 256 ns.
    out["arrival_ns"] = (first_lookup.astype("Int64").reindex(ids)
                         .fillna(last_load["start_ns"].astype("Int64").reindex(ids)).astype("int64"))
    for col in ("tokens_queried", "tokens_hit"):
        out[col] = last_lookup[col].reindex(ids)
    for col in ("tokens_local", "tokens_external", "groups"):
        out[col] = last_load[col].reindex(ids)
    out["lookups"] = lookup_count.reindex(ids).fillna(0).astype("int64")
    out["load_span_id"] = last_load["span_id"].reindex(ids).fillna("")

    copies = spans[spans["name"] == COPY]
    load_copies = copies[copies["copy_direction"] == "load"].groupby("owner_span_id", sort=False)
    load_end = load_copies["end_ns"].max()
    load_bytes = load_copies["copy_bytes"].sum()
    load_start = last_load["start_ns"].astype("Int64").reindex(ids)
    end = load_end.astype("Int64").reindex(out["load_span_id"]).set_axis(ids)
    out["load_ms"] = ((end - load_start) / 1e6).astype(float)
    # Bytes of every load of the request, not only the last.
    req_of_load = loads.set_index("span_id")["request_id"]
    bytes_by_req = load_bytes.groupby(load_bytes.index.map(req_of_load)).sum()
    out["bytes_loaded"] = bytes_by_req.reindex(ids).astype("Int64")
    stores = spans[spans["name"] == STORE].set_index("span_id")["request_id"]
    store_bytes = copies[copies["copy_direction"] == "store"].groupby("owner_span_id")["copy_bytes"].sum()
    stored_by_req = store_bytes.groupby(store_bytes.index.map(stores)).sum()
    out["bytes_stored"] = stored_by_req.reindex(ids).astype("Int64")

    queried = out["tokens_queried"].astype(float)
    out["hit_rate"] = out["tokens_hit"].astype(float) / queried.where(queried > 0)
    out["arrival"] = pd.to_datetime(out["arrival_ns"], unit="ns", utc=True)
    out["t_s"] = (out["arrival_ns"] - out["arrival_ns"].min()) / 1e9
    out = out.reset_index().sort_values(["arrival_ns", "request_id"], kind="stable").reset_index(drop=True)
    return out[list(REQUEST_COLUMNS)]


def _empty_requests() -> pd.DataFrame:
    frame = pd.DataFrame({col: pd.Series(dtype=object) for col in REQUEST_COLUMNS})
    for col in ("tokens_queried", "tokens_hit", "tokens_local", "tokens_external", "groups",
                "bytes_loaded", "bytes_stored"):
        frame[col] = frame[col].astype("Int64")
    for col in ("hit_rate", "load_ms", "t_s"):
        frame[col] = frame[col].astype(float)
    frame["lookups"] = frame["lookups"].astype("int64")
    frame["arrival_ns"] = frame["arrival_ns"].astype("int64")
    frame["arrival"] = pd.to_datetime(frame["arrival_ns"], unit="ns", utc=True)
    return frame


def search_requests(requests: pd.DataFrame, text: str, only_hits: bool = False) -> pd.DataFrame:
    """Requests whose id or trace id contains `text` (case-insensitive)."""
    out = requests
    text = text.strip().lower()
    if text:
        match = out["request_id"].str.lower().str.contains(text, regex=False) | out[
            "trace_id"
        ].str.contains(text, regex=False)
        out = out[match]
    if only_hits:
        out = out[out["tokens_hit"].fillna(0) > 0]
    return out


# -- hit rate ---------------------------------------------------------------------------------


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else math.nan


def hit_rate(requests: pd.DataFrame) -> float:
    """Token hit rate over all requests (NaN when nothing was queried)."""
    return _ratio(requests["tokens_hit"].sum(), requests["tokens_queried"].sum())


_NICE_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60,
                   120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)


def pick_bucket_seconds(duration_s: float, max_buckets: int = 60) -> float:
    """The smallest round bucket width that cuts `duration_s` into at most `max_buckets`."""
    for width in _NICE_BUCKETS_S:
        if duration_s / width <= max_buckets:
            return width
    return _NICE_BUCKETS_S[-1]


def hit_rate_over_time(requests: pd.DataFrame, bucket_s: float | None = None) -> pd.DataFrame:
    """Token hit rate per time bucket of request arrival; buckets without requests are left out."""
    cols = ["bucket_start", "t_s", "requests", "tokens_queried", "tokens_hit", "hit_rate"]
    if requests.empty:
        return pd.DataFrame(columns=cols)
    t0 = int(requests["arrival_ns"].min())
    if bucket_s is None:
        bucket_s = pick_bucket_seconds((int(requests["arrival_ns"].max()) - t0) / 1e9)
    width_ns = int(round(bucket_s * 1e9))
    bucket = (requests["arrival_ns"] - t0) // width_ns
    grouped = requests.assign(bucket=bucket).groupby("bucket", sort=True)
    out = pd.DataFrame({
        "requests": grouped.size(),
        "tokens_queried": grouped["tokens_queried"].sum(),
        "tokens_hit": grouped["tokens_hit"].sum(),
    })
    out["hit_rate"] = out["tokens_hit"].astype(float) / out["tokens_queried"].astype(float).where(
        out["tokens_queried"] > 0
    )
    start_ns = t0 + out.index.to_numpy() * width_ns
    out["t_s"] = (start_ns - t0) / 1e9
    out["bucket_start"] = pd.to_datetime(start_ns, unit="ns", utc=True)
    return out.reset_index(drop=True)[cols]


# -- per KV group -----------------------------------------------------------------------------

GROUP_KEYS = ["group_index", "group_kind"]


def group_label(index: Any, kind: Any) -> str:
    return f"g{index} {kind}"


def _scans(spans: pd.DataFrame) -> pd.DataFrame:
    return spans[spans["name"] == SCAN]


def _copies(spans: pd.DataFrame, direction: str | None = None) -> pd.DataFrame:
    copies = spans[spans["name"] == COPY]
    if direction is not None:
        copies = copies[copies["copy_direction"] == direction]
    return copies


def _observed_groupby(frame: pd.DataFrame, keys: list[str]):
    return frame.assign(group_kind=frame["group_kind"].astype(str)).groupby(keys, sort=True, observed=True)


def null_skip_by_group(spans: pd.DataFrame) -> pd.DataFrame:
    """Per group: scans, blocks scanned, skipped as null, loaded (pending), and the null-skip share."""
    cols = [*GROUP_KEYS, "scans", "blocks_scanned", "blocks_null_skipped", "blocks_loaded", "null_skip_share"]
    scans = _scans(spans)
    if scans.empty:
        return pd.DataFrame(columns=cols)
    g = _observed_groupby(scans, GROUP_KEYS)
    out = pd.DataFrame({
        "scans": g.size(),
        "blocks_scanned": g["blocks_total"].sum(),
        "blocks_null_skipped": g["blocks_null_skipped"].sum(),
        "blocks_loaded": g["blocks_pending"].sum(),
    })
    out["null_skip_share"] = out["blocks_null_skipped"].astype(float) / out["blocks_scanned"].astype(
        float
    ).where(out["blocks_scanned"] > 0)
    return out.reset_index()[cols]


def hit_rate_by_group(spans: pd.DataFrame, requests: pd.DataFrame) -> pd.DataFrame:
    """Per group: token hit rate of the requests whose load scanned it (`GROUP_HIT_RATE_DEFINITION`)."""
    cols = [*GROUP_KEYS, "requests", "tokens_queried", "tokens_hit", "hit_rate"]
    scans = _scans(spans)
    if scans.empty:
        return pd.DataFrame(columns=cols)
    load_req = spans.loc[spans["name"] == LOAD, ["span_id", "request_id"]]
    pairs = scans[["parent_span_id", *GROUP_KEYS]].merge(
        load_req, left_on="parent_span_id", right_on="span_id", how="inner"
    )
    pairs = pairs.assign(group_kind=pairs["group_kind"].astype(str))
    pairs = pairs.drop_duplicates(["request_id", *GROUP_KEYS])
    tokens = requests[["request_id", "tokens_queried", "tokens_hit"]]
    merged = pairs.merge(tokens, on="request_id", how="inner")
    g = merged.groupby(GROUP_KEYS, sort=True, observed=True)
    out = pd.DataFrame({
        "requests": g.size(),
        "tokens_queried": g["tokens_queried"].sum(),
        "tokens_hit": g["tokens_hit"].sum(),
    })
    out["hit_rate"] = out["tokens_hit"].astype(float) / out["tokens_queried"].astype(float).where(
        out["tokens_queried"] > 0
    )
    return out.reset_index()[cols]


QUANTILES = (0.5, 0.95, 0.99)


def _quantile_row(values: pd.Series) -> dict[str, float]:
    values = values.dropna().astype(float)
    if values.empty:
        return {"count": 0, "p50_ms": math.nan, "p95_ms": math.nan, "p99_ms": math.nan, "max_ms": math.nan}
    q = np.percentile(values.to_numpy(), [q * 100 for q in QUANTILES])
    return {"count": int(len(values)), "p50_ms": q[0], "p95_ms": q[1], "p99_ms": q[2],
            "max_ms": float(values.max())}


def load_latency_quantiles(spans: pd.DataFrame, requests: pd.DataFrame) -> pd.DataFrame:
    """p50/p95/p99 (linear interpolation) of request load time, then of load copies per group."""
    rows = [{"scope": "request load (all groups)", "group_index": pd.NA, "group_kind": "",
             **_quantile_row(requests["load_ms"])}]
    copies = _copies(spans, "load")
    if not copies.empty:
        for (index, kind), grp in _observed_groupby(copies, GROUP_KEYS):
            rows.append({"scope": f"copy {group_label(index, kind)}", "group_index": index,
                         "group_kind": kind, **_quantile_row(grp["duration_ms"])})
    return pd.DataFrame(rows, columns=["scope", "group_index", "group_kind", "count", "p50_ms",
                                       "p95_ms", "p99_ms", "max_ms"])


def load_latency_distribution(spans: pd.DataFrame, requests: pd.DataFrame) -> pd.DataFrame:
    """Long table (series, ms): request load times and load-copy durations per group."""
    parts = [pd.DataFrame({"series": "request load", "ms": requests["load_ms"].dropna().astype(float)})]
    copies = _copies(spans, "load")
    if not copies.empty:
        labels = "copy g" + copies["group_index"].astype(str) + " " + copies["group_kind"].astype(str)
        parts.append(pd.DataFrame({"series": labels, "ms": copies["duration_ms"].astype(float)}))
    return pd.concat(parts, ignore_index=True)


def copy_throughput(spans: pd.DataFrame) -> pd.DataFrame:
    """Per group and direction: copies, bytes, summed copy time and throughput.

    `gb_per_s` is Σ bytes / Σ copy seconds (1 GB = 1e9 bytes); `p50_gb_per_s` is the median of the
    per-copy throughputs.
    """
    cols = [*GROUP_KEYS, "direction", "copies", "blocks", "bytes", "copy_seconds", "gb_per_s", "p50_gb_per_s"]
    copies = _copies(spans)
    if copies.empty:
        return pd.DataFrame(columns=cols)
    copies = copies.assign(
        direction=copies["copy_direction"].astype(str),
        seconds=copies["duration_ms"] / 1e3,
    )
    per_copy = copies["copy_bytes"].astype(float) / copies["seconds"].where(copies["seconds"] > 0) / 1e9
    copies = copies.assign(per_copy=per_copy)
    g = _observed_groupby(copies, [*GROUP_KEYS, "direction"])
    out = pd.DataFrame({
        "copies": g.size(),
        "blocks": g["copy_blocks"].sum(),
        "bytes": g["copy_bytes"].sum(),
        "copy_seconds": g["seconds"].sum(),
        "p50_gb_per_s": g["per_copy"].median(),
    })
    out["gb_per_s"] = out["bytes"].astype(float) / out["copy_seconds"].where(out["copy_seconds"] > 0) / 1e9
    return out.reset_index()[cols]


def group_summary(spans: pd.DataFrame, requests: pd.DataFrame) -> pd.DataFrame:
    """One row per group for the overview: hit rate, null skip, load copy latency and throughput."""
    skip = null_skip_by_group(spans)
    if skip.empty:
        return pd.DataFrame(columns=["group", *GROUP_KEYS])
    out = skip.merge(hit_rate_by_group(spans, requests)[[*GROUP_KEYS, "hit_rate"]], on=GROUP_KEYS, how="left")
    lat = load_latency_quantiles(spans, requests).iloc[1:]
    lat = lat.assign(group_index=lat["group_index"].astype("Int64"))
    out = out.merge(lat[[*GROUP_KEYS, "p50_ms", "p95_ms", "p99_ms"]], on=GROUP_KEYS, how="left")
    tp = copy_throughput(spans)
    for direction in DIRECTIONS:
        part = tp.loc[tp["direction"] == direction, [*GROUP_KEYS, "bytes", "gb_per_s"]]
        part = part.rename(columns={"bytes": f"bytes_{PAST_TENSE[direction]}", "gb_per_s": f"{direction}_gb_per_s"})
        out = out.merge(part, on=GROUP_KEYS, how="left")
    out.insert(0, "group", [group_label(i, k) for i, k in zip(out["group_index"], out["group_kind"])])
    return out


def top_slow_loads(requests: pd.DataFrame, n: int = 10) -> pd.DataFrame:
    """The `n` requests with the longest load time."""
    timed = requests[requests["load_ms"].notna()]
    return timed.nlargest(n, "load_ms")[
        ["request_id", "t_s", "load_ms", "tokens_external", "bytes_loaded", "trace_id"]
    ].reset_index(drop=True)


def overview_numbers(requests: pd.DataFrame, spans: pd.DataFrame) -> dict[str, float]:
    """Headline numbers for the overview page."""
    load_ms = requests["load_ms"].dropna().astype(float)
    q = np.percentile(load_ms, [50, 95, 99]) if len(load_ms) else [math.nan] * 3
    copies = _copies(spans)
    by_dir = copies.groupby(copies["copy_direction"].astype(str))["copy_bytes"].sum()
    start = spans["start_ns"].min() if len(spans) else 0
    end = spans["end_ns"].max() if len(spans) else 0
    return {
        "requests": int(len(requests)),
        "requests_with_hit": int((requests["tokens_hit"].fillna(0) > 0).sum()),
        "tokens_queried": int(requests["tokens_queried"].sum()),
        "tokens_hit": int(requests["tokens_hit"].sum()),
        "hit_rate": hit_rate(requests),
        "loads_timed": int(len(load_ms)),
        "load_p50_ms": float(q[0]),
        "load_p95_ms": float(q[1]),
        "load_p99_ms": float(q[2]),
        "bytes_loaded": int(by_dir.get("load", 0)),
        "bytes_stored": int(by_dir.get("store", 0)),
        "spans": int(len(spans)),
        "duration_s": (int(end) - int(start)) / 1e9,
    }


# -- one request ------------------------------------------------------------------------------

_ROW_ORDER = {LOOKUP: 0, LOAD: 1, SCAN: 2, "copy load": 3, STORE: 4, "copy store": 5}
_SHOWN_AS = {"request_id", "group_index", "group_kind", "copy_direction"}  # already in the row label


def waterfall_rows(spans: pd.DataFrame, requests: pd.DataFrame, request_id: str) -> pd.DataFrame:
    """The kvscope spans of one request on one time axis (ms from its first span).

    Rows: lookups, loads, each group's scan, the load copies, stores and store copies, each with
    its attributes as text. Other kvscope spans in the request's trace are included too.
    """
    cols = ["row", "kind", "name", "start_ms", "end_ms", "duration_ms", "group_index", "group_kind",
            "direction", "attributes", "status_code", "span_id", "parent_span_id", "trace_id"]
    req = requests[requests["request_id"] == request_id]
    if req.empty:
        return pd.DataFrame(columns=cols)
    trace_id = req["trace_id"].iloc[0]
    own = spans["request_id"] == request_id
    owner_ids = set(spans.loc[own & spans["name"].isin([LOAD, STORE]), "span_id"])
    related = own | ((spans["name"] == COPY) & spans["owner_span_id"].isin(owner_ids))
    related |= (spans["name"] == SCAN) & spans["parent_span_id"].isin(owner_ids)
    related |= spans["trace_id"] == trace_id
    rows = spans[related].copy()
    kind = rows["name"].astype(str)
    is_copy = kind == COPY
    kind = kind.where(~is_copy, "copy " + rows["copy_direction"].astype(str))
    rows["kind"] = kind.str.replace("kvscope.", "", regex=False)
    rows["_order"] = kind.map(_ROW_ORDER).fillna(9)
    t0 = rows["start_ns"].min()
    rows["start_ms"] = (rows["start_ns"] - t0) / 1e6
    rows["end_ms"] = (rows["end_ns"] - t0) / 1e6
    rows["direction"] = rows["copy_direction"].astype(object)
    rows = rows.sort_values(["_order", "group_index", "worker_rank", "start_ns"], kind="stable", na_position="first")
    rows["row"] = _unique([_row_label(r) for r in rows.itertuples(index=False)])
    rows["attributes"] = [_attribute_text(r) for r in rows.to_dict("records")]
    return rows[cols].reset_index(drop=True)


def _row_label(r) -> str:
    label = r.kind
    if not pd.isna(r.group_index):
        label += f" {group_label(r.group_index, r.group_kind)}"
    if not pd.isna(r.worker_rank):
        label += f" rank {r.worker_rank}"
    return label


def _unique(labels: list[str]) -> list[str]:
    seen: Counter[str] = Counter()
    out = []
    for label in labels:
        seen[label] += 1
        out.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return out


def _short_key(key: str) -> str:
    # The row label already says lookup/load/scan/copy: "kvscope.group.blocks.total" -> "blocks.total".
    for prefix in ("kvscope.group.", "kvscope.copy.", "kvscope."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def _attribute_text(row: dict[str, Any]) -> str:
    parts = []
    known = set()
    for key, (col, _) in ATTRIBUTE_COLUMNS.items():
        known.add(key)
        value = row.get(col)
        if col in _SHOWN_AS or value is None or pd.isna(value):
            continue
        parts.append(f"{_short_key(key)}={value}")
    for key, value in (row.get("attributes") or {}).items():
        if key not in known:
            parts.append(f"{key}={value}")
    return ", ".join(parts)


# -- replay -----------------------------------------------------------------------------------

REPLAY_COLUMNS = ("step", "request_id", "t_s", "tokens_queried", "tokens_hit", "cum_tokens_queried",
                  "cum_tokens_hit", "cum_hit_rate", "cum_bytes_loaded", "cum_bytes_stored")


def replay_timeline(requests: pd.DataFrame, spans: pd.DataFrame) -> pd.DataFrame:
    """One row per request in arrival order with the cumulative state (see `REPLAY_DEFINITION`)."""
    if requests.empty:
        return pd.DataFrame(columns=list(REPLAY_COLUMNS))
    reqs = requests.sort_values(["arrival_ns", "request_id"], kind="stable").reset_index(drop=True)
    out = pd.DataFrame({
        "step": np.arange(1, len(reqs) + 1),
        "request_id": reqs["request_id"],
        "t_s": reqs["t_s"],
        "tokens_queried": reqs["tokens_queried"],
        "tokens_hit": reqs["tokens_hit"],
    })
    out["cum_tokens_queried"] = reqs["tokens_queried"].fillna(0).astype("int64").cumsum()
    out["cum_tokens_hit"] = reqs["tokens_hit"].fillna(0).astype("int64").cumsum()
    out["cum_hit_rate"] = out["cum_tokens_hit"] / out["cum_tokens_queried"].where(out["cum_tokens_queried"] > 0)
    cutoff = np.append(reqs["arrival_ns"].to_numpy()[1:], np.iinfo(np.int64).max)
    for direction in DIRECTIONS:
        copies = _copies(spans, direction).sort_values("end_ns")
        cum = np.concatenate([[0], copies["copy_bytes"].fillna(0).astype("int64").cumsum().to_numpy()])
        idx = np.searchsorted(copies["end_ns"].to_numpy(), cutoff, side="right")
        out[f"cum_bytes_{PAST_TENSE[direction]}"] = cum[idx]
    return out[list(REPLAY_COLUMNS)]


def replay_state(timeline: pd.DataFrame, step: int) -> dict[str, Any]:
    """The state after `step` requests (1-based, clamped to the timeline)."""
    if timeline.empty:
        raise ValueError("no requests to replay")
    step = min(max(int(step), 1), len(timeline))
    return timeline.iloc[step - 1].to_dict()
