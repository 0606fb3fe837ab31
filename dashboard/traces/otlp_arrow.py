"""Fast decoder for clean OTLP/JSON trace files: one C++ parse of the whole file, then Arrow
compute kernels unnest resourceSpans -> scopeSpans -> spans -> attributes column-wise.

It handles the common case only and declines (returns None) on anything else: a line that does
not parse (Arrow's parser also refuses a lone surrogate escape such as ``\\ud800``), JSON types
that change between lines, an attribute value of an unexpected type, a null entry in a list,
missing ids or timestamps. The line-by-line decoder in `traces` then reads the file and reports
each problem with its line number, so declining costs time, never correctness.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from dashboard.traces import line_decoder, schema

try:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj
except ImportError:  # pragma: no cover - pyarrow comes with streamlit
    pa = None

KNOWN_KEYS = list(schema.ATTRIBUTE_COLUMNS)
# Arrow's JSON parser and its kernels recurse per level of nesting: a line some thousand levels deep overflows the
# C stack (a segfault, no exception). OTLP spans nest about a dozen levels; the line decoder takes the rest. The
# depth is counted outside strings (`nesting_depth`): brackets inside them could hide a line's depth from a count of
# every bracket, at any depth.
MAX_NESTING = 64
_NOT_STRUCTURAL = bytes(c for c in range(256) if c not in b'{}[]"\n')
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("{"), ord("[")]] = 1
_STEP[[ord("}"), ord("]")]] = -1
_QUOTE, _NEWLINE = ord('"'), ord("\n")


class _Declined(Exception):
    """The file is not in the shape this decoder handles; use the line-by-line decoder."""


def decode(data: bytes, label: str, lines: list[bytes]) -> line_decoder.DecodedSpans | None:
    """Decode a whole file, or None when the line-by-line decoder must do it."""
    if pa is None:
        return None
    if not _is_utf8(data):  # Arrow lets such bytes pass where it converts nothing; the line decoder skips the line
        return None
    if nesting_depth(data) > MAX_NESTING:
        return None
    line_numbers = np.array([i for i, raw in enumerate(lines, 1) if raw.strip()], dtype=np.int64)
    if not len(line_numbers):
        return None
    longest = max(len(raw) for raw in lines)
    try:
        table = pj.read_json(
            pa.BufferReader(data),
            read_options=pj.ReadOptions(block_size=max(1 << 20, longest + 64)),
        )
        if table.num_rows != len(line_numbers):
            return None
        return _unnest(table, label, line_numbers)
    except (_Declined, pa.ArrowException, KeyError, TypeError, ValueError, IndexError):
        return None


def nesting_depth(data: bytes) -> int:
    """The deepest nesting of objects and arrays on any line, brackets inside strings left out: exact for
    lines of JSON (a line that is not JSON fails Arrow's parse anyway)."""
    if b"\\" in data:  # an escaped backslash, then an escaped quote (one inside its string) go first
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    kept = np.frombuffer(data.translate(None, _NOT_STRUCTURAL), dtype=np.uint8)  # brackets, quotes, newlines
    quotes = kept == _QUOTE
    in_string = np.cumsum(quotes, dtype=np.int32) & 1  # an odd count of quotes so far
    step = _STEP[kept]
    step[in_string.astype(bool)] = 0
    depth = np.cumsum(step, dtype=np.int32)
    ends = np.flatnonzero(kept == _NEWLINE)
    if not (depth[ends].any() or in_string[ends].any()):
        return int(depth.max(initial=0))  # every line ended where it began: one running count serves them all
    return _per_line_depth(kept, quotes, ends)


def _per_line_depth(kept: np.ndarray, quotes: np.ndarray, ends: np.ndarray) -> int:
    """`nesting_depth` where some line is cut short or unbalanced: every count starts again at each line."""

    def per_line(steps: np.ndarray) -> np.ndarray:
        total = np.cumsum(steps, dtype=np.int32)
        restart = np.zeros(len(total), dtype=np.int32)
        restart[ends] = np.diff(total[ends], prepend=0)
        return total - np.cumsum(restart, dtype=np.int32)

    step = _STEP[kept]
    step[(per_line(quotes) & 1).astype(bool)] = 0
    return int(per_line(step).max(initial=0))


def _is_utf8(data: bytes) -> bool:
    if data.isascii():  # the common case, ten times faster than decoding
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _unnest(table: pa.Table, label: str, line_numbers: np.ndarray) -> line_decoder.DecodedSpans:
    problems: list[line_decoder.Problem] = []
    rs = table.column("resourceSpans").combine_chunks() if "resourceSpans" in table.column_names else None
    no_spans = (np.ones(table.num_rows, dtype=bool) if rs is None or pa.types.is_null(rs.type)
                else rs.is_null().to_numpy(zero_copy_only=False))
    if no_spans.any() and {"traceId", "spanId", "name"} & set(table.column_names):
        # Perhaps a bare span: its reason and skipped-span count depend on keys Arrow cannot tell from null.
        raise _Declined("a line without resourceSpans that may be a bare span")
    for row in np.flatnonzero(no_spans):
        doc = {k: table.column(k)[int(row)].as_py() for k in ("resourceMetrics", "resourceLogs")
               if k in table.column_names}
        problems.append(line_decoder.Problem(label, int(line_numbers[row]), line_decoder.not_a_trace_export_reason(doc)))

    rs_items, rs_row = _flatten(rs)
    ss_items, ss_rs = _flatten(_field(rs_items, "scopeSpans", legacy="instrumentationLibrarySpans"))
    sp, sp_ss = _flatten(_field(ss_items, "spans"))
    if sp is None:
        return _empty(problems, len(line_numbers))
    sp_row = rs_row[ss_rs][sp_ss]

    scope = _field(ss_items, "scope", legacy="instrumentationLibrary")
    scope_names = _pylist(_field(scope, "name"), len(ss_items))
    scope_versions = _pylist(_field(scope, "version"), len(ss_items))
    bad_scope = np.array([n == schema.SCOPE_NAME and not line_decoder.supported_version(v)
                          for n, v in zip(scope_names, scope_versions)], dtype=bool)

    name = _field(sp, "name")
    if name is None or not pa.types.is_string(name.type):
        raise _Declined("span names")
    is_kv = pc.fill_null(pc.starts_with(name, "kvscope."), False).to_numpy(zero_copy_only=False)
    span_bad_scope = bad_scope[sp_ss]
    version_skipped = is_kv & span_bad_scope
    if version_skipped.any():
        counts = Counter(zip(sp_row[version_skipped].tolist(), sp_ss[version_skipped].tolist()))
        for (row, ss), n in sorted(counts.items()):
            reason = line_decoder.unsupported_version_reason(scope_versions[ss] or "")
            problems.append(line_decoder.Problem(label, int(line_numbers[row]), reason, n))
    keep = np.flatnonzero(is_kv & ~span_bad_scope)
    other = int(len(is_kv) - is_kv.sum())
    n = len(keep)

    def column(field_name: str):  # one field of the kept spans
        arr = _field(sp, field_name)
        return arr if arr is None or n == len(sp) else arr.take(pa.array(keep))

    values, invalid, extras = _attributes(_field(sp, "attributes"), keep, len(sp))
    _inherit_resource_attributes(rs_items, ss_rs[sp_ss][keep], values, invalid)
    parent = column("parentSpanId")
    status = _field(sp, "status")
    code = _field(status, "code")
    return line_decoder.DecodedSpans(
        trace_id=_strings(column("traceId"), "traceId"),
        span_id=_strings(column("spanId"), "spanId"),
        parent_span_id=(np.full(n, "", dtype=object) if parent is None or pa.types.is_null(parent.type)
                        else _as_numpy(pc.fill_null(_string_typed(parent), ""))),
        name=_as_numpy(column("name")),
        start_ns=_nanos(column("startTimeUnixNano"), "startTimeUnixNano"),
        end_ns=_nanos(column("endTimeUnixNano"), "endTimeUnixNano"),
        status_code=_status_codes(code, keep, len(sp)),
        source_line=line_numbers[sp_row[keep]],
        values=values,
        invalid=invalid,
        extra_attributes=extras,
        problems=problems,
        other_spans=other,
        lines=len(line_numbers),
    )


def _empty(problems: list[line_decoder.Problem], lines: int) -> line_decoder.DecodedSpans:
    decoded = line_decoder.decode_lines("", [])
    decoded.problems = problems
    decoded.lines = lines
    return decoded


def _flatten(arr) -> tuple[Any, np.ndarray]:
    """(items, parent index of each item) of a list-of-structs array; (None, []) when empty."""
    if arr is None or pa.types.is_null(arr.type):
        return None, np.zeros(0, dtype=np.int64)
    if not pa.types.is_list(arr.type):
        raise _Declined(f"expected a list, got {arr.type}")
    items = pc.list_flatten(arr)
    if len(items) == 0:
        return None, np.zeros(0, dtype=np.int64)
    if items.null_count:  # [null, {...}], or [null] where no line holds an object (Arrow's null type):
        raise _Declined("null in a list of objects")  # the line decoder reports the entry that is not an object
    if not pa.types.is_struct(items.type):
        raise _Declined(f"expected objects, got {items.type}")
    return items, pc.list_parent_indices(arr).to_numpy().astype(np.int64)


def _field(arr, name: str, legacy: str | None = None):
    if arr is None or pa.types.is_null(arr.type):  # absent, or null on every line: no field
        return None
    if not pa.types.is_struct(arr.type):  # "status": "ok" on every line: the line decoder names the field
        raise _Declined(f"expected objects, got {arr.type}")
    if legacy is not None and arr.type.get_field_index(legacy) >= 0:
        raise _Declined(f"legacy field {legacy}")
    index = arr.type.get_field_index(name)
    return None if index < 0 else pc.struct_field(arr, [index])


def _pylist(arr, n: int) -> list:
    return [None] * n if arr is None else arr.to_pylist()


def _as_numpy(arr) -> np.ndarray:
    return arr.to_numpy(zero_copy_only=False)


def _string_typed(arr):
    if not pa.types.is_string(arr.type):
        raise _Declined(f"expected strings, got {arr.type}")
    return arr


def _strings(arr, name: str) -> np.ndarray:
    if arr is None or arr.null_count:
        raise _Declined(f"missing {name}")
    return _as_numpy(_string_typed(arr))


def _nanos(arr, name: str) -> np.ndarray:
    if arr is None or arr.null_count:
        raise _Declined(f"missing {name}")
    if pa.types.is_string(arr.type):
        # Arrow's cast also takes "0x10" (hex) where the line decoder's int() does not: digits only here.
        # min_count=0: no kept span at all (a file without kvscope spans) passes; null would decline the file
        if not pc.all(pc.match_substring_regex(arr, r"^[0-9]+$"), min_count=0).as_py():
            raise _Declined(f"{name} not in decimal digits")  # the line decoder names each line
        arr = pc.cast(arr, pa.int64())  # "1700000000000000000"; raises past int64 -> declined
    elif not pa.types.is_integer(arr.type):
        raise _Declined(f"{name} of type {arr.type}")
    nanos = _as_numpy(arr).astype(np.int64)
    if (nanos <= 0).any():
        raise _Declined(f"negative or unset (0) {name}")  # the line decoder names each line
    return nanos


def _status_codes(code, keep: np.ndarray, total: int) -> np.ndarray:
    if code is None or pa.types.is_null(code.type):
        return np.zeros(len(keep), dtype=np.int64)
    if not pa.types.is_integer(code.type):
        raise _Declined("status code names")
    codes = _as_numpy(pc.fill_null(code, 0)).astype(np.int64)[keep]
    if ((codes < 0) | (codes > 2)).any():
        raise _Declined("unknown status codes")  # the line decoder names each line
    return codes


def _attributes(attributes, keep: np.ndarray, total: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list]:
    """Per known key: one value per kept span (NaN/None when absent), invalid masks, the rest as dicts.

    `attributes` is the list column of all `total` spans; `keep` indexes the kept ones.
    """
    values: dict[str, np.ndarray] = {}
    invalid: dict[str, np.ndarray] = {}
    n = len(keep)
    items, span_of = _flatten(attributes)
    if items is not None and n < total:  # renumber to kept spans; attributes of others go
        new_index = np.full(total, -1, dtype=np.int64)
        new_index[keep] = np.arange(n)
        span_of = new_index[span_of]
        mine = np.flatnonzero(span_of >= 0)
        items, span_of = items.take(pa.array(mine)), span_of[mine]
    if items is None or len(items) == 0:
        for key, (_, is_int) in schema.ATTRIBUTE_COLUMNS.items():
            values[key] = np.full(n, np.nan) if is_int else np.full(n, None, dtype=object)
            invalid[key] = np.zeros(n, dtype=bool)
        return values, invalid, [None] * n
    keys = _field(items, "key")
    if keys is None or keys.null_count:
        raise _Declined("attribute without key")
    keys = _string_typed(keys)
    value = _field(items, "value")
    if _holds_several(value):
        raise _Declined("an attribute holding several values")  # the line decoder names it
    key_index = _as_numpy(pc.fill_null(pc.index_in(keys, value_set=pa.array(KNOWN_KEYS)), -1))
    number = _numbers(value, len(items))
    text = _field(value, "stringValue")
    text = _as_numpy(_string_typed(text)) if text is not None and not pa.types.is_null(text.type) else None

    for j, (key, (_, is_int)) in enumerate(schema.ATTRIBUTE_COLUMNS.items()):
        rows = np.flatnonzero(key_index == j)
        present = np.zeros(n, dtype=bool)
        present[span_of[rows]] = True
        if is_int:
            got = number[rows]
            if np.isnan(got).any():
                raise _Declined(f"non-numeric {key}")
            col = np.full(n, np.nan)
            col[span_of[rows]] = got
            invalid[key] = present & ~line_decoder.integral_mask(col)
        else:
            got = text[rows] if text is not None else np.full(len(rows), None, dtype=object)
            if len(rows) and np.equal(got, None).any():
                raise _Declined(f"non-string {key}")
            col = np.full(n, None, dtype=object)
            col[span_of[rows]] = got
            invalid[key] = np.zeros(n, dtype=bool)
        values[key] = col

    extras: list[dict[str, Any] | None] = [None] * n
    extra_rows = np.flatnonzero(key_index == -1)
    if len(extra_rows):
        picked = value.take(pa.array(extra_rows)).to_pylist()
        names = keys.take(pa.array(extra_rows)).to_pylist()
        for row, key, v in zip(extra_rows.tolist(), names, picked):
            span = int(span_of[row])
            # The one field set ({"boolValue": true}); None for an unset value ({}, null or no "value").
            entry = next((x for x in (v or {}).values() if x is not None), None)
            if extras[span] is None:
                extras[span] = {}
            extras[span][key] = line_decoder.without_nulls(entry)
    return values, invalid, extras


def _inherit_resource_attributes(rs_items, rs_of_span: np.ndarray, values: dict, invalid: dict) -> None:
    """Give each kept span the `schema.RESOURCE_ATTRIBUTES` of its resource (``rs_of_span``) where it has
    none of its own, as the line decoder does; declines on a value not of its column's type (a plain
    number, or a string)."""
    items, rs_of_item = _flatten(_field(_field(rs_items, "resource"), "attributes"))
    if items is None:
        return
    keys = _field(items, "key")
    if keys is None or keys.null_count:
        raise _Declined("resource attribute without key")
    keys = _as_numpy(_string_typed(keys))
    value = _field(items, "value")
    for key in schema.RESOURCE_ATTRIBUTES:
        rows = np.flatnonzero(keys == key)
        if not len(rows):
            continue
        if len(np.unique(rs_of_item[rows])) < len(rows):
            raise _Declined(f"resource attribute {key} given twice")  # the line decoder takes the first
        picked = value.take(pa.array(rows)) if value is not None else None
        if _holds_several(picked):
            raise _Declined(f"resource attribute {key} holding several values")
        if not schema.ATTRIBUTE_COLUMNS[key][1]:  # a string
            text = _field(picked, "stringValue")
            got = (_as_numpy(_string_typed(text)) if text is not None and not pa.types.is_null(text.type)
                   else np.full(len(rows), None, dtype=object))
            if np.equal(got, None).any():
                raise _Declined(f"non-string resource attribute {key}")
            by_resource = np.full(len(rs_items), None, dtype=object)
            by_resource[rs_of_item[rows]] = got
            col = values[key]
            values[key] = np.where(np.equal(col, None), by_resource[rs_of_span], col)
            continue
        number = _numbers(picked, len(rows))
        if np.isnan(number).any():
            raise _Declined(f"non-numeric resource attribute {key}")
        by_resource = np.full(len(rs_items), np.nan)
        by_resource[rs_of_item[rows]] = number
        inherited = by_resource[rs_of_span]
        col = values[key]
        own = ~np.isnan(col)
        values[key] = np.where(own, col, inherited)
        invalid[key] = ~np.isnan(values[key]) & ~line_decoder.integral_mask(values[key])


def _holds_several(value) -> bool:
    """Whether an AnyValue column has an entry with two fields set (a oneof holds one)."""
    if value is None or not pa.types.is_struct(value.type) or value.type.num_fields < 2:
        return False
    held = sum(_as_numpy(pc.is_valid(pc.struct_field(value, [i]))).astype(np.int64)
               for i in range(value.type.num_fields))
    return bool((held > 1).any())


def _numbers(value, count: int) -> np.ndarray:
    """intValue (a decimal string or a JSON number) or doubleValue of each attribute, NaN for others."""
    out = np.full(count, np.nan)
    for name in ("doubleValue", "intValue"):  # one of them at most (`_attributes` declines both)
        arr = _field(value, name)
        if arr is None or pa.types.is_null(arr.type):
            continue
        if not (pa.types.is_string(arr.type) or pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)):
            raise _Declined(f"{name} of type {arr.type}")
        as_float = _as_numpy(pc.cast(arr, pa.float64())).astype(float)  # nulls -> NaN
        out = np.where(np.isnan(as_float), out, as_float)
    return out
