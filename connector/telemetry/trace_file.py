"""Trace file sink: one OTLP/JSON ``ExportTraceServiceRequest`` per line.

The format is the one the OpenTelemetry Collector's ``file`` exporter writes (OTLP/JSON as the
OTLP specification defines it): camelCase field names, enums as integers, 64-bit integers as
strings, and ``traceId``/``spanId``/``parentSpanId`` as lowercase hex rather than protobuf-JSON's
base64. The dashboard therefore reads the connector's own files and a Collector's alike.

Several processes (the scheduler and every worker) may append to the same file: each batch is
written with a single ``write(2)`` on an ``O_APPEND`` descriptor, so lines never interleave.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import math
import os
import re
import stat
import threading
import weakref
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring
from typing import Any

from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from connector.telemetry.span_records import KINDS, expand_records, record_attributes, record_name

logger = logging.getLogger(__name__)

# OTLP/JSON encodes these bytes fields as hex; every other bytes field stays base64.
_SPAN_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def request_to_json_line(request: ExportTraceServiceRequest) -> str:
    """Encode one request as a compact OTLP/JSON line, newline included."""
    message = json_format.MessageToDict(request, use_integers_for_enums=True)
    _convert_ids(message, _b64_to_hex)
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False) + "\n"


def spans_to_json_line(spans: Sequence[ReadableSpan]) -> str:
    """Encode SDK spans as one OTLP/JSON line (the exporter's unit of output)."""
    return request_to_json_line(encode_spans(spans))


class RecordJsonEncoder:
    """Encodes span records (`span_records`) as one OTLP/JSON line: the same line as `spans_to_json_line`
    writes for the SDK spans they stand for.

    Skips the SDK span objects, the protobuf message, its JSON printer and even `json.dumps` of
    a dict tree: a record of a known kind without a ``tracestate`` (the common case) is one
    %-format of that kind's template, name and attribute keys already in it; other records
    (`GENERIC_SPAN` spans, a ``tracestate``) take a general path. The resource/scope envelope is built once.
    """

    def __init__(self, resource: Any, scope_name: str, scope_version: str):
        self._head = (
            '{"resourceSpans":[{"resource":{"attributes":['
            + _attributes_json(resource.attributes)
            + ']},"scopeSpans":[{"scope":{"name":' + _json_str(scope_name)
            + ',"version":' + _json_str(scope_version) + '},"spans":['
        )
        self._children = [_typed_template(kind, child=True) if kind.attributes else None for kind in KINDS]
        self._roots = [_typed_template(kind, child=False) if kind.attributes else None for kind in KINDS]
        self._escapes = [_string_escaper(kind) for kind in KINDS]

    def __call__(self, records: Sequence[tuple]) -> str:
        children, roots, escapes = self._children, self._roots, self._escapes
        out = []
        for r in expand_records(records):
            kind = r[0]
            if children[kind] is None or r[5] is not None:  # GENERIC_SPAN, or a tracestate to write
                out.append(_general_span_json(r))
                continue
            escape = escapes[kind]
            values = escape(r[8]) if escape is not None else r[8]
            if r[3] is not None:
                out.append(children[kind] % (r[1], r[2], r[3], r[6], r[7], *values, 0x300 if r[4] else 0x100))
            else:
                out.append(roots[kind] % (r[1], r[2], r[6], r[7], *values))
        return self._head + ",".join(out) + "]}]}]}\n"


def _typed_template(kind, child: bool) -> str:
    # literal text ('%' doubled) with a conversion per value: %d for ints, %s for escaped strings
    attributes = ",".join(
        _key_prefix(key).replace("%", "%%") + ('{"intValue":"%d"}}' if value_type is int else '{"stringValue":%s}}')
        for key, value_type in kind.attributes
    )
    name = _json_str(kind.name).replace("%", "%%")
    parent = '"parentSpanId":"%016x",' if child else ""
    flags = "%d" if child else "256"  # a root: SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE only
    return ('{"traceId":"%032x","spanId":"%016x",' + parent + '"name":' + name + ',"kind":1,'
            '"startTimeUnixNano":"%d","endTimeUnixNano":"%d","attributes":[' + attributes
            + '],"status":' + _status_json(kind).replace("%", "%%") + ',"flags":' + flags + '}')


def _status_json(kind) -> str:
    # OTLP/JSON: STATUS_CODE_ERROR is 2; an unset status is an empty object
    return '{"code":2,"message":' + _json_str(kind.error) + "}" if kind.error else "{}"


def _string_escaper(kind):
    """A function giving a record's values with its string values as JSON literals (None: no strings)."""
    positions = [i for i, (_, value_type) in enumerate(kind.attributes) if value_type is str]
    if not positions:
        return None

    def escape(values):
        values = list(values)
        for i in positions:
            values[i] = _json_str(values[i])
        return values

    return escape


def _general_span_json(r: tuple) -> str:
    ids = f'"traceId":"{r[1]:032x}","spanId":"{r[2]:016x}",'
    if r[5]:
        ids += '"traceState":' + _json_str(r[5]) + ","
    flags = 0x100  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE, as the SDK's encoder sets it
    if r[3] is not None:
        ids += f'"parentSpanId":"{r[3]:016x}",'
        if r[4]:
            flags |= 0x200  # SPAN_FLAGS_CONTEXT_IS_REMOTE
    attributes = record_attributes(r)
    attributes = '"attributes":[' + _attributes_json(attributes) + "]," if attributes else ""
    status = _status_json(KINDS[r[0]])
    return _SPAN_TEMPLATE % (ids, _json_str(record_name(r)), r[6], r[7], attributes, status, flags)


_SPAN_TEMPLATE = '{%s"name":%s,"kind":1,"startTimeUnixNano":"%d","endTimeUnixNano":"%d",%s"status":%s,"flags":%d}'
_json_str = encode_basestring  # a JSON string literal, non-ASCII kept (as json.dumps(ensure_ascii=False))
_KEY_PREFIXES: dict[str, str] = {}


def _key_prefix(key: str) -> str:
    prefix = _KEY_PREFIXES.get(key)
    if prefix is None:
        prefix = _KEY_PREFIXES.setdefault(key, '{"key":' + _json_str(key) + ',"value":')
    return prefix


def _attributes_json(attributes) -> str:
    parts = []
    for key, value in attributes.items():
        prefix = _key_prefix(key)
        kind = type(value)
        if kind is int:
            parts.append(f'{prefix}{{"intValue":"{value}"}}}}')
        elif kind is str:
            parts.append(prefix + '{"stringValue":' + _json_str(value) + "}}")
        else:
            parts.append(prefix + json.dumps(_any_value(value), separators=(",", ":"), ensure_ascii=False) + "}")
    return ",".join(parts)


def records_to_json_line(records: Sequence[tuple], resource: Any, scope_name: str, scope_version: str) -> str:
    """One-off form of `RecordJsonEncoder` (tests, tools)."""
    return RecordJsonEncoder(resource, scope_name, scope_version)(records)


def _any_value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        if not math.isfinite(value):  # JSON has no NaN or Infinity: OTLP/JSON (proto3) spells them as strings
            return {"doubleValue": "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")}
        return {"doubleValue": value}
    if isinstance(value, (list, tuple)):
        return {"arrayValue": {"values": [_any_value(v) for v in value]}}
    # as the OTLP exporters encode them (the general span API takes any attribute value)
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode("ascii")}
    if isinstance(value, Mapping):
        return {"kvlistValue": {"values": [{"key": str(k), "value": _any_value(v)} for k, v in value.items()]}}
    return {"stringValue": str(value)}


def parse_json_line(line: str) -> ExportTraceServiceRequest:
    """Parse one OTLP/JSON line (ours or a Collector's) back into the protobuf message.

    Raises ``ValueError`` (``json.JSONDecodeError`` or ``json_format.ParseError``) on a bad line.
    """
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError(f"expected a JSON object, got {type(message).__name__}")
    _convert_ids(message, _hex_to_b64)
    return json_format.ParseDict(message, ExportTraceServiceRequest())


def _b64_to_hex(value: str) -> str:
    return base64.b64decode(value).hex()


def _hex_to_b64(value: str) -> str:
    return base64.b64encode(bytes.fromhex(value)).decode("ascii")


def _convert_ids(message: dict[str, Any], convert) -> None:
    for resource_spans in message.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                _convert_fields(span, convert)
                for link in span.get("links", ()):
                    _convert_fields(link, convert)


def _convert_fields(obj: dict[str, Any], convert) -> None:
    for key in _SPAN_ID_FIELDS:
        value = obj.get(key)
        if value:
            obj[key] = convert(value)


class OtlpJsonLinesExporter(SpanExporter):
    """Appends each exported batch to ``path`` as one OTLP/JSON line.

    Never raises into the caller: when the file cannot be opened or written, the first failure
    logs one warning naming the path and the OS error, and every failing export after that
    returns ``SpanExportResult.FAILURE`` silently. Opening is retried on each export, so a path
    that becomes writable later starts receiving spans.
    """

    def __init__(self, path: str | os.PathLike[str], encode=spans_to_json_line):
        self.path = os.fspath(path)
        self._own_fd = _own_stream(self.path)  # the path names this process's stdout, stderr or a descriptor
        self._encode = encode  # spans -> one line; kvscope's tracing passes a light-span encoder
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._torn = False  # a write failed part way: the file may end in a partial line
        self._warned = False
        self._shutdown = False
        if hasattr(os, "register_at_fork"):
            # A fork while another thread held the lock would leave the child's copy locked forever.
            reinit = weakref.WeakMethod(self._after_fork)
            os.register_at_fork(after_in_child=lambda: (m := reinit()) and m())

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        try:
            # "replace": one odd string (a lone surrogate in a request id) must not cost the batch
            data = self._encode(spans).encode("utf-8", "replace")
        except Exception as exc:  # an encoder bug must not reach the engine
            return self._fail(f"could not encode {len(spans)} spans: {type(exc).__name__}: {str(exc)[:200]}")
        with self._lock:
            if self._shutdown:
                return SpanExportResult.FAILURE
            try:
                fd = self._open()
                # after a failed write (a full disk) end its partial line first, or this line would be
                # glued to it and both lost to readers (a blank line is skipped)
                write_all(fd, b"\n" + data if self._torn else data)
                self._torn = False
            except OSError as exc:
                self._torn = True
                self._close()
                return self._fail(f"cannot write trace file {self.path!r}: {exc}")
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        # Every line goes to the kernel in export(); nothing is buffered here.
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._shutdown = True
            self._close()

    def _open(self) -> int:
        if self._fd is not None and not self._still_at_path(self._fd):
            self._close()  # rotated or deleted (logrotate, an operator): write to the path again
        if self._fd is None:
            if self._own_fd is not None:
                # The process's own stdout or stderr: the same open file, not a new one at the path, whose
                # write offset would lag the process's own writes (`> log`: lines written over each other)
                self._fd = os.dup(self._own_fd)
                return self._fd
            directory = os.path.dirname(os.path.abspath(self.path))
            os.makedirs(directory, exist_ok=True)
            # Non-blocking to open: a named pipe nobody reads fails now (ENXIO) instead of holding
            # the exporter, and the engine's shutdown behind it, until a reader comes
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
            except OSError as exc:
                if exc.errno == errno.ENXIO and _is_fifo(self.path):
                    raise OSError(exc.errno, f"{exc.strerror} (a named pipe that nothing reads)") from exc
                raise
            os.set_blocking(fd, True)
            self._fd = fd
        return self._fd

    def _still_at_path(self, fd: int) -> bool:
        """Whether the open file is still the one at the path (one stat a batch, as logging's
        `WatchedFileHandler` does); the process's own stream always is."""
        if self._own_fd is not None:
            return True
        try:
            at_path, open_file = os.stat(self.path), os.fstat(fd)
        except OSError:
            return False
        return (at_path.st_dev, at_path.st_ino) == (open_file.st_dev, open_file.st_ino)

    def _close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def _fail(self, message: str) -> SpanExportResult:
        if not self._warned:
            self._warned = True
            logger.warning("kvscope: %s; spans are dropped and further failures are not logged", message)
        return SpanExportResult.FAILURE


_OWN_STREAMS = {"/dev/stdout": 1, "/dev/stderr": 2}
_OWN_FD = re.compile(r"/(?:dev/fd|proc/self/fd)/(\d+)")


def _own_stream(path: str) -> int | None:
    """The descriptor a path names in this process (/dev/stdout, /dev/stderr, /dev/fd/N, /proc/self/fd/N)."""
    path = os.path.normpath(str(path))
    if path in _OWN_STREAMS:
        return _OWN_STREAMS[path]
    match = _OWN_FD.fullmatch(path)
    return int(match.group(1)) if match else None


def _is_fifo(path: str) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``: a regular file takes it in one write(), a pipe may not."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]
