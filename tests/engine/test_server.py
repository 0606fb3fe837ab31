"""The real OpenAI-compatible server with kvscope (loaded through the plugin entry point) and
tracing on: requests with their own `traceparent` over HTTP, a device prefix-cache reset, the same
requests again, then `/metrics` and the trace file."""

from __future__ import annotations

import base64
import gzip
import json
import os
import signal
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest
import requests
import zmq
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client.parser import text_string_to_metric_families
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from connector.telemetry.metrics import METRIC_NAMES
from connector.telemetry.trace_file import parse_json_line
from connector.tiny_models import build_model
from tests.compat.kv_event_views import host_blocks_unlike_device, router_view

from .api_server import free_port, live_processes, proc_stat, running_api_server
from .conftest import prompts_sharing_prefixes

pytestmark = pytest.mark.engine


class _OtlpSink(BaseHTTPRequestHandler):
    """Takes OTLP/HTTP protobuf posts (vLLM's own spans), so tracing can be on without a backend, and keeps
    each decoded `ExportTraceServiceRequest` in its server's `exports`, as a Collector would receive it."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":  # OTEL_EXPORTER_OTLP_COMPRESSION=gzip
            body = gzip.decompress(body)
        try:
            self.server.exports.append(ExportTraceServiceRequest.FromString(body))
        except DecodeError:
            self.send_response(400)
        else:
            self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def otlp_sink():
    sink = ThreadingHTTPServer(("127.0.0.1", 0), _OtlpSink)
    sink.exports = []
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    try:
        yield sink
    finally:
        sink.shutdown()


@pytest.fixture(scope="module")
def kv_events():
    """A KV-aware router's subscription to the server's KV cache events (`--kv-events-config`, ZMQ):
    (the port the server publishes on, every event received, in order). Subscribed before the server
    starts, so no event is missed."""
    port = free_port()
    context = zmq.Context()
    socket_ = context.socket(zmq.SUB)
    socket_.setsockopt(zmq.SUBSCRIBE, b"")
    socket_.connect(f"tcp://127.0.0.1:{port}")
    received, stop = [], threading.Event()

    def receive():
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not stop.is_set():
            if socket_.poll(100):
                _topic, _seq, payload = socket_.recv_multipart()
                received.extend(decoder.decode(payload).events)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    try:
        yield port, received
    finally:
        stop.set()
        thread.join(timeout=10)
        socket_.close(0)
        context.term()


@pytest.fixture(scope="module")
def server(otlp_sink, kv_events):
    model = build_model("gemma3", window=64)
    trace_file = os.path.join(tempfile.mkdtemp(prefix="kvscope-server-"), "spans.jsonl")
    transfer = {"kv_connector": "KVScopeConnector", "kv_role": "kv_both",  # entry point, no module path
                "kv_connector_extra_config": {"cpu_bytes": 64 << 20, "trace_file": trace_file}}
    args = [
        # 0 (the default) aborts on Ctrl-C: every engine process is SIGKILLed at once, spans still queued lost
        "--shutdown-timeout", "20",
        "--otlp-traces-endpoint", f"http://127.0.0.1:{otlp_sink.server_port}/v1/traces",
        "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                          "endpoint": f"tcp://*:{kv_events[0]}"})]
    log = os.path.join(os.path.dirname(trace_file), "server.log")
    with running_api_server(model, transfer, log, args,
                            env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}) as (base, proc):
        yield base, model, trace_file, proc


@pytest.fixture(scope="module")
def two_rounds(server):
    base, model, trace_file, _ = server
    prompts = prompts_sharing_prefixes()
    sent = {}  # round -> list of trace ids
    for round_ in (0, 1):
        ids = []
        for i, prompt in enumerate(prompts):
            trace_id = f"{round_ + 1:08x}{i + 1:024x}"
            headers = {"traceparent": f"00-{trace_id}-{i + 1:016x}-01"}
            r = requests.post(base + "/v1/completions", headers=headers, timeout=120, json={
                "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            ids.append(trace_id)
        sent[round_] = ids
        if round_ == 0:
            assert requests.post(base + "/reset_prefix_cache", timeout=30).status_code == 200
    time.sleep(6)  # batch span processor and the stats interval
    metrics, deadline = None, time.time() + 60
    while True:  # until the last steps' stats are in: two scrapes agree on every kvscope sample
        latest = requests.get(base + "/metrics", timeout=30).text
        if metrics is not None and _kvscope_samples(latest) == _kvscope_samples(metrics) or time.time() > deadline:
            return sent, latest, trace_file
        metrics = latest
        time.sleep(2)


def _kvscope_samples(text):
    return [line for line in text.splitlines() if line.startswith("kvscope_") and "_created{" not in line]


def _families(text):
    return {f.name: f for f in text_string_to_metric_families(text)}


def _total(families, name):
    fam = families[name]
    return sum(s.value for s in fam.samples if s.name in (name, name + "_total"))


def test_every_contract_metric_is_on_vllm_metrics(two_rounds):
    _, text, _ = two_rounds
    exposed = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for name in METRIC_NAMES:
        base = name.removesuffix("_total")
        assert any(e == name or e.startswith(base) for e in exposed), name
    engine_labelled = [s for f in text_string_to_metric_families(text) for s in f.samples
                       if s.name == "kvscope_hit_tokens_total"]
    assert engine_labelled and all("model_name" in s.labels and "engine" in s.labels for s in engine_labelled)


def test_hits_are_sane_and_equal_vllm_external_hits(two_rounds):
    _, text, _ = two_rounds
    fams = _families(text)
    hits = _total(fams, "kvscope_hit_tokens")
    lookups = _total(fams, "kvscope_lookup_tokens")
    external = _total(fams, "vllm:external_prefix_cache_hits")
    assert 0 < hits <= lookups
    assert hits == external
    # what was not served, by reason, adds up to the rest; round 1 was cold
    missed = {s.labels["reason"]: s.value for s in fams["kvscope_missed_tokens"].samples if s.name.endswith("_total")}
    assert sum(missed.values()) == lookups - hits and missed["new"] > 0
    # vLLM's per-tier cache-hit counter files kvscope's hits under the host tier
    by_source = {s.labels["source"]: s.value for s in fams["vllm:prompt_tokens_cached_by_source"].samples
                 if s.name.endswith("_total")}
    assert by_source["host"] == hits and by_source["external_unspecified"] == 0


def test_a_healthy_run_drops_no_span(two_rounds):
    _, text, _ = two_rounds
    assert _total(_families(text), "kvscope_dropped_trace_records") == 0  # every span reached the trace file


def test_per_group_labels_and_copy_histograms_have_samples(two_rounds):
    _, text, _ = two_rounds
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    kinds = {s.labels.get("kind") for s in samples if s.name == "kvscope_scan_blocks_total"}
    assert kinds == {"sliding_window", "full_attention"}
    copies = {(s.labels["kind"], s.labels["direction"]): s.value for s in samples
              if s.name == "kvscope_copy_duration_seconds_count"}
    for kind in ("sliding_window", "full_attention"):
        assert copies.get((kind, "load"), 0) > 0 and copies.get((kind, "store"), 0) > 0
    nulls = {s.labels["kind"]: s.value for s in samples if s.name == "kvscope_null_blocks_skipped_total"}
    assert nulls["sliding_window"] > 0


def test_loading_requests_have_their_spans_in_the_trace_they_sent(two_rounds):
    sent, _, trace_file = two_rounds
    spans = []
    with open(trace_file) as f:
        for line in f:
            for rs in parse_json_line(line).resource_spans:
                for ss in rs.scope_spans:
                    spans.extend(ss.spans)
    loads = [s for s in spans if s.name == "kvscope.load"]
    assert loads
    sent_ids = set(sent[0]) | set(sent[1])
    assert {load.trace_id.hex() for load in loads} & set(sent[1])  # round 1 loads from the host tier
    for load in loads:
        assert load.trace_id.hex() in sent_ids  # each load in the trace its request sent
        copies = [s for s in spans if s.name == "kvscope.group.copy" and s.trace_id == load.trace_id]
        assert copies


def _collector_json_line(export: ExportTraceServiceRequest) -> str:
    """One export as the Collector's file exporter writes it (OTLP/JSON): camelCase fields, int64 as decimal
    strings, enums as numbers, and trace and span ids in hex, not protobuf-JSON's base64. kvscope's own
    spans (should its OTLP export reach the sink too) are left out: this is a file of vLLM's spans."""
    doc = json_format.MessageToDict(export, use_integers_for_enums=True)
    for rs in doc.get("resourceSpans", []):
        rs["scopeSpans"] = [ss for ss in rs.get("scopeSpans", []) if ss.get("scope", {}).get("name") != "kvscope"]
        for ss in rs["scopeSpans"]:
            for sp in ss.get("spans", []):
                for ids in (sp, *sp.get("links", [])):
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if ids.get(key):
                            ids[key] = base64.b64decode(ids[key]).hex()
    return json.dumps(doc, separators=(",", ":")) + "\n"


def _vllm_request_traces(exports: list[ExportTraceServiceRequest]) -> set[str]:
    return {sp.trace_id.hex() for export in list(exports) for rs in export.resource_spans
            for ss in rs.scope_spans for sp in ss.spans if sp.name == "llm_request"}


def test_the_dashboard_puts_vllms_request_span_beside_kvscopes(two_rounds, otlp_sink, tmp_path):
    """vLLM's own request spans, received over OTLP and written as a Collector's file, read with kvscope's
    trace file by the dashboard's reader: each request sent with a traceparent is one row holding its
    kvscope lookup and vLLM's latencies, and round 2's loading requests have a load time and a TTFT."""
    from dashboard import traces

    sent, _, trace_file = two_rounds
    deadline = time.time() + 30  # vLLM's batch span processor exports every 5 s
    while not set(sent[0]) | set(sent[1]) <= _vllm_request_traces(otlp_sink.exports) and time.time() < deadline:
        time.sleep(1)
    collector_file = tmp_path / "vllm-spans.jsonl"
    collector_file.write_text("".join(_collector_json_line(e) for e in list(otlp_sink.exports)))

    read = traces.read_trace_files([trace_file, str(collector_file)])
    assert [p for p in read.problems if p.file == str(collector_file)] == []  # vLLM's spans are no kvscope problem
    table = traces.requests_table(read.spans, read.vllm_requests)
    prompts = prompts_sharing_prefixes()
    for ids in sent.values():
        for prompt, trace_id in zip(prompts, ids):
            rows = table[table["trace_id"] == trace_id]
            assert len(rows) == 1, trace_id
            row = rows.iloc[0]
            assert row["lookups"] >= 1 and row["tokens_queried"] > 0, trace_id  # kvscope's lookup
            vllm = row[["vllm_key", "vllm_queue_ms", "vllm_ttft_ms", "vllm_e2e_ms", "vllm_prompt_tokens"]]
            assert vllm.notna().all(), (trace_id, vllm.to_dict())  # vLLM's span, joined, with its latencies
            assert row["vllm_prompt_tokens"] == len(prompt), trace_id  # vLLM's span of this very request
            assert 0 <= row["vllm_queue_ms"] and 0 < row["vllm_ttft_ms"] <= row["vllm_e2e_ms"], trace_id
    loading = table[table["trace_id"].isin(sent[1]) & (table["loads"] > 0)]
    assert len(loading) > 0
    assert loading["load_ms"].notna().all() and loading["vllm_ttft_ms"].notna().all()
    # the load ran between the request's arrival and its first token
    assert (loading["load_ms"] < loading["vllm_ttft_ms"]).all()
    # the Overview's split by host-tier outcome counts every traced request once, where it belongs
    traced = table[table["trace_id"].isin(set(sent[0]) | set(sent[1]))]
    by_outcome = traces.vllm_latency_by_outcome(traced).set_index("outcome")["requests"].to_dict()
    failed = int(traced["load_failed"].sum())
    expected = {"loaded from the host tier": int((traced["loads"] > 0).sum()) - failed,
                "no host-tier load": int((traced["loads"] == 0).sum()), "load failed (recomputed)": failed}
    assert by_outcome == {k: v for k, v in expected.items() if v}
    assert by_outcome["loaded from the host tier"] >= len(loading) and sum(by_outcome.values()) == len(traced)


# ---- the Grafana boards and Prometheus rules against this real server ----

@pytest.fixture
def prometheus_scraping_server(server, two_rounds, tmp_path_factory):
    """A real Prometheus scraping this server every second, with the rules loaded, while a
    background workload keeps hits, loads and stores flowing. Stopped after its test: a Ctrl-C
    while a keep-alive scrape connection or a workload request is open can leave the API server
    (uvicorn) waiting for it past any timeout, which is not what the Ctrl-C test checks."""
    from tests.dashboards.paths import RULE_FILES
    from tests.dashboards.promtools import PrometheusServer, fast_scrape_config, find_binary

    if find_binary("prometheus") is None:
        pytest.skip("prometheus is not installed (.ci/install-prometheus.sh installs it)")
    base, model, _, _ = server
    config = fast_scrape_config("vllm", base.removeprefix("http://"), RULE_FILES)
    prom = PrometheusServer(config, tmp_path_factory.mktemp("prometheus")).start()
    stop = threading.Event()
    prompts = prompts_sharing_prefixes()

    def workload():
        # shared prefixes (host-tier loads after each reset) with fresh tails (new blocks to store)
        i = 0
        while not stop.is_set():
            tail = [(i * 7919 + 13 * j) % 509 + 1 for j in range(200)]
            try:
                requests.post(base + "/v1/completions", timeout=60, json={
                    "model": model, "prompt": prompts[i % len(prompts)] + tail, "max_tokens": 2,
                    "temperature": 0})
                if i % len(prompts) == len(prompts) - 1:
                    requests.post(base + "/reset_prefix_cache", timeout=30)
            except requests.RequestException:
                pass
            i += 1

    thread = threading.Thread(target=workload, daemon=True)
    thread.start()
    try:
        yield prom
    finally:
        stop.set()
        thread.join(timeout=60)
        prom.stop()


def test_every_board_query_and_rule_returns_data_from_the_real_engine(prometheus_scraping_server):
    from tests.dashboards.paths import DASHBOARDS_DIR, RULES_DIR
    from tests.dashboards.promcheck import evaluate_board_queries, rule_health_failures

    variables = {"__rate_interval": "30s", "__interval": "5s", "__range": "5m",
                 "datasource": "prometheus", "model_name": ".*", "instance": ".*", "engine": ".*", "group": ".*"}
    # A wait for device KV room is observed only when a deferred load is admitted; these rounds may defer none.
    no_deferral = ("Wait for device KV room", "kvscope:load_deferral_wait_seconds:p")
    url = prometheus_scraping_server.url
    deadline = time.time() + 120
    failures = ["not evaluated"]
    while time.time() < deadline:
        failures = evaluate_board_queries(url, DASHBOARDS_DIR, RULES_DIR, variables, allow_empty=no_deferral)
        if not failures:
            break
        time.sleep(3)
    assert failures == [], "\n".join(failures) + "\n" + prometheus_scraping_server.log_tail()
    assert rule_health_failures(url) == []


def test_a_kv_aware_router_sees_the_host_tier_beside_the_device_blocks(server, two_rounds, kv_events):
    """What a router subscribed to the server's KV cache events learns: the host tier's blocks (medium
    CPU) of both groups, each described as vLLM described the device blocks of the same tokens; after a
    reset of the tier (`/reset_prefix_cache?reset_external=true`), none."""
    base, model, _, _ = server
    _, events = kv_events
    host = [e for e in list(events) if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert {e.group_idx for e in host} == {0, 1}
    assert {e.kv_cache_spec_kind for e in host} == {"sliding_window", "full_attention"}
    checked, unlike = host_blocks_unlike_device(list(events))
    assert checked >= len(host) and unlike == []
    assert router_view(list(events))
    deadline = time.time() + 60
    while not requests.post(base + "/reset_prefix_cache?reset_external=true", timeout=30).json()["success"]:
        assert time.time() < deadline, "the server never reset its caches"
        time.sleep(1)
    while router_view(list(events)):  # published with the next step
        assert time.time() < deadline, f"the tier's removals never came: {router_view(list(events))}"
        requests.post(base + "/v1/completions", timeout=60, json={
            "model": model, "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0})
        time.sleep(0.5)


# ---- last: Ctrl-C (it stops this module's server) ----

def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in live_processes().items():
        children.setdefault(ppid, []).append(pid)
    return children


def _descendants(pid: int) -> list[int]:
    children, found, todo = _children_by_parent(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def test_ctrl_c_stops_the_server_and_its_export_helper_and_loses_no_span(server, two_rounds):
    """A terminal's Ctrl-C (SIGINT to the whole process group, the export helper included) right
    after a request: the server exits, the helper drains and exits with it, and the request's spans
    are in the trace file, every line whole."""
    base, model, trace_file, proc = server
    helpers = [p for p in _descendants(proc.pid) if "connector.telemetry.export_process" in _cmdline(p)]
    assert helpers, "the engine's spans should go through the export helper process (the default)"
    trace_id = f"{0xC7:08x}{1:024x}"
    r = requests.post(base + "/v1/completions", timeout=120,
                      headers={"traceparent": f"00-{trace_id}-{0xC7:016x}-01"},
                      json={"model": model, "prompt": prompts_sharing_prefixes()[0], "max_tokens": 2,
                            "temperature": 0})
    assert r.status_code == 200, r.text
    os.killpg(proc.pid, signal.SIGINT)  # likely before the batcher's next export (every 0.2 s)
    proc.wait(timeout=120)
    deadline = time.time() + 60
    while any(_alive(p) for p in helpers) and time.time() < deadline:
        time.sleep(0.5)
    assert not any(_alive(p) for p in helpers), "the export helper outlived the server"
    names = set()
    with open(trace_file) as f:
        for line in f:  # a torn last line would not parse
            for rs in parse_json_line(line).resource_spans:
                for ss in rs.scope_spans:
                    names |= {span.name for span in ss.spans if span.trace_id.hex() == trace_id}
    assert "kvscope.lookup" in names


def test_vllms_spans_read_alike_from_the_collectors_binary_file_formats(two_rounds, otlp_sink, tmp_path):
    """The protobuf exports vLLM sent, framed as the Collector's file exporter frames them with `format: proto`
    (and `compression: zstd`), read as the same request spans as their OTLP/JSON lines."""
    import struct

    import zstandard

    from dashboard import traces

    sent, _, _ = two_rounds
    deadline = time.time() + 30  # vLLM's batch span processor exports every 5 s
    while not set(sent[0]) | set(sent[1]) <= _vllm_request_traces(otlp_sink.exports) and time.time() < deadline:
        time.sleep(1)
    exports = list(otlp_sink.exports)
    as_json = tmp_path / "vllm.jsonl"
    as_json.write_text("".join(_collector_json_line(e) for e in exports))
    wire = [e.SerializeToString() for e in exports]
    zstd = zstandard.ZstdCompressor()
    files = {"proto": b"".join(struct.pack(">I", len(w)) + w for w in wire),
             "proto+zstd": b"".join(struct.pack(">I", len(c)) + c for c in map(zstd.compress, wire))}
    expected = traces.read_trace_files([as_json]).vllm_requests.drop(columns=["source_file"])
    assert len(expected) >= len(sent[0]) + len(sent[1])
    for name, data in files.items():
        path = tmp_path / name
        path.write_bytes(data)
        read = traces.read_trace_files([path])
        assert read.problems == [], name
        got = read.vllm_requests.drop(columns=["source_file"])
        assert got.drop(columns=["attributes"]).equals(expected.drop(columns=["attributes"])), name
        assert list(got["attributes"]) == list(expected["attributes"]), name
