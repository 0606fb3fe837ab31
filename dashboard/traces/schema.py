"""The span contract (DESIGN.md §2) as the trace reader's span frame holds it.

Span names, the attributes each requires, the column each known attribute becomes, and the
selections and labels every shaping module shares.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import pandas as pd

from connector.telemetry.span_records import ENGINE_RESOURCE_ATTRIBUTE

SERVICE_INSTANCE_ATTRIBUTE = "service.instance.id"

SCOPE_NAME = "kvscope"
# Scope versions whose span schema this reader knows ("0.1" accepts 0.1, 0.1.0, 0.1.3.dev1, ...).
SUPPORTED_SCOPE_VERSIONS = ("0.1",)

LOOKUP = "kvscope.lookup"
LOAD = "kvscope.load"
SCAN = "kvscope.group.scan"
COPY = "kvscope.group.copy"
STORE = "kvscope.store"
# A wait for device KV room that no lookup or load span tells: the span is the wait (`DEFERRAL_DEFINITION`). The
# request ended (aborted) while kvscope deferred its load, the only span of a request vLLM never admitted; or,
# resumed after a preemption, vLLM admitted it with nothing to load (`DEFERRAL_OUTCOME` "admitted"; files
# written before the attribute have only the first kind). Newer files only.
DEFERRAL = "kvscope.deferral"
DEFERRAL_OUTCOME = "kvscope.deferred.outcome"  # kept in the `attributes` dict
SPAN_NAMES = (LOOKUP, LOAD, SCAN, COPY, STORE, DEFERRAL)

GROUP_KINDS = ("full_attention", "sliding_window", "mamba")
DIRECTIONS = ("load", "store")
PAST_TENSE = {"load": "loaded", "store": "stored"}  # column names: bytes_loaded, bytes_stored

# Attribute key -> (column, is integer). Every other attribute stays in the `attributes` dict.
ATTRIBUTE_COLUMNS: dict[str, tuple[str, bool]] = {
    "kvscope.request.id": ("request_id", False),
    "kvscope.tokens.queried": ("tokens_queried", True),
    "kvscope.tokens.hit": ("tokens_hit", True),
    "kvscope.miss.reason": ("miss_reason", False),  # newer files only: NA in older ones
    # Only on the lookup kvscope admitted a deferred load on, the load of a request resumed after preemption, and
    # a `DEFERRAL` span (`DEFERRAL_DEFINITION`): NA on every other span, and in files written before kvscope
    # recorded them.
    "kvscope.deferred.lookups": ("deferred_lookups", True),
    "kvscope.deferred.wait_us": ("deferred_wait_us", True),
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
    # A resource attribute (vLLM's data-parallel index): each decoder gives it to every span of its
    # resource (`RESOURCE_ATTRIBUTES`); NA in files written before kvscope recorded it.
    ENGINE_RESOURCE_ATTRIBUTE: ("engine", True),
    # The OpenTelemetry SDK's id of the process that wrote the span (a UUID per process, unless
    # OTEL_RESOURCE_ATTRIBUTES sets it): lookups of one engine index from several processes are separate
    # servers or restarts, each with a host tier of its own. NA where the SDK did not set it.
    SERVICE_INSTANCE_ATTRIBUTE: ("service_instance", False),
}
# Resource attributes read as if each span of the resource carried them (a span's own value wins).
RESOURCE_ATTRIBUTES = (ENGINE_RESOURCE_ATTRIBUTE, SERVICE_INSTANCE_ATTRIBUTE)

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
    DEFERRAL: ("kvscope.request.id", "kvscope.tokens.external", "kvscope.deferred.lookups",
               "kvscope.deferred.wait_us"),
}

ALLOWED_VALUES: dict[str, tuple[str, ...]] = {
    "kvscope.group.kind": GROUP_KINDS,
    "kvscope.copy.direction": DIRECTIONS,
}

# `attributes` holds the attributes that have no column of their own (dict or None).
# Shaping joins a copy or scan to its load or store by `owner_key` -> `span_key`, never by span id.
SPAN_COLUMNS = (
    "trace_id",
    "span_id",
    "parent_span_id",
    "name",
    "start_ns",
    "end_ns",
    "duration_ms",
    *(col for col, _ in ATTRIBUTE_COLUMNS.values()),
    "span_key",  # unique per row: what joins use, as span ids repeat across runs
    "owner_key",  # a copy's or scan's load or store (its span_key), NA when none (`owners`)
    "clock_ok",  # False: it ends before it starts, or starts before its owner: no load time (reported by the reader)
    "status_code",
    "attributes",
    "source_file",
    "source_line",
)

GROUP_KEYS = ["group_index", "group_kind"]
# A request: its id alone repeats across runs (a benchmark rerun with client-set ids), and every
# kvscope span of one request is in one trace (rooted by its lookup, or the upstream traceparent).
# No engine in the key: data-parallel engines sharing a trace cannot repeat an id, as vLLM (0.32+)
# suffixes every client id with 8 random characters (unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION).
REQUEST_KEY = ["trace_id", "request_id"]


def group_label(index: Any, kind: Any) -> str:
    return f"g{index} {kind}"


def scans_of(spans: pd.DataFrame) -> pd.DataFrame:
    return spans[spans["name"] == SCAN]


STATUS_ERROR = 2  # OTLP's STATUS_CODE_ERROR: a copy span of a copy that failed on its worker


def duration_ok(spans: pd.DataFrame) -> pd.Series:
    """Whether a span's duration can be trusted: it is measured on one clock (on a GPU, between two
    device events), so only one that ends before it starts is wrong; an offset to another span's
    clock (`clock_ok`) spoils load times, not durations."""
    return spans["end_ns"] >= spans["start_ns"]


def moved_bytes(copies: pd.DataFrame) -> pd.Series:
    """The bytes each copy span moved: 0 for a failed one (status ERROR) whatever its span says, as
    `copies_of` leaves it out (the connector's own say 0)."""
    return copies["copy_bytes"].where(copies["status_code"] != STATUS_ERROR, 0)


def copies_of(spans: pd.DataFrame, direction: str | None = None, timed: bool = False) -> pd.DataFrame:
    """Copy spans of copies that ran (a failed copy's span, status ERROR, moved nothing and took no time);
    `timed`: only those whose duration can be trusted (`duration_ok`), for durations and throughput."""
    copies = spans[(spans["name"] == COPY) & (spans["status_code"] != STATUS_ERROR)]
    if timed:
        copies = copies[duration_ok(copies)]
    if direction is not None:
        copies = copies[copies["copy_direction"] == direction]
    return copies


def base64_id(value: str, width: int) -> str | None:
    """A trace or span id written in base64 (protobuf-JSON tools) as lowercase hex of `width` digits, else None."""
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) * 2 == width else None
