"""Trace files (OTLP/JSON lines) -> one row per kvscope span, and a problem for all it skipped;
vLLM's request spans beside them (`vllm_spans`).

Takes the lines the connector and the OpenTelemetry Collector's file exporter write (one
``ExportTraceServiceRequest`` per line). Never raises on bad input: each skipped line or span is a
`Problem` naming the file, the line and the reason.

Speed: parsing costs one ``json.loads`` per line and one small loop per span that only copies
fields; converting, validating and joining are done column-wise afterwards. A clean file takes
the Arrow decoder (`otlp_arrow`) instead.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dashboard.formatting import printable_path
from dashboard.traces.file_formats import as_json_lines
from dashboard.traces.json_numbers import json_integer
from dashboard.traces.owners import CLOCK_TOLERANCE_NS, owner_keys, starts_before_owner
from dashboard.traces.problems import DUPLICATE_SPAN, Problem
from dashboard.traces.schema import (
    ALLOWED_VALUES,
    ATTRIBUTE_COLUMNS,
    LOOKUP,
    REQUIRED_ATTRIBUTES,
    RESOURCE_ATTRIBUTES,
    SCAN,
    SCOPE_NAME,
    SPAN_COLUMNS,
    SUPPORTED_SCOPE_VERSIONS,
    base64_id,
)
from dashboard.traces.vllm_spans import combine_vllm_requests, empty_vllm_requests, read_vllm_requests


@dataclass(frozen=True)
class Traces:
    """Result of reading trace files: one row per kvscope span, and what was skipped."""

    spans: pd.DataFrame
    problems: list[Problem] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    lines: int = 0  # non-empty lines read
    other_spans: int = 0  # spans outside kvscope, vLLM's request spans among them
    vllm_requests: pd.DataFrame = field(default_factory=empty_vllm_requests)  # vLLM's request spans (`vllm_spans`)
    vllm_spans_read: int = 0  # vLLM request spans in all files, a span given twice counted twice (as `other_spans`)

    @property
    def empty(self) -> bool:
        return self.spans.empty

    @property
    def spans_left_out(self) -> int:
        """Spans neither kvscope's nor vLLM's request spans (at least 0: a line the kvscope decoder could not
        take apart may still have given a vLLM span)."""
        return max(self.other_spans - self.vllm_spans_read, 0)


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

    Never raises on bad input: unreadable, empty or compressed-beyond-reach files, files of another
    kind, lines that are not OTLP/JSON, spans without the attributes their name requires, duplicate
    spans and unknown kvscope scope versions become `Problem`s, and everything else loads. A path
    given twice (a folder and a file in it) is read once. vLLM's request spans of every file are
    read too (`vllm_spans`), never as problems.
    """
    frames: list[pd.DataFrame] = []
    vllm_frames: list[pd.DataFrame] = []
    problems: list[Problem] = []
    files: list[str] = []
    first_label: dict[Path, tuple[str, bool]] = {}  # a path -> the label it was first given as, and if it was read
    lines = other = 0
    for source in sources:
        if isinstance(source, TraceSource):
            label, data = source.name, source.data
        else:
            path = os.fspath(source)
            label = printable_path(path)  # a file name need not be UTF-8: messages and pages show it escaped
            resolved = Path(path).resolve()
            if resolved in first_label:
                first, was_read = first_label[resolved]
                problems.append(Problem(label, 0, f"the same file as {first}: "
                                        + ("read once" if was_read else "it could not be read")))
                continue
            first_label[resolved] = (label, False)
            try:
                data = Path(path).read_bytes()
            except OSError as exc:
                files.append(label)
                problems.append(Problem(label, 0, f"cannot read file: {exc.strerror or exc}", spans=None))
                continue
            first_label[resolved] = (label, True)
        files.append(label)
        data, found = as_json_lines(label, data)
        problems += found
        if data is None:
            continue
        decoded = decode_spans(label, data)
        vllm_frames.append(read_vllm_requests(label, data))
        if not decoded.lines and not found:
            problems.append(Problem(label, 0, "empty file: it holds no lines"))
        frame, rejected = _validated_frame(decoded, label)
        frames.append(frame)
        problems += decoded.problems + rejected + _early_times(frame, label)
        lines += decoded.lines
        other += decoded.other_spans
    spans, duplicates = _combine(frames)
    order = {name: i for i, name in enumerate(files)}
    problems = sorted(problems + duplicates, key=lambda p: (order.get(p.file, len(order)), p.line))
    return Traces(spans=spans, problems=problems, files=files, lines=lines, other_spans=other,
                  vllm_requests=combine_vllm_requests(vllm_frames), vllm_spans_read=sum(map(len, vllm_frames)))


# 2000-01-01 in ns since the epoch: span times before it are no clock's now, but a clock set wrong or times in
# another unit (µs, s)
PLAUSIBLE_SINCE_NS = 946_684_800 * 10**9


def _early_times(frame: pd.DataFrame, label: str) -> list[Problem]:
    """A note where spans start before 2000: read all the same, but they stretch every time axis."""
    early = int((frame["start_ns"] < PLAUSIBLE_SINCE_NS).sum()) if len(frame) else 0
    if not early:
        return []
    return [Problem(label, 0, f"{early} span(s) start before 2000-01-01: a clock set wrong, or times not in "
                              "nanoseconds since the epoch (microseconds? seconds?); read all the same")]


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


def _split_lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")


# A UTF-16 surrogate, as JSON's escape or as the bytes a CESU-8/WTF-8 writer gives it (ED A0..BF):
# decoding turns a lone one into a str no UTF-8 (nor Arrow) takes.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")

INCOMPLETE_LAST_LINE = ("incomplete last line: it does not parse and no newline ends it (is the file "
                        "still being written, or did its writer stop mid-line?)")


def decode_lines(label: str, lines: Sequence[bytes]) -> DecodedSpans:
    """The line-by-line decoder: one `json.loads` per line, one small loop per span.

    `lines` is the file split at newlines: a last entry that is not empty had no newline after it.
    """
    rows: list[tuple] = []
    problems: list[Problem] = []
    other = count = 0
    last = len(lines)
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        count += 1
        try:
            # UTF-8 said, not guessed: `json.loads(bytes)` reads a line starting with NULs as UTF-32. A leading
            # BOM goes, as Arrow drops the file's; surrogates pass, for `_SURROGATE_ESCAPE` to skip their spans.
            doc = json.loads(raw.decode("utf-8-sig", "surrogatepass"))
        except ValueError as exc:
            if lineno == last:  # a writer appends whole lines: this one is not finished (or was cut)
                problems.append(Problem(label, lineno, INCOMPLETE_LAST_LINE, spans=None))
            elif isinstance(exc, json.JSONDecodeError):
                problems.append(Problem(label, lineno, f"not JSON: {exc.msg} (column {exc.colno})", spans=None))
            elif isinstance(exc, UnicodeDecodeError):
                problems.append(Problem(label, lineno, f"not UTF-8 text: {_short(exc)}", spans=None))
            else:  # e.g. an integer of more than 4300 digits
                problems.append(Problem(label, lineno, f"not JSON that can be read: {_short(exc)}", spans=None))
            continue
        except RecursionError:
            problems.append(Problem(label, lineno, "JSON nested too deeply to be an OTLP trace export", spans=None))
            continue
        exports = doc if isinstance(doc, list) else [doc]  # a list of exports: a whole-file JSON document
        if not exports or not all(isinstance(export, dict) for export in exports):
            got = _json_type(doc) if not isinstance(doc, list) else "an empty list" if not exports else \
                f"a list holding {_json_type(next(e for e in exports if not isinstance(e, dict)))}"
            problems.append(Problem(label, lineno, f"expected a JSON object (an ExportTraceServiceRequest), got {got}"))
            continue
        check_unicode = _SURROGATE_ESCAPE.search(raw) is not None
        not_exports: Counter[str] = Counter()
        bare_spans: Counter[str] = Counter()  # kvscope spans written without their export around them
        for export in exports:
            resource_spans = export.get("resourceSpans")
            if resource_spans is None:
                reason = not_a_trace_export_reason(export)
                not_exports[reason] += 1
                bare_spans[reason] += _is_kvscope(export)
                continue
            try:
                line_rows, line_other, line_problems = _parse_export(resource_spans, label, lineno, check_unicode)
            except (AttributeError, TypeError, KeyError, ValueError) as exc:
                problems.append(Problem(label, lineno, f"not an OTLP trace export: {_short(exc)}", spans=None))
                continue
            rows += line_rows
            other += line_other
            problems += line_problems
        for reason, n in not_exports.items():  # once per line: a list can hold thousands alike
            problems.append(Problem(label, lineno, reason if n == 1 else f"{reason} ({n} entries of the list)",
                                    spans=bare_spans[reason]))
    return _columns_from_rows(rows, problems, other, count)


def not_a_trace_export_reason(doc: dict) -> str:
    other = [k for k in ("resourceMetrics", "resourceLogs") if doc.get(k) is not None]
    if not other and "traceId" in doc and "spanId" in doc:
        return ("no resourceSpans: a bare span, not a trace export (spans belong in "
                "resourceSpans[].scopeSpans[].spans of an ExportTraceServiceRequest)")
    hint = f" (a {other[0]} export)" if other else ""
    return f"no resourceSpans: not a trace export{hint}"


def unsupported_version_reason(version: Any) -> str:
    supported = ", ".join(v + ".x" for v in SUPPORTED_SCOPE_VERSIONS)
    return f"kvscope scope version {version!r} is not supported (this dashboard reads {supported})"


def _parse_export(resource_spans: list, label: str, lineno: int,
                  check_unicode: bool = False) -> tuple[list[tuple], int, list[Problem]]:
    """Copy the fields of every kvscope span of one line; conversion happens column-wise later.

    `check_unicode`: the line escapes a surrogate, so a span may hold a string that is not Unicode.
    """
    rows: list[tuple] = []
    other = 0
    bad: Counter[str] = Counter()
    lost: list[Problem] = []  # a resource or scope not in OTLP's shape: its spans (how many unknown), not the line's
    for i, rs in enumerate(_list_at(resource_spans, "resourceSpans")):
        try:
            rs = _object_at(rs, f"resourceSpans[{i}]")
            # "instrumentationLibrarySpans" is the pre-1.0 OTLP name some old Collectors still write.
            legacy = not rs.get("scopeSpans") and "instrumentationLibrarySpans" in rs
            field = "instrumentationLibrarySpans" if legacy else "scopeSpans"
            inherited = _resource_attributes(rs)
            scopes = list(enumerate(_list_at(rs.get(field), f"resourceSpans[{i}].{field}")))
        except (AttributeError, TypeError, KeyError, ValueError) as exc:
            lost.append(Problem(label, lineno, f"not an OTLP trace export: {_short(exc)}", spans=None))
            continue
        for j, ss in scopes:
            where = f"resourceSpans[{i}].{field}[{j}]"
            try:
                ss = _object_at(ss, where)
                scope = _object_at(ss.get("scope") or ss.get("instrumentationLibrary"), f"{where}.scope",
                                   optional=True)
                spans = _list_at(ss.get("spans"), f"{where}.spans")
            except (AttributeError, TypeError, KeyError, ValueError) as exc:
                lost.append(Problem(label, lineno, f"not an OTLP trace export: {_short(exc)}", spans=None))
                continue
            if scope.get("name") == SCOPE_NAME and not supported_version(scope.get("version")):
                n = sum(1 for s in spans if _is_kvscope(s))
                other += len(spans) - n
                bad[unsupported_version_reason(scope.get("version", ""))] += n
                continue
            for sp in spans:
                if not isinstance(sp, dict):  # only this entry is lost, not the line's other spans
                    bad[f"an entry of spans is {_json_type(sp)}, not a span object"] += 1
                    continue
                name = sp.get("name")
                if not isinstance(name, str) or not name.startswith("kvscope."):
                    other += 1
                    continue
                if check_unicode and not _is_unicode(sp):
                    bad[f"{_printable(name)} span holds a string that is not valid Unicode (a lone "
                        "surrogate such as \\ud800)"] += 1
                    continue
                try:
                    attrs = {}
                    for a in _list_at(sp.get("attributes"), "attributes"):
                        a = _object_at(a, "an entry of attributes")
                        if "key" not in a:
                            raise _Malformed("an attribute has no key")
                        value = _object_at(a.get("value"), f"the value of attribute {a['key']!r}", optional=True)
                        # {"intValue": "128"}: the one entry; unset: OTLP/JSON writes {} or null, or leaves it out
                        if not isinstance(a["key"], str):
                            raise _Malformed(f"an attribute key is {_json_type(a['key'])}, expected a string")
                        attrs[a["key"]] = without_nulls(_one_value(value, a["key"]))
                    for key, value in inherited:
                        if key not in attrs:
                            attrs[key] = _one_value(_object_at(value, f"the value of resource attribute {key!r}",
                                                               optional=True), key)
                    status = _object_at(sp.get("status"), "status", optional=True)
                    rows.append((
                        sp["traceId"],
                        sp["spanId"],
                        "" if sp.get("parentSpanId") is None else sp["parentSpanId"],  # null: no parent
                        name,
                        _unix_nanos(sp["startTimeUnixNano"], "startTimeUnixNano"),
                        _unix_nanos(sp["endTimeUnixNano"], "endTimeUnixNano"),
                        _status_code(status.get("code")),
                        attrs,
                        lineno,
                    ))
                except KeyError as exc:
                    bad[f"{name} span without {exc.args[0]}"] += 1
                except (AttributeError, TypeError, ValueError, OverflowError) as exc:
                    bad[f"malformed {name} span: {_short(exc)}"] += 1
                except RecursionError:
                    bad[f"malformed {name} span: an attribute value nested too deeply"] += 1
    problems = lost + [Problem(label, lineno, reason, n) for reason, n in bad.items()]
    return rows, other, problems


def _resource_attributes(rs: dict) -> list[tuple[str, Any]]:
    """(key, raw AnyValue) of each of `RESOURCE_ATTRIBUTES` the resource holds, for its spans to inherit
    (a value is checked as a span's own attribute is, span by span). A resource of another shape
    holds none: it is not kvscope's to judge."""
    resource = rs.get("resource")
    attributes = resource.get("attributes") if isinstance(resource, dict) else None
    if not isinstance(attributes, list):
        return []
    return [(a["key"], a.get("value")) for a in attributes
            if isinstance(a, dict) and a.get("key") in RESOURCE_ATTRIBUTES]


class _Malformed(ValueError):
    """A part of an export is not of the shape OTLP/JSON gives it; the message names the part."""


def _one_value(value: dict, key: Any) -> Any:
    """The value an OTLP/JSON AnyValue holds, None when unset; _Malformed when it holds several (a
    oneof holds one: which to read would be a guess, and the two decoders would guess apart)."""
    held = [field for field, v in value.items() if v is not None]
    if len(held) > 1:
        raise _Malformed(f"attribute {key!r} holds {len(held)} values ({', '.join(map(str, held))}); "
                         "an OTLP AnyValue holds one")
    return value[held[0]] if held else None


def _list_at(value: Any, where: str) -> list:
    """`value` as a list (absent or null: empty), or _Malformed naming `where` and what it is instead."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _Malformed(f"{where} is {_json_type(value)}, expected a list")
    return value


def _object_at(value: Any, where: str, optional: bool = False) -> dict:
    """`value` as an object (`optional`: absent or null is an empty one), or _Malformed naming `where`."""
    if value is None and optional:
        return {}
    if not isinstance(value, dict):
        raise _Malformed(f"{where} is {_json_type(value)}, expected an object")
    return value


def _is_kvscope(sp: Any) -> bool:
    return isinstance(sp, dict) and isinstance(name := sp.get("name"), str) and name.startswith("kvscope.")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return {str: "a string", int: "a number", float: "a number", list: "a list", dict: "an object"}.get(
        type(value), f"a {type(value).__name__}")


def _is_unicode(sp: dict) -> bool:
    """Whether every string of a span is Unicode text (pandas and Arrow fail on a lone surrogate)."""
    try:
        json.dumps(sp, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


_STATUS_CODES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}


def _status_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, str):
        if code not in _STATUS_CODES:
            raise ValueError(_unknown_status(code))
        return _STATUS_CODES[code]
    try:
        value = json_integer(code)
    except ValueError:
        raise ValueError(_unknown_status(code)) from None
    if value not in _STATUS_CODES.values():
        raise ValueError(_unknown_status(code))
    return value


def _unknown_status(code: Any) -> str:
    return (f"unknown status code {_shown(code)}: accepted are 0, 1, 2 and their names "
            f"{', '.join(_STATUS_CODES)}")


_INT64_LIMIT = 1 << 63


def _shown(value: Any) -> str:
    """A value as an error names it: JSON's words for true, false and null, Python's quotes for text."""
    return json.dumps(value) if value is None or isinstance(value, bool) else repr(value)


def _unix_nanos(value: Any, field: str) -> int:
    """A span time: an integer (or its decimal string, as OTLP/JSON writes it) of ns since the epoch."""
    try:
        nanos = json_integer(value)
    except ValueError:
        raise ValueError(f"{field} is {_shown(value)}, expected an integer: nanoseconds since the epoch") from None
    if nanos == 0:  # OTLP's unset: taken as 1970, one such span would stretch every time axis over 50 years
        raise ValueError(f"{field} is 0 (unset); expected ns since the epoch")
    if not 0 <= nanos < _INT64_LIMIT:
        raise ValueError(f"{field} {value!r} is outside 0..2^63 ns")
    return nanos


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
                given = raw[present]
                # pandas reads true as 1: a boolean is no count (NaN here, then invalid)
                given[[isinstance(v, bool) for v in given]] = None
                out[present] = pd.to_numeric(pd.Series(given, dtype=object), errors="coerce")
            values[key] = out
            invalid[key] = present & ~integral_mask(out)
        else:
            out = np.full(n, None, dtype=object)
            out[present] = [v if isinstance(v, str) else json.dumps(v) for v in raw[present]]
            values[key] = out
            invalid[key] = np.zeros(n, dtype=bool)
    known = ATTRIBUTE_COLUMNS.keys()
    extras = [{k: v for k, v in a.items() if k not in known} or None for a in attrs_list]  # without nulls already
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


def without_nulls(value: Any) -> Any:
    """An attribute value with the null fields of its objects left out (an arrayValue's or kvlistValue's).

    OTLP/JSON reads a null field as unset; the Arrow decoder gives every object of a column the
    fields of all of them, null where absent, and both decoders must give the same dicts.
    """
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


# Integer attributes are counts and sizes: as float64 they are exact up to 2^53, and beyond it
# they would not fit the frame's Int64 columns either.
_EXACT_INT_LIMIT = float(1 << 53)


def integral_mask(values: np.ndarray) -> np.ndarray:
    """Which values are integers the frame can hold (NaN, fractions, infinities and beyond ±2^53 are not)."""
    with np.errstate(invalid="ignore"):
        return np.isfinite(values) & (np.floor(values) == values) & (np.abs(values) <= _EXACT_INT_LIMIT)


def _empty_spans() -> pd.DataFrame:
    frame = pd.DataFrame({col: pd.Series(dtype=object) for col in SPAN_COLUMNS})
    for col in ("start_ns", "end_ns", "source_line", "status_code"):
        frame[col] = frame[col].astype("int64")
    frame["duration_ms"] = frame["duration_ms"].astype(float)
    frame["span_key"] = frame["span_key"].astype("int64")
    frame["owner_key"] = frame["owner_key"].astype("Int64")
    frame["clock_ok"] = frame["clock_ok"].astype(bool)
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
    # An id that is no string (null, a number, a list) is invalid: `astype(str)` would keep null as NaN
    # (which base64 decoding rejects with TypeError) and could turn a 16-digit number into a valid id.
    for col, width in (("trace_id", 32), ("span_id", 16), ("parent_span_id", 16)):
        is_text = frame[col].map(lambda v: isinstance(v, str)).to_numpy(dtype=bool)
        original = frame[col].where(is_text, "").astype(str)
        ids = original.str.lower()
        ok = ids.str.fullmatch(f"[0-9a-f]{{{width}}}").to_numpy(dtype=bool, copy=True) & is_text
        if col == "parent_span_id":
            ok |= (ids == "").to_numpy(dtype=bool) & is_text
        if not ok.all():
            fixed = original[~ok].map(lambda v, w=width: base64_id(v, w))
            ids.loc[~ok] = fixed.fillna(ids[~ok])
            still = np.zeros(n, dtype=bool)
            still[~ok] = fixed.isna().to_numpy()
            reasons.append((still, f"span with an invalid {col.replace('_', ' ')} (expected a string of {width} hex "
                                   f"digits, or {width // 2} bytes in base64)"))
        frame[col] = ids

    for key, (col, is_int) in ATTRIBUTE_COLUMNS.items():
        values = d.values[key]
        if d.invalid[key].any():
            reasons.append((d.invalid[key], f"{key} is not an integer (or beyond ±2^53)"))
        if is_int:
            lowest, accepted = _LOWEST_VALUES.get(key, (0, "a count >= 0"))
            with np.errstate(invalid="ignore"):
                negative = values < lowest  # every integer attribute counts or indexes something
            if negative.any():
                reasons.append((negative, _each_value(values, negative, f"{key} is {{}}, expected {accepted}")))
            frame[col] = pd.array(np.where(integral_mask(values), values, np.nan), dtype="Int64")
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

    queried, hit = d.values["kvscope.tokens.queried"], d.values["kvscope.tokens.hit"]
    with np.errstate(invalid="ignore"):
        hit_too_many = (names == LOOKUP) & (hit > queried)
    if hit_too_many.any():
        reasons.append((hit_too_many, _each_value(
            np.stack([hit, queried], axis=1), hit_too_many,
            "kvscope.tokens.hit {} is more than kvscope.tokens.queried {}, expected hit <= queried")))
    # a scan's blocks are null (skipped) or pending (loaded): more of them than it scanned made a null-skip share
    # over 100%
    total = d.values["kvscope.group.blocks.total"]
    split = d.values["kvscope.group.blocks.null_skipped"] + d.values["kvscope.group.blocks.pending"]
    with np.errstate(invalid="ignore"):
        split_too_many = (names == SCAN) & (split > total)
    if split_too_many.any():
        reasons.append((split_too_many, _each_value(
            np.stack([d.values["kvscope.group.blocks.null_skipped"], d.values["kvscope.group.blocks.pending"], total],
                     axis=1), split_too_many,
            "kvscope.group.blocks.null_skipped {} + kvscope.group.blocks.pending {} is more than "
            "kvscope.group.blocks.total {}, expected null skipped + pending <= total")))

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


# Integer attributes that may go below 0, and how far: a scan with no pending block starts at -1.
_LOWEST_VALUES = {"kvscope.group.blocks.start": (-1, "a block index >= 0, or -1 when no block is pending")}


def _each_value(values: np.ndarray, mask: np.ndarray, template: str) -> np.ndarray:
    """A reason per masked span naming its value(s) (`template` holds one {} per column of `values`)."""
    reasons = np.full(len(mask), None, dtype=object)
    picked = values[mask].reshape(int(mask.sum()), -1)
    reasons[mask] = [template.format(*(f"{v:.0f}" if float(v).is_integer() else f"{v:g}" for v in row))
                     for row in picked]
    return reasons


def _combine(frames: list[pd.DataFrame]) -> tuple[pd.DataFrame, list[Problem]]:
    frames = [f for f in frames if len(f)]
    if not frames:
        return _empty_spans(), []
    frame = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)
    problems: list[Problem] = []
    ids = ["trace_id", "span_id"]
    dup = frame.duplicated([*ids, "name", "start_ns", "end_ns"], keep="first").to_numpy()
    if dup.any():  # the same span twice: a file read twice, or a Collector copy beside the connector's
        problems = _problems_at(frame, dup, DUPLICATE_SPAN)
        frame = frame[~dup].reset_index(drop=True)
    too_large, reasons = _counts_past_sum_limit(frame)
    if too_large.any():
        problems += _problems_at(frame, too_large, reasons)
        frame = frame[~too_large].reset_index(drop=True)
    # Kept: different spans. Owners are looked for in the child's own file first (`owners`), and in
    # another file only when one span of all the others has the id, so a span id reused in another
    # file does no harm; within one file, the child's request id tells the spans apart.
    reused_in_file = frame.duplicated(["source_file", *ids], keep=False).to_numpy()
    reused_elsewhere = frame.duplicated(ids, keep=False).to_numpy() & ~reused_in_file
    if reused_in_file.any():
        problems += _problems_at(frame, reused_in_file, "traceId and spanId also used by a different span of this "
                                 "file; a copy or scan under that id joins the one of its request id, or none",
                                 skipped=False)
    if reused_elsewhere.any():
        problems += _problems_at(frame, reused_elsewhere, "traceId and spanId also used by a different span in another "
                                 "file (runs whose id generator was seeded alike?); a copy or scan under that id joins "
                                 "the one of its own file, or none", skipped=False)
    frame["duration_ms"] = (frame["end_ns"] - frame["start_ns"]) / 1e6
    for col in ("name", "group_kind", "copy_direction", "source_file"):
        frame[col] = frame[col].astype("category")
    frame["span_key"] = np.arange(len(frame), dtype=np.int64)
    frame["owner_key"] = owner_keys(frame)
    problems += _clock_problems(frame)
    return frame[list(SPAN_COLUMNS)], problems


# Every sum the pages make adds one integer column's values (all >= 0) over some spans, at most two such sums
# together: with each column's total below 2^62, no int64 sum wraps around.
_SUM_LIMIT = 1 << 62
# float64 sums of values >= 0 are off by far less than this share of the total: only a column whose float total
# comes this close to the limit is summed exactly.
_FLOAT_SUM_MARGIN = 1 - 2.0 ** -30


def _counts_past_sum_limit(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """The spans to leave out so that no column's total reaches `_SUM_LIMIT`, and a reason per span.

    Only when a column's total does (absurd counts: 2^53 tokens in each of a thousand lookups): then the values
    above the largest bound whose values (those at or below it) still total less than the limit go, so the
    fewest and largest counts go, and equal counts go or stay together.
    """
    mask = np.zeros(len(frame), dtype=bool)
    reasons = np.full(len(frame), None, dtype=object)
    for key, (col, is_int) in ATTRIBUTE_COLUMNS.items():
        if not is_int:
            continue
        values = frame[col].to_numpy(dtype=float, na_value=np.nan)
        kept = ~np.isnan(values) & ~mask
        if not np.sum(values[kept]) >= _SUM_LIMIT * _FLOAT_SUM_MARGIN:
            continue
        bound = _largest_bound_below_limit(values[kept])
        if bound is None:
            continue
        over = kept & (values > bound)
        mask |= over
        having = np.count_nonzero(kept)
        reasons[over] = [f"{key} is {v:.0f}: summed over the {having:,} spans that have it, counts this large would "
                         f"pass 2^62, expected at most {bound:.0f}" for v in values[over]]
    return mask, reasons


def _largest_bound_below_limit(values: np.ndarray) -> float | None:
    """The largest bound such that ``values`` (whole numbers >= 0, up to 2^53) at or below it total less than
    `_SUM_LIMIT`, summed exactly: the largest value that can stay, or one below the smallest when the smallest
    alone reach the limit; None when all of them total less."""
    distinct, counts = np.unique(values, return_counts=True)
    total, bound = 0, float(distinct[0]) - 1
    for value, count in zip(distinct.tolist(), counts.tolist()):
        total += int(value) * count  # Python ints: exact, where float64 or int64 sums are not
        if total >= _SUM_LIMIT:
            return bound
        bound = value
    return None


ENDS_BEFORE_START = ("span ends before it starts (endTimeUnixNano < startTimeUnixNano); a copy that does is left "
                     "out of copy durations and throughput, and a load that does or whose copy does gets no load "
                     "time")
STARTS_BEFORE_OWNER = (f"copy or scan starts more than {CLOCK_TOLERANCE_NS / 1e6:g} ms before the load or store it "
                       "belongs to (placed on another clock?); a load copy's load gets no load time, and the span's "
                       "own duration still counts")


def _clock_problems(frame: pd.DataFrame) -> list[Problem]:
    """Set `clock_ok` and report the spans whose times cannot be trusted (kept: their ids and bytes still count).

    Only a span ending before it starts has a wrong duration (`schema.duration_ok`); one starting
    before its owner was measured on its own clock, whose offset to the scheduler's is off: that
    spoils its load's load time only.
    """
    ends_early = (frame["end_ns"] < frame["start_ns"]).to_numpy()
    early = starts_before_owner(frame) & ~ends_early
    frame["clock_ok"] = ~(ends_early | early)
    return (_problems_at(frame, ends_early, ENDS_BEFORE_START, skipped=False)
            + _problems_at(frame, early, STARTS_BEFORE_OWNER, skipped=False))


def _problems_at(frame: pd.DataFrame, mask: np.ndarray, reason: str | np.ndarray,
                 skipped: bool = True) -> list[Problem]:
    """One problem per (file, line) and reason of the masked spans; `reason`: one for all, or one per span (an
    array as long as the frame); `skipped` False: the spans stay, counted in the text."""
    hits = frame.loc[mask, ["source_file", "source_line"]].assign(
        reason=reason if isinstance(reason, str) else reason[mask])
    counts = hits.groupby(["source_file", "source_line", "reason"], observed=True, sort=True).size()
    if skipped:
        return [Problem(str(f), int(line), why, int(n)) for (f, line, why), n in counts.items()]
    return [Problem(str(f), int(line), f"{why} ({n} span(s), kept)") for (f, line, why), n in counts.items()]
