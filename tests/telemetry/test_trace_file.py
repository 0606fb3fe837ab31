"""The trace file: OTLP/JSON lines as the Collector's file exporter writes them."""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import threading
import time

import pytest
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SpanExportResult

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from connector.telemetry.trace_file import OtlpJsonLinesExporter, parse_json_line

from .descriptors import descriptors_open_on


def _make_spans(tracing, n_children=2):
    root = tracing.start_span("kvscope.load")
    root.set_attribute("kvscope.tokens.external", 2**40)
    root.set_attribute("kvscope.request.id", "req-1")
    ctx = tracing.context_of(root)
    for i in range(n_children):
        child = tracing.start_span("kvscope.group.scan", context=ctx)
        child.set_attribute("kvscope.group.index", i)
        child.set_attribute("kvscope.group.kind", "sliding_window")
        child.end()
    root.end()


def test_one_line_per_export_in_otlp_json(tmp_path, tracing, span_exporter):
    _make_spans(tracing)
    spans = span_exporter.get_finished_spans()
    path = tmp_path / "traces.jsonl"
    exporter = OtlpJsonLinesExporter(path)

    assert exporter.export(spans[:1]) is SpanExportResult.SUCCESS
    assert exporter.export(spans[1:]) is SpanExportResult.SUCCESS
    exporter.shutdown()

    lines = path.read_text().splitlines(keepends=True)
    assert len(lines) == 2 and all(line.endswith("\n") for line in lines)
    request = json.loads(lines[1])
    span = request["resourceSpans"][0]["scopeSpans"][0]["spans"][-1]
    original = spans[-1]
    # OTLP/JSON: lowercase hex ids, 64-bit integers as strings, enums as integers, camelCase.
    assert span["traceId"] == format(original.context.trace_id, "032x")
    assert span["spanId"] == format(original.context.span_id, "016x")
    assert span["startTimeUnixNano"] == str(original.start_time)
    assert span["kind"] == 1
    attributes = {a["key"]: a["value"] for a in span["attributes"]}
    assert attributes["kvscope.tokens.external"] == {"intValue": str(2**40)}
    assert attributes["kvscope.request.id"] == {"stringValue": "req-1"}
    child = request["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert child["parentSpanId"] == span["spanId"]
    scope = request["resourceSpans"][0]["scopeSpans"][0]["scope"]
    assert scope["name"] == "kvscope"


def test_line_parses_back_to_the_same_request(tmp_path, tracing, span_exporter):
    _make_spans(tracing, n_children=3)
    spans = span_exporter.get_finished_spans()
    path = tmp_path / "t.jsonl"
    OtlpJsonLinesExporter(path).export(spans)
    line = path.read_text()

    assert parse_json_line(line) == encode_spans(spans)

    # The same line read with plain protobuf JSON, after turning the hex ids back into base64.
    message = json.loads(line)
    for rs in message["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    parsed = json_format.ParseDict(message, ExportTraceServiceRequest())
    assert parsed == encode_spans(spans)


def test_unwritable_path_logs_once_and_never_raises(tmp_path, tracing, span_exporter, caplog):
    _make_spans(tracing)
    spans = span_exporter.get_finished_spans()
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    path = not_a_dir / "sub" / "traces.jsonl"  # parent is a regular file: fails even as root
    exporter = OtlpJsonLinesExporter(path)

    with caplog.at_level(logging.WARNING, logger="connector.telemetry.trace_file"):
        results = [exporter.export(spans) for _ in range(3)]

    assert results == [SpanExportResult.FAILURE] * 3
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert str(path) in message and "Not a directory" in message


def test_concurrent_exports_write_whole_lines(tmp_path, tracing, span_exporter):
    _make_spans(tracing, n_children=20)
    spans = span_exporter.get_finished_spans()
    path = tmp_path / "t.jsonl"
    exporter = OtlpJsonLinesExporter(path)

    def work():
        for _ in range(25):
            exporter.export(spans)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    lines = path.read_text().splitlines()
    assert len(lines) == 100
    for line in lines:
        assert len(parse_json_line(line).resource_spans[0].scope_spans[0].spans) == len(spans)


def test_export_appends_to_an_existing_file(tmp_path, tracing, span_exporter):
    _make_spans(tracing)
    path = tmp_path / "t.jsonl"
    path.write_text('{"resourceSpans":[]}\n')
    OtlpJsonLinesExporter(path).export(span_exporter.get_finished_spans())
    assert len(path.read_text().splitlines()) == 2


def test_record_encoder_writes_exactly_what_the_sdk_encoder_writes(tmp_path):
    """The trace file's fast path (records -> JSON) against the SDK/protobuf path, for every record
    kind, typed and general, as root, local child, remote child and with a tracestate."""
    import json as _json

    from opentelemetry.sdk.resources import Resource

    from connector import __version__
    from connector.telemetry.span_records import (
        DEFERRAL_WAIT_SPAN,
        COPY_SPAN,
        DEFERRED_LOOKUP_SPAN,
        FAILED_COPY_SPAN,
        LOAD_SPAN,
        LOOKUP_SPAN,
        SCAN_SPAN,
        STORE_SPAN,
    )
    from connector.telemetry.trace_file import records_to_json_line, spans_to_json_line
    from connector.telemetry.sinks import SCOPE_NAME, SdkSpanExporter
    from connector.telemetry.tracing import KVScopeTracing

    captured = []

    class Keep:
        def on_end(self, record):
            captured.append(record)

    tracing = KVScopeTracing.for_exporter(InMemorySpanExporter())
    tracing._processor = Keep()
    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
               "tracestate": "vendor=1,other=x"}
    upstream = tracing.context_from_trace_headers(headers)
    # the general span API (GENERIC_SPAN records), with a tracestate and odd attribute types
    root = tracing.start_span("kvscope.load", context=upstream)
    root.set_attributes({"kvscope.request.id": "r1", "kvscope.tokens.local": 0, "flag": True,
                         "ratio": 0.25, "ids": [1, 2], "raw": b"\x01\xff", "map": {"k": 1, "v": ["a", 2.5]}})
    child = tracing.start_span("kvscope.group.scan", context=tracing.context_of(root))
    child.set_attributes({"kvscope.group.kind": "sliding_window", "kvscope.group.index": 1})
    child.end()
    root.end()
    tracing.record_span("kvscope.lookup", None, 5, 9, {"kvscope.tokens.hit": 0})
    # typed records: a root, local children (the template path), remote parents, a tracestate
    odd_id = 'req "1" %d \\ \u00e9\u2603'
    lookup = tracing.record(LOOKUP_SPAN, None, 10, 12, (odd_id, 64, 32, "storing", 0))
    load = tracing.open_span(lookup, 13)
    tracing.record(SCAN_SPAN, load, 14, 15, (0, "sliding_window", 8, 3, 2, 5))
    tracing.record(SCAN_SPAN, load, 15, 16, (1, "full_attention", 8, 0, 2, 6))
    tracing.end_span(LOAD_SPAN, load, 17, (odd_id, 16, 32, 2))
    tracing.record(STORE_SPAN, lookup, 18, 18, (odd_id, 2, 4))
    carrier = tracing.carrier_of(load)
    tracing.record(COPY_SPAN, tracing.context_from_carrier(carrier), 20, 25, (1, "full_attention", "load", 2, 4096, 0, odd_id))
    # failed copies (status ERROR): the template path, and the general one (a tracestate)
    tracing.record(FAILED_COPY_SPAN, tracing.context_from_carrier(carrier), 26, 26,
                   (1, "full_attention", "load", 0, 0, 1, odd_id))
    tracing.record(FAILED_COPY_SPAN, upstream, 27, 27, (0, "sliding_window", "store", 0, 0, 0, "r2"))
    tracing.record(LOOKUP_SPAN, upstream, 30, 31, ("r2", 1, 0, "new", 0))
    no_state = tracing.context_from_trace_headers({"traceparent": headers["traceparent"]})
    tracing.record(LOOKUP_SPAN, no_state, 32, 33, ("r3", 1, 0, "new", 0))
    tracing.record(DEFERRED_LOOKUP_SPAN, None, 34, 35, ("r5", 64, 0, "evicted", 0, 3, 12_400))  # its hit gone
    tracing.record(DEFERRAL_WAIT_SPAN, upstream, 36, 39_000, ("r8", 96, 4, 38, "ended"))  # aborted while deferred
    # compound load records (one per load: lookup, scans and load), under a local and a remote parent
    scans = [(41, 42, 0, "sliding_window", 8, 3, 2, 5), (42, 43, 1, "full_attention", 8, 0, 2, 6)]
    tracing.end_load(tracing.open_span(None, 40), 40, 44, (odd_id, 16, 32, 2, scans, None))
    remote = tracing.parent_from_trace_headers(headers)
    lookup_part = (0x1234, remote.span_id, True, 50, 51, 64, 32, "other_blocks", 128)
    tracing.end_load(remote, 52, 55, ("r4", 0, 32, 2, scans, lookup_part))
    deferred_part = (0x5678, remote.span_id, True, 60, 61, 64, 32, "other_blocks", 128, 2, 7_000)
    tracing.end_load(remote, 62, 65, ("r6", 0, 32, 2, scans, deferred_part))
    tracing.end_load(remote, 66, 69, ("r7", 0, 32, 2, scans, None, 1, 500))  # resumed: the load tells the wait
    assert len(captured) == 19
    resource = Resource.create({"service.name": "kvscope"})
    fast = records_to_json_line(captured, resource, SCOPE_NAME, __version__)
    readable = []
    SdkSpanExporter(type("Sink", (), {"export": lambda self, spans: readable.extend(spans)})(), resource).export(captured)
    assert _json.loads(fast) == _json.loads(spans_to_json_line(readable))
    statuses = [s["status"] for s in _json.loads(fast)["resourceSpans"][0]["scopeSpans"][0]["spans"]]
    assert statuses.count({"code": 2, "message": FAILED_COPY_SPAN.error}) == 2
    assert statuses.count({}) == len(statuses) - 2


def test_a_rotated_or_deleted_trace_file_is_written_again_at_its_path(tmp_path, tracing, span_exporter):
    """logrotate renames the file, an operator deletes it: later spans go to the path, not the
    old, unlinked file."""
    _make_spans(tracing)
    spans = span_exporter.get_finished_spans()
    path = tmp_path / "t.jsonl"
    exporter = OtlpJsonLinesExporter(path)
    exporter.export(spans)
    path.rename(tmp_path / "t.jsonl.1")
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    path.unlink()
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert len((tmp_path / "t.jsonl.1").read_text().splitlines()) == 1
    assert len(path.read_text().splitlines()) == 1


def _export_torn_by_a_full_disk(path, tracing, span_exporter, monkeypatch):
    """An exporter of ``path`` whose first export a full disk stopped after 40 bytes (a torn line);
    writes work again afterwards. Returns the exporter and the spans each export writes."""
    from connector.telemetry import trace_file

    _make_spans(tracing)
    spans = span_exporter.get_finished_spans()
    exporter = OtlpJsonLinesExporter(path)
    real_write = os.write

    def disk_full(fd, data):
        real_write(fd, bytes(data[:40]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trace_file.os, "write", disk_full)
    assert exporter.export(spans) is SpanExportResult.FAILURE
    monkeypatch.setattr(trace_file.os, "write", real_write)
    return exporter, spans


def test_a_write_failing_part_way_does_not_take_the_next_line_with_it(tmp_path, tracing, span_exporter,
                                                                    monkeypatch):
    """A full disk: a write stops after some bytes. The next line must still parse."""
    path = tmp_path / "t.jsonl"
    exporter, spans = _export_torn_by_a_full_disk(path, tracing, span_exporter, monkeypatch)
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    exporter.shutdown()
    lines = path.read_text().split("\n")
    assert len(lines[0]) == 40 and lines[-1] == ""  # the torn line, then the next one whole
    assert len(parse_json_line(lines[1]).resource_spans[0].scope_spans[0].spans) == len(spans)


def test_one_odd_request_id_does_not_cost_its_batch(tmp_path):
    """A lone surrogate cannot be UTF-8: it is replaced, and the batch's other spans are written."""
    path = tmp_path / "t.jsonl"
    exporter = OtlpJsonLinesExporter(path, encode=lambda spans: '{"ids":"' + ",".join(spans) + '"}\n')
    assert exporter.export(["ok", "bad\ud800"]) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert path.read_text(encoding="utf-8") == '{"ids":"ok,bad?"}\n'


def test_non_finite_doubles_are_written_as_otlp_json_spells_them(tmp_path):
    """JSON has no NaN or Infinity: a bare `NaN` makes the line unreadable to the Collector and to
    strict parsers, so they are written as proto3's JSON strings and parse back to the same values."""
    import json as _json
    import math

    from opentelemetry.sdk.resources import Resource

    from connector.telemetry.trace_file import parse_json_line, records_to_json_line
    from connector.telemetry.tracing import KVScopeTracing

    captured = []
    tracing = KVScopeTracing(type("Keep", (), {"on_end": lambda self, r: captured.append(r)})(), None)
    span = tracing.start_span("custom", start_time=1)
    span.set_attributes({"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "many": [1.5, math.nan]})
    span.end(2)
    line = records_to_json_line(captured, Resource.create({"service.name": "t"}), "kvscope", "0")

    def refuse(name):
        raise ValueError(f"bare {name} in the line")

    (written,) = _json.loads(line, parse_constant=refuse)["resourceSpans"][0]["scopeSpans"][0]["spans"]
    values = {a["key"]: a["value"] for a in written["attributes"]}
    assert values["nan"] == {"doubleValue": "NaN"}
    assert values["inf"] == {"doubleValue": "Infinity"} and values["ninf"] == {"doubleValue": "-Infinity"}
    assert values["many"]["arrayValue"]["values"] == [{"doubleValue": 1.5}, {"doubleValue": "NaN"}]
    (parsed,) = parse_json_line(line).resource_spans[0].scope_spans[0].spans
    back = {a.key: a.value for a in parsed.attributes}
    assert math.isnan(back["nan"].double_value) and back["inf"].double_value == math.inf
    assert back["ninf"].double_value == -math.inf


def test_a_named_pipe_nothing_reads_fails_at_once_and_one_with_a_reader_gets_the_lines(
        tmp_path, tracing, span_exporter, caplog):
    """Opening a FIFO for writing waits for a reader: the exporter (and the engine's shutdown
    waiting for its lock) must not. With a reader, lines go through it as to a file."""
    import os

    _make_spans(tracing)
    spans = span_exporter.get_finished_spans()
    path = tmp_path / "spans.fifo"
    os.mkfifo(path)
    exporter = OtlpJsonLinesExporter(path)
    done = []
    worker = threading.Thread(target=lambda: done.append(exporter.export(spans)), daemon=True)
    with caplog.at_level(logging.WARNING, logger="connector.telemetry.trace_file"):
        worker.start()
        worker.join(10)
    assert done == [SpanExportResult.FAILURE], "the export waited for a reader of the named pipe"
    assert "a named pipe that nothing reads" in caplog.records[-1].getMessage()
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        line = os.read(reader, 1 << 20).decode()
        assert line.endswith("\n") and len(json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]) == 3
    finally:
        exporter.shutdown()
        os.close(reader)


def test_string_array_attributes_are_written_as_the_sdk_encoder_writes_them(tmp_path):
    """Spans made through the span API may carry lists of strings: the trace file's own encoder writes
    them as the OTLP exporter does, so the two sinks of one span agree."""
    import json as _json

    from opentelemetry.sdk.resources import Resource

    from connector.telemetry.sinks import SdkSpanExporter
    from connector.telemetry.trace_file import records_to_json_line, spans_to_json_line
    from connector.telemetry.tracing import KVScopeTracing

    captured = []
    tracing = KVScopeTracing(type("Keep", (), {"on_end": lambda self, r: captured.append(r)})(), None)
    span = tracing.start_span("custom", start_time=1)
    span.set_attributes({"names": ["a", "b\u00e9"]})
    span.end(2)
    resource = Resource.create({"service.name": "t"})
    readable = []
    SdkSpanExporter(type("Sink", (), {"export": lambda self, spans: readable.extend(spans)})(), resource).export(captured)
    def spans(line):
        return _json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]

    (written,) = spans(records_to_json_line(captured, resource, "kvscope", "0"))
    assert written["attributes"] == [
        {"key": "names", "value": {"arrayValue": {"values": [{"stringValue": "a"}, {"stringValue": "b\u00e9"}]}}}]
    assert [written] == spans(spans_to_json_line(readable))


def test_a_line_that_is_not_a_json_object_is_a_value_error():
    """Readers report and skip a bad line on ValueError (contract §4): valid JSON that is not an
    object must not escape as another error."""
    for line in ("[]", '"resourceSpans"', "3"):
        with pytest.raises(ValueError, match="expected a JSON object"):
            parse_json_line(line)


def test_link_ids_are_written_as_hex_and_read_back():
    """OTLP/JSON writes every trace and span id as hex, those of a span's links included."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace import Link

    from connector.telemetry.trace_file import spans_to_json_line

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("first") as first:
        pass
    tracer.start_span("second", links=[Link(first.get_span_context())]).end()
    spans = memory.get_finished_spans()
    line = spans_to_json_line(spans)
    (link,) = json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"][1]["links"]
    assert link["traceId"] == format(first.get_span_context().trace_id, "032x")
    assert link["spanId"] == format(first.get_span_context().span_id, "016x")
    assert parse_json_line(line) == encode_spans(spans)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_an_export_held_the_file_lock_can_still_export(tmp_path, tracing, span_exporter):
    """vLLM forks its workers from a process whose export thread may be writing at that moment: the
    child's exporter must not inherit a lock that no thread of the child will ever release."""
    _make_spans(tracing)
    spans = span_exporter.get_finished_spans()
    path = tmp_path / "t.jsonl"
    exporter = OtlpJsonLinesExporter(path)
    with exporter._lock:  # an export in progress on another thread, as the fork sees it
        pid = os.fork()
        if pid == 0:
            # a child stuck on the lock dies instead of hanging the test (not pytest-timeout's handler,
            # which would raise into a copy of the test run)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(10)
            os._exit(0 if exporter.export(spans) is SpanExportResult.SUCCESS else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(path.read_text().splitlines()) == 1


def test_an_empty_batch_writes_nothing(tmp_path):
    """An empty line, or a request with no spans, is noise for every reader of the file."""
    path = tmp_path / "t.jsonl"
    exporter = OtlpJsonLinesExporter(path)
    assert exporter.export([]) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert not path.exists()


def test_a_batch_that_cannot_be_encoded_fails_and_is_logged_once(tmp_path, caplog):
    """An encoder bug costs its batch, said once, and never reaches the engine as an exception."""
    def broken(spans):
        raise TypeError("not a span")

    exporter = OtlpJsonLinesExporter(tmp_path / "t.jsonl", encode=broken)
    with caplog.at_level(logging.WARNING, logger="connector.telemetry.trace_file"):
        assert [exporter.export(["x"]) for _ in range(2)] == [SpanExportResult.FAILURE] * 2
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "could not encode 1 spans: TypeError: not a span" in warning.getMessage()


def test_after_shutdown_exports_fail_and_the_file_is_closed(tmp_path, tracing, span_exporter):
    """Spans that end after the engine's shutdown are not written to a file it considers closed."""
    _make_spans(tracing)
    spans = span_exporter.get_finished_spans()
    path = tmp_path / "t.jsonl"
    exporter = OtlpJsonLinesExporter(path)
    exporter.export(spans)
    assert exporter.force_flush() is True  # every line is already with the kernel
    exporter.shutdown()
    assert not descriptors_open_on(path)
    assert exporter.export(spans) is SpanExportResult.FAILURE
    assert len(path.read_text().splitlines()) == 1


def test_lines_after_a_torn_one_follow_each_other_without_blank_lines(tmp_path, tracing, span_exporter,
                                                                      monkeypatch):
    """A write that failed before writing anything leaves no partial line: no newline is added, and
    the lines after it follow each other without blank lines."""
    from connector.telemetry import trace_file

    _make_spans(tracing)
    spans = span_exporter.get_finished_spans()
    path = tmp_path / "t.jsonl"
    exporter = OtlpJsonLinesExporter(path)

    def disk_full(fd, data):
        raise OSError(28, "No space left on device")

    real_write = os.write
    monkeypatch.setattr(trace_file.os, "write", disk_full)
    exporter.export(spans)
    monkeypatch.setattr(trace_file.os, "write", real_write)
    for _ in range(3):
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    exporter.shutdown()
    lines = path.read_text().split("\n")
    assert all(lines[:3]) and lines[3:] == [""]


def test_without_the_append_lock_a_torn_line_is_ended_once_by_the_next_export(tmp_path, tracing, span_exporter,
                                                                               monkeypatch):
    """A file system without flock: the exporter cannot check the file's last byte under the lock, so it
    ends its own torn line from memory. The next line must start on a line of its own (not glued to the
    torn one, both lost to readers), and the lines after it must not each start with a blank line."""
    import errno

    from connector.telemetry import trace_file

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(trace_file.fcntl, "flock", no_flock)
    path = tmp_path / "t.jsonl"
    exporter, spans = _export_torn_by_a_full_disk(path, tracing, span_exporter, monkeypatch)
    for _ in range(2):
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    exporter.shutdown()
    torn, first, second, end = path.read_text().split("\n")
    assert len(torn) == 40 and end == ""
    for line in (first, second):
        assert len(parse_json_line(line).resource_spans[0].scope_spans[0].spans) == len(spans)


def test_the_trace_file_and_its_directories_are_created_readable_by_all(tmp_path, tracing, span_exporter):
    """A dashboard run by another user reads the file: 0644 (less the umask), like a log file."""
    _make_spans(tracing)
    path = tmp_path / "new" / "dir" / "t.jsonl"
    exporter = OtlpJsonLinesExporter(path)
    umask = os.umask(0o022)
    try:
        assert exporter.export(span_exporter.get_finished_spans()) is SpanExportResult.SUCCESS
    finally:
        os.umask(umask)
    exporter.shutdown()
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_path_that_cannot_be_opened_fails_the_export_without_raising(tmp_path, tracing, span_exporter, caplog):
    """A directory given as the trace file (or one the process may not write): the export fails, said
    once with the OS error, and never raises into the engine."""
    _make_spans(tracing)
    exporter = OtlpJsonLinesExporter(tmp_path)
    with caplog.at_level(logging.WARNING, logger="connector.telemetry.trace_file"):
        assert exporter.export(span_exporter.get_finished_spans()) is SpanExportResult.FAILURE
    assert "Is a directory" in caplog.records[-1].getMessage()


def test_a_line_longer_than_a_pipes_buffer_reaches_a_slow_reader_whole(tmp_path):
    """Writes to a pipe wait for room (up to WRITE_TIMEOUT_S), so a reader slower than the exporter
    still gets every byte of a long line (one that cannot be split: no spans in it)."""
    path = tmp_path / "spans.fifo"
    os.mkfifo(path)
    line = '{"resourceSpans":[]}' + " " * 300_000 + "\n"
    exporter = OtlpJsonLinesExporter(path, encode=lambda spans: line)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    received = []

    def read_slowly():
        time.sleep(0.3)
        os.set_blocking(reader, True)
        while sum(map(len, received)) < len(line):
            received.append(os.read(reader, 1 << 16))

    thread = threading.Thread(target=read_slowly, daemon=True)
    thread.start()
    try:
        assert exporter.export(["span"]) is SpanExportResult.SUCCESS
        thread.join(10)
        assert b"".join(received).decode() == line
    finally:
        exporter.shutdown()
        os.close(reader)


def test_a_file_rotated_with_a_new_one_created_in_its_place_is_written_at_its_path(tmp_path, tracing, span_exporter):
    """logrotate's default (`create`): the file is renamed and a new empty one made at the path at
    once; later spans go to the new file, not on into the rotated one."""
    _make_spans(tracing)
    spans = span_exporter.get_finished_spans()
    path = tmp_path / "t.jsonl"
    exporter = OtlpJsonLinesExporter(path)
    exporter.export(spans)
    path.rename(tmp_path / "t.jsonl.1")
    path.touch()
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert len((tmp_path / "t.jsonl.1").read_text().splitlines()) == 1
    assert len(path.read_text().splitlines()) == 1


@pytest.mark.parametrize("path, fd", [
    ("/dev/stdout", 1), ("/dev/stderr", 2), ("/dev/fd/7", 7), ("/proc/self/fd/12", 12), ("/dev/./stderr", 2),
    ("/dev/stdout.jsonl", None), ("/tmp/dev/fd/3", None), ("traces.jsonl", None),
])
def test_paths_naming_the_processs_own_streams_are_recognised(path, fd):
    """Those are written through the process's own descriptor (one write offset with its own output);
    any other path is opened as a file."""
    from connector.telemetry.trace_file import own_descriptor

    assert own_descriptor(path) == fd


def _append_big_lines(path, tag, count):
    line = '{"resourceSpans":[],"pad":"' + tag * (1 << 20) + '"}\n'  # a write of 256 pages
    exporter = OtlpJsonLinesExporter(path, encode=lambda spans: line)
    results = {exporter.export([object()]) for _ in range(count)}
    exporter.shutdown()
    os._exit(0 if results == {SpanExportResult.SUCCESS} else 1)


def test_processes_appending_at_once_leave_no_blank_line(tmp_path, monkeypatch):
    """The scheduler's and the workers' export helpers append to one file at once. The check for a
    partial last line must not see another process's write in progress (the file grows page by
    page) and add a newline to it: that made a blank line, which the Ctrl-C server test read."""
    import multiprocessing

    from connector.telemetry import trace_file

    # Under a loaded machine a writer can hold the lock past the 1 s a stopped one is given; the
    # unchecked write that follows may then leave a blank line (readers skip it). Not this test's case.
    monkeypatch.setattr(trace_file, "APPEND_LOCK_WAIT_S", 120.0)  # (the forked writers inherit it)
    path = tmp_path / "t.jsonl"
    writers = [multiprocessing.get_context("fork").Process(target=_append_big_lines, args=(path, tag, 30))
               for tag in "abc"]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=60)
    assert [w.exitcode for w in writers] == [0, 0, 0]
    lines = path.read_text().split("\n")
    assert lines[-1] == "" and len(lines) == 91
    assert sorted(json.loads(line)["pad"][0] for line in lines[:-1]) == ["a"] * 30 + ["b"] * 30 + ["c"] * 30


def test_a_writer_holding_the_append_lock_delays_an_export_only_briefly(tmp_path, tracing, span_exporter,
                                                                         monkeypatch):
    """Another process stopped while it held the lock: after APPEND_LOCK_WAIT_S the line is written
    anyway, without the partial-line check."""
    import fcntl

    from connector.telemetry import trace_file

    monkeypatch.setattr(trace_file, "APPEND_LOCK_WAIT_S", 0.05)
    _make_spans(tracing)
    spans = span_exporter.get_finished_spans()
    path = tmp_path / "t.jsonl"
    path.write_text('{"torn')  # a partial line the check would end, had it the lock
    holder = os.open(path, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    exporter = OtlpJsonLinesExporter(path)
    try:
        started = time.monotonic()
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        assert time.monotonic() - started < 2.0
        fcntl.flock(holder, fcntl.LOCK_UN)
        assert exporter.export(spans) is SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
        os.close(holder)
    first, second, end = path.read_text().split("\n")
    assert first.startswith('{"torn{') and end == ""  # unchecked: glued to the partial line
    assert len(parse_json_line(second).resource_spans[0].scope_spans[0].spans) == len(spans)


def test_a_forked_child_does_not_share_its_parents_append_lock(tmp_path, tracing, span_exporter, monkeypatch):
    """flock belongs to the open file: a child writing through the descriptors it inherited took the
    lock while its parent held it (thread export, in a process that forks after its first export)."""
    import fcntl

    from connector.telemetry import trace_file

    monkeypatch.setattr(trace_file, "APPEND_LOCK_WAIT_S", 0.05)
    _make_spans(tracing)
    spans = span_exporter.get_finished_spans()
    path = tmp_path / "t.jsonl"
    exporter = OtlpJsonLinesExporter(path)
    try:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        fcntl.flock(exporter._tail_fd, fcntl.LOCK_EX)  # the parent, in the middle of an append
        pid = os.fork()
        if pid == 0:  # the child: the lock must be out of its reach while the parent holds it
            code = 1
            try:
                exporter._open()
                code = 0 if not exporter._lock_for_append() else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        fcntl.flock(exporter._tail_fd, fcntl.LOCK_UN)
        assert os.waitstatus_to_exitcode(status) == 0
        assert exporter.export(spans) is SpanExportResult.SUCCESS  # the parent's descriptors are its own still
    finally:
        exporter.shutdown()
    assert len(path.read_text().splitlines()) == 2
