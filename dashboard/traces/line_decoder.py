"""The line-by-line decoder of trace files (OTLP/JSON lines), and the column-wise spans both decoders give.

`decode_lines` takes any file apart, one ``json.loads`` per line and one small loop per span that only
copies fields; it never raises on bad input, naming each line or span it skips (`Problem`). Clean files
take the faster Arrow decoder (`otlp_arrow`), which declines anything unusual to this one. Both give a
`DecodedSpans`, which `reader` validates and joins.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from dashboard.traces.json_numbers import json_integer
from dashboard.traces.problems import Problem
from dashboard.traces.schema import ATTRIBUTE_COLUMNS, RESOURCE_ATTRIBUTES, SCOPE_NAME, SUPPORTED_SCOPE_VERSIONS


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

