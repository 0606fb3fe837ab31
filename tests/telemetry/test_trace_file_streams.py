"""The trace file as a pipe, FIFO or shared file: whole lines with several writers, a stalled reader,
a line another process left cut short."""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult

from connector.telemetry import trace_file
from connector.telemetry.sinks import Sinks, build_exporters
from connector.telemetry.span_records import COPY_SPAN
from connector.telemetry.trace_file import (OtlpJsonLinesExporter, RecordJsonEncoder, parse_json_line,
                                            split_json_line)

from .descriptors import descriptors_open_on

REPO = Path(__file__).resolve().parents[2]

# A writer process: the exporter kvscope builds, writing numbered spans to its own stdout.
WRITER = """
import sys
from connector.telemetry.sinks import Sinks, build_exporters
from connector.telemetry.span_records import COPY_SPAN
writer, batches, per_batch = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
exporter = build_exporters(Sinks("/dev/stdout", {}, {"service.name": "w%d" % writer}))[0]
for b in range(batches):
    records = [(COPY_SPAN.code, writer + 1, b * per_batch + i + 1, 7, True, None, 10, 20,
                (0, "full_attention", "load", 4, 4096, writer, "req-%d" % i)) for i in range(per_batch)]
    assert exporter.export(records).name == "SUCCESS"
"""


def _records(writer: int, batch: int, per_batch: int) -> list[tuple]:
    return [(COPY_SPAN.code, writer + 1, batch * per_batch + i + 1, 7, True, None, 10, 20,
             (0, "full_attention", "load", 4, 4096, writer, f"req-{i}")) for i in range(per_batch)]


def _read_slowly(fd: int) -> bytes:
    """A reader slower than the writers, 4 KiB at a time: the pipe fills and writers contend."""
    chunks = []
    with os.fdopen(fd, "rb", buffering=0) as reader:
        while chunk := reader.read(4096):
            chunks.append(chunk)
            time.sleep(0.0002)
    return b"".join(chunks)


def _spans_by_line(data: bytes) -> list[list[tuple[str, str]]]:
    """Each line's spans as (service.name, spanId); fails on a line that is not OTLP/JSON."""
    assert data.endswith(b"\n")
    lines = []
    for line in data.split(b"\n")[:-1]:
        assert len(line) + 1 <= trace_file.PIPE_BUF, "a line a pipe may tear"
        request = parse_json_line(line.decode())
        spans = []
        for resource_spans in request.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
            for scope_spans in resource_spans.scope_spans:
                assert scope_spans.scope.name
                spans += [(service, s.span_id.hex()) for s in scope_spans.spans]
        lines.append(spans)
    return lines


def _expected(writers: int, batches: int, per_batch: int) -> list[tuple[str, str]]:
    return sorted((f"w{w}", format(n, "016x")) for w in range(writers) for n in range(1, batches * per_batch + 1))


def test_processes_writing_to_one_pipe_each_get_every_span_through_once_on_whole_lines():
    """`vllm serve ... | tee log` or a container's log pipe: the scheduler's and the workers' exporters
    share a pipe, where only writes of up to PIPE_BUF bytes stay whole."""
    writers, batches, per_batch = 3, 6, 300  # a batch is ~100 KB: many PIPE_BUF lines
    read_end, write_end = os.pipe()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(w), str(batches), str(per_batch)],
                              stdout=write_end, cwd=REPO, env=env) for w in range(writers)]
    os.close(write_end)
    data = _read_slowly(read_end)
    assert [p.wait(60) for p in procs] == [0] * writers
    lines = _spans_by_line(data)
    assert len(lines) > writers * batches  # batches were split
    assert sorted(span for line in lines for span in line) == _expected(writers, batches, per_batch)


def test_threads_writing_to_the_processs_own_pipe_leave_it_blocking_and_lines_whole():
    """/dev/fd/N naming a pipe: written through a non-blocking open file of its own, so the process's
    descriptor (its stdout, say) is not made non-blocking under the rest of the program."""
    writers, batches, per_batch = 3, 4, 200
    read_end, write_end = os.pipe()
    exporters = [OtlpJsonLinesExporter(f"/dev/fd/{write_end}",
                                       encode=RecordJsonEncoder(Resource({"service.name": f"w{w}"}), "s", "1"))
                 for w in range(writers)]
    results = []

    def write(w):
        results.extend(exporters[w].export(_records(w, b, per_batch)) for b in range(batches))

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    reader = threading.Thread(target=lambda: results.append(_read_slowly(read_end)))
    reader.start()
    for t in threads:
        t.join(60)
    assert os.get_blocking(write_end)
    for exporter in exporters:
        exporter.shutdown()
    os.close(write_end)
    reader.join(60)
    data = results.pop()
    assert results == [SpanExportResult.SUCCESS] * writers * batches
    assert sorted(span for line in _spans_by_line(data) for span in line) == _expected(writers, batches, per_batch)


def test_a_regular_file_still_gets_one_line_per_batch(tmp_path):
    path = tmp_path / "t.jsonl"
    exporter = OtlpJsonLinesExporter(path, encode=RecordJsonEncoder(Resource({}), "s", "1"))
    assert exporter.export(_records(0, 0, 300)) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert len(path.read_bytes().splitlines()) == 1


def test_the_processs_own_stream_redirected_to_a_file_is_written_at_its_own_offset(tmp_path):
    """`vllm serve > log` with trace_file=/dev/stdout: the lines go through the process's own open file,
    after what it printed, and what it prints next follows them. A new open file of the log would
    write from offset 0, over the process's own output (and the process's next output over the lines)."""
    path = tmp_path / "log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # as the shell's `>` opens it: no O_APPEND
    try:
        os.write(fd, b"engine starting\n")
        exporter = OtlpJsonLinesExporter(f"/dev/fd/{fd}", encode=RecordJsonEncoder(Resource({}), "s", "1"))
        assert exporter.export(_records(0, 0, 3)) is SpanExportResult.SUCCESS
        exporter.shutdown()
        os.write(fd, b"engine stopped\n")
    finally:
        os.close(fd)
    before, line, after, end = path.read_text().split("\n")
    assert (before, after, end) == ("engine starting", "engine stopped", "")
    assert len(parse_json_line(line).resource_spans[0].scope_spans[0].spans) == 3


def _request(groups: list[tuple[str, str, list[int]]]) -> bytes:
    """An OTLP/JSON line with one resource/scope per group: (service, scope, span sizes in bytes)."""
    resource_spans = []
    for service, scope, sizes in groups:
        spans = [{"traceId": "ab" * 16, "spanId": f"{i + 1:016x}", "name": "x" * size, "kind": 1}
                 for i, size in enumerate(sizes)]
        resource_spans.append({"resource": {"attributes": [{"key": "service.name",
                                                            "value": {"stringValue": service}}]},
                               "scopeSpans": [{"scope": {"name": scope}, "spans": spans}], "schemaUrl": "u"})
    return (json.dumps({"resourceSpans": resource_spans}, separators=(",", ":")) + "\n").encode()


def test_a_line_is_split_greedily_by_resource_and_scope_and_a_large_span_goes_alone():
    line = _request([("a", "s1", [300] * 20), ("b", "s2", [100, 5000, 100, 100])])
    lines = split_json_line(line, 4096)
    sizes = [len(x) for x in lines]
    assert all(x.endswith(b"\n") and x.count(b"\n") == 1 for x in lines)
    # a's 20 spans of ~390 bytes: 9 fit a line beside the envelope; then b's, around the one over the limit
    assert [len(parse_json_line(x.decode()).resource_spans[0].scope_spans[0].spans) for x in lines] == [9, 9, 2, 1, 1, 2]
    span = json.loads(lines[1])["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert sizes[0] + 1 + len(json.dumps(span, separators=(",", ":"))) > 4096  # greedy: no room for one more
    assert [s for s in sizes if s > 4096] == [sizes[4]]
    for x in lines:
        message = json.loads(x)
        (rs,) = message["resourceSpans"]
        assert rs["schemaUrl"] == "u" and len(rs["scopeSpans"]) == 1
        service = rs["resource"]["attributes"][0]["value"]["stringValue"]
        assert rs["scopeSpans"][0]["scope"]["name"] == {"a": "s1", "b": "s2"}[service]
    assert split_json_line(b'{"resourceSpans":[]}\n', 10) == [b'{"resourceSpans":[]}\n']  # nothing to split
    assert split_json_line(b"not json, and long\n", 10) == [b"not json, and long\n"]
    assert split_json_line(line, len(line)) == [line]


def test_no_split_line_of_several_spans_is_longer_than_the_limit_whatever_the_limit():
    """A line one byte over PIPE_BUF may be torn among writers: the comma before each further span
    counts, at every limit (one of them leaves no room for it)."""
    line = _request([("a", "s1", [50, 61, 47, 70, 52, 66, 58, 49, 73, 55] * 3)])
    for limit in range(300, 1200):
        for piece in split_json_line(line, limit):
            spans = json.loads(piece)["resourceSpans"][0]["scopeSpans"][0]["spans"]
            assert len(piece) <= limit or len(spans) == 1, (limit, len(piece))


def test_a_line_without_resource_or_scope_splits_into_lines_that_parse():
    """OTLP/JSON leaves an unset resource or scope out (another encoder's line): each piece then opens its
    resource with `{"scopeSpans":[` and its scope with `{"spans":[`, never with `{,`, which no reader parses."""
    spans = [{"traceId": "ab" * 16, "spanId": f"{i + 1:016x}", "name": "x" * 300, "kind": 1} for i in range(20)]
    line = (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}, separators=(",", ":")) + "\n").encode()
    lines = split_json_line(line, 4096)
    assert len(lines) > 1
    assert sum(len(parse_json_line(x.decode()).resource_spans[0].scope_spans[0].spans) for x in lines) == 20


# ------------------------------------------------------------------ a reader that stalls

@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setattr(trace_file, "WRITE_TIMEOUT_S", 0.2)


def test_a_fifo_whose_reader_stalled_fails_exports_within_the_timeout_and_shutdown_returns(
        tmp_path, short_timeout, caplog):
    path = tmp_path / "spans.fifo"
    os.mkfifo(path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # open, and never read
    exporter = OtlpJsonLinesExporter(path, encode=RecordJsonEncoder(Resource({}), "s", "1"))
    try:
        with caplog.at_level(logging.WARNING, logger="connector.telemetry.trace_file"):
            for batch in range(100):  # the pipe holds 64 KiB: a few batches fill it
                start = time.monotonic()
                result = exporter.export(_records(0, batch, 100))
                if result is SpanExportResult.FAILURE:
                    break
            assert result is SpanExportResult.FAILURE
            assert time.monotonic() - start < 2.0
            start = time.monotonic()  # still stalled: no second wait
            assert exporter.export(_records(0, 999, 100)) is SpanExportResult.FAILURE
            assert time.monotonic() - start < 0.1
        assert len(caplog.records) == 1 and "took nothing for 0.2 s" in caplog.records[0].getMessage()
        exporter.shutdown()
        assert exporter.export(_records(0, 0, 1)) is SpanExportResult.FAILURE
        # what did get through is whole lines
        data = b""
        while True:
            try:
                chunk = os.read(reader, 1 << 20)
            except BlockingIOError:  # (a writer still holds it open)
                break
            if not chunk:  # every writer closed it
                break
            data += chunk
        assert data and all(parse_json_line(x.decode()) for x in data.split(b"\n")[:-1])
    finally:
        os.close(reader)


def test_a_long_line_a_stalled_reader_took_in_part_is_ended_before_the_next_line(tmp_path, short_timeout):
    """A span larger than PIPE_BUF goes in several writes; a reader that stops part way leaves a partial
    line in the pipe. The next export ends it first: the next line is not glued to it and lost with it."""
    path = tmp_path / "spans.fifo"
    os.mkfifo(path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    exporter = OtlpJsonLinesExporter(path, encode=RecordJsonEncoder(Resource({}), "s", "1"))
    try:
        huge = [(COPY_SPAN.code, 1, 1, 7, True, None, 10, 20,
                 (0, "full_attention", "load", 4, 4096, 0, "req-" + "x" * (1 << 20)))]  # more than the pipe holds
        assert exporter.export(huge) is SpanExportResult.FAILURE  # the pipe took part of it, then nothing
        data = b""
        while True:
            try:
                chunk = os.read(reader, 1 << 20)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
        assert data and not data.endswith(b"\n")  # a partial line
        assert exporter.export(_records(0, 1, 2)) is SpanExportResult.SUCCESS  # the reader reads again
        data += os.read(reader, 1 << 20)
        *_, last, end = data.split(b"\n")
        assert end == b""
        assert len(parse_json_line(last.decode()).resource_spans[0].scope_spans[0].spans) == 2
    finally:
        exporter.shutdown()
        os.close(reader)


def test_once_a_stalled_reader_takes_a_batch_again_exports_wait_the_full_timeout_again(monkeypatch):
    """After a stall, batches fail without waiting until one gets through; from then on a stream that is
    momentarily full is waited for (WRITE_TIMEOUT_S) again, not failed at once as if its reader were still
    stalled (a socket: every write waits for room first, with the timeout in force)."""
    ours, theirs = socket.socketpair()
    timeouts = []
    real_wait = trace_file._wait_writable

    def wait_writable(fd, timeout):
        timeouts.append(timeout)
        if len(timeouts) == 1:
            raise TimeoutError(errno.ETIMEDOUT, "its reader took nothing")  # the reader stalled
        real_wait(fd, timeout)

    monkeypatch.setattr(trace_file, "_wait_writable", wait_writable)
    exporter = OtlpJsonLinesExporter(f"/dev/fd/{ours.fileno()}",
                                     encode=RecordJsonEncoder(Resource({"service.name": "w0"}), "s", "1"))
    try:
        results = [exporter.export(_records(0, batch, 1)) for batch in range(3)]
    finally:
        exporter.shutdown()
        ours.close()
    assert results == [SpanExportResult.FAILURE, SpanExportResult.SUCCESS, SpanExportResult.SUCCESS]
    assert timeouts == [trace_file.WRITE_TIMEOUT_S, 0.0, trace_file.WRITE_TIMEOUT_S]
    with theirs:
        data = theirs.recv(1 << 20)
    assert [len(line) for line in _spans_by_line(data)] == [1, 1]


def test_shutdown_gives_up_on_an_export_that_never_returns(tmp_path, short_timeout, caplog):
    """A write stuck beyond any deadline (a hung network file system): the engine's exit goes on."""
    exporter = OtlpJsonLinesExporter(tmp_path / "t.jsonl")
    exporter._lock.acquire()  # as an export stuck in write() holds it
    try:
        with caplog.at_level(logging.WARNING, logger="connector.telemetry.trace_file"):
            start = time.monotonic()
            exporter.shutdown()
            assert time.monotonic() - start < 3.0
        assert "still stuck at shutdown" in caplog.records[-1].getMessage()
    finally:
        exporter._lock.release()
    assert exporter.export(_records(0, 0, 1)) is SpanExportResult.FAILURE


def test_an_export_that_outlived_shutdown_closes_the_file_when_it_returns(tmp_path, short_timeout, monkeypatch):
    """Shutdown gave up waiting for a stuck write (a hung file system): when that write returns at last,
    its export closes the file, or the descriptor stays open for the rest of the process."""
    path = tmp_path / "t.jsonl"
    exporter = OtlpJsonLinesExporter(path, encode=RecordJsonEncoder(Resource({}), "s", "1"))
    real_write_all = trace_file.write_all

    def stuck_write(fd, data):
        exporter.shutdown()  # the engine exits while this write hangs: shutdown gives up on it
        real_write_all(fd, data)

    monkeypatch.setattr(trace_file, "write_all", stuck_write)
    assert exporter.export(_records(0, 0, 1)) is SpanExportResult.SUCCESS
    assert not descriptors_open_on(path)
    assert exporter.export(_records(0, 1, 1)) is SpanExportResult.FAILURE
    assert len(path.read_text().splitlines()) == 1


# ------------------------------------------------------------------ a line another process cut short

def _whole_lines(path: Path) -> list[str]:
    return [x for x in path.read_text().split("\n") if x and x.startswith('{"resourceSpans"') and x.endswith("}")]


def test_a_line_another_process_left_cut_short_does_not_take_the_next_one_with_it(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"resourceSpans":[{"resou')  # another writer's line, cut short by a full disk
    exporter = OtlpJsonLinesExporter(path, encode=RecordJsonEncoder(Resource({}), "s", "1"))
    assert exporter.export(_records(0, 0, 3)) is SpanExportResult.SUCCESS
    assert exporter.export(_records(0, 1, 3)) is SpanExportResult.SUCCESS
    exporter.shutdown()
    torn, first, second, end = path.read_text().split("\n")
    assert torn == '{"resourceSpans":[{"resou' and end == ""
    assert [len(parse_json_line(x).resource_spans[0].scope_spans[0].spans) for x in (first, second)] == [3, 3]


def test_a_writer_cut_short_by_the_file_size_limit_leaves_another_processs_next_line_whole(tmp_path):
    """Writer A (a child process) hits RLIMIT_FSIZE (as a full disk cuts a write) part way through its
    line; writer B, a fresh exporter on the same file, then appends: B's line must parse."""
    path = tmp_path / "t.jsonl"
    b = build_exporters(Sinks(str(path), {}, {"service.name": "B"}))[0]
    assert b.export(_records(1, 0, 50)) is SpanExportResult.SUCCESS
    size = path.stat().st_size

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 2000, resource.RLIM_INFINITY))

    a = subprocess.run([sys.executable, "-c", WRITER.replace('"/dev/stdout"', repr(str(path))), "0", "1", "50"],
                       cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), preexec_fn=limit_file_size,
                       capture_output=True, text=True, timeout=60)
    assert a.returncode != 0 and "File too large" in a.stderr
    assert path.stat().st_size == size + 2000  # A's line, cut short
    b = build_exporters(Sinks(str(path), {}, {"service.name": "B"}))[0]
    assert b.export(_records(1, 1, 50)) is SpanExportResult.SUCCESS
    b.shutdown()
    lines = path.read_text().split("\n")
    assert len(lines) == 4 and lines[-1] == ""
    assert len(lines[1]) == 2000
    for line in (lines[0], lines[2]):
        assert len(parse_json_line(line).resource_spans[0].scope_spans[0].spans) == 50
