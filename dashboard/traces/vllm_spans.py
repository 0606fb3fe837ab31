"""vLLM's own request spans (`llm_request`) of OTLP/JSON lines -> one row per span.

vLLM writes one when a request finishes, if it runs with ``--otlp-traces-endpoint``
(vllm/v1/engine/output_processor.py, ``do_tracing``): from the request's arrival to its end, in the
trace of the request's ``traceparent``, where kvscope's spans of that request are too (`vllm_join`).
Its ``gen_ai.*`` attributes hold latencies in seconds (doubles), token counts and the request id the
client sees. The span is found by its name: vLLM 0.32 records it under scope ``vllm.tracing.otel``,
older releases under ``vllm.llm_engine``.

Read apart from kvscope's spans, on lines that name the span only: the kvscope reader reports lines
that do not parse, and a vLLM span without usable ids or times is left out, never a kvscope problem.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd

from dashboard.traces.json_numbers import json_integer
from dashboard.traces.schema import base64_id

VLLM_REQUEST_SPAN = "llm_request"
_MARKER = b'"' + VLLM_REQUEST_SPAN.encode() + b'"'  # a line without it holds no such span: not parsed twice

# vLLM attribute -> (column, scale): latencies in seconds become milliseconds; None: text.
VLLM_ATTRIBUTES: dict[str, tuple[str, float | None]] = {
    "gen_ai.request.id": ("vllm_request_id", None),
    "gen_ai.latency.time_in_queue": ("queue_ms", 1e3),
    "gen_ai.latency.time_to_first_token": ("ttft_ms", 1e3),
    "gen_ai.latency.e2e": ("e2e_ms", 1e3),
    "gen_ai.latency.time_in_model_prefill": ("prefill_ms", 1e3),
    "gen_ai.latency.time_in_model_decode": ("decode_ms", 1e3),
    "gen_ai.usage.prompt_tokens": ("prompt_tokens", 1.0),
    "gen_ai.usage.completion_tokens": ("completion_tokens", 1.0),
}
_TOKEN_COLUMNS = ("prompt_tokens", "completion_tokens")
VLLM_COLUMNS = ("vllm_key", "trace_id", "span_id", "parent_span_id", "start_ns", "end_ns", "status_code",
                *(col for col, _ in VLLM_ATTRIBUTES.values()), "attributes", "source_file", "source_line")
_HEX = {32: re.compile("[0-9a-f]{32}"), 16: re.compile("[0-9a-f]{16}")}
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads pairs the surrogates of one character


def read_vllm_requests(label: str, data: bytes) -> pd.DataFrame:
    """The `llm_request` spans of one file's JSON lines (`VLLM_COLUMNS`, `vllm_key` unset)."""
    rows: list[tuple] = []
    if _MARKER in data:
        for lineno, raw in enumerate(data.split(b"\n"), 1):
            if _MARKER not in raw:
                continue
            try:
                doc = json.loads(raw)
            except (ValueError, RecursionError):
                continue
            for export in doc if isinstance(doc, list) else [doc]:
                rows += [(*row, label, lineno) for row in map(_row, _request_spans(export)) if row is not None]
    return _frame(rows)


def combine_vllm_requests(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """All files' vLLM request spans, each once (a span in two files: its first), `vllm_key` numbering them."""
    frames = [f for f in frames if len(f)]
    frame = pd.concat(frames, ignore_index=True) if frames else _frame([])
    frame = frame.drop_duplicates(["trace_id", "span_id"], keep="first").reset_index(drop=True)
    frame["vllm_key"] = np.arange(len(frame), dtype=np.int64)
    return frame


def empty_vllm_requests() -> pd.DataFrame:
    return combine_vllm_requests([])


def _request_spans(export: Any) -> Iterator[dict]:
    if not isinstance(export, dict):
        return
    for rs in _list(export.get("resourceSpans")):
        if not isinstance(rs, dict):
            continue
        for ss in _list(rs.get("scopeSpans")) + _list(rs.get("instrumentationLibrarySpans")):
            if isinstance(ss, dict):
                yield from (sp for sp in _list(ss.get("spans"))
                            if isinstance(sp, dict) and sp.get("name") == VLLM_REQUEST_SPAN)


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _row(sp: dict) -> tuple | None:
    trace_id, span_id = _id(sp.get("traceId"), 32), _id(sp.get("spanId"), 16)
    try:
        start, end = json_integer(sp["startTimeUnixNano"]), json_integer(sp["endTimeUnixNano"])
    except (KeyError, ValueError):
        return None
    if trace_id is None or span_id is None or not (0 <= start < 1 << 63 and 0 <= end < 1 << 63):
        return None
    attrs = {}
    for a in _list(sp.get("attributes")):
        if isinstance(a, dict) and isinstance(a.get("key"), str) and isinstance(a.get("value"), dict):
            value = next(iter(a["value"].values()), None)  # {"doubleValue": 0.01}: the one entry
            attrs[_text(a["key"])] = _text(value) if isinstance(value, str) else value
    values = [_value(attrs.get(key), scale) for key, (_, scale) in VLLM_ATTRIBUTES.items()]
    status = sp.get("status")
    code = status.get("code", 0) if isinstance(status, dict) else 0
    return (trace_id, span_id, _id(sp.get("parentSpanId"), 16) or "", start, end,
            code if type(code) is int and code in (0, 1, 2) else 0, *values, attrs or None)


def _text(value: str) -> str:
    """A string with any lone surrogate (JSON can escape one: "\\ud800") replaced: pages encode it as UTF-8."""
    return _LONE_SURROGATE.sub("\ufffd", value)


def _id(value: Any, width: int) -> str | None:
    if not isinstance(value, str):
        return None
    lower = value.lower()
    return lower if _HEX[width].fullmatch(lower) else base64_id(value, width)


def _value(value: Any, scale: float | None) -> Any:
    """An attribute as its column holds it: text, or a finite number scaled (NaN when absent or not a number)."""
    if scale is None:
        return value if isinstance(value, str) else None
    try:
        number = float(value) * scale  # intValue is a decimal string in OTLP/JSON
    except (TypeError, ValueError, OverflowError):
        return math.nan
    return number if math.isfinite(number) else math.nan


def _frame(rows: list[tuple]) -> pd.DataFrame:
    columns = [c for c in VLLM_COLUMNS if c != "vllm_key"]
    frame = pd.DataFrame(rows, columns=columns).astype({"start_ns": "int64", "end_ns": "int64",
                                                        "status_code": "int64", "source_line": "int64"})
    for col, scale in VLLM_ATTRIBUTES.values():
        if scale is not None:
            frame[col] = frame[col].astype(float)
    for col in _TOKEN_COLUMNS:  # counts: integers where whole and within int64, NA otherwise
        values = frame[col]
        whole = values.where(np.isfinite(values) & (values == np.floor(values)) & (values.abs() < 2.0 ** 63))
        frame[col] = whole.astype("Int64")
    for col in ("trace_id", "span_id", "parent_span_id", "vllm_request_id", "attributes", "source_file"):
        frame[col] = frame[col].astype(object)
    frame.insert(0, "vllm_key", np.zeros(len(frame), dtype=np.int64))
    return frame
