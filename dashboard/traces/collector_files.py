"""The OpenTelemetry Collector's binary file-exporter formats -> OTLP/JSON lines.

Besides JSON lines, the Collector's `file` exporter writes (exporter/fileexporter, file_writer.go,
marshaller.go, compression_writer.go):

- ``format: proto``: each export as a protobuf `ExportTraceServiceRequest` after 4 bytes holding its
  length (an unsigned 32-bit big-endian integer);
- ``compression: zstd``: each export (JSON or protobuf) compressed as one zstd frame, after the same
  4 length bytes; with the ``exporter.file.nativeCompression`` feature gate instead one zstd stream of
  what the file would hold uncompressed (JSON lines, or length-prefixed protobuf), which ``zstd -d``
  also reads.

Each message becomes one JSON line (a protobuf one written by `protobuf_json`), numbered from 1 as lines
are (a problem's "line" is then the message). A file still being written ends in a message or zstd frame
cut short: the messages before it are read and the cut reported, as for gzip.
"""

from __future__ import annotations

import struct

from dashboard.traces.problems import Problem

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_LENGTH = struct.Struct(">I")
ZSTD_MODULE_MISSING = ("zstd-compressed (the Collector's file exporter with `compression: zstd`): reading it needs "
                       "the `zstandard` module (pip install zstandard, or install kvscope's dashboard extra), "
                       "or decompress it first (`zstd -d FILE`)")
ZSTD_CUT_SHORT = ("zstd stream ends early (is the file still being written?): the lines before the cut are read, "
                  "the rest is unknown")
MAX_INFLATED_BYTES = 8 << 30  # what one zstd file may decompress to: a bomb stops here, not in the OOM killer
ZSTD_TOO_LARGE = (f"zstd stream decompresses past {MAX_INFLATED_BYTES >> 30} GiB: what comes before is read; "
                  "split the file")
_ZSTD_PIECE = 1 << 16  # compressed bytes per step
NOT_TRACES = ("not a trace export: no span of it has a trace and span id (the Collector's metrics or logs "
              "written with `format: proto`?)")
MESSAGE_CUT_SHORT = ("the last length-prefixed message is cut short (is the file still being written?): the "
                     "messages before it are read")


def is_length_prefixed(data: bytes) -> bool:
    """Whether ``data`` starts like the Collector's length-prefixed messages: a big-endian length that fits
    in the file, then a zstd frame or a protobuf `ExportTraceServiceRequest` (field 1, length-delimited:
    byte 0x0A). Empty messages (length 0) before the first are passed over. No JSON or text file starts so:
    its first 4 bytes read as a length beyond any file."""
    at = 0
    for _ in range(64):
        if len(data) - at < _LENGTH.size + 1:
            return False
        (size,) = _LENGTH.unpack_from(data, at)
        if size == 0:
            at += _LENGTH.size
            continue
        body = data[at + _LENGTH.size: at + _LENGTH.size + 4]
        return size <= len(data) - at - _LENGTH.size and (body == ZSTD_MAGIC or body[:1] == b"\x0a")
    return False


def unzstd(label: str, data: bytes) -> tuple[bytes | None, list[Problem]]:
    """A zstd stream of one or more frames, decompressed; None when it cannot be read at all.

    In pieces, so a corrupt or cut-short frame keeps what came out of it before (the caller keeps its
    complete lines or messages), and a stream that would inflate past `MAX_INFLATED_BYTES` (a zstd bomb
    in an upload) stops there."""
    try:
        import zstandard
    except ImportError:
        return None, [Problem(label, 0, ZSTD_MODULE_MISSING, spans=None)]
    parts: list[bytes] = []
    inflated = 0
    view, at, frame = memoryview(data), 0, None
    while at < len(data):
        if frame is None:
            frame = zstandard.ZstdDecompressor().decompressobj()
        piece = view[at:at + _ZSTD_PIECE]
        try:
            out = frame.decompress(piece)
        except zstandard.ZstdError as exc:
            return b"".join(parts), [Problem(label, 0, f"cannot decompress this zstd stream past byte {inflated:,} "
                                                       f"of its content ({exc}): what comes before is read",
                                             spans=None)]
        parts.append(out)
        inflated += len(out)
        if inflated > MAX_INFLATED_BYTES:
            kept = b"".join(parts)[:MAX_INFLATED_BYTES]
            return kept, [Problem(label, 0, ZSTD_TOO_LARGE, spans=None)]
        if frame.eof:  # the next frame starts in what this one left of the piece
            at += len(piece) - len(frame.unused_data)
            frame = None
        else:
            at += len(piece)
    if frame is not None:  # a frame cut short: only its complete lines (or messages) count
        return b"".join(parts), [Problem(label, 0, ZSTD_CUT_SHORT, spans=None)]
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
        if not size:  # an empty export: nothing to read, and no problem
            lines.append(b"")
            continue
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
    """A protobuf `ExportTraceServiceRequest` as an OTLP/JSON line (`protobuf_json`): ids in hex, 64-bit
    integers as decimal strings, enums as numbers; the fields the readers look at."""
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from dashboard.traces.protobuf_json import export_as_json_line

    try:
        message = ExportTraceServiceRequest.FromString(body)
    except DecodeError as exc:
        return b"", f"not a protobuf ExportTraceServiceRequest ({exc})"
    spans = [span for rs in message.resource_spans for ss in rs.scope_spans for span in ss.spans]
    if spans and not any(len(span.trace_id) == 16 and len(span.span_id) == 8 for span in spans):
        # metrics and logs parse as traces too (their messages share field numbers), into spans without ids
        return b"", NOT_TRACES
    return export_as_json_line(message), None
