"""Telemetry fixtures: isolated tracing and Prometheus registries, fresh for every test."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client import CollectorRegistry

from connector.telemetry.testing import in_memory_tracing
from connector.telemetry.tracing import KVScopeTracing


@pytest.fixture
def tracing_with_exporter():
    tracing, exporter = in_memory_tracing(sample_ratio=1.0)
    yield tracing, exporter
    tracing.shutdown()


@pytest.fixture
def tracing(tracing_with_exporter) -> KVScopeTracing:
    return tracing_with_exporter[0]


@pytest.fixture
def span_exporter(tracing_with_exporter):
    return tracing_with_exporter[1]


@pytest.fixture
def disabled_tracing() -> KVScopeTracing:
    return KVScopeTracing.from_config(trace_file=None, sample_ratio=None, env={})


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def prom_metrics(registry):
    from connector.telemetry.testing import build_prom_metrics

    return build_prom_metrics(registry, engines=2)


class _OtlpHttpHandler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.requests.append(ExportTraceServiceRequest.FromString(body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    """An OTLP/HTTP collector on a free local port; ``receiver.requests`` holds each request it got."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OtlpHttpHandler)
    server.requests = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()
