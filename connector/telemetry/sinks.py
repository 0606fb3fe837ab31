"""Where the connector's spans go: the trace file and OTLP sinks, built from the connector config
and the standard ``OTEL_*`` environment, taking span records (`span_records`).

Both sides of the export use this: the span export helper process (`export_process`) and, with
``KVSCOPE_TRACE_EXPORT=thread``, the engine process itself. OTLP protocol, endpoint, headers and
timeout follow the OpenTelemetry environment specification; a dead endpoint is logged once and
then skipped for a cool-down (`LogOnceExporter`), never waited on.

Sinks (any combination):
- ``trace_file``: OTLP/JSON lines (``trace_file.OtlpJsonLinesExporter``) behind the batching processor.
- OTLP export, when the standard environment asks for it: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, or ``OTEL_TRACES_EXPORTER`` naming ``otlp``. The protocol comes
  from ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``; unset means ``grpc``,
  the default of vLLM's own tracer (``--otlp-traces-endpoint`` exports the variable
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` to the engine processes), so one endpoint receives both.
  ``http/protobuf`` selects the HTTP exporter. ``OTEL_SDK_DISABLED=true`` turns all tracing off.
  A dead endpoint never slows the engine: export runs off the engine thread (the helper process,
  or the batcher's thread) with a short timeout, the first failure is logged once, and batches are
  dropped for a cool-down after a failure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from connector import __version__
from connector.telemetry.otel_env import otlp_protocol
from connector.telemetry.span_records import expand_records, to_readable_span
from connector.telemetry.trace_file import OtlpJsonLinesExporter, RecordJsonEncoder

logger = logging.getLogger(__name__)

SCOPE_NAME = "kvscope"
DEFAULT_SERVICE_NAME = "kvscope"
# Seconds one OTLP export may take (retries included) unless OTEL_EXPORTER_OTLP[_TRACES]_TIMEOUT says.
DEFAULT_OTLP_TIMEOUT_S = 2.0
# At most this (a longer export holds the engine's shutdown: it waits for the sinks to drain).
MAX_OTLP_TIMEOUT_S = 30.0
# After a failed OTLP export, batches are dropped for this long instead of waiting on a dead endpoint.
OTLP_FAILURE_COOLDOWN_S = 10.0


@dataclass(frozen=True)
class Sinks:
    """Where spans go, as plain data the helper process can rebuild the exporters from."""

    trace_file: str | None
    otel_env: dict[str, str] = field(default_factory=dict)  # the OTEL_* variables that configure OTLP
    resource: dict[str, object] = field(default_factory=dict)  # resource attributes, already resolved


def build_exporters(sinks: Sinks) -> list[SpanExporter]:
    """The exporters for ``sinks``, taking span records (in the helper process, or in this one)."""
    resource = Resource(sinks.resource)
    exporters: list[SpanExporter] = []
    if sinks.trace_file:
        # The file gets records encoded directly (no SDK span, no protobuf): the cheap path.
        encoder = RecordJsonEncoder(resource, SCOPE_NAME, __version__)
        exporters.append(OtlpJsonLinesExporter(sinks.trace_file, encode=encoder))
    if otlp_requested(sinks.otel_env):
        otlp = build_otlp_exporter(sinks.otel_env)
        if otlp is not None:
            exporters.append(SdkSpanExporter(otlp, resource))
    return exporters


_SCOPE = InstrumentationScope(SCOPE_NAME, __version__)


class SdkSpanExporter(SpanExporter):
    """Turns span records into SDK `ReadableSpan`s (on the export thread) for a real exporter."""

    def __init__(self, inner: SpanExporter, resource: Resource):
        self._inner = inner
        self._resource = resource

    def export(self, records: Sequence[tuple]) -> SpanExportResult:
        return self._inner.export([to_readable_span(r, self._resource, _SCOPE) for r in expand_records(records)])

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self._inner.shutdown()


def otlp_requested(env: Mapping[str, str]) -> bool:
    """Whether the standard OTEL_* variables ask for OTLP trace export."""
    if truthy(env.get("OTEL_SDK_DISABLED")):
        return False
    names = _exporter_names(env)
    if names == ["none"]:
        return False
    return bool(
        env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or "otlp" in names
    )


def build_otlp_exporter(env: Mapping[str, str]) -> SpanExporter | None:
    """OTLP span exporter configured from ``env``, wrapped to fail fast and log once."""
    protocol = otlp_protocol(env)  # checked at start-up (`otel_env.check_otlp_env`)
    timeout = _timeout_s(env)
    headers = _headers(env)
    traces_endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base_endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )

            endpoint = traces_endpoint or base_endpoint or "http://localhost:4317"
            # Plaintext unless https:// or OTEL_EXPORTER_OTLP_[TRACES_]INSECURE=false asks for TLS (vLLM's own
            # gRPC exporter is always plaintext: a collector beside vLLM gets both)
            insecure_flag = (env.get("OTEL_EXPORTER_OTLP_TRACES_INSECURE") or env.get("OTEL_EXPORTER_OTLP_INSECURE")
                             or "").strip().lower()
            secure = endpoint.lower().startswith("https://") or insecure_flag == "false"
            inner: SpanExporter = GrpcExporter(
                endpoint=endpoint,
                insecure=not secure,
                headers=headers or None,
                timeout=timeout,
            )
        else:
            if protocol != "http/protobuf":
                logger.warning(
                    "kvscope: OTLP protocol %r is not supported for traces; using 'http/protobuf' "
                    "(accepted: 'grpc', 'http/protobuf')",
                    protocol,
                )
                protocol = "http/protobuf"  # what the exporter below speaks: its failures say so
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpExporter,
            )

            if traces_endpoint:
                endpoint = traces_endpoint
            else:
                endpoint = (base_endpoint or "http://localhost:4318").rstrip("/") + "/v1/traces"
            inner = HttpExporter(endpoint=endpoint, headers=headers or None, timeout=timeout)
    except Exception as exc:  # a broken exporter install must not stop the engine
        logger.warning("kvscope: cannot create the OTLP trace exporter (%s); OTLP export is off", exc)
        return None
    return LogOnceExporter(inner, description=f"OTLP {protocol} {endpoint}")


class LogOnceExporter(SpanExporter):
    """Wraps an exporter: logs its first failure once, fails fast for a while after each failure.

    The inner exporter's own log records are captured while it exports (on this wrapper's thread
    only, so other users of the same exporter classes keep theirs); the first failure is reported
    with the first captured message. After a failure, batches are dropped for ``cooldown_s`` instead
    of waiting for a dead endpoint again, so ``force_flush``/``shutdown`` stay quick.
    """

    def __init__(
        self,
        inner: SpanExporter,
        description: str,
        cooldown_s: float = OTLP_FAILURE_COOLDOWN_S,
        clock=time.monotonic,
    ):
        self.inner = inner
        self.description = description
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._retry_at = float("-inf")
        self._warned = False
        _CAPTURE.install()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._clock() < self._retry_at:
            return SpanExportResult.FAILURE
        with _CAPTURE.capturing() as captured:
            try:
                result = self.inner.export(spans)
                reason = "; ".join(dict.fromkeys(captured[:1] + captured[-1:])) or "export returned FAILURE"
            except Exception as exc:
                result = SpanExportResult.FAILURE
                reason = repr(exc)
        if result is SpanExportResult.SUCCESS:
            return result
        self._retry_at = self._clock() + self.cooldown_s
        if not self._warned:
            self._warned = True
            logger.warning(
                "kvscope: trace export to %s failed (%s); spans are dropped while it fails and "
                "further failures are not logged",
                self.description,
                reason,
            )
        return SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self) -> None:
        with _CAPTURE.capturing():
            try:
                self.inner.shutdown()
            except Exception:
                pass


class _ThreadLogCapture(logging.Filter):
    """Swallows (and keeps) the OTLP exporters' log records on threads that asked for it."""

    LOGGER_NAMES = (
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
        "opentelemetry.exporter.otlp.proto.http._common",
        "opentelemetry.exporter.otlp.common.http",
        "opentelemetry.exporter.otlp.proto.grpc.exporter",
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    )

    def __init__(self):
        super().__init__()
        self._local = threading.local()
        self._installed = False
        self._lock = threading.Lock()

    def install(self) -> None:
        with self._lock:
            if not self._installed:
                for name in self.LOGGER_NAMES:
                    logging.getLogger(name).addFilter(self)
                self._installed = True

    def capturing(self) -> _Capturing:
        return _Capturing(self._local)

    def filter(self, record: logging.LogRecord) -> bool:
        sink = getattr(self._local, "sink", None)
        if sink is None:
            return True
        try:
            sink.append(record.getMessage())
        except Exception:
            sink.append(str(record.msg))
        return False


class _Capturing:
    def __init__(self, local: threading.local):
        self._local = local
        self._sink: list[str] = []

    def __enter__(self) -> list[str]:
        self._previous = getattr(self._local, "sink", None)
        self._local.sink = self._sink
        return self._sink

    def __exit__(self, *exc: object) -> None:
        self._local.sink = self._previous


_CAPTURE = _ThreadLogCapture()


def truthy(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def _exporter_names(env: Mapping[str, str]) -> list[str]:
    return [n.strip().lower() for n in (env.get("OTEL_TRACES_EXPORTER") or "").split(",") if n.strip()]


def _timeout_s(env: Mapping[str, str]) -> float:
    # Seconds, as the Python OTLP exporters read these variables.
    raw = env.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or env.get("OTEL_EXPORTER_OTLP_TIMEOUT")
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if value > MAX_OTLP_TIMEOUT_S:
            # the OpenTelemetry spec says milliseconds: 10000 meant 10 s, not the 2.8 h it reads as here
            logger.warning("kvscope: OTLP timeout %r is read as seconds (as the Python OTLP exporters read it, "
                           "not milliseconds as the OpenTelemetry spec says); using the most accepted, %g s",
                           raw, MAX_OTLP_TIMEOUT_S)
            return MAX_OTLP_TIMEOUT_S
        if value > 0:
            return value
        logger.warning("kvscope: ignoring OTLP timeout %r (seconds > 0 accepted)", raw)
    return DEFAULT_OTLP_TIMEOUT_S


def _parse_kv_list(raw: str | None) -> dict[str, str]:
    """``k1=v1,k2=v2`` (W3C baggage-like, percent-encoded) as OTEL_*_HEADERS and resource attrs use."""
    from urllib.parse import unquote

    result: dict[str, str] = {}
    for item in (raw or "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            result[unquote(key.strip())] = unquote(value.strip())
    return result


def _headers(env: Mapping[str, str]) -> dict[str, str]:
    # Header names are case-insensitive, and gRPC refuses an upper-case metadata key ("Invalid metadata",
    # every export): lower-cased, as the SDK's own parse_env_headers does
    headers = {}
    for name in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"):
        headers.update({key.lower(): value for key, value in _parse_kv_list(env.get(name)).items()})
    return headers


def resource_from_env(env: Mapping[str, str], attributes: Mapping[str, Any] | None = None) -> Resource:
    """The resource of every span: ``service.name`` (``OTEL_SERVICE_NAME``, else ``kvscope``), the
    ``OTEL_RESOURCE_ATTRIBUTES`` and ``attributes`` (facts of this process, such as its engine: they
    win over the environment's)."""
    # Resource.create merges OTEL_RESOURCE_ATTRIBUTES from the process environment itself;
    # service.name is decided here so that `env` wins and "kvscope" is the default.
    service_name = (
        env.get("OTEL_SERVICE_NAME")
        or _parse_kv_list(env.get("OTEL_RESOURCE_ATTRIBUTES")).get("service.name")
        or DEFAULT_SERVICE_NAME
    )
    return Resource.create({"service.name": service_name, **(attributes or {})})
