"""`vllm serve --data-parallel-size 2 --api-server-count 2`: two engines (each with its own kvscope
scheduler, worker and host tier) behind two API server processes, vLLM's scale-out on a multi-GPU
node. vLLM then gathers its metrics through Prometheus' multiprocess mode, one series per engine, and
the two engines write spans to one trace file. Every API server must show kvscope's counts alike,
per engine, equal to vLLM's own hits; the shared trace file must hold whole lines that add up to them."""

from __future__ import annotations

import os
import tempfile
import time
from collections import defaultdict

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from connector.telemetry.span_records import ENGINE_RESOURCE_ATTRIBUTE
from connector.telemetry.trace_file import parse_json_line
from connector.tiny_models import build_model

from .api_server import running_api_server
from .conftest import prompts_sharing_prefixes

pytestmark = pytest.mark.engine
SCRAPES = 10  # new connections each: the kernel spreads them over both API servers (SO_REUSEPORT)
COUNTERS = {"kvscope_hit_tokens_total": "vllm:external_prefix_cache_hits_total",
            "kvscope_lookup_tokens_total": "vllm:external_prefix_cache_queries_total"}


def _by_engine(text: str) -> dict[str, dict[str, float]]:
    """{sample name: {engine label: value summed over the other labels}}."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name][sample.labels.get("engine", "")] += sample.value
    return out


def _settled(text: str) -> bool:
    metrics = _by_engine(text)
    return sum(metrics["kvscope_loaded_blocks_total"].values()) > 0 and all(
        metrics[ours] == metrics[theirs] for ours, theirs in COUNTERS.items())


@pytest.fixture(scope="module")
def scaled_out():
    model = build_model("gemma3", window=64)
    folder = tempfile.mkdtemp(prefix="kvscope-scaleout-")
    trace_file = os.path.join(folder, "spans.jsonl")
    transfer = {"kv_connector": "KVScopeConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes": 64 << 20, "trace_file": trace_file}}
    args = ["--data-parallel-size", "2", "--api-server-count", "2"]
    with running_api_server(model, transfer, os.path.join(folder, "server.log"), args) as (base, _):
        prompts = prompts_sharing_prefixes()
        for round_ in (0, 1):
            for prompt in prompts:
                r = requests.post(base + "/v1/completions", timeout=120, json={
                    "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, r.text
            if round_ == 0:  # the second round must come from the host tiers
                assert requests.post(base + "/reset_prefix_cache", timeout=30).status_code == 200
        deadline = time.time() + 60  # until the last steps' stats have reached the metrics
        while not _settled(requests.get(base + "/metrics", timeout=30).text) and time.time() < deadline:
            time.sleep(2)
        scrapes = [requests.get(base + "/metrics", timeout=30).text for _ in range(SCRAPES)]
        # the spans of every request in the file while the server runs (its shutdown is not under test here)
        sent, deadline = 2 * len(prompts), time.time() + 60
        while not _all_written(trace_file, sent) and time.time() < deadline:
            time.sleep(1)
    yield scrapes, trace_file, sent


def _spans(trace_file: str) -> list:
    """Every span of the file, each with its resource's engine as `span.engine` (str, as the metric label)."""
    spans = []
    with open(trace_file) as f:
        for line in f:  # a torn or interleaved line fails to parse here
            for rs in parse_json_line(line).resource_spans:
                engine = next((str(a.value.int_value) for a in rs.resource.attributes
                               if a.key == ENGINE_RESOURCE_ATTRIBUTE), None)
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        spans.append(_EngineSpan(span, engine))
    return spans


class _EngineSpan:
    """A protobuf span and the engine its resource names."""

    def __init__(self, span, engine: str | None):
        self.span, self.engine = span, engine

    def __getattr__(self, name):
        return getattr(self.span, name)


def _all_written(trace_file: str, sent: int) -> bool:
    """Every request's lookup span, and a copy span in each load's trace."""
    try:
        spans = _spans(trace_file)
    except (OSError, ValueError):  # not written yet, or a line half read while it is written
        return False
    copied = {s.trace_id for s in spans if s.name == "kvscope.group.copy"}
    return (sum(s.name == "kvscope.lookup" for s in spans) >= sent
            and all(s.trace_id in copied for s in spans if s.name == "kvscope.load"))


def test_every_api_server_shows_each_engines_counts_once(scaled_out):
    scrapes, _, _ = scaled_out
    first = _by_engine(scrapes[0])
    assert set(first["kvscope_hit_tokens_total"]) == {"0", "1"}  # one series per engine
    assert sum(first["kvscope_hit_tokens_total"].values()) > 0
    assert sum(first["kvscope_copy_duration_seconds_count"].values()) > 0
    ours = {name: values for name, values in first.items() if name.startswith("kvscope_")}
    for text in scrapes:
        metrics = _by_engine(text)
        for name, vllms in COUNTERS.items():  # per engine, as vLLM counts its external prefix-cache hits
            assert metrics[name] == metrics[vllms], name
        for engine, hit in metrics["kvscope_hit_tokens_total"].items():
            assert hit <= metrics["kvscope_lookup_tokens_total"][engine]
        # the same counts from either API server: not one copy per server, none missing
        assert {name: values for name, values in metrics.items() if name.startswith("kvscope_")} == ours


def test_both_engines_write_whole_lines_to_one_trace_file_that_add_up(scaled_out):
    scrapes, trace_file, requests_sent = scaled_out
    spans = _spans(trace_file)

    def attribute(span, key):
        return next(a.value.int_value for a in span.attributes if a.key == key)

    lookups = [s for s in spans if s.name == "kvscope.lookup"]
    assert len(lookups) == requests_sent  # every request looked up once, by the engine it ran on
    assert {s.engine for s in spans} == {"0", "1"}  # every span names its engine, as the metrics do
    hits = _by_engine(scrapes[0])["kvscope_hit_tokens_total"]
    assert sum(hits.values()) > 0
    for engine in ("0", "1"):  # each engine's spans add up to its own hit metric
        assert sum(attribute(s, "kvscope.tokens.hit") for s in lookups if s.engine == engine) == hits[engine]
    loads = [s for s in spans if s.name == "kvscope.load"]
    assert len(loads) == sum(1 for s in lookups if attribute(s, "kvscope.tokens.hit") > 0)
    for load in loads:
        assert [s for s in spans if s.name == "kvscope.group.copy" and s.trace_id == load.trace_id]


def test_the_replay_app_tells_each_engines_requests_apart(scaled_out):
    """The replay app reads the shared file: every request under the engine that ran it, whose hits
    add up to that engine's metric."""
    from dashboard import traces

    scrapes, trace_file, requests_sent = scaled_out
    read = traces.read_trace_files([trace_file])
    requests = traces.requests_table(read.spans)
    assert len(requests) == requests_sent and requests["engine"].notna().all()
    assert traces.engines_of(requests) == [0, 1]
    hits = _by_engine(scrapes[0])["kvscope_hit_tokens_total"]
    for engine in (0, 1):
        assert traces.search_requests(requests, "", engine=engine)["tokens_hit"].sum() == hits[str(engine)]
