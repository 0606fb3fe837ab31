"""One request's kvscope spans on one time axis, with their attributes as text; vLLM's request span above them."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pandas as pd

from dashboard.traces.schema import (
    ATTRIBUTE_COLUMNS,
    COPY,
    DEFERRAL,
    LOAD,
    LOOKUP,
    SCAN,
    STATUS_ERROR,
    STORE,
    group_label,
)
from dashboard.traces.vllm_spans import VLLM_REQUEST_SPAN

VLLM_KIND = "vLLM request"  # the waterfall's kind (and colour) of vLLM's own request span
# The kind of a deferred request's wait before its lookup (`DEFERRAL_DEFINITION`): no span of its own, drawn from
# its lookup span's deferral attributes; or the `kvscope.deferral` span of a request that ended waiting
DEVICE_KV_WAIT = "waiting for device KV room"

_ROW_ORDER = {VLLM_REQUEST_SPAN: -1, DEVICE_KV_WAIT: -0.5, LOOKUP: 0, LOAD: 1, SCAN: 2, "copy load": 3, STORE: 4,
              "copy store": 5}
_SHOWN_AS = {"request_id", "group_index", "group_kind", "copy_direction"}  # already in the row label


def waterfall_rows(spans: pd.DataFrame, requests: pd.DataFrame, request_id: str,
                   trace_id: str | None = None, vllm: pd.DataFrame | None = None) -> pd.DataFrame:
    """The kvscope spans of one request on one time axis (ms from its first span).

    The request is (`trace_id`, `request_id`); without `trace_id`, the request id must name one
    request (runs read together can repeat it: ValueError then). Rows: lookups, loads, each group's
    scan, the load copies, stores and store copies, each with its attributes as text. Only the
    request's own spans: several requests can share one trace (one upstream ``traceparent`` for a
    batch of prompts), and another's load is not this one's. With `vllm` (the reader's `vllm_requests`),
    the request's vLLM span (`vllm_key` of its row) comes first: the request as vLLM saw it, from arrival
    to finish, the parent row of kvscope's work. A lookup kvscope deferred for device KV room (or the load of
    a request resumed after preemption, whose lookup has no span) has a `DEVICE_KV_WAIT` row before the
    lookups: its wait, ending where that span starts (times then count from the wait's start when it comes
    first). The `kvscope.deferral` span of a request that ended waiting is such a wait, and drawn as one.
    """
    cols = ["row", "kind", "name", "start_ms", "end_ms", "duration_ms", "group_index", "group_kind",
            "direction", "attributes", "status_code", "span_id", "parent_span_id", "trace_id"]
    req = requests[requests["request_id"] == request_id]
    if trace_id is None and req["trace_id"].nunique() > 1:
        raise ValueError(f"request id {request_id!r} names {len(req)} requests (one per trace): give its trace id")
    if trace_id is not None:
        req = req[req["trace_id"] == trace_id]
    if req.empty:
        return pd.DataFrame(columns=cols)
    own = (spans["request_id"] == request_id) & (spans["trace_id"] == req["trace_id"].iloc[0])
    owner_keys = spans.loc[own & spans["name"].isin([LOAD, STORE]), "span_key"]
    related = own | (spans["name"].isin([COPY, SCAN]) & spans["owner_key"].isin(owner_keys))
    rows = spans[related].copy()
    rows["name"] = rows["name"].astype(str)
    waits = _device_kv_waits(rows)
    if not waits.empty:
        rows = pd.concat([rows, waits], ignore_index=True)
        rows["status_code"] = rows["status_code"].astype("Int64")  # a wait has none: the spans' stay integers
    key = req["vllm_key"].iloc[0] if "vllm_key" in req else pd.NA
    if vllm is not None and not pd.isna(key):
        rows = pd.concat([_vllm_row(vllm[vllm["vllm_key"] == key]), rows], ignore_index=True)
    kind = rows["name"].astype(str)
    kind = kind.where(kind != DEFERRAL, DEVICE_KV_WAIT)  # a wait that outlasted its request: a span of its own
    is_copy = kind == COPY
    kind = kind.where(~is_copy, "copy " + rows["copy_direction"].astype(str))
    rows["_order"] = kind.map(_ROW_ORDER).fillna(9)
    kind = kind.where(~(is_copy & (rows["status_code"] == STATUS_ERROR)), kind + " failed")  # a colour of its own
    rows["kind"] = kind.str.replace("kvscope.", "", regex=False).replace(VLLM_REQUEST_SPAN, VLLM_KIND)
    t0 = rows["start_ns"].min()
    rows["start_ms"] = (rows["start_ns"] - t0) / 1e6
    rows["end_ms"] = (rows["end_ns"] - t0) / 1e6
    rows["direction"] = rows["copy_direction"].astype(object)
    rows = rows.sort_values(["_order", "group_index", "worker_rank", "start_ns"], kind="stable", na_position="first")
    rows["row"] = _unique([_row_label(r) for r in rows.itertuples(index=False)])
    rows["attributes"] = [_attribute_text(r) for r in rows.to_dict("records")]
    return rows[cols].reset_index(drop=True)


def _device_kv_waits(rows: pd.DataFrame) -> pd.DataFrame:
    """A row per lookup or load span with a deferral wait: from the start of its first deferred lookup (which
    has no span) to the start of that span, with its deferral attributes."""
    deferred = rows[rows["name"].isin([LOOKUP, LOAD]) & rows["deferred_wait_us"].notna()]
    lookup_start = deferred["start_ns"].to_numpy(dtype="int64")
    wait_ns = deferred["deferred_wait_us"].to_numpy(dtype="int64") * 1000
    return pd.DataFrame({
        "name": DEVICE_KV_WAIT,
        "start_ns": lookup_start - wait_ns,
        "end_ns": lookup_start,
        "duration_ms": wait_ns / 1e6,
        "trace_id": deferred["trace_id"].to_numpy(),
        "request_id": deferred["request_id"].to_numpy(),
        "deferred_lookups": deferred["deferred_lookups"].to_numpy(),
        "deferred_wait_us": deferred["deferred_wait_us"].to_numpy(),
        "attributes": [None] * len(deferred),  # its lookup's other attributes stay on the lookup's row
    })


def _vllm_row(span: pd.DataFrame) -> pd.DataFrame:
    """vLLM's span as a span-frame row: its own attributes, gen_ai.* keys shortened, as extra attributes."""
    return pd.DataFrame({
        "name": VLLM_REQUEST_SPAN,
        "start_ns": span["start_ns"].to_numpy(),
        "end_ns": span["end_ns"].to_numpy(),
        "duration_ms": (span["end_ns"] - span["start_ns"]).to_numpy() / 1e6,
        "status_code": span["status_code"].to_numpy(),
        "span_id": span["span_id"].to_numpy(),
        "parent_span_id": span["parent_span_id"].to_numpy(),
        "trace_id": span["trace_id"].to_numpy(),
        "attributes": [{k.removeprefix("gen_ai."): v for k, v in (a or {}).items()} for a in span["attributes"]],
    })


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
