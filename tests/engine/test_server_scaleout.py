"""`vllm serve --api-server-count 2`: two API server processes in front of one engine (vLLM's scale-out
for busy front ends, and its default under data parallelism). vLLM then gathers its metrics through
Prometheus' multiprocess mode and hands engine stats to one API server only; kvscope's metrics ride
that path, so every API server must show them alike: counted once, equal to vLLM's own hits."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from connector.tiny_models import build_model

from .api_server import running_api_server
from .conftest import prompts_sharing_prefixes

pytestmark = pytest.mark.engine
SCRAPES = 10  # new connections each: the kernel spreads them over both servers (SO_REUSEPORT)


def _totals(text: str) -> dict[str, float]:
    """Sum of each family's samples (`_total`/`_count` kept apart), e.g. {"kvscope_hit_tokens_total": 2816.0}."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


@pytest.fixture(scope="module")
def scrapes():
    model = build_model("gemma3", window=64)
    folder = tempfile.mkdtemp(prefix="kvscope-scaleout-")
    transfer = {"kv_connector": "KVScopeConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes": 64 << 20}}
    with running_api_server(model, transfer, os.path.join(folder, "server.log"),
                            ["--api-server-count", "2"]) as (base, _):
        prompts = prompts_sharing_prefixes()
        for round_ in (0, 1):
            for prompt in prompts:
                r = requests.post(base + "/v1/completions", timeout=120, json={
                    "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, r.text
            if round_ == 0:  # the second round must come from the host tier
                assert requests.post(base + "/reset_prefix_cache", timeout=30).status_code == 200
        deadline = time.time() + 60  # until the last step's stats have reached the metrics
        while True:
            totals = _totals(requests.get(base + "/metrics", timeout=30).text)
            if totals.get("kvscope_loaded_blocks_total") and totals.get("kvscope_hit_tokens_total") == totals.get(
                    "vllm:external_prefix_cache_hits_total") or time.time() > deadline:
                break
            time.sleep(2)
        yield [requests.get(base + "/metrics", timeout=30).text for _ in range(SCRAPES)]


def test_every_api_server_shows_kvscopes_metrics_counted_once(scrapes):
    first = _totals(scrapes[0])
    assert first["kvscope_hit_tokens_total"] > 0 and first["kvscope_loaded_blocks_total"] > 0
    assert first["kvscope_copy_duration_seconds_count"] > 0
    for text in scrapes:
        totals = _totals(text)
        # hits and lookups as vLLM counts its external prefix-cache hits and queries, on every server
        assert totals["kvscope_hit_tokens_total"] == totals["vllm:external_prefix_cache_hits_total"]
        assert totals["kvscope_lookup_tokens_total"] == totals["vllm:external_prefix_cache_queries_total"]
        assert totals["kvscope_hit_tokens_total"] <= totals["kvscope_lookup_tokens_total"]
        # the same counts from either server: one engine's stats, not one copy per API server
        assert {k: v for k, v in totals.items() if k.startswith("kvscope_")} == {
            k: v for k, v in first.items() if k.startswith("kvscope_")}
        hit_series = [s for f in text_string_to_metric_families(text) for s in f.samples
                      if s.name == "kvscope_hit_tokens_total"]
        assert [s.labels["engine"] for s in hit_series] == ["0"]
