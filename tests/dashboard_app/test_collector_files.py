"""The Collector's binary file-exporter formats (`collector_files`): protobuf and zstd, framed as its
`file` exporter frames them (a 4-byte big-endian length before each message; or, with the native
compression feature gate, one zstd stream), read as the same spans as the JSON lines they encode.

No Collector runs here: the files are built as exporter/fileexporter's file_writer.go and
compression_writer.go write them, from the committed fixture, and (tests/engine/test_server.py) from
vLLM's own spans as a real server sent them."""

from __future__ import annotations

import base64
import json
import struct
import sys

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from dashboard import traces
from dashboard.traces import collector_files

from .conftest import TWO_ROUNDS
from .test_reader import line, lookup

zstandard = pytest.importorskip("zstandard", reason="the dashboard extra's zstandard module reads zstd files")

LINES = [raw for raw in TWO_ROUNDS.read_bytes().split(b"\n") if raw.strip()]
_ZSTD = zstandard.ZstdCompressor()


def as_protobuf(json_line: bytes) -> bytes:
    """One OTLP/JSON export as the protobuf message the Collector writes with `format: proto`."""
    document = json.loads(json_line)
    for resource_spans in document["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            for span in scope_spans["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if span.get(key):  # OTLP/JSON hex -> protobuf's JSON mapping of bytes (base64)
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return json_format.ParseDict(document, ExportTraceServiceRequest()).SerializeToString()


def length_prefixed(messages: list[bytes]) -> bytes:  # file_writer.go, exportMessageAsBuffer
    return b"".join(struct.pack(">I", len(m)) + m for m in messages)


FORMATS = {
    "proto": lambda: length_prefixed([as_protobuf(raw) for raw in LINES]),
    "json+zstd": lambda: length_prefixed([_ZSTD.compress(raw) for raw in LINES]),
    "proto+zstd": lambda: length_prefixed([_ZSTD.compress(as_protobuf(raw)) for raw in LINES]),
    # the native compression feature gate: one zstd stream, a frame per flush
    "json+zstd native": lambda: b"".join(_ZSTD.compress(raw + b"\n") for raw in LINES),
    "proto+zstd native": lambda: b"".join(_ZSTD.compress(length_prefixed([as_protobuf(raw)])) for raw in LINES),
}


def _comparable(read: traces.Traces):
    spans = read.spans.drop(columns=["source_file", "source_line"]).sort_values("span_key").reset_index(drop=True)
    vllm = read.vllm_requests.drop(columns=["source_file", "source_line"]).reset_index(drop=True)
    return spans, vllm


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_each_collector_format_reads_as_the_json_lines_it_encodes(tmp_path, kind):
    expected = traces.read_trace_files([TWO_ROUNDS])
    path = tmp_path / "collector.bin"
    path.write_bytes(FORMATS[kind]())
    read = traces.read_trace_files([path])
    assert read.problems == []
    spans, vllm = _comparable(read)
    want_spans, want_vllm = _comparable(expected)
    pd_testing = pytest.importorskip("pandas.testing")
    pd_testing.assert_frame_equal(spans, want_spans)
    pd_testing.assert_frame_equal(vllm, want_vllm)
    assert (read.lines, read.other_spans, read.vllm_spans_read) == (expected.lines, expected.other_spans,
                                                                    expected.vllm_spans_read)
    assert len(want_spans) == 103 and len(want_vllm) == 10  # the fixture: every kind of span, vLLM's too


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_a_collector_file_still_being_written_keeps_its_complete_messages(tmp_path, kind):
    data = FORMATS[kind]()
    path = tmp_path / "collector.bin"
    path.write_bytes(data[: len(data) * 2 // 3])
    read = traces.read_trace_files([path])
    assert [(p.line, p.spans) for p in read.problems] == [(0, None)]
    assert "(is the file still being written?)" in read.problems[0].reason
    # the complete messages before the cut: exactly the spans of the JSON lines they hold
    kept = traces.read_trace_files([TWO_ROUNDS]).spans
    assert 0 < len(read.spans) < len(kept)
    assert set(read.spans["span_id"]) <= set(kept["span_id"])
    assert read.spans["source_line"].max() < len(LINES)


def test_a_message_that_does_not_decode_is_reported_at_its_number_and_the_next_is_read(tmp_path):
    messages = [as_protobuf(raw) for raw in LINES[:3]]
    messages[1] = b"\x0a\xff\xff\xff"  # resource_spans whose length runs past the message
    path = tmp_path / "collector.bin"
    path.write_bytes(length_prefixed(messages))
    read = traces.read_trace_files([path])
    assert [(p.line, p.spans) for p in read.problems] == [(2, None)]
    assert read.problems[0].reason.startswith("not a protobuf ExportTraceServiceRequest")
    assert sorted(set(read.spans["source_line"])) == [1, 3]


def test_a_corrupt_zstd_frame_keeps_the_frames_before_it(tmp_path):
    frames = [_ZSTD.compress(raw + b"\n") for raw in LINES[:3]]
    broken = frames[1][:8] + bytes(len(frames[1]) - 8)  # its header kept, its blocks zeroed
    path = tmp_path / "t.jsonl.zst"
    path.write_bytes(frames[0] + broken + frames[2])
    read = traces.read_trace_files([path])
    assert len(read.problems) == 1 and read.problems[0].reason.startswith(
        f"cannot decompress this zstd stream past byte {len(LINES[0]) + 1:,} of its content")
    assert set(read.spans["source_line"]) == {1}


def test_without_the_zstandard_module_a_zstd_file_is_named_with_what_to_do(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl.zst"
    path.write_bytes(FORMATS["json+zstd native"]())
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import fails
    read = traces.read_trace_files([path])
    assert [p.reason for p in read.problems] == [collector_files.ZSTD_MODULE_MISSING]
    assert "pip install zstandard" in read.problems[0].reason and read.spans.empty


def test_json_lines_are_never_taken_for_length_prefixed_messages():
    assert not collector_files.is_length_prefixed(LINES[0])
    assert collector_files.is_length_prefixed(FORMATS["proto"]())
    assert collector_files.is_length_prefixed(FORMATS["json+zstd"]())


def test_a_message_whose_length_reads_as_a_byte_order_mark_is_read_as_a_message(tmp_path):
    """A first message 65,279 bytes long begins 00 00 FE FF: UTF-32's big-endian byte-order mark."""
    document = json.loads(LINES[0])
    span = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    padding = {"key": "padding", "value": {"stringValue": ""}}
    span.setdefault("attributes", []).append(padding)
    size = 0
    for _ in range(4):  # the length prefixes around the padding grow with it
        size += 0xFEFF - len(as_protobuf(json.dumps(document).encode()))
        padding["value"]["stringValue"] = "x" * size
    message = as_protobuf(json.dumps(document).encode())
    assert len(message) == 0xFEFF
    path = tmp_path / "collector.bin"
    path.write_bytes(length_prefixed([message, as_protobuf(LINES[1])]))
    assert path.read_bytes()[:4] == b"\x00\x00\xfe\xff"
    read = traces.read_trace_files([path])
    assert read.problems == [] and sorted(set(read.spans["source_line"])) == [1, 2]


def test_a_single_zstd_frame_cut_short_keeps_the_lines_it_holds(tmp_path):
    """`zstd FILE` on a trace file makes one frame: cut short, the lines it had given are still read (as gzip's).
    The trace's lines come first, then 2 MB of blank lines (random blanks and tabs, which the reader skips
    and zstd cannot squeeze into one block): the cut falls there."""
    import random

    rng = random.Random(0)
    blanks = "".join(rng.choice(" \t") for _ in range(2_000_000)).encode()
    filler = b"\n".join(blanks[i:i + 1000] for i in range(0, len(blanks), 1000))
    data = _ZSTD.compress(TWO_ROUNDS.read_bytes() + filler)
    path = tmp_path / "t.jsonl.zst"
    path.write_bytes(data[: len(data) * 95 // 100])
    read = traces.read_trace_files([path])
    assert [p.reason for p in read.problems] == [collector_files.ZSTD_CUT_SHORT]
    assert len(read.spans) == 103  # every span, from the frame's first blocks


def test_a_zstd_bomb_stops_at_the_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(collector_files, "MAX_INFLATED_BYTES", 10_000)
    path = tmp_path / "bomb.zst"
    path.write_bytes(_ZSTD.compress(b" " * 50_000_000))  # 50 MB of blanks in a few kB
    assert path.stat().st_size < 10_000
    inflated, problems = collector_files.unzstd(str(path), path.read_bytes())
    assert len(inflated) == 10_000 and [p.reason for p in problems] == [collector_files.ZSTD_TOO_LARGE]


def test_a_metrics_file_written_as_protobuf_is_named_not_read_as_spans(tmp_path):
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    metrics = json_format.ParseDict({"resourceMetrics": [{"scopeMetrics": [{"metrics": [
        {"name": "vllm:num_requests_running", "gauge": {"dataPoints": [{"asInt": "3"}]}}]}]}]},
        ExportMetricsServiceRequest()).SerializeToString()
    path = tmp_path / "metrics.pb"
    path.write_bytes(length_prefixed([metrics]))
    read = traces.read_trace_files([path])
    assert [(p.line, p.reason) for p in read.problems] == [(1, collector_files.NOT_TRACES)]
    assert read.spans.empty and read.other_spans == 0


def test_empty_exports_are_passed_over_silently(tmp_path):
    path = tmp_path / "collector.pb"
    path.write_bytes(length_prefixed([b"", as_protobuf(LINES[0]), b"", as_protobuf(LINES[1])]))
    read = traces.read_trace_files([path])
    assert read.problems == [] and sorted(set(read.spans["source_line"])) == [2, 4]


def test_a_first_message_of_16_mib_or_more_is_still_recognised():
    body = b"\x0a" + bytes(16 << 20)
    assert collector_files.is_length_prefixed(length_prefixed([body]))
    assert not collector_files.is_length_prefixed(length_prefixed([body])[:-1])  # its length runs past the file


def test_a_zstd_stream_cut_mid_line_keeps_its_complete_lines_and_says_only_that(tmp_path):
    """Cut where a line is half decompressed: the half line is the cut's, not a line that does not parse too.
    Random ids keep zstd from squeezing the lines into less than the cut leaves."""
    import random

    rng = random.Random(0)
    text = "".join(line(lookup(f"r{i}", span_id=f"{rng.getrandbits(64) | 1:016x}",
                               trace=f"{rng.getrandbits(128) | 1:032x}")) + "\n" for i in range(3000)).encode()
    data = _ZSTD.compress(text)
    path = tmp_path / "t.jsonl.zst"
    path.write_bytes(data[: len(data) // 2])
    read = traces.read_trace_files([path])
    assert [p.reason for p in read.problems] == [collector_files.ZSTD_CUT_SHORT]
    assert 0 < len(read.spans) < 3000
