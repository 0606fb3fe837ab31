"""Test helpers for kvscope telemetry: isolated tracing and Prometheus registries (no global state).

Used by the unit tests and by anything that wants to look at the connector's telemetry without
touching the process-wide OpenTelemetry provider or Prometheus registry::

    tracing, exporter = in_memory_tracing()
    ...                                    # code under test uses `tracing`
    spans = exporter.get_finished_spans()

    registry = CollectorRegistry()
    prom = build_prom_metrics(registry)
    prom.observe(stats.data)
    registry.get_sample_value("kvscope_hit_tokens_total", engine_labels())
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from connector.telemetry.tracing import KVScopeTracing

# What vLLM's PrometheusStatLogger passes: labelnames ["model_name", "engine"], values per engine.
VLLM_LABELNAMES = ["model_name", "engine"]
TEST_MODEL_NAME = "test-model"


def in_memory_tracing(sample_ratio: float = 1.0) -> tuple[KVScopeTracing, InMemorySpanExporter]:
    """Tracing whose spans land, synchronously, in a fresh ``InMemorySpanExporter``."""
    exporter = InMemorySpanExporter()
    return KVScopeTracing.for_exporter(exporter, sample_ratio=sample_ratio), exporter


def metric_types_for(registry: CollectorRegistry) -> dict[type, type]:
    """vLLM-style ``metric_types`` whose classes register in ``registry`` instead of the global one."""

    def bound(base: type) -> type:
        class Bound(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.setdefault("registry", registry)
                super().__init__(*args, **kwargs)

        Bound.__name__ = Bound.__qualname__ = f"Registry{base.__name__}"
        return Bound

    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def per_engine_labelvalues(engines: int = 1, model_name: str = TEST_MODEL_NAME) -> dict[int, list[object]]:
    return {idx: [model_name, str(idx)] for idx in range(engines)}


def engine_labels(engine_idx: int = 0, model_name: str = TEST_MODEL_NAME, **own: str) -> dict[str, str]:
    """Label dict of one series, for ``registry.get_sample_value``."""
    return {"model_name": model_name, "engine": str(engine_idx), **own}


def build_prom_metrics(registry: CollectorRegistry, engines: int = 1):
    """``KVScopePromMetrics`` as vLLM would build it, registered in ``registry``."""
    from connector.telemetry.metrics import KVScopePromMetrics

    return KVScopePromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        metric_types_for(registry),
        list(VLLM_LABELNAMES),
        per_engine_labelvalues(engines),
    )


def trace_file_spans(path) -> list:
    """Every span of an OTLP/JSON-lines trace file (kvscope's or a Collector's), as protobuf spans; a line
    that does not parse raises (tests want to see it)."""
    from connector.telemetry.trace_file import parse_json_line

    with open(path) as f:
        return [span for line in f for rs in parse_json_line(line).resource_spans
                for ss in rs.scope_spans for span in ss.spans]


def proto_span_attributes(span) -> dict[str, Any]:
    """A protobuf (OTLP) span's attributes as a dict of ints and strings, the only kinds kvscope writes."""
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = value.string_value if value.HasField("string_value") else value.int_value
    return out
