"""A decoded protobuf `ExportTraceServiceRequest` as the OTLP/JSON line the trace readers take, written as text.

The line holds what ``json.dumps(json_format.MessageToDict(message, use_integers_for_enums=True))`` held, byte
for byte, once trace, span and parent ids are turned into hex as OTLP/JSON writes them: 64-bit integers as
decimal strings, enums as numbers, bytes values in base64, non-finite doubles as "NaN", "Infinity",
"-Infinity", fields at their default value left out, non-ASCII escaped. Only the fields some reader looks at
(`reader`, `otlp_arrow`, `vllm_spans`) are written (`WRITTEN_FIELDS`): schema URLs, a scope's attributes,
span kinds, flags, trace states, events, links and status messages are left out. A resource's attributes are
written (its spans inherit `schema.RESOURCE_ATTRIBUTES` from them: the engine of each data-parallel engine).
Attribute values are written whole, nested arrays and key-value lists too: the reader keeps them.

Why not `MessageToDict`: it looks up every field's descriptor and builds a dict per message, a million
dicts for 100k spans that wake the garbage collector again and again; strings are built here instead,
with `json.dumps`' own string escaping, about four times faster.
"""

from __future__ import annotations

import base64
import functools
import json
import math
from json.encoder import encode_basestring_ascii as _quoted  # what json.dumps escapes strings with

from opentelemetry.proto.common.v1.common_pb2 import KeyValue

_KEY_STRINDEX = "key_strindex" in KeyValue.DESCRIPTOR.fields_by_name  # newer opentelemetry-proto only

# message -> its fields this module writes (protobuf names); every other field of theirs is left out. The
# strindex fields (profiles' string tables) exist in newer opentelemetry-proto releases only.
WRITTEN_FIELDS = {
    "opentelemetry.proto.collector.trace.v1.ExportTraceServiceRequest": ("resource_spans",),
    "opentelemetry.proto.trace.v1.ResourceSpans": ("resource", "scope_spans"),
    "opentelemetry.proto.resource.v1.Resource": ("attributes",),  # `kvscope.engine`, for the resource's spans
    "opentelemetry.proto.trace.v1.ScopeSpans": ("scope", "spans"),
    "opentelemetry.proto.common.v1.InstrumentationScope": ("name", "version"),
    "opentelemetry.proto.trace.v1.Span": ("trace_id", "span_id", "parent_span_id", "name", "start_time_unix_nano",
                                          "end_time_unix_nano", "attributes", "status"),
    "opentelemetry.proto.trace.v1.Status": ("code",),
    # attribute values, kept whole by the reader: every field
    "opentelemetry.proto.common.v1.KeyValue": ("key", "value", "key_strindex"),
    "opentelemetry.proto.common.v1.AnyValue": ("string_value", "bool_value", "int_value", "double_value",
                                               "array_value", "kvlist_value", "bytes_value", "string_value_strindex"),
    "opentelemetry.proto.common.v1.ArrayValue": ("values",),
    "opentelemetry.proto.common.v1.KeyValueList": ("values",),
}


def export_as_json_line(message) -> bytes:
    """The OTLP/JSON line of a decoded `ExportTraceServiceRequest` (see the module's docstring)."""
    resource_spans = message.resource_spans
    if not resource_spans:
        return b"{}"
    return ('{"resourceSpans":[' + ",".join([_resource_spans(rs) for rs in resource_spans]) + "]}").encode("ascii")


def _resource_spans(rs) -> str:
    fields = []
    if rs.HasField("resource"):
        attributes = rs.resource.attributes
        written = '"attributes":[' + ",".join([_key_value(kv) for kv in attributes]) + "]" if attributes else ""
        fields.append('"resource":{' + written + "}")
    scope_spans = rs.scope_spans
    if scope_spans:
        fields.append('"scopeSpans":[' + ",".join([_scope_spans(ss) for ss in scope_spans]) + "]")
    return "{" + ",".join(fields) + "}"


def _scope_spans(ss) -> str:
    fields = []
    if ss.HasField("scope"):
        scope = ss.scope
        named = [f'"name":{_quoted(scope.name)}'] if scope.name else []
        if scope.version:
            named.append(f'"version":{_quoted(scope.version)}')
        fields.append('"scope":{' + ",".join(named) + "}")
    spans = ss.spans
    if spans:
        fields.append('"spans":[' + ",".join([_span(span) for span in spans]) + "]")
    return "{" + ",".join(fields) + "}"


def _span(span) -> str:
    trace_id, span_id, parent_span_id = span.trace_id, span.span_id, span.parent_span_id
    name, start, end = span.name, span.start_time_unix_nano, span.end_time_unix_nano
    fields = []
    if trace_id:  # OTLP/JSON writes ids in hex (protobuf's JSON mapping would write base64)
        fields.append(f'"traceId":"{trace_id.hex()}"')
    if span_id:
        fields.append(f'"spanId":"{span_id.hex()}"')
    if parent_span_id:
        fields.append(f'"parentSpanId":"{parent_span_id.hex()}"')
    if name:
        fields.append('"name":' + _quoted(name))
    if start:
        fields.append(f'"startTimeUnixNano":"{start}"')
    if end:
        fields.append(f'"endTimeUnixNano":"{end}"')
    attributes = span.attributes
    if attributes:
        fields.append('"attributes":[' + ",".join([_key_value(kv) for kv in attributes]) + "]")
    if span.HasField("status"):
        code = span.status.code
        fields.append(f'"status":{{"code":{code}}}' if code else '"status":{}')
    return "{" + ",".join(fields) + "}"


def _key_value(kv) -> str:
    key, value = kv.key, kv.value
    kind = value.WhichOneof("value")
    if key and kind is not None and not (_KEY_STRINDEX and kv.key_strindex):  # nearly every attribute
        start = _key_start(key)
        if kind == "string_value":
            return start + '{"stringValue":' + _quoted(value.string_value) + "}}"
        if kind == "int_value":
            return f'{start}{{"intValue":"{value.int_value}"}}}}'
        return start + _ANY_VALUE.get(kind, _any_value_generic)(value) + "}"
    fields = ['"key":' + _quoted(key)] if key else []
    if kind is not None:
        fields.append('"value":' + _ANY_VALUE.get(kind, _any_value_generic)(value))
    elif kv.HasField("value"):  # set, holding nothing
        fields.append('"value":{}')
    if _KEY_STRINDEX and kv.key_strindex:
        fields.append(f'"keyStrindex":{kv.key_strindex}')
    return "{" + ",".join(fields) + "}"


@functools.lru_cache(maxsize=4096)  # spans repeat a few keys: escaped once
def _key_start(key: str) -> str:
    return '{"key":' + _quoted(key) + ',"value":'


def _any_value(value) -> str:
    kind = value.WhichOneof("value")
    return "{}" if kind is None else _ANY_VALUE.get(kind, _any_value_generic)(value)


def _double(number: float) -> str:
    if math.isfinite(number):
        return float.__repr__(number)  # as json.dumps writes it
    return '"NaN"' if math.isnan(number) else '"Infinity"' if number > 0 else '"-Infinity"'


def _values(values, write) -> str:
    return '{"values":[' + ",".join([write(v) for v in values]) + "]}" if values else "{}"


def _any_value_generic(value) -> str:
    """A kind of value this module does not know (a newer opentelemetry-proto): as protobuf writes it."""
    from google.protobuf import json_format

    return json.dumps(json_format.MessageToDict(value, use_integers_for_enums=True), separators=(",", ":"))


_ANY_VALUE = {  # AnyValue's oneof "value": its one field set (a field at its default value included)
    "string_value": lambda v: '{"stringValue":' + _quoted(v.string_value) + "}",
    "int_value": lambda v: f'{{"intValue":"{v.int_value}"}}',
    "bool_value": lambda v: '{"boolValue":true}' if v.bool_value else '{"boolValue":false}',
    "double_value": lambda v: '{"doubleValue":' + _double(v.double_value) + "}",
    "array_value": lambda v: '{"arrayValue":' + _values(v.array_value.values, _any_value) + "}",
    "kvlist_value": lambda v: '{"kvlistValue":' + _values(v.kvlist_value.values, _key_value) + "}",
    "bytes_value": lambda v: '{"bytesValue":"' + base64.b64encode(v.bytes_value).decode("ascii") + '"}',
    "string_value_strindex": lambda v: f'{{"stringValueStrindex":{v.string_value_strindex}}}',
}
