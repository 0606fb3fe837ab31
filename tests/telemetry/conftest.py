"""Telemetry fixtures: isolated tracing and Prometheus registries, fresh for every test."""

from __future__ import annotations

import pytest
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
