"""The connector's own spans over OTLP/HTTP to a real receiver, through the export helper process:
what an operator's collector gets for a planned multi-group load."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import pytest

from connector.planning import scan_group
from connector.telemetry.testing import proto_span_attributes
from connector.telemetry.tracing import EXPORT_MODE_VARIABLE, KVScopeTracing

from .test_scheduler_spans import LAYOUTS, B, make_request, make_scheduler, plan, store_everything


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_load_reaches_an_otlp_collector_as_lookup_load_and_one_scan_per_group(receiver, mode):
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{receiver.server_port}/v1/traces",
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "kvscope-test",
           EXPORT_MODE_VARIABLE: mode}
    tracing = KVScopeTracing.from_config(None, 1.0, env=env)
    try:
        sched = make_scheduler(tracing)
        request = make_request("r1", 200)
        store_everything(sched, request)
        _, _, ids = plan(sched, request)
        assert tracing.force_flush(10_000)
        deadline = time.monotonic() + 10
        while not receiver.requests and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        tracing.shutdown()
    spans, services = [], set()
    for message in receiver.requests:
        for rs in message.resource_spans:
            services |= {kv.value.string_value for kv in rs.resource.attributes if kv.key == "service.name"}
            for ss in rs.scope_spans:
                assert ss.scope.name == "kvscope"
                spans.extend(ss.spans)
    assert services == {"kvscope-test"}
    by_name: dict[str, list] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    (lookup,), (load,), scans = by_name.pop("kvscope.lookup"), by_name.pop("kvscope.load"), by_name.pop("kvscope.group.scan")
    assert not by_name
    assert len({s.trace_id for s in spans}) == 1 and len({s.span_id for s in spans}) == 4
    assert lookup.parent_span_id == b"" and load.parent_span_id == lookup.span_id
    assert [s.parent_span_id for s in scans] == [load.span_id] * len(LAYOUTS)
    assert proto_span_attributes(load) == {"kvscope.request.id": "r1", "kvscope.tokens.local": 0,
                                 "kvscope.tokens.external": 192, "kvscope.groups": 2}
    for scan in scans:
        a = proto_span_attributes(scan)
        g = a["kvscope.group.index"]
        expect = scan_group(LAYOUTS[g], ids[g], 0, 192, B)
        assert (a["kvscope.group.blocks.total"], a["kvscope.group.blocks.null_skipped"],
                a["kvscope.group.blocks.pending"], a["kvscope.group.blocks.start"]) == (
                    expect.blocks_total, expect.null_skipped, expect.pending, expect.start)
        assert load.start_time_unix_nano <= scan.start_time_unix_nano <= scan.end_time_unix_nano <= load.end_time_unix_nano
    carrier = sched._pending_loads[0].trace_carrier  # the workers' copy spans go under this load
    assert carrier[:2] == (int.from_bytes(load.trace_id, "big"), int.from_bytes(load.span_id, "big"))


def test_an_otlp_timeout_past_the_most_accepted_is_capped_and_one_in_seconds_kept():
    from connector.telemetry.sinks import DEFAULT_OTLP_TIMEOUT_S, MAX_OTLP_TIMEOUT_S, _timeout_s

    assert _timeout_s({"OTEL_EXPORTER_OTLP_TIMEOUT": "10000"}) == MAX_OTLP_TIMEOUT_S  # the spec's 10 s, in ms
    assert _timeout_s({"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "inf"}) == MAX_OTLP_TIMEOUT_S
    assert _timeout_s({"OTEL_EXPORTER_OTLP_TIMEOUT": "5"}) == 5.0
    assert _timeout_s({"OTEL_EXPORTER_OTLP_TIMEOUT": "nan"}) == DEFAULT_OTLP_TIMEOUT_S
    # no time at all would fail every export: ignored, as a negative one is
    assert _timeout_s({"OTEL_EXPORTER_OTLP_TIMEOUT": "0"}) == DEFAULT_OTLP_TIMEOUT_S
    assert _timeout_s({"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "-1"}) == DEFAULT_OTLP_TIMEOUT_S


def test_the_trace_specific_otlp_timeout_wins_and_only_one_not_taken_as_given_is_warned_of(caplog):
    from connector.telemetry.sinks import MAX_OTLP_TIMEOUT_S, _timeout_s

    with caplog.at_level(logging.WARNING, logger="connector.telemetry.sinks"):
        assert _timeout_s({"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "3", "OTEL_EXPORTER_OTLP_TIMEOUT": "7"}) == 3.0
        assert _timeout_s({"OTEL_EXPORTER_OTLP_TIMEOUT": str(MAX_OTLP_TIMEOUT_S)}) == MAX_OTLP_TIMEOUT_S
        assert not caplog.records  # the most accepted is taken as given
        _timeout_s({"OTEL_EXPORTER_OTLP_TIMEOUT": "0"})
    (record,) = caplog.records
    assert "ignoring OTLP timeout '0' (seconds > 0 accepted)" in record.getMessage()


# --- found by the mutation campaign of sinks.py ---------------------------------------------------


def test_an_otlp_export_gets_two_seconds_unless_told_at_most_thirty_and_a_fraction_of_one_as_given():
    """The bounds themselves, not only their names: a longer wait holds up the engine's shutdown."""
    from connector.telemetry.sinks import _timeout_s

    assert _timeout_s({}) == 2.0
    assert _timeout_s({"OTEL_EXPORTER_OTLP_TIMEOUT": "30"}) == 30.0
    assert _timeout_s({"OTEL_EXPORTER_OTLP_TIMEOUT": "31"}) == 30.0
    assert _timeout_s({"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "0.5"}) == 0.5


def test_trace_specific_otlp_headers_are_added_to_the_general_ones_and_win():
    from connector.telemetry.sinks import _headers

    assert _headers({"OTEL_EXPORTER_OTLP_HEADERS": "a=1,b=2", "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "b=3,c=x%20y"}) == {
        "a": "1", "b": "3", "c": "x y"}
    # keys are percent-decoded too, values stripped before decoding; an entry without a key is skipped
    assert _headers({"OTEL_EXPORTER_OTLP_HEADERS": "x%2Dkey= a%20b , =orphan"}) == {"x-key": "a b"}


def test_the_service_name_comes_from_otel_service_name_then_the_resource_attributes_then_kvscope():
    from connector.telemetry.sinks import resource_from_env

    both = {"OTEL_SERVICE_NAME": "svc", "OTEL_RESOURCE_ATTRIBUTES": "service.name=attr"}
    assert resource_from_env(both).attributes["service.name"] == "svc"
    assert resource_from_env({"OTEL_RESOURCE_ATTRIBUTES": "service.name=attr"}).attributes["service.name"] == "attr"
    # an entry without "=" is skipped, as the SDK's resource detector skips it: it names no service
    assert resource_from_env({"OTEL_RESOURCE_ATTRIBUTES": "service.name=attr,service.name"}).attributes[
        "service.name"] == "attr"
    # the process's own attributes win over the environment's, the service name among them
    assert resource_from_env(both, {"service.name": "own"}).attributes["service.name"] == "own"


def test_an_exporter_that_raises_while_shutting_down_never_stops_the_engines_shutdown():
    from opentelemetry.sdk.trace.export import SpanExporter

    from connector.telemetry.sinks import LogOnceExporter

    class Raising(SpanExporter):
        calls = 0

        def export(self, spans):
            raise AssertionError("not exported")

        def shutdown(self):
            type(self).calls += 1
            raise RuntimeError("channel already closed")

    LogOnceExporter(Raising(), "OTLP test").shutdown()
    assert Raising.calls == 1


@contextmanager
def _grpc_collector(tmp_path):
    """A real OTLP gRPC trace receiver on a TCP port and a unix socket: (port, socket, the names of the spans it
    received, the metadata of each export)."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[str] = []
    metadata: list[dict] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            metadata.append(dict(context.invocation_metadata()))
            received.extend(span.name for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    socket = tmp_path / "otlp.sock"
    port = server.add_insecure_port("127.0.0.1:0")
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    try:
        yield port, socket, received, metadata
    finally:
        server.stop(0)


def _export_one_load(env: dict) -> None:
    tracing = KVScopeTracing.from_config(None, 1.0, env={**env, EXPORT_MODE_VARIABLE: "thread"})
    try:
        sched = make_scheduler(tracing)
        request = make_request("r1", 200)
        store_everything(sched, request)
        plan(sched, request)
        assert tracing.force_flush(10_000)
    finally:
        tracing.shutdown()


@pytest.mark.parametrize("form", ["grpc://127.0.0.1:{port}", "127.0.0.1:{port}", "unix://{socket}",
                                  "UNIX://{socket}"])
def test_a_load_reaches_a_grpc_collector_at_each_endpoint_form_the_exporter_takes(tmp_path, form):
    """`grpc://host:4317` is vLLM's OpenTelemetry example's form (vLLM passes it to its engine
    processes); a check once refused it, and gRPC targets, at start-up. gRPC reads a target's scheme in
    any case."""
    with _grpc_collector(tmp_path) as (port, socket, received, _):
        _export_one_load({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": form.format(port=port, socket=socket),
                          "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"})
    assert sorted(set(received)) == ["kvscope.group.scan", "kvscope.load", "kvscope.lookup"]


def test_an_authorization_header_written_with_capitals_reaches_a_grpc_collector(tmp_path):
    """gRPC refuses upper-case metadata keys ("Invalid metadata", every export failed) where `kvscope check`
    said ok: header names are sent lower-cased, as the SDK's own parser does (HTTP's are case-insensitive)."""
    with _grpc_collector(tmp_path) as (port, _, received, metadata):
        _export_one_load({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}",
                          "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
                          "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20abc,X-Tenant=t1"})
    assert sorted(set(received)) == ["kvscope.group.scan", "kvscope.load", "kvscope.lookup"]
    assert {(m["authorization"], m["x-tenant"]) for m in metadata} == {("Bearer abc", "t1")}
