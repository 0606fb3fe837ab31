"""KVScopeTracing: sinks, sampling of whole requests, W3C propagation, the not-recording path."""

from __future__ import annotations

import json
import logging
import time

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import format_span_id, format_trace_id

from connector import __version__
from connector.telemetry.span_records import ENGINE_RESOURCE_ATTRIBUTE
from connector.telemetry.testing import in_memory_tracing
from connector.telemetry.sinks import LogOnceExporter, build_otlp_exporter, otlp_requested
from connector.telemetry.tracing import KVScopeTracing, SpanRef, trace_id_bound

UPSTREAM_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
UPSTREAM_SPAN = "00f067aa0ba902b7"


def _traceparent(sampled: bool) -> str:
    return f"00-{UPSTREAM_TRACE}-{UPSTREAM_SPAN}-{'01' if sampled else '00'}"


def _one_request(tracing: KVScopeTracing, headers=None) -> None:
    """Scheduler: load span + scan child; worker: copy span from the shipped carrier."""
    parent = tracing.context_from_trace_headers(headers)
    load = tracing.start_span("kvscope.load", context=parent)
    scan = tracing.start_span("kvscope.group.scan", context=tracing.context_of(load))
    scan.end()
    carrier = tracing.carrier_of(load)
    load.end()
    worker_ctx = tracing.context_from_carrier(carrier)
    if worker_ctx is not None:  # no carrier: the request is not traced, the worker builds nothing
        now = time.time_ns()
        tracing.record_span("kvscope.group.copy", worker_ctx, now, now + 1000, {"kvscope.copy.blocks": 3})


# ------------------------------------------------------------------ disabled: free, builds nothing
def test_no_sink_builds_nothing_and_spans_do_not_record(disabled_tracing):
    t = disabled_tracing
    assert t.enabled is False and t.resource is None
    span = t.start_span("kvscope.load")
    assert span is trace.INVALID_SPAN and not span.is_recording()
    assert t.context_of(span) is None
    assert t.carrier_of(span) is None
    assert t.context_from_carrier({"traceparent": _traceparent(True)}) is None
    assert t.context_from_trace_headers({"traceparent": _traceparent(True)}) is None
    assert t.record_span("kvscope.group.copy", None, 1, 2, {"a": 1}) is trace.INVALID_SPAN
    assert t.context_of(t.record_span("kvscope.lookup", None, 1, 2)) is None
    # the typed API too: nothing recorded, nothing to parent children with
    from connector.telemetry.span_records import LOAD_SPAN, LOOKUP_SPAN

    lookup = t.record(LOOKUP_SPAN, None, 1, 2, ("r", 1, 0, "new", 0))
    assert lookup is trace.INVALID_SPAN and not t.may_record(lookup)
    load = t.open_span(None)
    t.end_span(LOAD_SPAN, load, 3, ("r", 0, 1, 1))
    assert t.carrier_of(load) is None
    assert t.force_flush() is True
    t.shutdown()


def test_sdk_disabled_env_turns_tracing_off_even_with_a_file_and_says_so(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="connector.telemetry.tracing"):
        t = KVScopeTracing.from_config(str(tmp_path / "t.jsonl"), 1.0, env={"OTEL_SDK_DISABLED": "true"})
    assert t.enabled is False
    assert any("OTEL_SDK_DISABLED" in r.getMessage() and "t.jsonl" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("ratio", [-0.1, 1.5, "half", float("nan")])
def test_bad_ratio_names_the_key(ratio):
    with pytest.raises(ValueError, match="trace_sample_ratio"):
        KVScopeTracing.from_config("x.jsonl", ratio, env={})


def test_own_provider_never_the_global_one(tmp_path):
    before = trace.get_tracer_provider()
    t = KVScopeTracing.from_config(str(tmp_path / "t.jsonl"), None, env={})
    try:
        assert t.enabled and t.resource is not None
        assert trace.get_tracer_provider() is before
    finally:
        t.shutdown()


@pytest.mark.parametrize("ratio, sampler, recorded", [(None, "always_off", 0), (None, "traceidratio", 1000),
                                                      (1.0, "always_off", 1000), (None, None, 1000),
                                                      (None, "parentbased_always_on", 1000)])
def test_otel_traces_sampler_samples_only_without_trace_sample_ratio(tmp_path, ratio, sampler, recorded):
    env = {"KVSCOPE_TRACE_EXPORT": "thread"} | ({"OTEL_TRACES_SAMPLER": sampler} if sampler else {})
    t = KVScopeTracing.from_config(str(tmp_path / "t.jsonl"), ratio, env=env)
    try:
        assert sum(t.start_span("kvscope.lookup").is_recording() for _ in range(1000)) == recorded
    finally:
        t.shutdown()


def _random_traceparent(rng, sampled: bool) -> dict:
    return {"traceparent": f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64) | 1:016x}-{'01' if sampled else '00'}"}


@pytest.mark.parametrize("sampler, arg, upstream_sampled, expected", [
    # parentbased: a sampled traceparent is followed whatever the ratio (vLLM's own tracer traces it too)
    ("parentbased_always_off", None, True, (1000, 1000)),
    ("parentbased_traceidratio", "0.1", True, (1000, 1000)),
    ("parentbased_always_on", None, False, (0, 0)),
    # plain samplers: the ratio alone, the traceparent's flag ignored
    ("always_off", None, True, (0, 0)),
    ("always_on", None, False, (1000, 1000)),
    ("traceidratio", "0.5", False, (430, 570)),
    # trace_sample_ratio (no OTEL_TRACES_SAMPLER): sampled upstream and the ratio
    (None, None, True, (430, 570)),
    (None, None, False, (0, 0)),
])
def test_otel_traces_sampler_treats_a_traceparent_as_its_standard_meaning_says(tmp_path, sampler, arg,
                                                                              upstream_sampled, expected):
    """`parentbased_always_off` recorded nothing under a sampled traceparent, so kvscope's spans were
    missing from the request traces vLLM's own tracer kept under the same variable."""
    import random

    env = {"KVSCOPE_TRACE_EXPORT": "thread"}
    env |= {"OTEL_TRACES_SAMPLER": sampler} if sampler else {}
    env |= {"OTEL_TRACES_SAMPLER_ARG": arg} if arg else {}
    scheduler = KVScopeTracing.from_config(str(tmp_path / "s.jsonl"), None if sampler else 0.5, env=env)
    worker = KVScopeTracing.from_config(str(tmp_path / "w.jsonl"), None if sampler else 0.5, env=env)
    rng = random.Random(3)
    try:
        kept = 0
        for _ in range(1000):
            load = scheduler.start_span("kvscope.load", context=scheduler.context_from_trace_headers(
                _random_traceparent(rng, upstream_sampled)))
            carrier = scheduler.carrier_of(load)
            assert (carrier is not None) == load.is_recording()
            if carrier is not None:  # the worker keeps every request the scheduler kept: whole traces
                assert worker.may_record(worker.parent_from_carrier(carrier))
                kept += 1
        assert expected[0] <= kept <= expected[1]
    finally:
        scheduler.shutdown()
        worker.shutdown()


def test_otel_traces_sampler_and_its_arg_are_read_as_the_sdk_reads_them():
    """Blank values count as unset, names are trimmed, and both ends of 0..1 are ratios."""
    from connector.telemetry.otel_env import (REMOTE_PARENT_AND_RATIO, REMOTE_PARENT_FOLLOWED, REMOTE_PARENT_IGNORED,
                                              sampler_from_env)

    # unset: the caller's default (trace_sample_ratio's 1.0), an unsampled traceparent still drops the request
    assert sampler_from_env({}) == (1.0, REMOTE_PARENT_AND_RATIO)
    assert sampler_from_env({"OTEL_TRACES_SAMPLER": " "}, default=0.25) == (0.25, REMOTE_PARENT_AND_RATIO)
    assert sampler_from_env({"OTEL_TRACES_SAMPLER": " always_on "}) == (1.0, REMOTE_PARENT_IGNORED)
    ratio_of = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio"}
    assert sampler_from_env(ratio_of | {"OTEL_TRACES_SAMPLER_ARG": " "}) == (1.0, REMOTE_PARENT_FOLLOWED)
    for arg, ratio in (("0", 0.0), ("1", 1.0), (" 0.5 ", 0.5)):
        assert sampler_from_env(ratio_of | {"OTEL_TRACES_SAMPLER_ARG": arg}) == (ratio, REMOTE_PARENT_FOLLOWED)


# ------------------------------------------------------------------ file sink end to end
def test_trace_file_sink_through_the_batch_processor(tmp_path):
    path = tmp_path / "traces.jsonl"
    t = KVScopeTracing.from_config(str(path), None, env={"OTEL_SERVICE_NAME": "my-svc"})
    _one_request(t)
    assert t.force_flush()
    t.shutdown()
    t.shutdown()  # idempotent

    lines = path.read_text().splitlines()
    assert lines
    spans, resource, scopes = [], None, set()
    for line in lines:
        request = json.loads(line)
        for rs in request["resourceSpans"]:
            resource = {a["key"]: a["value"]["stringValue"] for a in rs["resource"]["attributes"]}
            for ss in rs["scopeSpans"]:
                scopes.add((ss["scope"]["name"], ss["scope"]["version"]))
                spans.extend(ss["spans"])
    assert sorted(s["name"] for s in spans) == ["kvscope.group.copy", "kvscope.group.scan", "kvscope.load"]
    assert len({s["traceId"] for s in spans}) == 1
    assert resource["service.name"] == "my-svc"
    assert scopes == {("kvscope", __version__)}


def test_resource_attributes_of_the_process_join_the_environments_and_win(tmp_path, monkeypatch):
    """The connector names its engine (`ENGINE_RESOURCE_ATTRIBUTE`, the data-parallel rank): every
    span's resource carries it beside OTEL_RESOURCE_ATTRIBUTES, over a stale one there."""
    path = tmp_path / "traces.jsonl"
    env = {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,kvscope.engine=7"}
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", env["OTEL_RESOURCE_ATTRIBUTES"])  # Resource.create reads it
    t = KVScopeTracing.from_config(str(path), None, env=env, resource_attributes={ENGINE_RESOURCE_ATTRIBUTE: 1})
    _one_request(t)
    assert t.force_flush()
    t.shutdown()
    resources = [rs["resource"]["attributes"] for line in path.read_text().splitlines()
                 for rs in json.loads(line)["resourceSpans"]]
    assert resources
    for attributes in resources:
        values = {a["key"]: a["value"] for a in attributes}
        assert values["kvscope.engine"] == {"intValue": "1"}
        assert values["deployment.environment"] == {"stringValue": "prod"}
        assert values["service.name"] == {"stringValue": "kvscope"}


def test_default_service_name_is_kvscope(tmp_path):
    t = KVScopeTracing.from_config(str(tmp_path / "t.jsonl"), None, env={})
    try:
        assert t.resource.attributes["service.name"] == "kvscope"
    finally:
        t.shutdown()


# ------------------------------------------------------------------ sampling keeps or drops whole requests
@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_ratio_zero_and_one(ratio):
    t, exporter = in_memory_tracing(sample_ratio=ratio)
    for _ in range(50):
        _one_request(t)
    assert len(exporter.get_finished_spans()) == (150 if ratio == 1.0 else 0)


def test_half_ratio_keeps_about_half_and_never_splits_a_trace():
    t, exporter = in_memory_tracing(sample_ratio=0.5)
    n = 2000
    for _ in range(n):
        _one_request(t)
    by_trace: dict[int, list[str]] = {}
    for span in exporter.get_finished_spans():
        by_trace.setdefault(span.context.trace_id, []).append(span.name)
    # Whole traces only: every kept request has its load, scan and copy spans.
    assert all(sorted(names) == ["kvscope.group.copy", "kvscope.group.scan", "kvscope.load"]
               for names in by_trace.values())
    kept = len(by_trace) / n
    assert 0.43 < kept < 0.57  # binomial sd ~ 0.011: > 6 sd either side


def test_sampling_decides_by_trace_id_alone_like_trace_id_ratio_based():
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    bound = trace_id_bound(0.5)
    assert bound == TraceIdRatioBased(0.5).bound
    low = 0x0000000000000000_1000000000000000  # low 64 bits below 2**63: kept
    high = 0x0000000000000000_F000000000000000
    assert (low & ((1 << 64) - 1)) < bound <= (high & ((1 << 64) - 1))


def test_dropped_root_makes_no_carrier_and_no_worker_span():
    t, exporter = in_memory_tracing(sample_ratio=0.0)
    load = t.start_span("kvscope.load")
    assert not load.is_recording()
    assert t.carrier_of(load) is None
    # children of a dropped span are dropped with it (not new traces)
    child = t.start_span("kvscope.group.scan", context=t.context_of(load))
    assert not child.is_recording()
    assert exporter.get_finished_spans() == ()


# ------------------------------------------------------------------ propagation
def test_carrier_round_trip_keeps_trace_and_parent(tracing, span_exporter):
    load = tracing.start_span("kvscope.load")
    carrier = tracing.carrier_of(load)
    assert carrier == (load.get_span_context().trace_id, load.get_span_context().span_id, None)
    ctx = tracing.context_from_carrier(carrier)
    copy = tracing.record_span("kvscope.group.copy", ctx, 1_000, 5_000, {"kvscope.copy.direction": "load"})
    load.end()

    finished = {s.name: s for s in span_exporter.get_finished_spans()}
    copy_span = finished["kvscope.group.copy"]
    assert copy_span.context.trace_id == load.get_span_context().trace_id
    assert copy_span.parent.span_id == load.get_span_context().span_id
    assert copy_span.parent.is_remote
    assert (copy_span.start_time, copy_span.end_time) == (1_000, 5_000)
    assert copy_span.attributes["kvscope.copy.direction"] == "load"
    assert not copy.is_recording()  # already ended


def test_a_carrier_gives_the_worker_what_the_w3c_propagator_would(tracing):
    """The carrier is the span's traceparent fields as ints: the worker's parent must be exactly
    what extracting the span's W3C headers gives, tracestate included."""
    from opentelemetry.trace import NonRecordingSpan
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from connector.telemetry.span_records import LOOKUP_SPAN

    propagator = TraceContextTextMapPropagator()
    upstream = tracing.context_from_trace_headers({"traceparent": _traceparent(True),
                                                   "tracestate": "vendor=1,other=x"})
    for root_context in (upstream, None):
        load = tracing.start_span("kvscope.load", context=root_context)
        scan = tracing.start_span("kvscope.group.scan", context=tracing.context_of(load))
        typed = tracing.open_span(tracing.record(LOOKUP_SPAN, root_context, 1, 2, ("r", 1, 0, "new", 0)))
        for span in (load, scan, typed):
            headers: dict[str, str] = {}
            propagator.inject(headers, context=trace.set_span_in_context(NonRecordingSpan(span.get_span_context())))
            expected = trace.get_current_span(propagator.extract(headers)).get_span_context()
            got = trace.get_current_span(tracing.context_from_carrier(tracing.carrier_of(span))).get_span_context()
            assert got == expected and got.is_remote and got.trace_flags.sampled
            assert got.trace_state == expected.trace_state
            assert (tracing.carrier_of(span)[2] is not None) == (root_context is not None)


@pytest.mark.parametrize("state", [None, "vendor=1,other=x"])
@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_the_workers_parent_from_a_carrier_records_what_the_carriers_context_would(state, ratio):
    """`parent_from_carrier` (the worker's fast path) against `context_from_carrier`: the same copy
    span, but for its own id, and the same sampling decision."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from connector.telemetry.span_records import COPY_SPAN

    records = []

    class Keep:
        def on_end(self, record):
            records.append(record)

    t = KVScopeTracing.for_exporter(InMemorySpanExporter(), sample_ratio=ratio)
    t._processor = Keep()
    values = (1, "full_attention", "load", 2, 4096, 0, "r1")
    kept = 0
    ids = range(1, 1 << 64, (1 << 64) // 40)  # ids on both sides of the ratio's bound
    for trace_id in ids:
        carrier = (trace_id << 64 | trace_id, 0xB7AD6B7169203331, state)
        records.clear()
        t.record(COPY_SPAN, t.context_from_carrier(carrier), 10, 20, values)
        t.record(COPY_SPAN, t.parent_from_carrier(carrier), 10, 20, values)
        if not records:
            continue  # both dropped it
        kept += 1
        via_context, via_parent = records
        assert via_parent[:2] == via_context[:2] and via_parent[3:] == via_context[3:]
        assert via_parent[4] is True and via_parent[5] == state  # a remote parent, the tracestate kept
    assert kept == len(ids) if ratio == 1.0 else 0 < kept < len(ids)  # the comparison ran, both ways
    assert t.parent_from_carrier(None) is None and KVScopeTracing.disabled().parent_from_carrier((1, 2, None)) is None


def test_record_span_without_context_roots_a_trace_that_children_join(tracing, span_exporter):
    lookup = tracing.record_span("kvscope.lookup", None, 1_000, 2_000, {"kvscope.tokens.hit": 16})
    load = tracing.start_span("kvscope.load", context=tracing.context_of(lookup))
    load.end()
    lookup_span, load_span = span_exporter.get_finished_spans()
    assert lookup_span.parent is None and lookup_span.end_time == 2_000
    assert load_span.parent.span_id == lookup_span.context.span_id


def test_a_dropped_request_builds_no_span_objects():
    class Count:
        ended = 0

        def on_end(self, span):
            Count.ended += 1

    t = KVScopeTracing(Count(), sample_ratio=0.0)
    root = t.record_span("kvscope.lookup", None, 1, 2, {"kvscope.tokens.hit": 1})
    load = t.start_span("kvscope.load", context=t.context_of(root))
    scan = t.record_span("kvscope.group.scan", t.context_of(load), 3, 4, {"kvscope.group.index": 0})
    store = t.start_span("kvscope.store")
    # one shared, ended, non-recording span stands for all of them
    assert root is load is scan is store
    assert not root.is_recording() and t.carrier_of(load) is None
    load.set_attributes({"kvscope.groups": 2})
    load.end()
    assert root.attributes == {} and Count.ended == 0


def test_dropped_recorded_span_still_drops_its_children():
    t, exporter = in_memory_tracing(sample_ratio=0.0)
    lookup = t.record_span("kvscope.lookup", None, 1_000, 2_000, {"kvscope.tokens.hit": 16})
    assert not lookup.is_recording() and t.context_of(lookup) is not None
    t.start_span("kvscope.load", context=t.context_of(lookup)).end()
    assert exporter.get_finished_spans() == ()


def test_load_span_joins_the_incoming_traceparent(tracing, span_exporter):
    _one_request(tracing, headers={"traceparent": _traceparent(True), "tracestate": "vendor=1"})
    spans = span_exporter.get_finished_spans()
    assert len(spans) == 3
    assert {format_trace_id(s.context.trace_id) for s in spans} == {UPSTREAM_TRACE}
    load = next(s for s in spans if s.name == "kvscope.load")
    assert format_span_id(load.parent.span_id) == UPSTREAM_SPAN and load.parent.is_remote
    assert load.context.trace_state.get("vendor") == "1"


def test_header_names_are_case_insensitive(tracing):
    ctx = tracing.context_from_trace_headers({"Traceparent": _traceparent(True)})
    assert ctx is not None
    assert format_trace_id(trace.get_current_span(ctx).get_span_context().trace_id) == UPSTREAM_TRACE


@pytest.mark.parametrize("headers", [None, {}, {"traceparent": "garbage"}, {"other": "x"}])
def test_missing_or_bad_headers_give_no_context(tracing, headers):
    assert tracing.context_from_trace_headers(headers) is None


def test_unsampled_upstream_trace_is_respected(tracing, span_exporter):
    _one_request(tracing, headers={"traceparent": _traceparent(False)})
    assert span_exporter.get_finished_spans() == ()


def test_ratio_applies_under_a_sampled_upstream_trace():
    t, exporter = in_memory_tracing(sample_ratio=0.0)
    _one_request(t, headers={"traceparent": _traceparent(True)})
    assert exporter.get_finished_spans() == ()


# ------------------------------------------------------------------ OTLP from the standard environment
@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}, True),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, False),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_SDK_DISABLED": " TRUE ", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),  # any case, spaces
        ({"OTEL_TRACES_EXPORTER": " OTLP "}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp,none"}, True),  # as the SDK reads it: only "none" alone turns export off
        ({"OTEL_TRACES_EXPORTER": "none, ", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),  # blanks: no names
    ],
)
def test_otlp_requested(env, expected):
    assert otlp_requested(env) is expected


def test_otlp_http_endpoint_resolution():
    exporter = build_otlp_exporter(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    )
    try:
        assert isinstance(exporter, LogOnceExporter)
        assert exporter.inner._endpoint == "http://collector:4318/v1/traces"
    finally:
        exporter.shutdown()


def test_otlp_defaults_to_grpc_like_vllm():
    exporter = build_otlp_exporter({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"})
    try:
        assert type(exporter.inner).__module__.startswith("opentelemetry.exporter.otlp.proto.grpc")
    finally:
        exporter.shutdown()


@pytest.mark.parametrize("endpoint, flags, insecure", [
    ("grpc://collector:4317", {}, True),  # plaintext, as vLLM's own gRPC exporter always is
    ("http://collector:4317", {}, True),  # http:// is plaintext, as in the SDK (only https:// is TLS)
    ("collector:4317", {}, True),
    ("https://collector:4317", {}, False),
    ("https://collector:4317", {"OTEL_EXPORTER_OTLP_INSECURE": "true"}, False),  # https:// is TLS, as in the SDK
    ("grpc://collector:4317", {"OTEL_EXPORTER_OTLP_TRACES_INSECURE": "false"}, False),  # TLS asked for
    ("collector:4317", {"OTEL_EXPORTER_OTLP_INSECURE": "False"}, False),
    ("collector:4317", {"OTEL_EXPORTER_OTLP_INSECURE": " false "}, False),
    # the trace-specific flag wins over the general one
    ("collector:4317", {"OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true", "OTEL_EXPORTER_OTLP_INSECURE": "false"}, True),
])
def test_grpc_export_is_plaintext_unless_https_or_the_insecure_flag_asks_for_tls(endpoint, flags, insecure):
    exporter = build_otlp_exporter({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint, **flags})
    try:
        assert exporter.inner._insecure is insecure
    finally:
        exporter.shutdown()


def test_grpc_export_takes_its_endpoint_headers_and_timeout_from_the_environment():
    """Unset, the endpoint is the gRPC default (4317, where vLLM's own tracer sends); the trace-specific
    endpoint wins over the general one; headers and timeout reach the exporter."""
    exporter = build_otlp_exporter({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_HEADERS": "k=v",
                                    "OTEL_EXPORTER_OTLP_TIMEOUT": "5"})
    try:
        assert exporter.description == "OTLP grpc http://localhost:4317"
        assert exporter.inner._endpoint == "localhost:4317"
        assert exporter.inner._headers == (("k", "v"),) and exporter.inner._timeout == 5.0
    finally:
        exporter.shutdown()
    exporter = build_otlp_exporter({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4317",
                                    "OTEL_EXPORTER_OTLP_ENDPOINT": "http://general:4317"})
    try:
        assert exporter.inner._endpoint == "traces:4317"
    finally:
        exporter.shutdown()


def test_http_export_takes_its_endpoint_headers_and_timeout_from_the_environment():
    """Unset, the endpoint is the HTTP default (4318, path /v1/traces); headers and timeout reach the exporter."""
    exporter = build_otlp_exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_HEADERS": "k=v",
                                    "OTEL_EXPORTER_OTLP_TIMEOUT": "5"})
    try:
        assert exporter.description == "OTLP http/protobuf http://localhost:4318/v1/traces"
        assert exporter.inner._endpoint == "http://localhost:4318/v1/traces"
        assert exporter.inner._client._headers["k"] == "v" and exporter.inner._client._timeout == 5.0
    finally:
        exporter.shutdown()


def test_an_unsupported_otlp_protocol_is_warned_of_naming_the_accepted_and_exported_over_http(caplog):
    """The start-up check refuses it; should it get this far, export goes on over HTTP and says so
    (the failure messages name the protocol actually spoken)."""
    with caplog.at_level(logging.WARNING, logger="connector.telemetry.sinks"):
        exporter = build_otlp_exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
                                        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    try:
        assert exporter.description == "OTLP http/protobuf http://c:4318/v1/traces"
        (record,) = caplog.records
        assert "'http/json'" in record.getMessage() and "accepted: 'grpc', 'http/protobuf'" in record.getMessage()
    finally:
        exporter.shutdown()


class _FailingExporter(SpanExporter):
    def __init__(self):
        self.calls = 0

    def export(self, spans):
        self.calls += 1
        # an exporter's own error log, as the OTLP exporters write it
        logging.getLogger("opentelemetry.exporter.otlp.proto.http.trace_exporter").error("boom %d", self.calls)
        return SpanExportResult.FAILURE


def test_log_once_exporter_logs_once_and_cools_down(caplog):
    now = [0.0]
    inner = _FailingExporter()
    exporter = LogOnceExporter(inner, "OTLP test", cooldown_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG):
        assert exporter.export([]) is SpanExportResult.FAILURE
        assert exporter.export([]) is SpanExportResult.FAILURE  # within the cool-down: inner not called
        now[0] = 11.0
        assert exporter.export([]) is SpanExportResult.FAILURE
    assert inner.calls == 2
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(records) == 1
    assert "OTLP test" in records[0].getMessage() and "boom 1" in records[0].getMessage()
    # outside our exports the exporter's logger is untouched
    with caplog.at_level(logging.ERROR):
        logging.getLogger("opentelemetry.exporter.otlp.proto.http.trace_exporter").error("visible")
    assert "visible" in caplog.text


class _ScriptedExporter(SpanExporter):
    """Fails each export its own way: ``script`` holds log lines to write, or an exception to raise."""

    def __init__(self, *script):
        self.script = list(script)
        self.calls = 0

    def export(self, spans):
        self.calls += 1
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        for line in step:
            logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter").warning(*line)
        return SpanExportResult.FAILURE

    def shutdown(self):
        logging.getLogger("opentelemetry.exporter.otlp.proto.grpc.exporter").warning("closing the channel")


def _failure_warning(caplog, inner: SpanExporter) -> str:
    with caplog.at_level(logging.DEBUG):
        LogOnceExporter(inner, "OTLP test").export([])
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    return record.getMessage()


@pytest.mark.parametrize("step, reason", [
    ([("first %s", "try"), ("middle",), ("last",)], "(first try; last)"),  # the first and the last line logged
    ([], "(export returned FAILURE)"),  # nothing logged
    ([("%d blocks", "x")], "(%d blocks)"),  # a line its own arguments cannot format
    (ConnectionError("refused"), "(ConnectionError('refused'))"),
])
def test_the_one_failure_warning_says_why_the_export_failed(caplog, step, reason):
    assert reason in _failure_warning(caplog, _ScriptedExporter(step))


def test_the_cool_down_ends_at_its_last_instant_and_shutdown_logs_nothing(caplog):
    """At ``cooldown_s`` after a failure the endpoint is tried again; the exporter's own log lines while it
    shuts down (on the engine's shutdown path) are swallowed like its export's."""
    now = [0.0]
    inner = _ScriptedExporter([], [])
    exporter = LogOnceExporter(inner, "OTLP test", cooldown_s=10.0, clock=lambda: now[0])
    exporter.export([])
    now[0] = 10.0
    exporter.export([])
    assert inner.calls == 2
    with caplog.at_level(logging.DEBUG):
        exporter.shutdown()
    assert "closing the channel" not in caplog.text


def test_after_a_failure_the_endpoint_is_left_alone_for_ten_seconds_by_default():
    now = [0.0]
    inner = _ScriptedExporter([], [])
    exporter = LogOnceExporter(inner, "OTLP test", clock=lambda: now[0])
    exporter.export([])
    now[0] = 9.999
    assert exporter.export([]) is SpanExportResult.FAILURE
    assert inner.calls == 1
    now[0] = 10.0
    exporter.export([])
    assert inner.calls == 2


def _unreachable_otlp_env(export_mode: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces",  # discard port: refused
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "0.5",
        "KVSCOPE_TRACE_EXPORT": export_mode,
    }


def test_unreachable_otlp_endpoint_neither_blocks_nor_floods(caplog, monkeypatch):
    """With the export in this process (``KVSCOPE_TRACE_EXPORT=thread``) the OTLP exporter shares the
    engine's process: while it is stuck on the endpoint, span work still never waits for it, and
    after its failure the endpoint is not tried again (nor logged again) for the cool-down."""
    import threading

    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    entered, gate, returned = threading.Event(), threading.Event(), threading.Event()
    attempts: list[int] = []
    real_export = OTLPSpanExporter.export

    def held_export(self, spans):  # the real export to the dead endpoint, held until the test lets go
        attempts.append(len(spans))
        entered.set()
        try:
            if not gate.wait(30):
                gate.set()  # held past any test's patience (a hang): stop holding
            return real_export(self, spans)
        finally:
            returned.set()

    monkeypatch.setattr(OTLPSpanExporter, "export", held_export)
    with caplog.at_level(logging.DEBUG):
        t = KVScopeTracing.from_config(None, 1.0, env=_unreachable_otlp_env("thread"))
        assert t.enabled
        _one_request(t)
        assert entered.wait(30), "the export thread did not reach the OTLP exporter within 30 s"
        for _ in range(200):  # 600 spans: more than a full batch (512) queued behind the stuck export
            _one_request(t)
        # Every span call came back while the only export is still stuck: none waited on the endpoint.
        assert not returned.is_set(), "span work waited for the OTLP export"
        gate.set()
        assert t.force_flush(30_000) is False  # returns (not waiting on the endpoint), but delivered nothing
        t.shutdown()
    # After the first failure, batches are dropped for the cool-down: the endpoint is not waited on again.
    assert len(attempts) == 1, attempts
    assert t.take_lost_records() == {"sink_failed": 3 * 201}  # every record (3 a request), counted
    problems = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(problems) == 1, [r.getMessage() for r in problems]
    assert "127.0.0.1:9" in problems[0].getMessage()


def test_an_unreachable_otlp_endpoint_behind_the_export_helper_is_logged_here_once(caplog):
    """The default export (a helper process): its warning comes back to this process, once, and
    flushes still complete (the helper does not keep retrying the dead endpoint)."""
    with caplog.at_level(logging.DEBUG):
        t = KVScopeTracing.from_config(None, 1.0, env=_unreachable_otlp_env("process"))
        assert t.enabled
        for _ in range(20):
            _one_request(t)
        assert t.force_flush(30_000) is False  # returns, but the endpoint got nothing
        for _ in range(20):
            _one_request(t)
        assert t.force_flush(30_000) is False
        assert t.take_lost_records() == {"sink_failed": 3 * 40}  # the helper's sink failed every record
        t.shutdown()
    problems = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(problems) == 1, [r.getMessage() for r in problems]
    assert "127.0.0.1:9" in problems[0].getMessage()


# ------------------------------------------------------------------ pinned by a mutation campaign of tracing.py
def _sdk_sampled(ratio: float, trace_id: int) -> bool:
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    return TraceIdRatioBased(ratio).should_sample(None, trace_id, "x").decision.is_sampled()


class _FixedIds:
    """An id generator handing out chosen trace ids (to put a root's id on either side of the bound)."""

    def __init__(self, trace_ids):
        self._trace_ids = iter(trace_ids)

    def generate_trace_id(self) -> int:
        return next(self._trace_ids)

    def generate_span_id(self) -> int:
        return 0x1234


@pytest.mark.parametrize("ratio", [1e-10, 0.25, 0.5])  # 1e-10: an odd bound
def test_scheduler_and_worker_decide_like_trace_id_ratio_based_at_the_bound_and_whatever_the_high_bits(ratio):
    """The root's decision (scheduler), the carrier's (worker) and the SDK sampler's agree on every id,
    the ones at the bound and with high bits set among them: a request's trace is never split."""
    import random

    bound = trace_id_bound(ratio)
    lows = [0, 1, bound - 1, bound, bound + 1, (1 << 64) - 1]
    highs = [0, 1, 1 << 63, (1 << 64) - 1]
    rng = random.Random(7)
    ids = [high << 64 | low for high in highs for low in lows] + [rng.getrandbits(128) for _ in range(200)]
    ids = [i for i in ids if i]
    t, _ = in_memory_tracing(sample_ratio=ratio)
    t._ids = _FixedIds(ids)
    for trace_id in ids:
        expected = _sdk_sampled(ratio, trace_id)
        root = t.open_span(None)  # draws `trace_id`
        assert (type(root) is SpanRef) == expected, hex(trace_id)
        assert t.may_record(t.parent_from_carrier((trace_id, 0xB7, None))) == expected, hex(trace_id)


def test_a_local_parent_is_never_remote_an_upstream_one_is(tracing, span_exporter):
    from connector.telemetry.span_records import LOAD_SPAN, LOOKUP_SPAN, SCAN_SPAN

    for headers in (None, {"traceparent": _traceparent(True)}):
        span_exporter.clear()
        upstream = tracing.parent_from_trace_headers(headers)
        lookup = tracing.record(LOOKUP_SPAN, upstream, 1, 2, ("r", 1, 0, "new", 0))
        load = tracing.open_span(lookup, 3)
        tracing.record(SCAN_SPAN, load, 4, 5, (0, "full_attention", 1, 1, 0, 0))
        tracing.end_span(LOAD_SPAN, load, 6, ("r", 0, 1, 1))
        general = tracing.start_span("kvscope.custom", context=tracing.context_of(lookup))
        tracing.start_span("kvscope.custom.child", context=tracing.context_of(general)).end()
        general.end()
        spans = {s.name: s for s in span_exporter.get_finished_spans()}
        assert len(spans) == 5
        assert (spans["kvscope.load"].start_time, spans["kvscope.load"].end_time) == (3, 6)
        for name in ("kvscope.load", "kvscope.group.scan", "kvscope.custom", "kvscope.custom.child"):
            assert not spans[name].parent.is_remote, name
        if headers is None:
            assert spans["kvscope.lookup"].parent is None
        else:
            assert spans["kvscope.lookup"].parent.is_remote
            assert format_span_id(spans["kvscope.lookup"].parent.span_id) == UPSTREAM_SPAN


def test_a_general_span_under_the_upstream_parent_handle_joins_the_upstream_trace(tracing, span_exporter):
    upstream = tracing.parent_from_trace_headers({"traceparent": _traceparent(True), "tracestate": "vendor=1"})
    tracing.start_span("kvscope.custom", context=upstream).end()
    tracing.record_span("kvscope.recorded", upstream, 1, 2)
    for span in span_exporter.get_finished_spans():
        assert format_trace_id(span.context.trace_id) == UPSTREAM_TRACE
        assert format_span_id(span.parent.span_id) == UPSTREAM_SPAN and span.parent.is_remote
        assert span.context.trace_state.get("vendor") == "1"
    assert len(span_exporter.get_finished_spans()) == 2


@pytest.mark.parametrize("headers", [None, {}, {"traceparent": "garbage"}, {"other": "x"}])
def test_a_request_without_a_valid_traceparent_roots_its_own_trace(tracing, headers):
    assert tracing.parent_from_trace_headers(headers) is None


def test_an_otel_context_without_a_span_starts_a_new_trace(tracing, span_exporter):
    from opentelemetry.context import Context

    from connector.telemetry.span_records import LOOKUP_SPAN

    span = tracing.start_span("kvscope.custom", context=Context())
    assert span.is_recording() and span.get_span_context().is_valid
    span.end()
    lookup = tracing.open_span(Context(), 1)
    assert type(lookup) is SpanRef and lookup.trace_id and lookup.parent_span_id is None
    tracing.end_span(LOOKUP_SPAN, lookup, 2, ("r", 1, 0, "new", 0))
    custom, lookup_span = span_exporter.get_finished_spans()
    assert custom.parent is None and lookup_span.parent is None
    assert custom.context.trace_id != lookup_span.context.trace_id


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_a_foreign_span_parents_and_carries_like_a_kvscope_span(ratio):
    """A span of another tracer (an SDK span, a non-recording span from a context): `context_of` and
    `carrier_of` take it too, and its children follow its own sampling decision (a local parent)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import NonRecordingSpan

    t, exporter = in_memory_tracing(sample_ratio=ratio)
    sdk_span = TracerProvider().get_tracer("other").start_span("other.op")  # a private provider, not the global one
    ctx = sdk_span.get_span_context()
    assert t.carrier_of(sdk_span) == (ctx.trace_id, ctx.span_id, None)
    child = t.start_span("kvscope.custom", context=t.context_of(sdk_span))
    assert child.is_recording()  # sampled local parent: followed whatever the ratio
    child.end()
    (span,) = exporter.get_finished_spans()
    assert span.context.trace_id == ctx.trace_id and span.parent.span_id == ctx.span_id
    assert not span.parent.is_remote
    sdk_span.end()
    assert t.carrier_of(NonRecordingSpan(ctx)) is None  # not recording: no worker spans
    assert t.context_of(trace.INVALID_SPAN) is None


def test_a_span_ended_twice_is_recorded_once(tracing, span_exporter):
    span = tracing.start_span("kvscope.custom", start_time=10)
    span.end(20)
    span.end(30)
    (recorded,) = span_exporter.get_finished_spans()
    assert recorded.end_time == 20


def test_attributes_and_name_change_while_a_span_records_not_after(tracing, span_exporter):
    span = tracing.start_span("kvscope.first", start_time=10)
    span.set_attributes({"kvscope.a": 1, "kvscope.b": "x"})
    span.set_attribute("kvscope.c", True)
    span.update_name("kvscope.second")
    span.end(20)
    span.set_attributes({"kvscope.late": 1})
    span.set_attribute("kvscope.late2", 2)
    span.update_name("kvscope.late")
    assert span.name == "kvscope.second" and "kvscope.late2" not in span.attributes  # (a record may hold them)
    tracing.record_span("kvscope.bare", None, 1, 2)  # no attributes: none recorded
    named, bare = span_exporter.get_finished_spans()
    assert named.name == "kvscope.second"
    assert dict(named.attributes) == {"kvscope.a": 1, "kvscope.b": "x", "kvscope.c": True}
    assert bare.name == "kvscope.bare" and dict(bare.attributes) == {}


def test_a_spans_context_property_is_its_span_context_dropped_ones_unsampled(tracing):
    span = tracing.start_span("kvscope.custom")
    assert span.context is span.get_span_context() and span.context.trace_flags.sampled
    assert not span.context.is_remote  # a span of this process
    dropped = KVScopeTracing.for_exporter(InMemorySpanExporter(), sample_ratio=0.0).start_span("kvscope.custom")
    assert not dropped.is_recording()
    assert not dropped.get_span_context().trace_flags.sampled and not dropped.context.trace_flags.sampled


def test_a_forked_child_draws_other_ids_than_its_parent():
    """vLLM forks its workers: a child that kept its parent's generator would repeat its trace and span ids."""
    import os

    from connector.telemetry.tracing import OsRandomIdGenerator

    ids = OsRandomIdGenerator()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, f"{ids.generate_trace_id()} {ids.generate_span_id()}".encode())
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with os.fdopen(read) as f:
        child_trace, child_span = map(int, f.read().split())
    assert (child_trace, child_span) != (ids.generate_trace_id(), ids.generate_span_id())


def test_an_id_of_zero_bits_is_never_drawn():
    """An all-zero id is invalid in W3C: drawn (once in 2**64), it becomes 1."""
    from connector.telemetry.tracing import OsRandomIdGenerator

    class Zero:
        def getrandbits(self, bits):
            return 0

    ids = OsRandomIdGenerator()
    ids._rng = Zero()
    assert ids.generate_trace_id() == 1 and ids.generate_span_id() == 1


def test_tracing_for_an_exporter_names_the_service_flushes_and_shuts_it_down():
    from opentelemetry.sdk.resources import Resource

    class Recording(InMemorySpanExporter):
        shut = False

        def shutdown(self):
            Recording.shut = True
            super().shutdown()

    exporter = Recording()
    t = KVScopeTracing.for_exporter(exporter)
    t.start_span("kvscope.custom").end()
    (span,) = exporter.get_finished_spans()
    assert span.resource.attributes["service.name"] == "kvscope"
    assert t.force_flush() is True
    t.shutdown()
    assert Recording.shut
    own = Resource.create({"service.name": "mine"})
    exporter = InMemorySpanExporter()
    KVScopeTracing.for_exporter(exporter, resource=own).start_span("kvscope.custom").end()
    assert exporter.get_finished_spans()[0].resource is own


def test_a_load_with_no_span_before_it_roots_its_trace_or_drops_it():
    t, exporter = in_memory_tracing(sample_ratio=1.0)
    carrier = t.end_load(None, 10, 20, ("r", 16, 32, 0, [], None))
    (load,) = exporter.get_finished_spans()
    assert load.name == "kvscope.load" and load.parent is None and (load.start_time, load.end_time) == (10, 20)
    assert carrier == (load.context.trace_id, load.context.span_id, None)
    t0, dropped_exporter = in_memory_tracing(sample_ratio=0.0)
    assert t0.end_load(None, 10, 20, ("r", 16, 32, 0, [], None)) is None
    assert dropped_exporter.get_finished_spans() == ()


def test_end_step_with_tracing_off_does_nothing(disabled_tracing):
    disabled_tracing.end_step()  # the worker calls it every step, traced or not


def test_sdk_disabled_without_a_sink_says_nothing(caplog):
    with caplog.at_level("WARNING", logger="connector.telemetry.tracing"):
        assert KVScopeTracing.from_config(None, 1.0, env={"OTEL_SDK_DISABLED": "true"}).enabled is False
    assert not caplog.records


def test_tracing_is_off_when_no_exporter_can_be_built_in_this_process(monkeypatch):
    """Export in this process, OTLP only, and its exporter cannot be created (a broken install):
    nothing would take the spans, so none are recorded."""
    from opentelemetry.exporter.otlp.proto.http import trace_exporter

    def broken(*args, **kwargs):
        raise ImportError("broken install")

    monkeypatch.setattr(trace_exporter, "OTLPSpanExporter", broken)
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces",
           "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "KVSCOPE_TRACE_EXPORT": "thread"}
    t = KVScopeTracing.from_config(None, 1.0, env=env)
    assert t.enabled is False and t.start_span("kvscope.custom") is trace.INVALID_SPAN


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_shutdown_alone_writes_every_span_and_later_ones_are_dropped(tmp_path, mode):
    """vLLM shuts the connector down without a flush first: what was recorded is written all the same;
    spans after it are dropped, counted and told by a flush; a second shutdown does nothing."""
    from connector.telemetry.span_records import LOOKUP_SPAN

    path = tmp_path / "t.jsonl"
    t = KVScopeTracing.from_config(str(path), 1.0, env={"KVSCOPE_TRACE_EXPORT": mode})
    for i in range(3):
        t.record(LOOKUP_SPAN, None, 1, 2, (f"req-{i}", 1, 0, "new", 0))
    t.shutdown()
    written = path.read_text()
    assert written.count('"name":"kvscope.lookup"') == 3
    t.record(LOOKUP_SPAN, None, 1, 2, ("late", 1, 0, "new", 0))
    assert t.force_flush(1000) is False and t.take_lost_records() == {"after_shutdown": 1}
    t.shutdown()
    assert path.read_text() == written
