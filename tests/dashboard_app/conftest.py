"""Fixtures for the dashboard tests, and an independent reading of the fixture traces.

`raw_spans` walks the JSON with nothing but `json`, so the expected numbers in the tests do not
come from the code under test.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "traces"
TWO_ROUNDS = FIXTURES / "two_rounds.jsonl"
MALFORMED = FIXTURES / "collector_malformed.jsonl"
APP = REPO / "dashboard" / "app.py"


def raw_spans(path: Path) -> list[dict]:
    """Every kvscope span of a file (scope version 0.1.x), attributes decoded by hand."""
    out = []
    for line in path.read_text().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if not isinstance(doc, dict):
            continue
        for rs in doc.get("resourceSpans") or []:
            for ss in rs.get("scopeSpans") or []:
                scope = ss.get("scope") or {}
                if scope.get("name") == "kvscope" and not scope.get("version", "").startswith("0.1"):
                    continue
                for sp in ss.get("spans") or []:
                    if not sp["name"].startswith("kvscope."):
                        continue
                    attrs = {}
                    for a in sp.get("attributes", []):
                        (kind, value), = a["value"].items()
                        attrs[a["key"].removeprefix("kvscope.")] = int(value) if kind == "intValue" else value
                    out.append({"name": sp["name"], "trace": sp["traceId"], "span": sp["spanId"],
                                "parent": sp.get("parentSpanId", ""), "start": int(sp["startTimeUnixNano"]),
                                "end": int(sp["endTimeUnixNano"]), **attrs})
    return out


def two_engine_copy(folder: Path, key: str = "kvscope.engine") -> Path:
    """The two-rounds fixture as two data-parallel engines wrote it: every other line's resources name engine 1
    (`kvscope.engine`), the rest engine 0. With ``key="service.instance.id"``: as two processes (servers, or
    restarts of one) wrote it, each its own engine 0 ("p0", "p1")."""
    path = folder / ("two_engines.jsonl" if key == "kvscope.engine" else "two_processes.jsonl")
    lines = []
    for i, text in enumerate(TWO_ROUNDS.read_text().splitlines()):
        doc = json.loads(text)
        for rs in doc["resourceSpans"]:
            rs.setdefault("resource", {}).setdefault("attributes", []).append(
                {"key": key, "value": {"intValue": str(i % 2)} if key == "kvscope.engine" else
                 {"stringValue": f"p{i % 2}"}})
        lines.append(json.dumps(doc))
    path.write_text("\n".join(lines) + "\n")
    return path


def nearest_rank(values, percent: float) -> float:
    """The nearest-rank percentile: the smallest value with at least `percent` % of the values at or below it
    (a value that occurred, as the app shows)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(percent / 100 * len(ordered)) - 1)]


class Expected:
    """Numbers of the two-rounds fixture, computed from `raw_spans`."""

    def __init__(self, path: Path = TWO_ROUNDS):
        spans = raw_spans(path)
        self.spans = spans
        self.lookups = sorted((s for s in spans if s["name"] == "kvscope.lookup"), key=lambda s: s["start"])
        self.loads = {s["request.id"]: s for s in spans if s["name"] == "kvscope.load"}
        self.copies = [s for s in spans if s["name"] == "kvscope.group.copy"]
        self.scans = [s for s in spans if s["name"] == "kvscope.group.scan"]
        self.hit_rate = sum(s["tokens.hit"] for s in self.lookups) / sum(s["tokens.queried"] for s in self.lookups)
        self.load_ms, self.load_copy_ms = {}, {}
        for rid, load in self.loads.items():
            copies = [c for c in self.copies if c["trace"] == load["trace"] and c["copy.direction"] == "load"]
            self.load_ms[rid] = (max(c["end"] for c in copies) - load["start"]) / 1e6
            self.load_copy_ms[rid] = (max(c["end"] for c in copies) - min(c["start"] for c in copies)) / 1e6
        self.load_quantiles = [nearest_rank(list(self.load_ms.values()), p) for p in (50, 95, 99)]
        self.bytes = {d: sum(c["copy.bytes"] for c in self.copies if c["copy.direction"] == d)
                      for d in ("load", "store")}

    def cumulative_hit_rate(self, step: int) -> float:
        first = self.lookups[:step]
        return sum(s["tokens.hit"] for s in first) / sum(s["tokens.queried"] for s in first)


@pytest.fixture(scope="session")
def expected() -> Expected:
    return Expected()


# -- a stand-in Prometheus -------------------------------------------------------------------

HIT_RATE_VALUES = ["0.25", "0.5", "NaN", "0.75"]
QUANTILE_SECONDS = {"0.5": "0.002", "0.95": "0.004", "0.99": "0.008"}


class _PrometheusHandler(BaseHTTPRequestHandler):
    queries: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        url = urlparse(self.path)
        params = parse_qs(url.query)
        if url.path != "/api/v1/query_range":
            return self._send(404, {"status": "error", "errorType": "not_found", "error": "no such path"})
        query = params["query"][0]
        self.queries.append(query)
        start = float(params["start"][0])
        if "kvscope_hit_tokens_total" in query:
            values = [[start + 15 * i, v] for i, v in enumerate(HIT_RATE_VALUES)]
        elif "histogram_quantile" in query:
            q = query.split("(", 1)[1].split(",", 1)[0].strip()
            values = [[start, QUANTILE_SECONDS[q]], [start + 15, QUANTILE_SECONDS[q]]]
        else:
            return self._send(400, {"status": "error", "errorType": "bad_data", "error": "unknown query"})
        self._send(200, {"status": "success",
                         "data": {"resultType": "matrix", "result": [{"metric": {}, "values": values}]}})

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fake_prometheus() -> Iterator[str]:
    """Base URL of a local server that answers kvscope range queries with fixed series."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _PrometheusHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def closed_port_url() -> str:
    """A URL on which nothing listens."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
