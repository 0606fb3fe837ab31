"""Trace files written under vLLM's own scheduler, read back by the dashboard: what a replay shows
for loads that failed on a worker, requests sharing one upstream trace, and requests that load twice."""

from __future__ import annotations

import time

import pytest

from connector.tiny_models import build_model
from dashboard import traces
from tests.compat.model_free import ModelFreeEngine
from tests.compat.test_vllm_scheduler_loop import WINDOW, _assert_no_violations, _prompts
from tests.unit.test_store_planning import ROOMY_KV_CACHE_MANAGER

SHARED_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(scope="module")
def model_path() -> str:
    return build_model("gemma3", window=WINDOW)


def _traced_rounds(model_path, trace_file, *, workers=1, failing_rank=None, num_blocks=1200,
                   max_num_batched_tokens=2048, headers=None, max_tokens=2):
    """Round 0 stores, the device cache is reset, round 1 sends the same prompts (with `headers`);
    returns the loop's stats and the dashboard's (spans, requests) of the trace file."""
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 64, "trace_file": str(trace_file)},
                             window=WINDOW, workers=workers, num_blocks=num_blocks,
                             max_num_batched_tokens=max_num_batched_tokens)
    try:
        prompts = _prompts()
        for j, prompt in enumerate(prompts):
            engine.add(f"r0-{j}", prompt)
        engine.run()
        engine.reset_device_prefix_cache()
        if failing_rank is not None:
            engine.workers[failing_rank]._worker.fail_all_loads = True
        for j, prompt in enumerate(prompts):
            engine.add(f"r1-{j}", prompt, max_tokens, trace_headers=headers)
        engine.run()
    finally:
        engine.shutdown()  # flushes every connector's spans
    read = traces.read_trace_files([trace_file])
    assert not read.problems
    return engine.stats, read.spans, traces.requests_table(read.spans)


@pytest.fixture(autouse=True)
def _export_in_process(monkeypatch):
    monkeypatch.setenv("KVSCOPE_TRACE_EXPORT", "thread")  # no helper process per connector


def test_a_load_that_failed_on_one_worker_is_marked_failed_not_timed(model_path, tmp_path):
    stats, spans, requests = _traced_rounds(model_path, tmp_path / "t.jsonl", workers=2, failing_rank=1)
    _assert_no_violations(stats)
    loaded = requests[requests["loads"] > 0]
    assert set(loaded["request_id"]) == {r for r in stats.loads if r.startswith("r1-")}
    assert loaded["load_failed"].all() and loaded["load_ms"].isna().all()
    errors = spans[(spans["name"] == traces.COPY) & (spans["status_code"] == 2)]
    assert set(errors["worker_rank"]) == {1} and (errors["copy_bytes"] == 0).all()
    # rank 0 really copied: its bytes count, as in kvscope_load_bytes_total
    assert (loaded["bytes_loaded"] > 0).all()
    numbers = traces.overview_numbers(requests, spans)
    assert numbers["requests_load_failed"] == len(loaded) and numbers["loads_timed"] == 0


def test_requests_sharing_one_upstream_trace_each_show_only_their_own_spans(model_path, tmp_path):
    stats, spans, requests = _traced_rounds(model_path, tmp_path / "t.jsonl",
                                            headers={"traceparent": SHARED_TRACEPARENT})
    round1 = requests[requests["request_id"].str.startswith("r1-")]
    assert (round1["trace_id"] == SHARED_TRACEPARENT.split("-")[1]).all() and len(round1) == 4
    assert not round1["load_failed"].any() and (round1["load_ms"] > 0).all()
    for req_id in round1["request_id"]:
        rows = traces.waterfall_rows(spans, requests, req_id)
        own = spans[spans["span_id"].isin(rows["span_id"])]
        assert set(own["request_id"].dropna()) == {req_id}, req_id
        assert rows["kind"].tolist().count("lookup") == 1 and rows["kind"].tolist().count("load") == 1


def test_a_request_that_loads_again_after_preemption_sums_its_loads(tmp_path):
    """vLLM resumes a preempted request with a new lookup and load (traced under its first lookup,
    not counted as a hit again): the replay sums its loads' times and takes its tokens from the
    first. The scheduler and the trace file are kvscope's own; the copies are recorded as a worker
    records them, at chosen times."""
    from types import SimpleNamespace

    from connector.groups import GroupKind, GroupLayout
    from connector.scheduler import KVScopeScheduler
    from connector.telemetry.span_records import COPY_SPAN
    from connector.telemetry.tracing import KVScopeTracing

    path = tmp_path / "t.jsonl"
    tracing = KVScopeTracing.from_config(str(path), 1.0)
    layouts = [GroupLayout(0, GroupKind.FULL_ATTENTION, 16)]
    sched = KVScopeScheduler(layouts, offload_block_size=32, hash_block_size=16, num_slots=64, slot_bytes=1024,
                             world_size=1, tracing=tracing, kv_cache_manager_getter=lambda: ROOMY_KV_CACHE_MANAGER)
    request = SimpleNamespace(request_id="r1", num_tokens=200, num_computed_tokens=0, num_preemptions=0,
                              block_hashes=[f"h{i}" for i in range(12)], trace_headers=None)
    for k, h in enumerate(sched._offload_hashes(request)):
        sched.index.reserve_for_store((0, h))
        sched.index.complete_store((0, h))
    blocks = SimpleNamespace(get_block_ids=lambda: ([100 + i for i in range(13)],))
    copy_ms = []
    for resumed, (local, ms) in enumerate([(0, 5.0), (64, 2.0)]):  # the first load, then the resumed one
        request.num_preemptions = resumed
        external, _ = sched.get_num_new_matched_tokens(request, local)
        sched.update_state_after_alloc(request, blocks, external)
        job = sched._pending_loads.pop()
        start = time.time_ns()
        tracing.record(COPY_SPAN, tracing.parent_from_carrier(job.trace_carrier), start, start + int(ms * 1e6),
                       (0, "full_attention", "load", 4, 4096, 0, "r1"))
        copy_ms.append(ms)
    tracing.shutdown()
    read = traces.read_trace_files([path])
    requests = traces.requests_table(read.spans)
    (row,) = requests.itertuples(index=False)
    per_load = traces.load_rows(read.spans)
    assert row.loads == 2 and row.lookups == 1 and not row.load_failed
    assert row.tokens_external == 192 and row.tokens_local == 0  # the first load's, which its hit planned
    assert row.tokens_hit == 192  # the resumed load is no second hit
    assert row.load_ms == pytest.approx(per_load["load_ms"].sum()) and row.load_ms > sum(copy_ms)
    assert row.bytes_loaded == 2 * 4096
    # "only hits or loads" keeps a request that loaded, even with no hit
    no_hit = requests.assign(tokens_hit=0)
    assert len(traces.search_requests(no_hit, "", show="hits or loads")) == 1


def test_failed_copies_stay_out_of_copy_latency_and_throughput(model_path, tmp_path):
    """A failed copy's span (status ERROR, no bytes, no time) is no copy: the latency quantiles,
    copy counts and throughput cover the copies that ran."""
    _, spans, requests = _traced_rounds(model_path, tmp_path / "t.jsonl", workers=2, failing_rank=1)
    ran = spans[(spans["name"] == traces.COPY) & (spans["status_code"] != 2) & (spans["copy_direction"] == "load")]
    quantiles = traces.load_latency_quantiles(spans, requests).set_index("scope")
    copy_rows = quantiles[quantiles.index.str.startswith("copy")]
    assert copy_rows["count"].sum() == len(ran) > 0
    throughput = traces.copy_throughput(spans)
    assert throughput.loc[throughput["direction"] == "load", "copies"].sum() == len(ran)


def test_failed_loads_count_no_blocks_loaded_per_group(model_path, tmp_path):
    """As kvscope_loaded_blocks_total: blocks whose load failed reached no request."""
    _, spans, _ = _traced_rounds(model_path, tmp_path / "t.jsonl", workers=2, failing_rank=1)
    skip = traces.null_skip_by_group(spans)
    assert (skip["blocks_loaded"] == 0).all() and (skip["blocks_scanned"] > 0).all()
