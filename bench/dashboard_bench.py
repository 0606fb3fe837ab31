"""Benchmark: read and shape synthetic kvscope trace files of 10k and 100k spans.

Not a test. Writes the synthetic files to a temporary directory (or --dir), then reports the
median of --repeat runs of each step: reading the file(s) into the span frame, reading the same
spans from the OpenTelemetry Collector's protobuf file (`format: proto`) beside it, building the
requests table, and the shaping behind each page. Run from the repo root:

    .venv/bin/python bench/dashboard_bench.py [--spans 10000 100000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboard import traces  # noqa: E402

GROUPS = ((0, "sliding_window", 1_310_720), (1, "full_attention", 262_144))
SPANS_PER_LINE = 64  # a BatchSpanProcessor / Collector batch


def _attr(key: str, value) -> dict:
    if isinstance(value, str):
        return {"key": key, "value": {"stringValue": value}}
    return {"key": key, "value": {"intValue": str(value)}}


def _span(rng: random.Random, trace_id: str, parent: str, name: str, start: int, end: int, attrs: dict) -> dict:
    return {
        "traceId": trace_id,
        "spanId": f"{rng.getrandbits(64):016x}",
        "parentSpanId": parent,
        "name": name,
        "kind": 1,
        "startTimeUnixNano": str(start),
        "endTimeUnixNano": str(end),
        "attributes": [_attr(k, v) for k, v in attrs.items()],
        "status": {},
    }


def request_spans(rng: random.Random, i: int, t: int) -> list[dict]:
    """The spans of one request: a lookup, and for a hit a load, 2 scans and 2 load copies; a store."""
    trace_id = f"{rng.getrandbits(128):032x}"
    rid = f"cmpl-{i:08d}"
    queried = rng.randrange(64, 4096)
    hit = (queried // 16) * 16 if rng.random() < 0.6 else 0
    lookup = _span(rng, trace_id, "", "kvscope.lookup", t, t + 20_000,
                   {"kvscope.request.id": rid, "kvscope.tokens.queried": queried, "kvscope.tokens.hit": hit})
    out = [lookup]
    if hit:
        load = _span(rng, trace_id, lookup["spanId"], "kvscope.load", t + 50_000, t + 120_000,
                     {"kvscope.request.id": rid, "kvscope.tokens.local": 0, "kvscope.tokens.external": hit,
                      "kvscope.groups": 2})
        out.append(load)
        blocks = hit // 16
        c = t + 300_000
        for index, kind, block_bytes in GROUPS:
            pending = min(blocks, 8) if kind == "sliding_window" else blocks
            out.append(_span(rng, trace_id, load["spanId"], "kvscope.group.scan", t + 60_000, t + 80_000, {
                "kvscope.group.index": index, "kvscope.group.kind": kind, "kvscope.group.blocks.total": blocks,
                "kvscope.group.blocks.null_skipped": blocks - pending, "kvscope.group.blocks.pending": pending,
                "kvscope.group.blocks.start": blocks - pending}))
            dur = int(pending * block_bytes / rng.uniform(5, 12))
            out.append(_span(rng, trace_id, load["spanId"], "kvscope.group.copy", c, c + dur, {
                "kvscope.group.index": index, "kvscope.group.kind": kind, "kvscope.copy.direction": "load",
                "kvscope.copy.blocks": pending, "kvscope.copy.bytes": pending * block_bytes,
                "kvscope.worker.rank": 0}))
            c += dur + 10_000
    else:
        blocks = queried // 16
        store = _span(rng, trace_id, lookup["spanId"], "kvscope.store", t + 5_000_000, t + 5_040_000,
                      {"kvscope.request.id": rid, "kvscope.groups": 2, "kvscope.blocks": blocks})
        out.append(store)
    return out


def write_trace(path: Path, n_spans: int, seed: int = 0) -> int:
    """Write about `n_spans` kvscope spans (whole requests) to `path`; returns the exact count."""
    rng = random.Random(seed)
    pending: list[dict] = []
    written = i = 0
    t = 1_700_000_000_000_000_000
    with open(path, "w") as f:
        while written + len(pending) < n_spans:
            pending.extend(request_spans(rng, i, t))
            i += 1
            t += rng.randrange(1, 20) * 1_000_000
            while len(pending) >= SPANS_PER_LINE:
                written += _write_line(f, pending[:SPANS_PER_LINE])
                del pending[:SPANS_PER_LINE]
        if pending:
            written += _write_line(f, pending)
    return written


def _write_line(f, spans: list[dict]) -> int:
    doc = {"resourceSpans": [{"resource": {"attributes": [_attr("service.name", "vllm")]},
                              "scopeSpans": [{"scope": {"name": "kvscope", "version": "0.1.0"}, "spans": spans}]}]}
    f.write(json.dumps(doc, separators=(",", ":")) + "\n")
    return len(spans)


def write_protobuf(json_lines: Path, path: Path) -> None:
    """The spans of `json_lines` as the Collector's file exporter writes them with `format: proto`: each line
    a protobuf `ExportTraceServiceRequest` after its length (4 bytes, big-endian)."""
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    with open(json_lines, "rb") as lines, open(path, "wb") as out:
        for raw in lines:
            doc = json.loads(raw)
            for rs in doc["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    for span in ss["spans"]:
                        for key in ("traceId", "spanId", "parentSpanId"):  # hex -> protobuf-JSON's base64
                            if span.get(key):
                                span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
            message = json_format.ParseDict(doc, ExportTraceServiceRequest()).SerializeToString()
            out.write(struct.pack(">I", len(message)) + message)


def _median_seconds(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def measure(path: Path, repeat: int) -> dict[str, float]:
    """Median seconds of each step on one synthetic file (printed as it goes)."""
    size_mb = path.stat().st_size / 1e6
    read_s, loaded = _median_seconds(lambda: traces.read_trace_files([path]), repeat)
    spans = loaded.spans
    protobuf = path.with_suffix(".pb")
    write_protobuf(path, protobuf)
    proto_s, from_proto = _median_seconds(lambda: traces.read_trace_files([protobuf]), repeat)
    assert len(from_proto.spans) == len(spans) and not from_proto.problems
    lines = path.read_bytes().split(b"\n")
    slow_s, _ = _median_seconds(lambda: traces.decode_lines(str(path), lines), max(1, repeat // 2))
    req_s, requests = _median_seconds(lambda: traces.requests_table(spans), repeat)
    steps = {
        "overview page shaping": lambda: (
            traces.overview_numbers(requests, spans),
            traces.hit_rate_over_time(requests),
            traces.group_summary(spans, requests),
            traces.load_latency_distribution(spans, requests),
            traces.copy_throughput(spans),
            traces.top_slow_loads(requests),
        ),
        "waterfall of one request": lambda: traces.waterfall_rows(
            spans, requests, requests["request_id"].iloc[len(requests) // 2]),
        "replay timeline": lambda: traces.replay_timeline(requests, spans),
    }
    print(f"{len(spans):>7} spans, {len(requests)} requests, {size_mb:.1f} MB, {len(loaded.problems)} problems")
    print(f"  read file -> span frame      {read_s * 1e3:9.1f} ms  ({read_s / len(spans) * 1e6:.2f} µs/span)")
    print(f"  read protobuf file -> frame  {proto_s * 1e3:9.1f} ms  ({proto_s / read_s:.2f}x the JSON lines; "
          f"the same spans in {protobuf.stat().st_size / 1e6:.1f} MB of `format: proto`)")
    print(f"  (line-by-line decoder alone, used for files with bad lines: {slow_s * 1e3:.1f} ms)")
    print(f"  requests table               {req_s * 1e3:9.1f} ms")
    out = {"read": read_s, "read_protobuf": proto_s, "decode_line_by_line": slow_s, "requests_table": req_s}
    for label, fn in steps.items():
        s, _ = _median_seconds(fn, repeat)
        print(f"  {label:<28} {s * 1e3:9.1f} ms")
        out[label.replace(" ", "_")] = s
    return out


def run(quick: bool = False) -> list[dict]:
    """For `kvscope bench`: {name, median (ms), unit, ratio, ratio_of} records of 10k (and 100k) spans.

    The read record's ratio is against the line-by-line decoder that files with bad lines take; the
    protobuf read's against reading the same spans as JSON lines.
    """
    sizes, repeat = ([10_000], 3) if quick else ([10_000, 100_000], 5)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            path = Path(tmp) / f"synthetic_{n}.jsonl"
            write_trace(path, n)
            tag = f"[{n // 1000}k spans]"
            results = measure(path, repeat)
            against = {"read": "decode_line_by_line", "read_protobuf": "read"}
            for step, seconds in results.items():
                name = f"dashboard.{step}{tag}"
                base = against.get(step)
                records.append({"name": name, "median": seconds * 1e3, "unit": "ms",
                                "ratio": seconds / results[base] if base else None,
                                "ratio_of": f"dashboard.{base}{tag}" if base else None})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, help="where to write the synthetic files (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.dir or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        print(f"median of {args.repeat} runs")
        for n in args.spans:
            path = out_dir / f"synthetic_{n}.jsonl"
            write_trace(path, n)
            measure(path, args.repeat)


if __name__ == "__main__":
    main()
