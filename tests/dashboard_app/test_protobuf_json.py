"""A protobuf export written as a JSON line (`protobuf_json`) against what the Collector's protobuf files were read
as before: protobuf's own JSON mapping (`json_format.MessageToDict`), ids turned into hex, `json.dumps`.

For exports holding every kind of attribute value, fields at their default values, fields no reader reads and
spans the reader rejects: the line is the old one byte for byte, less the fields no reader looks at, and a file
of such messages reads to the same spans, vLLM spans and problems as the old lines."""

from __future__ import annotations

import base64
import json
import struct

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from dashboard import traces
from dashboard.traces import otlp_arrow
from dashboard.traces import protobuf_json

pd_testing = pytest.importorskip("pandas.testing")


def reference_line(message: ExportTraceServiceRequest) -> bytes:
    """How `collector_files` wrote a message before `protobuf_json`: protobuf's JSON mapping, span and link ids
    base64 -> hex (OTLP/JSON's ids)."""
    document = json_format.MessageToDict(message, use_integers_for_enums=True)
    for resource_spans in document.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                for ids in (span, *span.get("links", [])):
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if ids.get(key):
                            ids[key] = base64.b64decode(ids[key]).hex()
    return json.dumps(document, separators=(",", ":")).encode()


def pruned(document: dict, descriptor=ExportTraceServiceRequest.DESCRIPTOR) -> dict:
    """`document` (protobuf's JSON mapping of a `descriptor` message) with only `protobuf_json.WRITTEN_FIELDS`."""
    written = protobuf_json.WRITTEN_FIELDS[descriptor.full_name]
    fields = {f.json_name: f for f in descriptor.fields if f.name in written}
    out = {}
    for name, value in document.items():  # in the document's order: the field numbers'
        field = fields.get(name)
        if field is None:
            continue
        if field.message_type is not None:
            value = ([pruned(v, field.message_type) for v in value] if isinstance(value, list)
                     else pruned(value, field.message_type))
        out[name] = value
    return out


# --- messages -----------------------------------------------------------------------------------------------

def any_value(x) -> AnyValue:
    """A Python value as an AnyValue: None is one set to nothing; [] and {} are empty arrays and lists."""
    v = AnyValue()
    if isinstance(x, bool):
        v.bool_value = x
    elif isinstance(x, int):
        v.int_value = x
    elif isinstance(x, float):
        v.double_value = x
    elif isinstance(x, str):
        v.string_value = x
    elif isinstance(x, bytes):
        v.bytes_value = x
    elif isinstance(x, list):
        v.array_value.SetInParent()
        v.array_value.values.extend(any_value(e) for e in x)
    elif isinstance(x, dict):
        v.kvlist_value.SetInParent()
        v.kvlist_value.values.extend(attributes(x))
    return v


def attributes(values: dict) -> list[KeyValue]:
    return [KeyValue(key=k, value=any_value(v)) for k, v in values.items()]


def ids(n: int) -> dict:
    return {"trace_id": bytes([n]) * 16, "span_id": bytes([n, 1]) * 4}


def lookup(n: int, **extra) -> Span:
    """A kvscope lookup span the reader takes, with `extra` attributes (AnyValue or KeyValue entries too)."""
    span = Span(name="kvscope.lookup", start_time_unix_nano=1_700_000_000_000_000_000 + n,
                end_time_unix_nano=1_700_000_000_000_100_000 + n, **ids(n))
    span.attributes.extend(attributes({"kvscope.request.id": f"req-{n}", "kvscope.tokens.queried": 64,
                                       "kvscope.tokens.hit": 32}))
    for key, value in extra.items():
        span.attributes.append(value if isinstance(value, KeyValue) else KeyValue(key=key, value=any_value(value)))
    return span


def export(*spans: Span, scope=InstrumentationScope(name="kvscope", version="0.1.0"), **resource_fields):
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        scope_spans=[ScopeSpans(scope=scope, spans=spans)], **resource_fields)])


def _value_kinds() -> list[ExportTraceServiceRequest]:
    strindex = AnyValue()
    strindex.string_value_strindex = 3
    nested = {"": 1, "deep": [[1.5, None], {}], "bytes": b""}
    unset = KeyValue(key="unset.value")  # no value at all
    return [export(lookup(1, **{
        "text": 'quote " backslash \\ tab \t newline \n é 漢 😀 \x00 \x7f',
        "empty.text": "",
        "int.zero": 0, "int.negative": -5, "int.max": (1 << 63) - 1, "int.min": -(1 << 63),
        "double": 1.5, "double.zero": 0.0, "double.negative.zero": -0.0, "double.tiny": 5e-324,
        "double.big": 1e300, "double.tenth": 0.1, "double.nan": float("nan"), "double.inf": float("inf"),
        "double.negative.inf": float("-inf"),
        "bool.true": True, "bool.false": False,
        "bytes": b"\x00\xff\xfe kv", "bytes.empty": b"",
        "array.empty": [], "array": [1, "a", [True], {"k": 2.5}, None, b"\x01"],
        "kvlist.empty": {}, "kvlist": nested,
        "strindex": KeyValue(key="strindex", value=strindex),
        "key.strindex": KeyValue(key="key.strindex", value=any_value(1), key_strindex=7),
        "value.nothing": None,
        "unset.value": unset,
    }), lookup(2, **{"dup": 1, "dup.again": KeyValue(key="dup", value=any_value("second"))}))]


def _kvscope_columns_of_other_types() -> list[ExportTraceServiceRequest]:
    spans = [lookup(3)]
    for n, (key, value) in enumerate([("kvscope.tokens.hit", 32.0), ("kvscope.tokens.hit", 32.5),
                                      ("kvscope.tokens.hit", "32"), ("kvscope.tokens.hit", True),
                                      ("kvscope.tokens.hit", 1 << 60), ("kvscope.tokens.hit", float("nan")),
                                      ("kvscope.request.id", 7), ("kvscope.request.id", ["a"]),
                                      ("kvscope.request.id", None), ("kvscope.tokens.queried", b"\x01")], 4):
        span = lookup(n)
        del span.attributes[:]
        span.attributes.extend(attributes({"kvscope.request.id": f"req-{n}", "kvscope.tokens.queried": 64,
                                           "kvscope.tokens.hit": 32, key: value}))
        spans.append(span)
    return [export(*spans)]


def _spans_missing_fields() -> list[ExportTraceServiceRequest]:
    no_trace, short_id, no_name, no_start, no_end, late, error, unknown_code, message_only, no_key, no_value = (
        lookup(n) for n in range(20, 31))
    no_trace.ClearField("trace_id")
    short_id.span_id = b"\x01" * 5
    no_name.ClearField("name")
    no_start.ClearField("start_time_unix_nano")
    no_end.ClearField("end_time_unix_nano")
    late.end_time_unix_nano = (1 << 64) - 1
    error.status.CopyFrom(Status(code=Status.STATUS_CODE_ERROR, message="boom"))
    unknown_code.status.code = 7
    message_only.status.message = "only a message"
    no_key.attributes.append(KeyValue(value=any_value("no key")))
    no_value.attributes.append(KeyValue(key="kvscope.request.id"))  # the request id again, unset
    ok_status = lookup(31)
    ok_status.status.code = Status.STATUS_CODE_OK
    empty_status = lookup(32)
    empty_status.status.SetInParent()
    parent = lookup(33)
    parent.parent_span_id = b"\x07" * 8
    return [export(lookup(19), no_trace, short_id, no_name, no_start, no_end, late, error, unknown_code,
                   message_only, no_key, no_value, ok_status, empty_status, parent)]


def _fields_no_reader_reads() -> list[ExportTraceServiceRequest]:
    span = lookup(40)
    span.trace_state = "k=v"
    span.flags = 0x301
    span.kind = Span.SPAN_KIND_SERVER
    span.dropped_attributes_count = span.dropped_events_count = span.dropped_links_count = 3
    span.events.add(time_unix_nano=5, name="event", attributes=attributes({"e": 1.0}))
    span.links.add(trace_id=b"\x09" * 16, span_id=b"\x08" * 8, trace_state="x", attributes=attributes({"l": "v"}))
    scope = InstrumentationScope(name="kvscope", version="0.1.0", attributes=attributes({"s": 1}),
                                 dropped_attributes_count=2)
    message = export(span, scope=scope, resource=Resource(attributes=attributes({"service.name": "vllm"})),
                     schema_url="https://opentelemetry.io/schemas/1.21.0")
    message.resource_spans[0].scope_spans[0].schema_url = "https://example.com/scope"
    return [message]


def _scopes() -> list[ExportTraceServiceRequest]:
    message = export(lookup(50), scope=InstrumentationScope(name="kvscope", version="9.9"))
    for scope, n in ((InstrumentationScope(name="kvscope"), 51), (InstrumentationScope(), 52), (None, 53),
                     (InstrumentationScope(name="other", version="1"), 54), (InstrumentationScope(version="0.1"), 55)):
        scope_spans = ScopeSpans(spans=[lookup(n), Span(name="other.span", **ids(n + 100))])
        if scope is not None:
            scope_spans.scope.CopyFrom(scope)
        message.resource_spans[0].scope_spans.append(scope_spans)
    return [message]


def _vllm_request() -> list[ExportTraceServiceRequest]:
    vllm = Span(name="llm_request", start_time_unix_nano=1_700_000_000_000_000_000,
                end_time_unix_nano=1_700_000_001_000_000_000, **ids(60))
    vllm.attributes.extend(attributes({"gen_ai.request.id": "cmpl-1", "gen_ai.latency.time_in_queue": 0.0125,
                                       "gen_ai.latency.time_to_first_token": 0.25, "gen_ai.latency.e2e": 1.0,
                                       "gen_ai.usage.prompt_tokens": 640, "gen_ai.usage.completion_tokens": 32,
                                       "gen_ai.latency.time_in_model_decode": float("inf")}))
    child = lookup(61)
    child.trace_id, child.parent_span_id = vllm.trace_id, vllm.span_id
    message = export(child)
    message.resource_spans.append(ResourceSpans(scope_spans=[ScopeSpans(
        scope=InstrumentationScope(name="vllm.tracing.otel"), spans=[vllm])]))
    return [message]


def _empty_parts() -> list[ExportTraceServiceRequest]:
    message = export(lookup(70))
    message.resource_spans.append(ResourceSpans(resource=Resource(attributes=attributes({"a": 1}))))
    message.resource_spans.append(ResourceSpans(scope_spans=[ScopeSpans()]))
    message.resource_spans.append(ResourceSpans(scope_spans=[ScopeSpans(scope=InstrumentationScope())]))
    # the second message: an export holding nothing but a field no trace export has (field 2)
    return [message, ExportTraceServiceRequest.FromString(b"\x12\x00")]


def _engines_on_their_resources() -> list[ExportTraceServiceRequest]:
    """Two data-parallel engines: the connector names each on its resource (`kvscope.engine`), not on its spans."""
    engine_0 = Resource(attributes=attributes({"service.name": "vllm", "kvscope.engine": 0}))
    message = export(lookup(80), resource=engine_0)
    message.resource_spans.append(ResourceSpans(
        resource=Resource(attributes=attributes({"kvscope.engine": 1}), dropped_attributes_count=1),
        scope_spans=[ScopeSpans(scope=InstrumentationScope(name="kvscope", version="0.1.0"), spans=[lookup(81)])]))
    message.resource_spans.append(ResourceSpans(resource=Resource(), scope_spans=[ScopeSpans(
        scope=InstrumentationScope(name="kvscope", version="0.1.0"), spans=[lookup(82)])]))  # no engine named
    return [message]


CASES = {
    "engines on their resources": _engines_on_their_resources,
    "every kind of attribute value": _value_kinds,
    "kvscope columns given other types": _kvscope_columns_of_other_types,
    "spans missing fields or rejected": _spans_missing_fields,
    "fields no reader reads": _fields_no_reader_reads,
    "scopes and versions": _scopes,
    "a vLLM request span": _vllm_request,
    "empty parts": _empty_parts,
}


def _all_messages() -> list[ExportTraceServiceRequest]:
    return [m for build in CASES.values() for m in build()]


# --- tests --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(CASES))
def test_a_message_is_written_as_protobufs_json_mapping_wrote_it_less_the_fields_no_reader_reads(case):
    for message in CASES[case]():
        want = json.dumps(pruned(json.loads(reference_line(message))), separators=(",", ":")).encode()
        assert protobuf_json.export_as_json_line(message) == want


def _read(data: bytes) -> traces.Traces:
    return traces.read_trace_files([traces.TraceSource("t", data)])


def _assert_same_reading(got: traces.Traces, want: traces.Traces) -> None:
    pd_testing.assert_frame_equal(got.spans, want.spans)
    pd_testing.assert_frame_equal(got.vllm_requests, want.vllm_requests)
    assert got.problems == want.problems
    assert (got.lines, got.other_spans, got.vllm_spans_read) == (want.lines, want.other_spans, want.vllm_spans_read)


@pytest.mark.parametrize("decoder", ["arrow if it takes the file", "line by line"])
@pytest.mark.parametrize("case", [*sorted(CASES), "all in one file"])
def test_a_protobuf_file_reads_as_its_old_json_lines(case, decoder, monkeypatch):
    if decoder == "line by line":
        monkeypatch.setattr(otlp_arrow, "decode", lambda *args: None)
    messages = _all_messages() if case == "all in one file" else CASES[case]()
    bodies = [m.SerializeToString() for m in messages]
    got = _read(b"".join(struct.pack(">I", len(b)) + b for b in bodies))
    want = _read(b"\n".join(reference_line(m) for m in messages) + b"\n")
    _assert_same_reading(got, want)
    if case != "empty parts":
        assert len(got.spans)  # the cases hold spans the reader takes, so their columns are compared


def test_the_cases_reach_what_they_are_for():
    """The edge cases are read, not rejected wholesale: their attribute values arrive, and their problems are named."""
    read = _read(b"".join(struct.pack(">I", len(b)) + b for b in (m.SerializeToString() for m in _all_messages())))
    extras = read.spans.set_index("request_id")["attributes"]
    first = extras["req-1"]
    assert (first["int.min"], first["double.nan"], first["double.negative.zero"], first["bytes"]) == (
        "-9223372036854775808", "NaN", -0.0, "AP/+IGt2")  # int64 as text, non-finite as names, bytes in base64
    assert first["kvlist"]["values"][0] == {"value": {"intValue": "1"}}  # an entry without a key
    assert first["array.empty"] == {} and first["strindex"] == 3 and first["key.strindex"] == "1"
    assert first["value.nothing"] is None and first["unset.value"] is None  # an empty value, and none at all
    assert extras["req-2"] == {"dup": "second"}  # a key given twice: the last value
    reasons = " | ".join(p.reason for p in read.problems)
    for part in ("without traceId", "without startTimeUnixNano", "outside 0..2^63", "an attribute has no key",
                 "unknown status code 7", "invalid span id", "version '9.9' is not supported", "no resourceSpans",
                 "kvscope.tokens.hit is not an integer", "lacks kvscope.request.id"):
        assert part in reasons
    assert set(read.spans["status_code"]) == {0, 1, 2}
    assert len(read.vllm_requests) == 1 and read.vllm_requests["ttft_ms"].iloc[0] == 250


@pytest.mark.parametrize("decoder", ["arrow if it takes the file", "line by line"])
def test_each_span_of_a_protobuf_file_has_its_resources_engine(decoder, monkeypatch):
    if decoder == "line by line":
        monkeypatch.setattr(otlp_arrow, "decode", lambda *args: None)
    body = _engines_on_their_resources()[0].SerializeToString()
    read = _read(struct.pack(">I", len(body)) + body)
    engines = read.spans.set_index("request_id")["engine"]
    assert engines.fillna(-1).to_dict() == {"req-80": 0, "req-81": 1, "req-82": -1}  # -1: none named


def test_the_attribute_value_messages_are_written_whole_and_the_written_fields_exist():
    """A newer opentelemetry-proto that adds a field to an attribute value (the reader keeps them whole) fails here."""
    from google.protobuf import descriptor_pool

    pool = descriptor_pool.Default()
    for name, written in protobuf_json.WRITTEN_FIELDS.items():
        fields = {f.name for f in pool.FindMessageTypeByName(name).fields}
        assert set(written) <= fields, name
        if name.split(".")[-1] in ("KeyValue", "AnyValue", "ArrayValue", "KeyValueList"):
            assert set(written) == fields, name
