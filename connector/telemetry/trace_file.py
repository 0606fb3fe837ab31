"""Trace file sink: one OTLP/JSON ``ExportTraceServiceRequest`` per line.

The format is the one the OpenTelemetry Collector's ``file`` exporter writes (OTLP/JSON as the
OTLP specification defines it): camelCase field names, enums as integers, 64-bit integers as
strings, and ``traceId``/``spanId``/``parentSpanId`` as lowercase hex rather than protobuf-JSON's
base64. The dashboard therefore reads the connector's own files and a Collector's alike.

Several processes (the scheduler and every worker) may append to the same file: each batch is
written with a single ``write(2)`` on an ``O_APPEND`` descriptor, so lines never interleave, under
an ``flock`` kvscope's writers share, so the check for a partial last line sees no write in
progress. A pipe, FIFO, socket or terminal (``/dev/stdout`` under a container runtime, ``| tee``,
a collector's FIFO) keeps a write whole only up to ``PIPE_BUF`` bytes: there a batch goes as
several lines of at most that size each (a span larger than that alone on its line), one
``write(2)`` a line, and a reader that stops reading fails the export after ``WRITE_TIMEOUT_S``
rather than holding the engine.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import json
import logging
import math
import os
import re
import select
import stat
import threading
import time
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

# Longest write a pipe takes whole while other processes write to it (4096 on Linux; 512 is POSIX's least).
PIPE_BUF = getattr(select, "PIPE_BUF", 512)
# How long one export waits for a pipe, socket or terminal to take its lines before failing (a stalled reader).
WRITE_TIMEOUT_S = 5.0
# How long an export waits for another writer's append lock before writing without its line-end check.
APPEND_LOCK_WAIT_S = 1.0


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


def split_json_line(line: bytes, limit: int = PIPE_BUF) -> list[bytes]:
    """One OTLP/JSON line as several, each at most ``limit`` bytes (newline included) where it can be.

    Spans of one resource and scope are grouped greedily under the limit, each group with that
    resource and scope; a span too large for it goes alone. A line that fits, or that has no spans
    to split (or is not OTLP/JSON), comes back as it is.
    """
    if len(line) <= limit:
        return [line]
    try:
        message = json.loads(line)
        lines = []
        for resource_spans in message["resourceSpans"]:
            resource = {k: v for k, v in resource_spans.items() if k != "scopeSpans"}
            for scope_spans in resource_spans.get("scopeSpans", ()):
                scope = {k: v for k, v in scope_spans.items() if k != "spans"}
                head = ('{"resourceSpans":[' + _open_object(resource) + '"scopeSpans":['
                        + _open_object(scope) + '"spans":[').encode("utf-8", "replace")
                spans = [_dumps(span).encode("utf-8", "replace") for span in scope_spans.get("spans", ())]
                lines.extend(_group_spans(head, spans, b"]}]}]}\n", limit))
    except (ValueError, KeyError, TypeError, AttributeError):
        return [line]
    return lines or [line]


def _group_spans(head: bytes, spans: list[bytes], tail: bytes, limit: int) -> list[bytes]:
    lines, group, size = [], [], len(head) + len(tail)
    for span in spans:
        if group and size + 1 + len(span) > limit:
            lines.append(head + b",".join(group) + tail)
            group, size = [], len(head) + len(tail)
        size += len(span) + (1 if group else 0)  # the comma before every span but the first
        group.append(span)
    if group:
        lines.append(head + b",".join(group) + tail)
    return lines


def _open_object(fields: dict[str, Any]) -> str:
    # the object's text up to where one more field goes: '{' or '{"a":1,'
    text = _dumps(fields)[:-1]
    return text + "," if fields else text


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class OtlpJsonLinesExporter(SpanExporter):
    """Appends each exported batch to ``path`` as one OTLP/JSON line (to a pipe, socket or terminal:
    as lines of at most ``PIPE_BUF`` bytes).

    Never raises into the caller: when the file cannot be opened or written, the first failure
    logs one warning naming the path and the OS error, and every failing export after that
    returns ``SpanExportResult.FAILURE`` silently. Opening is retried on each export, so a path
    that becomes writable later starts receiving spans.
    """

    def __init__(self, path: str | os.PathLike[str], encode=spans_to_json_line):
        self.path = os.fspath(path)
        self._own_fd = own_descriptor(self.path)  # the path names this process's stdout, stderr or a descriptor
        self._encode = encode  # spans -> one line; kvscope's tracing passes a light-span encoder
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._regular = True  # the open file is a regular file (else a pipe, socket or terminal)
        self._tail_fd: int | None = None  # reads the regular file's last byte (often _fd itself; None: cannot)
        self._torn = False  # a write failed part way: the file may end in a partial line
        self._stalled = False  # the stream's reader took nothing for WRITE_TIMEOUT_S, and has not since
        self._warned = False
        self._shutdown = False
        if hasattr(os, "register_at_fork"):
            # A fork while another thread held the lock would leave the child's copy locked forever.
            reinit = weakref.WeakMethod(self._after_fork)
            os.register_at_fork(after_in_child=lambda: (m := reinit()) and m())

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        # The append lock (`flock`) belongs to the open file: a child writing through the parent's would
        # take it while the parent holds it. Its next export opens the file anew.
        self._close()

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
                if self._regular:
                    self._append(fd, data)
                else:
                    self._write_stream(fd, data)
                self._torn = False
            except OSError as exc:
                if self._regular:
                    self._torn = True  # (a stream knows whether it wrote part of a line)
                self._close()
                return self._fail(f"cannot write trace file {self.path!r}: {exc}")
            finally:
                if self._shutdown:  # shut down while this export was stuck (it gave up waiting for the lock)
                    self._close()
        return SpanExportResult.SUCCESS

    def _append(self, fd: int, data: bytes) -> None:
        """Append one line to the regular file, ended first if the file ends in a partial line.

        The check and the write hold an exclusive ``flock`` that every kvscope writer of the file
        takes: a check without it could read the end of another process's write still in progress
        (the kernel grows the file page by page) and add a newline that made a blank line."""
        locked = self._lock_for_append()
        try:
            write_all(fd, self._line_start(locked) + data)
        finally:
            if locked:
                fcntl.flock(self._tail_fd, fcntl.LOCK_UN)

    def _lock_for_append(self) -> bool:
        """Whether the append lock is held now: not where the file cannot be read, has no locks, or
        another writer held it for APPEND_LOCK_WAIT_S (a stopped process: write, unchecked, anyway)."""
        if self._tail_fd is None:
            return False
        deadline = time.monotonic() + APPEND_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(self._tail_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.001)
            except OSError:  # a file system without flock
                return False

    def _line_start(self, locked: bool) -> bytes:
        """A newline when the file ends in a partial line: another process's (or this one's) write
        cut short by a full disk, which this line would otherwise be glued to, both lost to readers."""
        if not locked:
            return b"\n" if self._torn else b""  # cannot check the file: only this process's torn writes
        size = os.fstat(self._tail_fd).st_size
        return b"\n" if size and os.pread(self._tail_fd, 1, size - 1) != b"\n" else b""

    def _write_stream(self, fd: int, data: bytes) -> None:
        """A pipe, socket or terminal: each line whole in one write() (atomic up to PIPE_BUF among
        writers), failing once the reader has taken nothing for WRITE_TIMEOUT_S."""
        # A reader that stalled costs one wait; until it reads again, batches fail without waiting
        # (each would wait out its own timeout: the engine's shutdown drains them one by one).
        timeout = 0.0 if self._stalled else WRITE_TIMEOUT_S
        try:
            if self._torn:
                self._write_line(fd, b"\n", timeout)  # end this process's partial line (a write that timed out)
            for line in split_json_line(data, PIPE_BUF):
                self._write_line(fd, line, timeout)
        except TimeoutError:
            self._stalled = True
            raise
        self._stalled = False

    def _write_line(self, fd: int, line: bytes, timeout: float) -> None:
        """Write all of ``line`` (in one write() when the stream takes it), waiting for room up to
        ``timeout`` each time; TimeoutError when it stays full that long."""
        view = memoryview(line)
        blocking = os.get_blocking(fd)  # a socket the process was given: cannot be made non-blocking alone
        while view:
            if blocking:
                _wait_writable(fd, timeout)  # a blocking write could wait for ever: wait here, bounded
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                _wait_writable(fd, timeout)
            # only a line longer than PIPE_BUF can be cut: the stream then ends in a partial line
            self._torn = 0 < len(view) < len(line)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        # Every line goes to the kernel in export(); nothing is buffered here.
        return True

    def shutdown(self) -> None:
        self._shutdown = True  # exports from now on fail, even one waiting for the lock
        # An export holds the lock for at most WRITE_TIMEOUT_S on a stalled pipe; a file system that
        # hangs (a dead NFS server) could hold it for ever, and the engine's exit must not wait on it.
        if not self._lock.acquire(timeout=WRITE_TIMEOUT_S + 1.0):
            logger.warning("kvscope: trace file %r: a write is still stuck at shutdown; not waiting for it",
                           self.path)
            return
        try:
            self._close()
        finally:
            self._lock.release()

    def _open(self) -> int:
        """The open descriptor (opened now if need be)."""
        if self._fd is not None:
            try:
                open_file = os.fstat(self._fd)
            except OSError:
                open_file = None
            if open_file is not None and self._still_at_path(open_file):
                return self._fd
            self._close()  # rotated or deleted (logrotate, an operator): write to the path again
        fd = self._open_own() if self._own_fd is not None else self._open_path()
        try:
            open_file = os.fstat(fd)
            self._regular = stat.S_ISREG(open_file.st_mode)
            if self._regular:
                os.set_blocking(fd, True)
                fd, self._tail_fd = self._readable(fd)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        return fd

    def _readable(self, fd: int) -> tuple[int, int | None]:
        """The regular file to write to and a descriptor to read its last byte with (None: none to be had)."""
        if (fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE) == os.O_RDWR:
            return fd, fd
        if self._own_fd is not None:
            return fd, _reopen(fd, os.O_RDONLY)  # the process's stream: written through its own open file
        both = _reopen(fd, os.O_RDWR | os.O_APPEND)  # a file at a path: one descriptor does both
        if both is None:
            return fd, None
        os.close(fd)
        return both, both

    def _open_own(self) -> int:
        # The process's own stdout or stderr: the same open file, not a new one at the path, whose
        # write offset would lag the process's own writes (`> log`: lines written over each other)
        fd = os.dup(self._own_fd)
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        # A pipe has no offset: a new open file of it can be non-blocking without making the
        # process's own stream so. A socket cannot be reopened; writes then wait for room first.
        nonblocking = _reopen(fd, os.O_WRONLY | os.O_NONBLOCK)
        if nonblocking is None:
            return fd
        os.close(fd)
        return nonblocking

    def _open_path(self) -> int:
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        # Non-blocking: a named pipe nobody reads fails now (ENXIO) instead of holding the exporter,
        # and the engine's shutdown behind it, until a reader comes; and writes to a pipe then wait
        # for room only up to their deadline. A regular file is made blocking again (after the fstat).
        try:
            return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            if exc.errno == errno.ENXIO and _is_fifo(self.path):
                raise OSError(exc.errno, f"{exc.strerror} (a named pipe that nothing reads)") from exc
            raise

    def _still_at_path(self, open_file: os.stat_result) -> bool:
        """Whether the open file is still the one at the path (one stat a batch, as logging's
        `WatchedFileHandler` does); the process's own stream always is."""
        if self._own_fd is not None:
            return True
        try:
            at_path = os.stat(self.path)
        except OSError:
            return False
        return (at_path.st_dev, at_path.st_ino) == (open_file.st_dev, open_file.st_ino)

    def _close(self) -> None:
        for fd in {self._fd, self._tail_fd}:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fd = self._tail_fd = None

    def _fail(self, message: str) -> SpanExportResult:
        if not self._warned:
            self._warned = True
            logger.warning("kvscope: %s; spans are dropped and further failures are not logged", message)
        return SpanExportResult.FAILURE


def _reopen(fd: int, flags: int) -> int | None:
    """A new open file of what ``fd`` names (Linux's /proc/self/fd), or None where it cannot be had
    (a socket, a file this process may not read, no /proc)."""
    try:
        return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)
    except OSError:
        return None


def _wait_writable(fd: int, timeout: float) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    if not poller.poll(math.ceil(timeout * 1000)):
        raise TimeoutError(errno.ETIMEDOUT, f"its reader took nothing for {WRITE_TIMEOUT_S:g} s (stalled?)")


_OWN_STREAMS = {"/dev/stdout": 1, "/dev/stderr": 2}
_OWN_FD = re.compile(r"/(?:dev/fd|proc/self/fd)/(\d+)")


def own_descriptor(path: str) -> int | None:
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
