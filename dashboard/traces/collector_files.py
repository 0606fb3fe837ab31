"""The OpenTelemetry Collector's binary file-exporter formats -> OTLP/JSON lines.

Besides JSON lines, the Collector's `file` exporter writes (exporter/fileexporter, file_writer.go,
marshaller.go, compression_writer.go):

- ``format: proto``: each export as a protobuf `ExportTraceServiceRequest` after 4 bytes holding its
  length (an unsigned 32-bit big-endian integer);
- ``compression: zstd``: each export (JSON or protobuf) compressed as one zstd frame, after the same
  4 length bytes; with the ``exporter.file.nativeCompression`` feature gate instead one zstd stream of
  what the file would hold uncompressed (JSON lines, or length-prefixed protobuf), which ``zstd -d``
  also reads.

Each message becomes one JSON line, numbered from 1 as lines are (a problem's "line" is then the
message). A file still being written ends in a message or zstd frame cut short: the messages before
it are read and the cut reported, as for gzip.
"""

from __future__ import annotations

import base64
import json
import struct

from dashboard.traces.problems import Problem

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_LENGTH = struct.Struct(">I")
ZSTD_MODULE_MISSING = ("zstd-compressed (the Collector's file exporter with `compression: zstd`): reading it needs "
                       "the `zstandard` module (pip install zstandard, or install kvscope's dashboard extra), "
                       "or decompress it first (`zstd -d FILE`)")
ZSTD_CUT_SHORT = ("zstd stream ends early (is the file still being written?): the lines before the cut are read, "
                  "the rest is unknown")
MESSAGE_CUT_SHORT = ("the last length-prefixed message is cut short (is the file still being written?): the "
                     "messages before it are read")


def is_length_prefixed(data: bytes) -> bool:
    """Whether ``data`` starts like the Collector's length-prefixed messages: a big-endian length (a first
    byte of 0 below 16 MiB, which no JSON or text file starts with) followed by a zstd frame or a protobuf
    `ExportTraceServiceRequest` (field 1, length-delimited: byte 0x0A)."""
    if len(data) < 5 or data[0] != 0:
        return False
    return data[4:8] == ZSTD_MAGIC or data[4] == 0x0A


def unzstd(label: str, data: bytes) -> tuple[bytes | None, list[Problem]]:
    """A zstd stream of one or more frames, decompressed; None when it cannot be read at all. Frame by frame:
    a frame cut short (a file still being written) or corrupt ends it, keeping the frames before."""
    try:
        import zstandard
    except ImportError:
        return None, [Problem(label, 0, ZSTD_MODULE_MISSING, spans=None)]
    parts: list[bytes] = []
    rest = data
    while rest:
        frame = zstandard.ZstdDecompressor().decompressobj()
        try:
            out = frame.decompress(rest)
        except zstandard.ZstdError as exc:
            done = sum(map(len, parts))
            return b"".join(parts), [Problem(label, 0, f"cannot decompress this zstd stream past byte {done:,} of "
                                                       f"its content ({exc}): what comes before is read", spans=None)]
        if not frame.eof:
            return b"".join(parts), [Problem(label, 0, ZSTD_CUT_SHORT, spans=None)]
        parts.append(out)
        rest = frame.unused_data
    return b"".join(parts), []


def messages_as_json_lines(label: str, data: bytes) -> tuple[bytes, list[Problem]]:
    """Length-prefixed messages (each zstd-compressed or not; JSON or protobuf) as JSON lines, one a message.

    A message that does not decode is reported and becomes an empty line (the reader skips those), so
    the next keeps its number; one cut short by the end of the file ends the reading.
    """
    lines: list[bytes] = []
    problems: list[Problem] = []
    view, at = memoryview(data), 0
    while at < len(data):
        if len(data) - at < _LENGTH.size:
            problems.append(Problem(label, 0, MESSAGE_CUT_SHORT, spans=None))
            break
        (size,) = _LENGTH.unpack_from(data, at)
        body = view[at + _LENGTH.size: at + _LENGTH.size + size]
        if len(body) < size:
            problems.append(Problem(label, 0, MESSAGE_CUT_SHORT, spans=None))
            break
        at += _LENGTH.size + size
        line, why = _message_as_json_line(label, bytes(body))
        if why is not None:
            problems.append(Problem(label, len(lines) + 1, why, spans=None))
            line = b""  # keeps the numbering; reported above, not again by the reader
        lines.append(line)
    return b"\n".join(lines) + b"\n" if lines else b"", problems


def _message_as_json_line(label: str, body: bytes) -> tuple[bytes, str | None]:
    if body[:4] == ZSTD_MAGIC:
        inflated, found = unzstd(label, body)
        if inflated is None or found:
            return b"", found[0].reason if found else ZSTD_MODULE_MISSING
        body = inflated
    if body.lstrip()[:1] == b"{":
        return b" ".join(body.split(b"\n")), None  # JSON (a message holds no newline; be safe)
    return _protobuf_as_json_line(body)


def _protobuf_as_json_line(body: bytes) -> tuple[bytes, str | None]:
    """A protobuf `ExportTraceServiceRequest` as an OTLP/JSON line: ids in hex (protobuf's JSON mapping
    writes bytes as base64, OTLP/JSON as hex), 64-bit integers as decimal strings, enums as numbers."""
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    try:
        message = ExportTraceServiceRequest.FromString(body)
    except DecodeError as exc:
        return b"", f"not a protobuf ExportTraceServiceRequest ({exc})"
    document = json_format.MessageToDict(message, use_integers_for_enums=True)
    for resource_spans in document.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                for ids in (span, *span.get("links", [])):
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if ids.get(key):
                            ids[key] = base64.b64decode(ids[key]).hex()
    return json.dumps(document, separators=(",", ":")).encode(), None
