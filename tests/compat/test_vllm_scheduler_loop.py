"""KVScopeConnector under vLLM's own scheduler and connector lifecycle, with a fake forward pass.

No model runs, so this needs no vLLM platform build: the same tests run against the installed vLLM
(0.32, CPU build) and against vLLM 0.33's and 0.34's own sources (`scripts/dev compat`, called by CI),
where no engine can start. Every forward checks that the KV its new tokens attend to is what an earlier
forward wrote for the same prefix (`model_free`): loads from the host tier must reproduce it block
for block, in each KV group, with the sliding window's null blocks skipped.
"""

from __future__ import annotations

import inspect
import json
import secrets
from collections import defaultdict
from unittest import mock

import pytest
from vllm.config import SchedulerConfig
from vllm.v1.request import RequestStatus
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

from connector.telemetry.testing import proto_span_attributes, trace_file_spans
from connector.tiny_models import build_model
from connector.worker import FENCE_AT_NEXT_STEP, FENCE_AT_ONCE, FENCE_WHEN_REUSED
from tests.compat.model_free import (HAS_V1_RUNNER, ModelFreeEngine, create_engine_config, loaded_blocks_by_group,
                                     without_load_admission)
from tests.compat.stall_scenarios import WINDOW, store_round, three_loads_past_their_reserve, two_failing_loads

# vLLM 0.34 has no V1 runner ("v1" then drives its CPU runner): fence placements only V1's order allows
_V1_RUNNER = pytest.mark.skipif(not HAS_V1_RUNNER, reason="this vLLM has no V1 model runner (0.34 on)")
# The V2 runner with speculative decoding runs the stores after the step's results: vLLM 0.33 on
_DEFERRED_FINALIZE = pytest.mark.skipif(
    "defer_finalize" not in inspect.signature(ActiveKVConnector.post_forward).parameters,
    reason="this vLLM's V2 runner has no deferred finalize (speculative decoding)")
V2_RUNNERS = ["v2", pytest.param("v2-spec", marks=_DEFERRED_FINALIZE)]


def _prompts() -> list[list[int]]:
    """Four prompts with a shared 300-token prefix and distinct suffixes (lengths not block multiples)."""
    shared = [(31 * i + 3) % 509 + 1 for i in range(300)]
    return [shared + [(17 * i + 11 * j + 5) % 509 + 1 for i in range(150 + 97 * j)] for j in range(4)]


@pytest.fixture(scope="module")
def model_path() -> str:
    return build_model("gemma3", window=WINDOW)


def _two_rounds(*args, **kwargs):
    """`_two_rounds_and_round0_hits`'s stats."""
    return _two_rounds_and_round0_hits(*args, **kwargs)[0]


def _two_rounds_and_round0_hits(model_path: str, block_size: int, max_num_batched_tokens: int, num_blocks: int = 1200,
                                max_tokens: int = 2, workers: int = 1, failing_rank: int | None = None,
                                async_scheduling: bool = False, runner: str = "v1",
                                parallel_overrides: dict | None = None):
    """Round 0 computes and stores; the device prefix cache is reset; round 1 sends the same prompts
    (with every load on `failing_rank` failing, when given). The stats, and round 0's host hit tokens
    (`store_round`)."""
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": block_size}, window=WINDOW,
                             num_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens, workers=workers,
                             async_scheduling=async_scheduling, runner=runner,
                             parallel_overrides=parallel_overrides)
    try:
        prompts = _prompts()
        round0_hits = store_round(engine, prompts, max_tokens)
        if failing_rank is not None:
            engine.workers[failing_rank]._worker.fail_all_loads = True
        for j, prompt in enumerate(prompts):
            engine.add(f"r1-{j}", prompt, max_tokens)
        engine.run()
        assert engine.host_tier_leaks() == []
    finally:
        engine.shutdown()
    return engine.stats, round0_hits


def _assert_no_violations(stats, loads: bool = True) -> None:
    """Every block a forward read held the right KV; with `loads`, some of them came from the host
    tier (blocks its forwards re-read of their own KV always count, so the check needs both)."""
    assert stats.checked_blocks > 0
    assert stats.checked_loaded_blocks > 0 or not loads, "no forward read a block a load filled"
    shown = "\n".join(map(str, stats.violations[:10]))
    assert not stats.violations, f"{len(stats.violations)} blocks read wrong KV:\n{shown}"


@pytest.mark.parametrize(
    "block_size, max_num_batched_tokens, num_blocks, max_tokens, async_scheduling",
    [
        (16, 2048, 1200, 2, False),  # one device block per offloaded block, whole prompts in one step
        (64, 100, 1200, 2, False),  # four per offloaded block, 100-token steps: chunk ends inside offloaded blocks
        (64, 2048, 180, 64, False),  # decoding outgrows the device cache: vLLM preempts a request and resumes it
        # vLLM's default on GPUs: each step scheduled before the previous one's output is in
        (16, 2048, 1200, 8, True),
        (64, 100, 1200, 8, True),
        (64, 2048, 180, 64, True),
    ],
    ids=["bs16-one-step", "bs64-chunked", "bs64-preempting",
         "async-bs16-one-step", "async-bs64-chunked", "async-bs64-preempting"],
)
def test_loads_give_the_forward_the_kv_it_wrote(model_path, block_size, max_num_batched_tokens, num_blocks,
                                                max_tokens, async_scheduling):
    stats = _two_rounds(model_path, block_size, max_num_batched_tokens, num_blocks, max_tokens,
                        async_scheduling=async_scheduling)
    _assert_loads_right(stats, num_blocks, async_scheduling)


@pytest.mark.parametrize("runner", V2_RUNNERS)
@pytest.mark.parametrize(
    "block_size, max_num_batched_tokens, num_blocks, max_tokens, async_scheduling",
    [(64, 100, 1200, 2, False), (16, 2048, 1200, 8, True), (64, 2048, 180, 64, True)],
    ids=["bs64-chunked", "async-bs16-one-step", "async-bs64-preempting"],
)
def test_the_v2_model_runner_gets_the_kv_it_wrote_too(model_path, block_size, max_num_batched_tokens, num_blocks,
                                                      max_tokens, async_scheduling, runner):
    """vLLM's V2 model runner (its default on GPUs) calls the connector's hooks in another order:
    loads start after the forward and the sampling, stores run after the sampling (with speculative
    decoding, after the step's results are taken). Loads are still right, reported and counted."""
    stats = _two_rounds(model_path, block_size, max_num_batched_tokens, num_blocks, max_tokens,
                        async_scheduling=async_scheduling, runner=runner)
    _assert_loads_right(stats, num_blocks, async_scheduling)


def _assert_loads_right(stats, num_blocks: int, async_scheduling: bool) -> None:
    _assert_no_violations(stats)
    assert bool(stats.resumed) == (num_blocks < 1000), stats.resumed
    assert bool(stats.scheduled_ahead) == async_scheduling
    round1 = [f"r1-{j}" for j in range(4)]
    loading = [r for r in round1 if r in stats.loads]
    assert loading, "round 1 loaded nothing from the host tier"
    assert set(loading) <= stats.finished_recving and not stats.failed_recving
    assert stats.external_hit_tokens > 0  # vLLM's own count of the tokens the connector served
    # group 0 is the sliding window: only the blocks inside the window at the hit are loaded
    round1_loaded = loaded_blocks_by_group(stats, round1)
    assert 0 < round1_loaded.get(0, 0) < round1_loaded[1], round1_loaded
    # kvscope's own stats, through vLLM's stats path, agree with vLLM and with what was loaded (in
    # round 0 too: vLLM's device cache keeps no window block where a prompt's shared prefix ends)
    loaded = loaded_blocks_by_group(stats, stats.loads)
    data = stats.connector.data
    assert data["hit_tokens"] == stats.external_hit_tokens
    assert data["loaded_blocks"] == {"0|sliding_window": loaded[0], "1|full_attention": loaded[1]}
    assert data["copy_blocks"]["0|sliding_window|load"] == loaded[0]
    assert data["copy_blocks"]["1|full_attention|load"] == loaded[1]
    assert data["null_blocks_skipped"]["0|sliding_window"] > 0
    assert data["null_blocks_skipped"].get("1|full_attention", 0) == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_request_resumed_after_preemption_counts_its_host_hits_once_as_vllm_does(model_path, async_scheduling):
    """vLLM preempts requests that loaded from the host tier (or stored to it) and looks them up again
    when it resumes them; its external prefix-cache hits count only a request's first scheduling.
    kvscope's hit and lookup tokens must too (they counted the resumed lookups as well, +832 hits)."""
    stats = _two_rounds(model_path, 64, 100, num_blocks=150, max_tokens=200, async_scheduling=async_scheduling)
    _assert_no_violations(stats)
    # a request resumed with a hit: in round 0 (its own stored blocks) or round 1
    assert stats.resumed & set(stats.loads), (stats.resumed, sorted(stats.loads))
    data = stats.connector.data
    assert data["hit_tokens"] == stats.external_hit_tokens > 0
    assert data["lookup_tokens"] == stats.external_queried_tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_request_asking_for_prompt_logprobs_loads_nothing_and_its_lookup_counts_as_vllms_query(
        model_path, async_scheduling):
    """vLLM reads no cached KV for a request that asks for prompt logprobs (it computes them only for tokens
    it computes: `skip_reading_prefix_cache`). It still asks the connector, then takes none of the hit. kvscope
    must plan no load for it, and count its lookup as vLLM counts the query: hit 0, the whole hit it found
    missed as `not_taken`. Its KV is stored as any other's: the same prompts without prompt logprobs load."""
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 64}, window=WINDOW,
                             max_num_batched_tokens=2048, async_scheduling=async_scheduling)
    try:
        prompts = _prompts()
        store_round(engine, prompts)
        queried = engine.stats.external_queried_tokens
        for j, prompt in enumerate(prompts):
            engine.add(f"r1-{j}", prompt, 2, prompt_logprobs=1)
        engine.run()
        data = engine.stats.connector.data
        assert not engine.stats.loads and engine.stats.external_hit_tokens == data.get("hit_tokens", 0) == 0
        # no device hit either: vLLM queried the whole prompts
        assert engine.stats.external_queried_tokens - queried == sum(map(len, prompts))
        assert data["lookup_tokens"] == engine.stats.external_queried_tokens
        # round 1's lookups found every whole offloaded block of round 0's prompts, and vLLM took none
        assert data["missed_tokens"]["not_taken"] == sum(len(p) // 64 * 64 for p in prompts)
        assert engine.telemetry_mismatches() == []
        engine.reset_device_prefix_cache()
        for j, prompt in enumerate(prompts):
            engine.add(f"r2-{j}", prompt, 2)
        engine.run()
        assert {f"r2-{j}" for j in range(len(prompts))} <= engine.stats.loads.keys()
        assert engine.host_tier_leaks() == [] and engine.telemetry_mismatches() == []
    finally:
        engine.shutdown()
    _assert_no_violations(engine.stats)


@pytest.mark.parametrize("kv_events", [False, True], ids=["events-off", "events-on"])
def test_a_paused_engine_that_cleared_its_caches_can_release_its_kv_memory(model_path, kv_events):
    """An RL loop pauses generation with `clear_cache=True` (vLLM resets its caches, the host tier with
    them), then releases the KV cache memory, which vLLM allows only with no work left
    (`EngineCore.release_kv_cache_memory`): the tier's reset must leave none (its events and the emptied
    tier's gauges go out with the next step)."""
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.engine.core import EngineCore

    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20}, window=WINDOW, kv_events=kv_events)
    sched = engine.scheduler
    released = []
    core = mock.Mock(scheduler=sched, batch_queue=None, model_executor=mock.Mock(is_sleeping=False))
    core.is_scheduler_paused = lambda: sched.pause_state != PauseState.UNPAUSED
    core._reset_caches = lambda **how: released.append("caches")  # 0.34 says `reset_connector=`
    try:
        engine.add("r0", [(7 * i + 3) % 509 + 1 for i in range(600)], 4)
        engine.run()
        assert engine.stats.connector.data["host_used_bytes"] > 0
        sched.set_pause_state(PauseState.PAUSED_ALL)  # as `_finish_pause(clear_cache=True)`, then its reset
        assert sched.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
        EngineCore.release_kv_cache_memory(core)  # vLLM's own check: raises with work left
        assert released == ["caches"]
        sched.set_pause_state(PauseState.UNPAUSED)
        engine.step_once()  # the next step publishes the emptied tier
        assert engine.stats.connector.data["host_used_bytes"] == 0
        if kv_events:
            assert not engine.kv_event_mismatches()
    finally:
        engine.shutdown()


def test_a_misplaced_load_is_caught(model_path, monkeypatch):
    """The check can fail: loads whose destination blocks are reversed within each group feed the
    forward KV of other positions, and the model-free loop reports it."""
    from connector import scheduler as scheduler_module

    real = scheduler_module.GroupTransfer

    def reversed_destinations(group_index, block_ids, slots, subs):
        return real(group_index, list(reversed(block_ids)), slots, subs)

    monkeypatch.setattr(scheduler_module, "GroupTransfer", reversed_destinations)
    stats = _two_rounds(model_path, 16, 2048)
    assert any(r.startswith("r1-") for r in stats.loads)
    assert stats.violations, "reversed load destinations went unnoticed"
    assert all(v.req_id.startswith("r1-") for v in stats.violations)


def test_two_workers_load_their_own_shards(model_path):
    """Tensor parallel: each worker loads its own shard, and a load is done when vLLM's
    `KVOutputAggregator` has it from both."""
    stats = _two_rounds(model_path, 64, 100, workers=2)
    _assert_no_violations(stats)
    round1 = [f"r1-{j}" for j in range(4)]
    loading = [r for r in round1 if r in stats.loads]
    assert loading and set(loading) <= stats.finished_recving and not stats.failed_recving
    data = stats.connector.data
    loaded = loaded_blocks_by_group(stats, stats.loads)  # round 0's loads too (`store_round`)
    assert data["loaded_blocks"] == {"0|sliding_window": loaded[0], "1|full_attention": loaded[1]}
    # copies are counted per worker
    assert data["copy_blocks"]["1|full_attention|load"] == 2 * loaded[1]


def test_a_data_parallel_rank_of_the_external_launcher_loads_what_its_worker_stored(model_path):
    """torchrun-style data parallel, one GPU a rank: vLLM's `world_size` counts every rank, but each
    rank's scheduler hears its own worker only (no output aggregator). Jobs waiting for `world_size`
    reports would never end: no block ready, no hit, host slots and job state held for ever."""
    launcher = {"distributed_executor_backend": "external_launcher", "data_parallel_size": 2, "world_size": 2}
    stats = _two_rounds(model_path, 64, 100, parallel_overrides=launcher)
    _assert_no_violations(stats)
    assert stats.external_hit_tokens > 0 and any(r.startswith("r1-") for r in stats.loads)


def test_known_vllm_gap_async_loads_admitted_past_their_reserve_stall_the_scheduler(model_path, monkeypatch):
    """Under device-KV pressure vLLM (0.32 to 0.34) admits three async loads, then the first one's
    next chunk needs more blocks than are free (its sliding-window group needs blocks for the whole
    chunk, not only its window: more than the admission estimate counts); its full-sequence check compares one
    request's need with all free blocks, the other loads' reserve is taken off the load's own blocks
    only. With nothing running nothing can be preempted, and the requests wait for ever (README).
    kvscope defers such loads (`load_admission`, the next test); without that the loads' part is sound:
    every load finished, no job is left. This pins vLLM's behaviour: when it fails, vLLM changed it and
    the README can say so."""
    without_load_admission(monkeypatch)
    engine = three_loads_past_their_reserve(model_path)
    try:
        with pytest.raises(AssertionError, match="still unfinished"):
            engine.run(max_steps=200)
        scheduler = engine.scheduler
        assert not scheduler.running and not engine.scheduler.get_kv_connector()._scheduler.has_unreported_jobs()
        assert set(engine.stats.finished_recving) >= {"r1-0", "r1-1", "r1-2"} and not engine.stats.failed_recving
        stuck = sorted(r.request_id for r in scheduler.requests.values())
        assert stuck == ["r1-0", "r1-1", "r1-2"]
        needed = sum(scheduler._request_remaining_blocks(r) for r in scheduler.requests.values())
        assert needed > scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    finally:
        engine.shutdown()


def test_known_vllm_gap_a_failed_load_at_the_head_of_the_queue_stalls_the_loads_behind_it(model_path, monkeypatch):
    """Two async loads admitted in one step both fail (a copy error). vLLM frees the first request's
    blocks and sends it back to waiting, but it stays first in the queue of requests holding KV; its
    prefill (the sliding-window group needs blocks for the whole chunk) needs more blocks than are
    free while the second request, behind it, still holds its load's blocks, and vLLM stops at the
    first request it cannot admit: the second one's failure is never taken, its blocks never freed,
    and both wait for ever (README). kvscope defers the second load (`load_admission`, the next test);
    without that kvscope's part is done: both loads were reported, no job is left, no host block stays
    pinned. This pins vLLM's behaviour (0.32 to 0.34): when it fails, vLLM changed it and the README
    can say so."""
    without_load_admission(monkeypatch)
    engine = two_failing_loads(model_path)
    try:
        with pytest.raises(AssertionError, match="still unfinished"):
            engine.run(max_steps=200)
        scheduler = engine.scheduler
        assert not scheduler.running and not scheduler.get_kv_connector()._scheduler.has_unreported_jobs()
        assert engine.stats.failed_recving == {"r1-0", "r1-1"}
        assert engine.host_tier_leaks() == []
        head, behind = scheduler.requests["r1-0"], scheduler.requests["r1-1"]
        assert head.status.name == "WAITING" and not any(scheduler.kv_cache_manager.get_block_ids("r1-0"))
        assert behind.status.name == "WAITING_FOR_REMOTE_KVS" and any(scheduler.kv_cache_manager.get_block_ids("r1-1"))
        assert "r1-1" in scheduler.finished_recving_kv_req_ids  # reported, never taken
    finally:
        engine.shutdown()


@pytest.mark.parametrize("scenario", ["past-their-reserve", "failing"])
def test_kvscope_defers_the_loads_that_would_stall_vllm_and_every_request_finishes(model_path, tmp_path, scenario):
    """Both stalls above, with kvscope's load admission: a load whose request, beside those whose loads
    vLLM has not yet run, could need more blocks than the device cache has waits for them to run
    (vLLM asks again each step). Every request finishes, loads still serve hits (or fail cleanly), the
    forward reads what was written and the tier holds nothing after. Each deferred request's lookup
    span says how many lookups it waited (`kvscope.deferred.*`), and no other span does."""
    build = three_loads_past_their_reserve if scenario == "past-their-reserve" else two_failing_loads
    trace_file = tmp_path / "spans.jsonl"
    engine = build(model_path, trace_file=trace_file)
    deferred = []
    kvscope = engine.scheduler.get_kv_connector()._scheduler
    may_start = kvscope.admission.may_start

    def noted(req_id, *args):
        started = may_start(req_id, *args)
        if not started:
            deferred.append(req_id)
        return started

    kvscope.admission.may_start = noted
    try:
        engine.run(max_steps=200)
        assert engine.host_tier_leaks() == []
    finally:
        engine.shutdown()  # flushes the spans to the file
    assert deferred  # the scenario still meets the pressure
    lookups = [s["attrs"] for spans in _spans_by_trace(trace_file).values() for s in spans
               if s["name"] == "kvscope.lookup"]
    waits = {a["kvscope.request.id"]: (a["kvscope.deferred.lookups"], a["kvscope.deferred.wait_us"])
             for a in lookups if "kvscope.deferred.lookups" in a}
    assert {req_id: lookups for req_id, (lookups, _) in waits.items()} == {
        req_id: deferred.count(req_id) for req_id in deferred}
    assert all(wait_us > 0 for _, wait_us in waits.values())
    _assert_no_violations(engine.stats, loads=scenario != "failing")
    if scenario == "failing":
        assert engine.stats.failed_recving
    else:
        assert engine.stats.external_hit_tokens > 0 and not engine.stats.failed_recving


_INFLIGHT_KV_LOADS = pytest.mark.skipif(
    "max_num_inflight_kv_loads" not in SchedulerConfig.__dataclass_fields__,
    reason="this vLLM has no --max-num-inflight-kv-loads (0.34 on)")


@_INFLIGHT_KV_LOADS
@pytest.mark.parametrize("scenario, cap, finishes", [
    ("past-their-reserve", 1, True), ("past-their-reserve", 2, True), ("past-their-reserve", 3, False),
    ("failing", 1, True), ("failing", 2, False),
])
def test_one_async_load_in_flight_avoids_both_known_stalls(model_path, monkeypatch, scenario, cap, finishes):
    """vLLM 0.34's `--max-num-inflight-kv-loads N` caps the requests holding blocks for an async
    load (kvscope's loads are all async). Alone (kvscope's load admission off), at 1 both stalls
    above are gone: each load's request runs before the next is admitted; every load finishes or
    fails cleanly and the forward reads what was written. At 2 the first stall is gone, not the
    second; at 3 neither (README)."""
    without_load_admission(monkeypatch)
    build = three_loads_past_their_reserve if scenario == "past-their-reserve" else two_failing_loads
    engine = build(model_path, engine_args={"max_num_inflight_kv_loads": cap})
    try:
        if finishes:
            engine.run(max_steps=200)
        else:
            with pytest.raises(AssertionError, match="still unfinished"):
                engine.run(max_steps=200)
            return
        assert engine.host_tier_leaks() == []
    finally:
        engine.shutdown()
    # the failed loads' requests recompute, so no forward reads a loaded block there
    _assert_no_violations(engine.stats, loads=scenario != "failing")
    if scenario == "failing":
        assert engine.stats.failed_recving
    else:
        assert engine.stats.external_hit_tokens > 0 and not engine.stats.failed_recving


def _load_beside_a_full_batch(model_path, may_load_async: bool | None = None) -> tuple[int, list, ModelFreeEngine]:
    """Round 0 stores a 448-token prompt; two requests then fill the running batch (`max_num_seqs` 2)
    with 24 decode steps each; C, that prompt and more, arrives. vLLM 0.34 with
    `--max-num-inflight-kv-loads 1`. Returns the step C's load was planned at (0 for none), the
    running requests then, and the engine, run to its end. `may_load_async`: kvscope's answer replaced."""
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 64}, window=WINDOW, num_blocks=400,
                             max_num_batched_tokens=512,
                             engine_args={"max_num_seqs": 2, "max_num_inflight_kv_loads": 1})
    if may_load_async is not None:
        engine.scheduler.connector.may_load_async = lambda request: may_load_async
    shared = [(31 * i + 3) % 509 + 1 for i in range(448)]
    store_round(engine, [shared + [7, 8, 9]])
    for j in range(2):
        engine.add(f"busy-{j}", [(13 * i + 7 * j + 2) % 509 + 1 for i in range(90)], 24)
    engine.run(pause_after=3)
    assert len(engine.scheduler.running) == 2
    engine.add("C", shared + [(11 * i + 5) % 509 + 1 for i in range(40)], 2)
    planned: list = []

    def note_load(out) -> None:
        if not planned and any(job.req_id == "C" for job in out.kv_connector_metadata.loads):
            planned.extend([engine.stats.steps, sorted(r.request_id for r in engine.scheduler.running)])

    engine.run(max_steps=300, on_scheduled=note_load)
    return (planned or [0, []])[0], (planned or [0, []])[1], engine


@_INFLIGHT_KV_LOADS
def test_a_host_tier_load_starts_while_the_running_batch_is_full(model_path):
    """vLLM 0.34 starts an async load beside a full running batch for a request its connector says
    `may_load_async`: kvscope says so where the host tier holds more of the prompt than the device's
    prefix cache. C's load starts while both busy requests run (it waited for one to finish with the
    answer left at vLLM's default); the forward reads what it loaded, and the tier served C alike."""
    step, running, engine = _load_beside_a_full_batch(model_path)
    assert running == ["busy-0", "busy-1"], (step, running)
    assert engine.host_tier_leaks() == []
    _assert_no_violations(engine.stats)
    hits = engine.stats.external_hit_tokens
    assert hits == 448, hits  # C's shared prompt, 7 offload blocks (round 0 and the busy ones load nothing)

    default_step, default_running, default = _load_beside_a_full_batch(model_path, may_load_async=False)
    assert default_step > step and len(default_running) < 2, (default_step, default_running)
    _assert_no_violations(default.stats)
    assert default.stats.external_hit_tokens == hits
    for each in (engine, default):
        each.shutdown()


@_INFLIGHT_KV_LOADS
def test_may_load_async_says_no_where_nothing_would_load(model_path):
    """No async slot for a request the tier cannot serve past the device's prefix cache: a prompt
    never stored, one the device cache holds as far as the tier does, one asking for prompt
    logprobs (vLLM then reads no cache)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 64}, window=WINDOW, num_blocks=400,
                             max_num_batched_tokens=512, engine_args={"max_num_inflight_kv_loads": 1})
    shared = [(31 * i + 3) % 509 + 1 for i in range(448)]
    store_round(engine, [shared + [7, 8, 9]])
    connector = engine.scheduler.connector

    def request(req_id, prompt, **params):
        return Request(req_id, prompt, SamplingParams(max_tokens=2, **params), None,
                       block_hasher=engine._block_hasher)

    assert connector.may_load_async(request("hit", shared + [1, 2]))
    assert not connector.may_load_async(request("new", [(5 * i + 1) % 509 + 1 for i in range(448)]))
    assert not connector.may_load_async(request("logprobs", shared + [1, 2], prompt_logprobs=1))
    engine.add("again", shared + [7, 8, 9], 2)  # computed on the device again: its cache now holds it
    engine.run()
    assert not connector.may_load_async(request("device", shared + [1, 2]))
    engine.shutdown()


def test_known_vllm_gap_mamba_align_at_a_shared_prefix_junction_with_drafts():
    """vLLM (0.32, 0.33), align mode, hash blocks (16) finer than Mamba blocks (64), MTP drafts and
    `enable_mamba_shared_prefix_checkpoint`: Z's first chunk stops at a shared-prefix junction inside a
    Mamba block (96, off a block boundary: the drafter's dropped block moves it), its next chunk starts
    there and runs to the prompt's end without stopping at 128 (it saves its checkpoint inside the
    chunk), yet vLLM caches the block it started inside under the 128-token key. W resumes at 128 from
    the state after 96. kvscope loads nothing. (Fuzz seed 276150 of "mamba-spec" on 0.33 reached it
    through a failed load that sent a request back to vLLM's prefix cache: traced by hand, vLLM's.)
    This pins it: when it fails, vLLM changed it."""
    from tests.compat.workload_fuzz import execute

    result = execute(_junction_plan())
    assert result.external_hit_tokens == 0 and result.checked_loaded_blocks == 0
    assert result.violations and all("req_id='W'" in v and "not the state after 128 tokens" in v
                                      for v in result.violations), result.violations
    assert result.vllm_mamba_align and result.verdict == "vllm_mamba_align" and result.failure is None


def _junction_plan() -> dict:
    """X, Z, W of `test_known_vllm_gap_mamba_align_at_a_shared_prefix_junction_with_drafts`."""
    def add(req_id, prompt):
        return {"id": req_id, "prompt": prompt, "max_tokens": 2, "salt": None}

    return {"seed": 276150, "config": {
        "mamba": {"block": 64, "hash_block": 16, "retention": None, "shared_prefix_checkpoint": True},
        "block_size": 64, "spec_tokens": 1, "spec_method": "mtp", "workers": 1, "async_scheduling": True,
        "runner": "v1", "num_blocks": 1200, "max_num_batched_tokens": 2048, "cpu_bytes": 64 << 20},
        "rounds": [{"between": "none", "phases": [
            {"adds": [add("X", [["276150p0", 112], ["x", 40]])], "pause_after": 6, "abort_on_schedule": [],
             "abort_after": []},
            {"adds": [add("Z", [["276150p0", 345], ["276150s9", 180]])], "pause_after": 2,
             "abort_on_schedule": [], "abort_after": []},
            {"adds": [add("W", [["276150p0", 345], ["w", 100]])], "pause_after": None, "abort_on_schedule": [],
             "abort_after": []}]}]}


def test_known_vllm_gap_mamba_align_at_a_junction_with_eagle_drafts_beside_a_kvscope_load():
    """The same mix-up of vLLM's with EAGLE drafts (0.32, 0.33): k2-7's 142-token prompt puts a shared-prefix
    junction inside Mamba block 2, and k2-10 then resumes at 128 tokens from vLLM's prefix cache in a block
    (1) that does not hold the state after 128. Here kvscope does load (k2-6: one Mamba state, at 896 tokens,
    and its attention blocks): fuzz seed 281021 of "mamba-spec" on 0.33, reported as a `violation` until the
    fuzzer followed each state block's writer. Traced by hand: no kvscope load wrote the block k2-10 read
    (vLLM's forward did, and vLLM's copy-on-write copied it); without k2-6 (no load at all) the same read is
    classified as vLLM's; without k2-7's junction or without drafts it is gone. This pins it: when it fails,
    vLLM changed it (or kvscope's loads began to touch the block)."""
    from tests.compat.workload_fuzz import _played

    def add(req_id, prompt, max_tokens=2):
        return {"id": req_id, "prompt": prompt, "max_tokens": max_tokens, "salt": None}

    def phase(*adds):
        return {"adds": list(adds), "pause_after": None, "abort_on_schedule": [], "abort_after": []}

    p, s0 = ["281021p0", 500], ["281021s0", 400]
    plan = {"seed": 281021, "config": {
        "mamba": {"block": 64, "hash_block": 16, "retention": 128, "shared_prefix_checkpoint": True},
        "block_size": 64, "spec_tokens": 1, "spec_method": "eagle", "workers": 1, "async_scheduling": False,
        "runner": "v1", "num_blocks": 1200, "max_num_batched_tokens": 2048, "cpu_bytes": 64 << 20},
        "rounds": [
            {"between": "reset", "phases": [phase(add("k0-0", [p, s0]),
                                                  add("k0-1", [p, s0, ["gen", 33], ["281021s1", 6]], 33))]},
            {"between": "none", "phases": [phase(add("k2-6", [p, s0, ["gen", 33], ["281021s1", 6], ["gen", 33]]),
                                                 add("k2-7", [["281021p0", 142], ["281021s7", 1]]),
                                                 add("k2-9", [p, ["281021s9", 63]]),
                                                 add("k2-10", [p, s0], 1))]}]}
    with _played(plan) as replay:
        engine, result = replay.engine, replay.finish()
        loaded_blocks = {block for (_, group), blocks in engine._loaded.items() if group == 0 for block in blocks}
        read = {(v.req_id, v.group, v.block_index, v.block_id, v.reason.split(": ", 1)[1])
                for v in engine.stats.violations}  # one per layer of the group
        from_vllm_cache = {v.from_vllm_cache for v in engine.stats.violations}
    assert result.external_hit_tokens > 0 and result.verdict == "vllm_mamba_align" and result.failure is None
    (req_id, group, block_index, block_id, reason), = read
    assert (req_id, group, block_index, reason) == ("k2-10", 0, 1, "not the state after 128 tokens")
    assert block_id not in loaded_blocks and from_vllm_cache == {True}  # vLLM's prefix cache gave it, vLLM wrote it


def test_known_vllm_gap_mamba_align_reached_through_a_failed_load():
    """Fuzz seed 354198 of "mamba-spec" (0.32), shrunk: in the second round every load of rank 0 fails. k2-14's
    load (384 tokens from the host tier) fails, vLLM frees its blocks and looks it up again: now its device
    prefix cache has a 64-token hit, block 69, which k2-12's first chunk filled with the state after 48
    tokens (MTP's dropped block moved k2-11's shared-prefix junction off the block boundary), and k2-14
    resumes from it. k2-16 resumes at 640 from block 112, which holds preempted k2-15's state after 592 (a
    chunk that ended inside the block and went on without stopping at 640). Both wrong states came from
    vLLM's prefix cache alone, in blocks vLLM's forward wrote: the fuzzer tells them apart
    (`Violation.from_vllm_cache`) though kvscope's failed load is what led the requests there. This pins it:
    when it fails, vLLM changed it (or kvscope's loads began to touch the blocks)."""
    from tests.compat.workload_fuzz import _played

    plan = _failed_load_plan()
    with _played(plan) as replay:
        engine, result = replay.engine, replay.finish()
        loaded_blocks = {block for (_, group), blocks in engine._loaded.items() if group == 0 for block in blocks}
        read = {(v.req_id, v.block_index, v.block_id, v.reason.split(": ", 1)[1], v.from_vllm_cache)
                for v in engine.stats.violations}  # one per layer of the group
        failed = engine.stats.failed_recving
    assert result.external_hit_tokens > 0 and "k2-14" in failed
    assert read == {("k2-14", 0, 69, "not the state after 64 tokens", True),
                    ("k2-16", 9, 112, "not the state after 640 tokens", True)}
    assert not {69, 112} & loaded_blocks
    assert result.verdict == "vllm_mamba_align" and result.failure is None


def _failed_load_plan() -> dict:
    """The requests of `test_known_vllm_gap_mamba_align_reached_through_a_failed_load`."""
    def add(req_id, *segments, max_tokens=2, salt=None):
        return {"id": req_id, "prompt": [list(s) for s in segments], "max_tokens": max_tokens, "salt": salt}

    def phase(*adds):
        return {"adds": list(adds), "pause_after": None, "abort_on_schedule": [], "abort_after": []}

    p0, p1, s7 = ("354198p0", 700), ("354198p1", 300), ("354198s7", 16)
    return {"seed": 354198, "config": {
        "mamba": {"block": 64, "hash_block": 16, "retention": None, "shared_prefix_checkpoint": True},
        "block_size": 64, "spec_tokens": 2, "spec_method": "mtp", "workers": 1, "async_scheduling": False,
        "runner": "v1", "num_blocks": 150, "max_num_batched_tokens": 2048, "cpu_bytes": 64 << 20,
        "fail_loads": {"rank": 0}},  # rank 0 fails every load in the second round
        "rounds": [
            {"between": "reset", "phases": [phase(add("k0-7", p1, s7, max_tokens=250))]},
            {"between": "none", "phases": [
                phase(add("k2-11", ("354198p1", 79), ("354198s11", 296)), add("k2-12", p1, ("354198s12", 17))),
                phase(add("k2-13", ("354198p0", 407), ("354198s13", 15), max_tokens=33, salt="a"),
                      add("k2-14", p1, s7, ("gen", 250), ("354198s14", 52)), add("k2-15", p0, ("354198s15", 120)),
                      add("k2-16", p0, ("354198s16", 17)))]}]}


def test_a_kvscope_copy_into_a_block_vllms_cache_then_serves_is_never_taken_for_vllms_mix_up(monkeypatch):
    """The negative control of the test above: a kvscope load copy landing in block 69 after k2-12's forward
    wrote and read it (from a host slot never stored to: zeros) makes k2-14's wrong state kvscope's, and the
    plan a failure, though k2-14 still reaches the block through vLLM's prefix cache."""
    from tests.compat import workload_fuzz

    real_engine = workload_fuzz._engine

    def engine_with_a_stray_load(config, trace_file=None):
        engine = real_engine(config, trace_file)
        worker, seen = engine.workers[0]._worker, []

        def stray_load():
            if len(seen) < 2 and engine._state_writers[0].get(69) == "vllm":  # k2-12's forward wrote it
                seen.append(engine.stats.steps)
                if len(seen) == 2:  # a step later: k2-12 has read it
                    worker.engine.load(0, [worker.num_slots - 1], [0], [69])

        engine.after_step.append(stray_load)
        return engine

    monkeypatch.setattr(workload_fuzz, "_engine", engine_with_a_stray_load)
    with workload_fuzz._played(_failed_load_plan()) as replay:
        engine, result = replay.engine, replay.finish()
        read = {(v.req_id, v.block_id, v.from_vllm_cache) for v in engine.stats.violations}
    assert read == {("k2-14", 69, False), ("k2-16", 112, True)}
    assert result.verdict == "violation" and not result.vllm_mamba_align


def test_a_request_resuming_from_vllms_mislabelled_mamba_block_stores_none_of_its_states():
    """vLLM's mix-up below (partial hash hits, no drafts) hands c the state after 560 as the state after
    576: every state c computes from it is wrong, and vLLM keys them. kvscope knows the block is wrong (b's
    forward started inside it and left) and stores none of c's states, so the host tier does not keep them
    past vLLM's own cache: c adds no Mamba state to the tier (without the guard it stored two). With
    drafts the guard is off (`StateBlocks`)."""
    from tests.compat.workload_fuzz import _played

    def add(req_id, prompt):
        return {"id": req_id, "prompt": prompt, "max_tokens": 2, "salt": None}

    def plan(*phases):
        return {"seed": 21164, "config": {"mamba": {"block": 64, "hash_block": 16, "retention": None},
                                          "block_size": 64, "workers": 1, "async_scheduling": False,
                                          "runner": "v1", "num_blocks": 1200, "max_num_batched_tokens": 2048,
                                          "cpu_bytes": 64 << 20},
                "rounds": [{"between": "none", "phases": [
                    {"adds": adds, "pause_after": None, "abort_on_schedule": [], "abort_after": []}
                    for adds in phases]}]}

    def mamba_states(plan):
        with _played(plan) as replay:
            index = replay.engine.scheduler.get_kv_connector()._scheduler.index
            wrong_reads = {v.req_id for v in replay.engine.stats.violations}
            return {key for key in index._entries if key[0] == 0 and index.is_ready(key)}, wrong_reads

    a = add("a", [["21164p1", 500], ["21164s0", 72]])
    b = add("b", [["21164p1", 500], ["21164s0", 72], ["gen", 150], ["21164s1", 67]])
    c = add("c", [["21164p1", 500], ["21164s0", 72], ["gen", 150], ["c", 200]])
    with_c, wrong_reads = mamba_states(plan([a, b], [c]))
    assert wrong_reads == {"c"}  # vLLM's mix-up: c resumed from the wrong state
    assert with_c == mamba_states(plan([a, b]))[0]


def test_known_vllm_gap_mamba_align_with_partial_hash_hits_caches_a_state_under_a_later_key():
    """vLLM (0.32, 0.33), align mode, hash blocks (16) finer than Mamba blocks (64): a request
    resuming at 560 from a partial hit gets the block it resumes in (a copy holding the state after
    560 tokens) cached under the 576-token key, and its chunk is not stopped at 576 because it saves
    its checkpoint inside the chunk: nothing ever writes the state after 576. The next request that
    hits 576 resumes from the state after 560. kvscope loads nothing here (no hit from its tier).
    The fuzzer tells this apart (`vllm_mamba_align`); this pins it: when it fails, vLLM changed it."""
    from tests.compat.workload_fuzz import execute

    plan = {"seed": 21164, "config": {"mamba": {"block": 64, "hash_block": 16, "retention": None},
                                      "block_size": 128, "workers": 1, "async_scheduling": False, "runner": "v1",
                                      "num_blocks": 1200, "max_num_batched_tokens": 2048, "cpu_bytes": 64 << 20},
            "rounds": [{"between": "none", "phases": [{"pause_after": None, "abort_on_schedule": [], "abort_after": [],
                                                       "adds": [
        {"id": "a", "prompt": [["21164p1", 500], ["21164s0", 72]], "max_tokens": 2, "salt": None},
        {"id": "b", "prompt": [["21164p1", 500], ["21164s0", 72], ["gen", 150], ["21164s1", 67]],
         "max_tokens": 2, "salt": None},
        {"id": "c", "prompt": [["21164p1", 500], ["21164s0", 72], ["gen", 150]], "max_tokens": 2, "salt": None},
    ]}]}]}
    result = execute(plan)
    assert result.external_hit_tokens == 0 and result.checked_loaded_blocks == 0
    assert result.violations and all("req_id='c'" in v and "not the state after 576 tokens" in v
                                      for v in result.violations), result.violations
    assert result.vllm_mamba_align and result.verdict == "vllm_mamba_align" and result.failure is None


def test_the_fuzzer_tells_vllms_mamba_align_mix_up_apart_where_kvscope_loaded_for_another_request():
    """Random workload seed 211678, shrunk: k3-19 resumes from vLLM's own cached Mamba state of fewer
    tokens (the mix-up above), while kvscope loads for k3-18 (it was reported as a kvscope failure once).
    Both rules tell it apart: the state k3-19 read came from vLLM's prefix cache alone, in a block vLLM's
    forward wrote; and replayed with kvscope offering no hit, the same violation comes again."""
    from tests.compat import workload_fuzz

    def add(req_id, *segments):
        return {"id": req_id, "prompt": [list(s) for s in segments], "max_tokens": 2, "salt": None}

    def phase(*adds):
        return {"adds": list(adds), "pause_after": None, "abort_on_schedule": [], "abort_after": []}

    plan = {"seed": 211678, "config": {"mamba": {"block": 64, "hash_block": 16, "retention": 0}, "block_size": 64,
                                       "workers": 1, "async_scheduling": False, "runner": "v1", "num_blocks": 1200,
                                       "max_num_batched_tokens": 512, "cpu_bytes": 64 << 20},
            "rounds": [
                {"between": "none", "phases": [
                    phase(add("k0-3", ("211678p1", 300), ("211678s3", 550)),
                          add("k0-4", ("211678p0", 300), ("211678s4", 39))),
                    phase(add("k0-6", ("211678p1", 215), ("211678s6", 5)),
                          add("k0-7", ("211678p1", 300), ("211678s7", 400)))]},
                {"between": "none", "phases": [
                    phase(add("k3-18", ("211678p0", 268), ("211678s18", 200)),
                          add("k3-19", ("211678p1", 300), ("211678s19", 1)))]}]}
    with workload_fuzz._played(plan) as replay:
        engine, result = replay.engine, replay.finish()
        assert workload_fuzz._same_without_kvscope_hits(plan, engine)  # the replay without hits: the same
    assert result.external_hit_tokens > 0  # kvscope loaded: "nothing loaded" does not apply
    assert result.violations and all("req_id='k3-19'" in v and "not the state after 256 tokens" in v
                                      and "from_vllm_cache=True" in v for v in result.violations), result.violations
    assert result.verdict == "vllm_mamba_align" and result.failure is None


def test_the_fuzzer_tells_the_known_admission_stall_apart_where_vllms_own_estimate_fits(monkeypatch):
    """The stall of `test_known_vllm_gap_async_loads_admitted_past_their_reserve_stall_the_scheduler`,
    where vLLM's capped estimate of what the stuck requests need fits in the free blocks, but the
    head one's next chunk (its sliding-window group needs every block the chunk spans) does not
    (random workload seed 160364, shrunk; it was reported as an unexplained failure before). With
    kvscope's load admission the plan runs through; without it the fuzzer names the stall."""
    from tests.compat import workload_fuzz

    plan = {"seed": 160364, "config": {"block_size": 256, "workers": 1, "async_scheduling": False, "runner": "v1",
                                       "num_blocks": 100, "max_num_batched_tokens": 512, "cpu_bytes": 1310720000},
            "rounds": [{"between": "none", "phases": [
        {"pause_after": None, "abort_on_schedule": [], "abort_after": [], "adds": [
            {"id": "k0-1", "prompt": [["160364s1", 495]], "max_tokens": 2, "salt": None},
            {"id": "k0-2", "prompt": [["160364p1", 700], ["160364s2", 42]], "max_tokens": 2, "salt": None},
            {"id": "k0-3", "prompt": [["160364p0", 358], ["160364s3", 17]], "max_tokens": 150, "salt": None}]},
        {"pause_after": None, "abort_on_schedule": [], "abort_after": [], "adds": [
            {"id": "k0-4", "prompt": [["160364s1", 495], ["160364s4", 80]], "max_tokens": 150, "salt": None},
            {"id": "k0-5", "prompt": [["160364p1", 700], ["160364s2", 39]], "max_tokens": 2, "salt": None},
            {"id": "k0-6", "prompt": [["160364p0", 358], ["160364s3", 17], ["gen", 150]], "max_tokens": 1, "salt": None}]}]}]}
    seen = []  # at the stall: (vLLM's estimate for the stuck requests, the head's next chunk, free blocks)
    tell = workload_fuzz._stalled_by_vllm

    def telling(engine):
        scheduler = engine.scheduler
        seen.append((sum(scheduler._request_remaining_blocks(r) for r in scheduler.requests.values()),
                     workload_fuzz._next_chunk_blocks(scheduler, scheduler.kv_holding_waiting.peek_request()),
                     scheduler.kv_cache_manager.block_pool.get_num_free_blocks()))
        return tell(engine)

    with mock.patch.object(workload_fuzz, "_stalled_by_vllm", telling):
        result = workload_fuzz.execute(plan)
        assert result.verdict == "ok" and not seen and result.external_hit_tokens > 0
        without_load_admission(monkeypatch)
        result = workload_fuzz.execute(plan)
    assert result.verdict == "stall" and result.failure == "stall" and not result.violations
    (estimate, chunk, free), = seen
    assert estimate <= free < chunk  # vLLM's estimate fits; the chunk it asks blocks for does not


def test_a_request_whose_load_failed_recomputes_instead_of_waiting_for_its_own_reserve(model_path, monkeypatch):
    """vLLM (0.32, 0.33) keeps a request whose async load failed among its in-flight prefills, so a
    second async admission of it counts its own reserve against itself and never fits once it needs
    half the free blocks: it would wait for ever. So kvscope offers such a request no hit again, even
    where its host blocks are still there (another request stored them again, or the failure was
    the device's): it recomputes."""
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 64}, window=WINDOW,
                             num_blocks=100, max_num_batched_tokens=512)
    prompt = [(31 * i + 3) % 509 + 1 for i in range(700)]
    try:
        store_round(engine, [prompt[:650]])
        sched = engine.scheduler.get_kv_connector()._scheduler
        monkeypatch.setattr(sched.index, "drop", lambda keys: None)  # the host blocks stay after the failure
        engine.workers[0]._worker.fail_all_loads = True
        engine.add("r1-0", prompt, 2)
        engine.run(max_steps=300)
        assert engine.stats.failed_recving == {"r1-0"} and len(engine.stats.loads["r1-0"]) == 1
        assert len(engine.tokens["r1-0"]) == len(prompt) + 2
        _assert_no_violations(engine.stats)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("runner", ["v1", *V2_RUNNERS])
def test_a_load_failing_on_one_worker_is_recomputed(model_path, runner):
    """Correctness first: when one worker's loads fail, vLLM recomputes the request on every worker,
    and no forward reads the half-loaded blocks."""
    stats = _two_rounds(model_path, 64, 100, workers=2, failing_rank=1, runner=runner)
    _assert_no_violations(stats)
    failed = {r for r in stats.failed_recving if r.startswith("r1-")}
    assert failed and failed == {r for r in stats.loads if r.startswith("r1-")}
    # counted in blocks: every block of the failed loads
    assert stats.connector.data["load_failures"] == sum(loaded_blocks_by_group(stats, failed).values())


def test_the_older_get_finished_is_refused_since_it_cannot_say_a_load_failed(model_path):
    """vLLM asks `get_transfer_results`; a wrapper still asking `get_finished` would take a failed
    load for a finished one and compute on blocks never loaded: it gets a clear error instead."""
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 64}, window=WINDOW)
    try:
        with pytest.raises(NotImplementedError, match="get_transfer_results"):
            engine.workers[0].get_finished(set())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("runner", ["v1", *V2_RUNNERS])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_requests_aborted_while_loading_leak_nothing(model_path, async_scheduling, runner):
    """A client aborts requests right after vLLM scheduled their loads: vLLM keeps their blocks until
    the workers report the loads, the connector unpins every host entry, and the same prompts
    sent again load correct KV."""
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 64}, window=WINDOW,
                             max_num_batched_tokens=100, async_scheduling=async_scheduling, runner=runner)
    aborted: set[str] = set()

    def abort_loading(out) -> None:
        loading = {job.req_id for job in getattr(out.kv_connector_metadata, "loads", ())} - aborted
        if loading:
            aborted.update(loading)
            engine.abort(loading)

    try:
        prompts = _prompts()
        store_round(engine, prompts)
        for j, prompt in enumerate(prompts):
            engine.add(f"r1-{j}", prompt)
        engine.run(on_scheduled=abort_loading)
        assert aborted and aborted <= engine.stats.finished_recving
        assert engine.host_tier_leaks() == []
        engine.reset_device_prefix_cache()
        for j, prompt in enumerate(prompts):
            engine.add(f"r2-{j}", prompt)
        engine.run()
    finally:
        engine.shutdown()
    stats = engine.stats
    _assert_no_violations(stats)
    assert any(r.startswith("r2-") for r in stats.loads)
    assert engine.host_tier_leaks() == []


@pytest.mark.parametrize("runner", ["v1", *V2_RUNNERS])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_stores_still_copying_when_the_last_request_ends_are_ready_for_the_next(model_path, monkeypatch,
                                                                                async_scheduling, runner):
    """On CUDA a store can still be copying when its request's last step ends, and only a later step
    reports it. vLLM keeps stepping while the connector has such work (`has_pending_push_work`, as for
    its own offloading connector): the host blocks become ready then, not when the next request comes,
    whose lookup would run before that step and miss them. CUDA's copies run here as CPU copies that
    report done on their fifth poll (a few steps later)."""
    from connector.copy_engine import CopyEngine

    real_store, real_poll = CopyEngine.store, CopyEngine.poll
    polls_left = {}  # id of a store's CopyResult -> (the result, polls before it reads as done)

    def store(self, *args):
        result = real_store(self, *args)
        polls_left[id(result)] = (result, 4)
        return result

    def poll(self, result):
        entry = polls_left.get(id(result))
        if entry is not None:
            if entry[1] > 0:
                polls_left[id(result)] = (result, entry[1] - 1)
                return False
            del polls_left[id(result)]
        return real_poll(self, result)

    monkeypatch.setattr(CopyEngine, "store", store)
    monkeypatch.setattr(CopyEngine, "poll", poll)
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 64}, window=WINDOW,
                             async_scheduling=async_scheduling, runner=runner)
    try:
        prompt = _prompts()[0]
        engine.add("first", prompt)
        engine.run()
        assert engine.host_tier_leaks() == []  # every store reported before the engine went idle
        assert not engine.scheduler.get_kv_connector().has_pending_push_work()
        engine.reset_device_prefix_cache()
        engine.add("again", prompt)
        engine.run()
    finally:
        engine.shutdown()
    assert engine.stats.external_hit_tokens == (len(prompt) - 1) // 64 * 64
    _assert_no_violations(engine.stats)


def test_a_request_aborted_while_its_load_is_deferred_gets_a_span_of_its_wait(model_path, tmp_path):
    """vLLM's own scheduler: a client aborts a request whose load kvscope deferred for device KV room (vLLM's
    `finish_requests` on a waiting request ends it in the connector too). vLLM never admitted it: its one
    span is a `kvscope.deferral` spanning the wait, and kvscope_load_deferral_wait_seconds observes it, as
    every other deferred load's; the other requests finish, nothing leaks, the counts agree with vLLM's."""
    trace_file = tmp_path / "spans.jsonl"
    engine = three_loads_past_their_reserve(model_path, trace_file=trace_file)
    admission = engine.scheduler.get_kv_connector()._scheduler.admission
    aborted = []

    def abort_the_first_deferred(_):
        if not aborted and admission.deferred:
            req_id, deferral = next(iter(admission.deferred.items()))
            aborted.append((req_id, deferral.lookups))
            engine.abort([req_id])

    try:
        engine.run(max_steps=200, on_scheduled=abort_the_first_deferred)
        assert engine.host_tier_leaks() == [] and engine.telemetry_mismatches() == []
    finally:
        engine.shutdown()  # flushes the spans to the file
    ((req_id, lookups),) = aborted
    spans = [s for trace in _spans_by_trace(trace_file).values() for s in trace
             if s["attrs"].get("kvscope.request.id") == req_id]
    assert [(s["name"], s["parent"]) for s in spans] == [("kvscope.deferral", "")]  # the root of its own trace
    told = spans[0]["attrs"]
    assert told["kvscope.deferred.lookups"] == lookups >= 1 and told["kvscope.deferred.wait_us"] > 0
    assert told["kvscope.tokens.external"] > 0
    data = engine.stats.connector.data
    assert len(data["load_deferral_wait_s"]) == data["deferred_loads"]  # the aborted one's too
    assert engine.scheduler.requests == {}


def _spans_by_trace(path) -> dict[str, list[dict]]:
    """The trace file's spans as {trace id: [{name, id, parent, attrs}]}, ids in hex."""
    traces = defaultdict(list)
    for span in trace_file_spans(path):
        traces[span.trace_id.hex()].append({"name": span.name, "id": span.span_id.hex(),
                                            "parent": span.parent_span_id.hex(), "attrs": proto_span_attributes(span)})
    return traces


def test_each_loading_request_traced_in_the_trace_it_sent(model_path, tmp_path):
    """Trace context through vLLM's own `Request.trace_headers` and the connector metadata: a
    request's lookup, load, per-group scans and both workers' copies are in the trace its
    `traceparent` names: lookup and load under the client's span, scans and copies under the load."""
    trace_file = tmp_path / "spans.jsonl"
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 64, "trace_file": str(trace_file)},
                             window=WINDOW, max_num_batched_tokens=100, workers=2)
    upstream = {}  # request id -> (trace id, the client's span id)
    try:
        prompts = _prompts()
        store_round(engine, prompts)
        for j, prompt in enumerate(prompts):
            trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
            upstream[f"r1-{j}"] = (trace_id, span_id)
            engine.add(f"r1-{j}", prompt, trace_headers={"traceparent": f"00-{trace_id}-{span_id}-01"})
        engine.run()
    finally:
        engine.shutdown()  # flushes every tracer's spans to the file
    _assert_no_violations(engine.stats)
    traces = _spans_by_trace(trace_file)
    loading = [r for r in upstream if r in engine.stats.loads]
    assert loading
    for req_id in loading:
        trace_id, client_span = upstream[req_id]
        spans = traces[trace_id]
        (lookup,) = [s for s in spans if s["name"] == "kvscope.lookup"]
        (load,) = [s for s in spans if s["name"] == "kvscope.load"]
        assert lookup["parent"] == client_span and load["parent"] == client_span
        assert load["attrs"]["kvscope.request.id"] == req_id and load["attrs"]["kvscope.groups"] == 2
        scans = {s["attrs"]["kvscope.group.kind"]: s for s in spans if s["name"] == "kvscope.group.scan"}
        assert set(scans) == {"sliding_window", "full_attention"}
        assert all(s["parent"] == load["id"] for s in scans.values())
        assert scans["sliding_window"]["attrs"]["kvscope.group.blocks.null_skipped"] > 0
        copies = [s for s in spans if s["name"] == "kvscope.group.copy" and s["attrs"]["kvscope.copy.direction"] == "load"]
        assert all(c["parent"] == load["id"] and c["attrs"]["kvscope.copy.bytes"] > 0 for c in copies)
        # two groups on each of two workers
        assert sorted((c["attrs"]["kvscope.worker.rank"], c["attrs"]["kvscope.group.kind"]) for c in copies) == [
            (0, "full_attention"), (0, "sliding_window"), (1, "full_attention"), (1, "sliding_window")]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_offloaded_blocks_larger_than_the_window_survive_chunked_prefill(model_path, async_scheduling):
    """Offloaded blocks of 256 tokens, a window of 64, 100-token prefill chunks: a block's first
    device blocks leave the window before its last ones are computed. Stored piece by piece, every
    block still reaches the host tier: round 1's hits equal those of whole-prompt prefill. (Round 0's
    differ: in 100-token steps a prompt can load the shared prefix an earlier one stored.)"""
    hits = {}
    for chunk in (2048, 100):
        stats, round0_hits = _two_rounds_and_round0_hits(model_path, 256, chunk, async_scheduling=async_scheduling)
        _assert_no_violations(stats)
        hits[chunk] = stats.external_hit_tokens - round0_hits
    assert hits[100] == hits[2048] > 0, hits


@pytest.mark.parametrize(
    "block_size, async_scheduling, num_blocks, runner",
    # 130 device blocks: vLLM preempts one request (which count does is chaotic: 150 did with every window
    # block kept, 130 does with vLLM's default retention, 110 does not)
    [(256, False, 1200, "v1"), (256, True, 1200, "v1"), (256, True, 130, "v1"), (64, False, 1200, "v1"),
     (256, True, 130, "v2")],
    ids=["bs256-sync", "bs256-async", "bs256-async-preempting", "bs64-sync", "v2-bs256-async-preempting"],
)
def test_a_conversation_turn_loads_the_previous_turns_output(model_path, block_size, async_scheduling, num_blocks,
                                                             runner):
    """Turn 2 of a conversation sends turn 1's prompt, its output and a new message. The blocks of
    turn 1's output (and the one straddling its prompt's end) have no key until their last token is
    sampled; with 256-token blocks the 64-token window drops their first pieces long before that,
    so they are stored under a placeholder key first. Every whole block turn 1 computed is a hit,
    as with 64-token blocks (which the window cannot outrun), and the KV loaded is right."""
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": block_size}, window=WINDOW,
                             async_scheduling=async_scheduling, num_blocks=num_blocks, runner=runner)
    turn2_hits, expected = _two_turns(engine, block_size)  # with 130 device blocks, vLLM preempts one
    _assert_no_violations(engine.stats)
    assert bool(engine.stats.resumed) == (num_blocks < 1000)
    assert turn2_hits == expected


def _two_turns(engine: ModelFreeEngine, block_size: int) -> tuple[int, int]:
    """Turn 1 decodes 200 tokens after each prompt; the device prefix cache is reset; turn 2 sends
    each conversation with a new message. Returns turn 2's host hits (vLLM's count) and the whole
    blocks turn 1 computed."""
    try:
        prompts = _prompts()
        for j, prompt in enumerate(prompts):
            engine.add(f"t1-{j}", prompt, max_tokens=200)
        engine.run()
        engine.reset_device_prefix_cache()
        turn1_hits, expected = engine.stats.external_hit_tokens, 0
        for j, prompt in enumerate(prompts):
            conversation = engine.tokens[f"t1-{j}"][:len(prompt) + 200]  # the worker may hold drafts past the end
            expected += (len(conversation) - 1) // block_size * block_size  # the last one was never computed
            engine.add(f"t2-{j}", conversation + [(11 * i + j) % 509 + 1 for i in range(50)], max_tokens=2)
        engine.run()
        assert engine.host_tier_leaks() == []
    finally:
        engine.shutdown()
    return engine.stats.external_hit_tokens - turn1_hits, expected


@pytest.mark.parametrize(
    "block_size, async_scheduling, runner, num_blocks, max_num_batched_tokens",
    [(256, False, "v1", 1200, 2048), (256, True, "v1", 1200, 2048), (64, True, "v1", 1200, 2048),
     (256, True, "v1", 150, 100), (256, True, "v2", 1200, 2048),
     pytest.param(256, True, "v2-spec", 1200, 2048, marks=_DEFERRED_FINALIZE)],
    ids=["bs256-sync", "bs256-async", "bs64-async", "bs256-async-preempting-chunked", "v2-bs256-async",
         "v2-spec-bs256-async"],
)
def test_speculative_decoding_stores_only_the_kv_of_accepted_tokens(model_path, block_size, async_scheduling,
                                                                     runner, num_blocks, max_num_batched_tokens):
    """Turn 1 decodes with three drafts a step, about a third wrong: the forward writes the KV of
    rejected drafts, and the next step overwrites it in place. Under async scheduling vLLM counts a
    step's drafts as computed before it knows which it accepts. 256-token blocks store ahead of
    their key (the 64-token window drops their first pieces first), so a store taken too early
    would keep rejected drafts' KV under the real key; turn 2 loads every whole block turn 1
    computed and checks each position."""
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": block_size}, window=WINDOW,
                             async_scheduling=async_scheduling, runner=runner, spec_tokens=3,
                             num_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens)
    turn2_hits, expected = _two_turns(engine, block_size)
    stats = engine.stats
    _assert_no_violations(stats)
    assert stats.drafts_rejected > 100, stats.drafts_rejected
    assert bool(stats.runner_corrections) == async_scheduling
    assert bool(stats.resumed) == (num_blocks < 1000)
    assert turn2_hits == expected


@pytest.mark.parametrize("window", [50, 51])
def test_drafts_accepted_past_a_blocks_first_piece_do_not_cost_its_window_copy(window):
    """A window just over the offloaded block less a device block (64 - 16): a step accepting its
    three drafts made a block's key and let vLLM free its first device block at once, so the
    window group's copy of some decoded blocks was never stored and a later request hit fewer
    tokens. With the drafts counted, the window group stores ahead, and every block is loaded."""
    engine = ModelFreeEngine(build_model("gemma3", window=window), {"cpu_bytes": 64 << 20, "block_size": 64},
                             window=window, spec_tokens=3)
    try:
        engine.add("a", list(range(1000, 1100)), max_tokens=300)
        engine.run()
        engine.reset_device_prefix_cache()
        # A request ending at each block in turn: the window group needs that block's copy for the hit
        for k in range(1, 7):
            engine.add(f"b{k}", engine.tokens["a"][:64 * k] + [7, 8, 9], max_tokens=1)
        engine.run()
        _assert_no_violations(engine.stats)
        assert engine.stats.external_hit_tokens == 64 * sum(range(1, 7))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_with_an_eagle_drafter_a_hit_leaves_the_last_stored_block_to_compute(model_path, async_scheduling):
    """vLLM drops an EAGLE hit's last block (the drafter's KV at its end came from a next token no key
    proves): kvscope's hits leave the last block turn 1 stored to compute, vLLM's scheduler counts
    exactly those hits, and every position a forward reads holds the right KV."""
    block_size = 64
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": block_size}, window=WINDOW,
                             async_scheduling=async_scheduling, spec_tokens=3, spec_method="eagle")
    assert engine.scheduler.use_eagle_block_drop
    assert engine.workers[0]._scheduler is None
    turn2_hits, whole_blocks = _two_turns(engine, block_size)
    _assert_no_violations(engine.stats)
    conversations = len(_prompts())
    assert turn2_hits == whole_blocks - conversations * block_size  # one block a conversation


def test_a_cache_salt_keeps_tenants_apart(model_path):
    """vLLM's `cache_salt` (per-tenant prefix-cache isolation) goes into the block hashes, so into the
    host tier's keys: another salt, or none, never hits what a salted request stored; the same salt does."""
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 64}, window=WINDOW)
    hits = {}
    try:
        prompts = _prompts()
        for round_, salt in enumerate(("tenant-a", "tenant-b", None, "tenant-a")):
            before = engine.stats.external_hit_tokens
            for j, prompt in enumerate(prompts):
                engine.add(f"r{round_}-{j}", prompt, cache_salt=salt)
            engine.run()
            engine.reset_device_prefix_cache()
            hits[round_] = engine.stats.external_hit_tokens - before
        assert engine.host_tier_leaks() == []
    finally:
        engine.shutdown()
    _assert_no_violations(engine.stats)
    # each round's prompts run together, so nothing hits within a round: only tenant a's second round hits
    assert hits[0] == hits[1] == hits[2] == 0 and hits[3] > 0, hits


@pytest.mark.parametrize("runner, fence", [
    # the placements CUDA picks (`sides.store_fence`): per runner, for caches that are zeroed
    # when allocated (Mamba, mixed precision) and for the others
    pytest.param("v1", FENCE_AT_NEXT_STEP, marks=_V1_RUNNER), ("v1", FENCE_WHEN_REUSED), ("v2", FENCE_AT_ONCE),
    ("v2", FENCE_WHEN_REUSED),
    pytest.param("v2-spec", FENCE_AT_ONCE, marks=_DEFERRED_FINALIZE),
    pytest.param("v2-spec", FENCE_WHEN_REUSED, marks=_DEFERRED_FINALIZE),
])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_stores_that_read_the_device_late_store_what_the_forward_wrote(model_path, async_scheduling, runner, fence):
    """Stores read their blocks late, as DMA does on CUDA (`LateReadingStores`), with vLLM short of
    blocks, so it preempts and frees blocks whose stores are still pending and gives them to other
    requests. Each fence placement CUDA may pick for a runner keeps every later write after those
    reads: at once, when the next step begins (V1: `handle_preemptions`), or only in a step that
    allocates a block a store still reads (the scheduler's `fence_stores`). The loads of round 1
    then bring back exactly what the forward wrote."""
    stats, fences, _ = _late_reading_rounds(model_path, async_scheduling, runner, fence)
    _assert_no_violations(stats)
    assert stats.resumed and any(r.startswith("r1-") for r in stats.loads)
    if fence == FENCE_WHEN_REUSED:  # it did fence, but in few of the steps
        assert 0 < fences < stats.steps / 4, (fences, stats.steps)


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("fence", [None, FENCE_WHEN_REUSED], ids=["no-fence", "reuse-never-flagged"])
def test_without_the_fence_late_reads_store_overwritten_blocks(model_path, runner, fence):
    """The check above can fail: with no fence, or with the fence only on reuse but the scheduler
    never flagging a reused block, later steps overwrite blocks before their stores read them,
    and round 1 loads wrong KV."""
    stats, _, _ = _late_reading_rounds(model_path, False, runner, fence, flag_reuse=False)
    assert stats.violations


@pytest.mark.parametrize("runner, async_scheduling, workers", [
    ("v1", False, 1), ("v2", False, 1), ("v1", True, 1), ("v2", True, 2)])
def test_only_a_load_writing_a_block_a_store_still_reads_waits_for_the_stores(model_path, runner, async_scheduling,
                                                                              workers):
    """On CUDA a load waits for the stores in flight only when the scheduler says one reads a block it
    writes (`TransferJob.waits_for_stores`): a store running past the step's forward need not hold
    up a hit's first token. With stores reading 30 steps late, a block the window freed goes to a
    load while the store that reads it is pending; then every block stored is loaded again
    (`_probe_stored_prefixes`): the few loads that waited were enough, as none gives wrong KV."""
    stats, _, lates = _late_reading_rounds(model_path, async_scheduling, runner, FENCE_WHEN_REUSED, probe=True,
                                           store_lag=30, workers=workers)
    _assert_no_violations(stats)
    waited = sum(late.loads_after_stores for late in lates)
    alone = sum(late.loads_alone for late in lates)
    assert 0 < waited < alone, (waited, alone)


@pytest.mark.parametrize("runner, workers", [("v1", 1), ("v2", 2)])
def test_a_load_that_should_wait_for_the_stores_and_does_not_gives_wrong_kv(model_path, runner, workers):
    """The check above can fail: with no load waiting, a load overwrites a block before a late store
    reads it, the host tier keeps the load's bytes under the store's key, and a later load gives
    them as wrong KV."""
    stats, _, _ = _late_reading_rounds(model_path, False, runner, FENCE_WHEN_REUSED, loads_wait=False, probe=True,
                                       store_lag=30, workers=workers)
    assert stats.violations


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_late_reading_stores_with_speculative_decoding(model_path, async_scheduling, runner):
    """With drafts, the forward rewrites the KV of rejected ones in place, in blocks their request
    still holds, so the fence's premise (only a block given out again is rewritten) must hold there
    too: stores take only blocks whose every position is final, and the fence on reuse is enough."""
    stats, fences, _ = _late_reading_rounds(model_path, async_scheduling, runner, FENCE_WHEN_REUSED, spec_tokens=3)
    _assert_no_violations(stats)
    assert stats.drafts_rejected > 100 and stats.resumed and any(r.startswith("r1-") for r in stats.loads)
    assert 0 < fences < stats.steps / 4, (fences, stats.steps)


@pytest.mark.parametrize("runner, fence, enough", [pytest.param("v1", FENCE_AT_NEXT_STEP, True, marks=_V1_RUNNER),
                                                   ("v2", FENCE_AT_ONCE, True), ("v2", FENCE_WHEN_REUSED, False)],
                         ids=["v1-next-step", "v2-at-once", "v2-when-reused-negative-control"])
def test_late_reading_stores_beside_a_mamba_group_whose_new_blocks_vllm_zeroes(model_path, monkeypatch, runner,
                                                                                fence, enough):
    """With a Mamba group vLLM zeroes every new attention block before the forward: V1 after
    `handle_preemptions` (where a step's fence lands), V2 before it. So V2 must fence its stores
    at once (`sides.store_fence`). Fenced only in a step that gives a store's block out again
    (right without zeroing), the block is zeroed before the late store reads it, and turn 2 loads
    zeros: the negative control, which also shows the zeroing is emulated."""
    from connector import sides
    from tests.compat.model_free import MambaAlign

    # the schedule the control was built on, every load starting at once: kvscope's load admission
    # changes it in this 100-block cache, and no late store then meets a zeroed block
    without_load_admission(monkeypatch)
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 16}, window=WINDOW, num_blocks=100,
                             max_num_batched_tokens=100, runner=runner, mamba=MambaAlign(16, 16))
    # vLLM's config names the V1 runner here (its V2 needs Triton); the loop drives the runner asked for
    monkeypatch.setattr(sides, "uses_v2_model_runner", lambda config: runner == "v2")
    assert (sides.store_fence(engine.vllm_config, engine.kv_cache_config) == fence) == enough
    _read_stores_late(engine, fence)
    turn2_hits, _ = _two_turns(engine, 16)
    stats = engine.stats
    assert stats.zeroed_blocks and stats.resumed and turn2_hits
    if enough:
        _assert_no_violations(stats)
    else:
        assert stats.violations


def _late_reading_rounds(model_path, async_scheduling: bool, runner: str, fence: str | None,
                         flag_reuse: bool = True, spec_tokens: int = 0, loads_wait: bool | None = None,
                         rounds: int = 2, probe: bool = False, store_lag: int = 10, workers: int = 1):
    """``loads_wait``: None, each load waits for the stores when the scheduler says
    (`TransferJob.waits_for_stores`); True or False, every load or none. ``probe``: then load every
    block the first round stored (`_probe_stored_prefixes`). Returns the engine's stats, the fence
    count and the workers' `LateReadingStores`."""
    # 150 device blocks, 100-token steps, 200 tokens decoded: vLLM preempts, and the window frees
    # blocks, while stores read 10 steps late (a stress: a DMA's lag is within a step or two)
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 64}, window=WINDOW,
                             num_blocks=150, max_num_batched_tokens=100, async_scheduling=async_scheduling,
                             runner=runner, spec_tokens=spec_tokens, workers=workers)
    if not flag_reuse:
        engine.scheduler.get_kv_connector()._scheduler.store_sources.reallocated = lambda out, computed: False
    if loads_wait is not None:
        def order_loads(loads):
            for job in loads:
                job.waits_for_stores = loads_wait

        engine.scheduler.get_kv_connector()._scheduler.store_sources.order_loads = order_loads
    fences, lates = _read_stores_late(engine, fence, store_lag)
    try:
        prompts = _prompts()
        for j, prompt in enumerate(prompts):
            engine.add(f"r0-{j}", prompt, max_tokens=200)
        engine.run()
        engine.reset_device_prefix_cache()
        for round_ in range(1, rounds):
            for j, prompt in enumerate(prompts):
                engine.add(f"r{round_}-{j}", prompt, max_tokens=200)
            engine.run()
            engine.reset_device_prefix_cache()
        if probe:
            _probe_stored_prefixes(engine, [f"r0-{j}" for j in range(len(prompts))])
    finally:
        engine.shutdown()
    return engine.stats, fences[0], lates


def _probe_stored_prefixes(engine: ModelFreeEngine, req_ids: list[str], block: int = 64) -> None:
    """Load every block the requests stored, in every group: one request per block boundary of each
    one's tokens, ending one token past it, so its hit ends there and its window's blocks are the
    ones before it. One at a time, after a reset of vLLM's device prefix cache: none hits another's
    blocks there. A host block holding other KV than its key's then reaches the loop's checks."""
    for req_id in req_ids:
        tokens = engine.tokens[req_id]
        for end in range(block, len(tokens), block):
            engine.reset_device_prefix_cache()
            engine.add(f"probe-{req_id}-{end}", tokens[:end + 1], max_tokens=1)
            engine.run()


def _read_stores_late(engine: ModelFreeEngine, fence: str | None, steps: int = 10):
    """Every worker's stores read the device ``steps`` steps late (`LateReadingStores`), fenced at ``fence``
    (None: never, and loads do not wait for stores either). Returns the fence count, a 1-list,
    and the workers' `LateReadingStores`."""
    from tests.compat.model_free import LateReadingStores

    fences, lates = [0], []
    for connector in engine.workers:
        worker = connector._worker
        late = LateReadingStores(worker.engine, steps=steps)
        lates.append(late)
        engine.after_step.append(late.tick)
        worker.store_fence = fence or FENCE_WHEN_REUSED  # as CUDA would (`sides.store_fence`)

        def fence_compute_stream(late=late):
            fences[0] += 1
            if fence is not None:
                late._read_all()

        worker.engine.fence_compute_stream = fence_compute_stream
        if fence is None:  # nor do loads wait for the stores
            worker.engine.load = lambda group, slots, subs, block_ids, waits_for_stores=True, late=late: late._copy(
                group, slots, subs, block_ids, to_device=True)
    return fences, lates


@pytest.mark.parametrize("runner", ["v1", *V2_RUNNERS])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_loads_that_land_steps_later_are_waited_for(model_path, async_scheduling, runner):
    """On CUDA a load's copy lands after the step that started it. Here every load writes the device
    blocks 3 steps later (`LateReadingStores(load_steps=3)`), and is done only then: no forward may
    read a loading request's blocks before, whatever the runner and scheduling."""
    stats = _late_load_rounds(model_path, async_scheduling, runner, report_early=False)
    _assert_no_violations(stats)
    loading = [r for r in stats.loads if r.startswith("r1-")]
    assert loading and set(loading) <= stats.finished_recving and not stats.failed_recving
    assert stats.external_hit_tokens > 0


def test_a_load_reported_done_before_it_lands_is_caught(model_path):
    """The check above can fail: a load said to be done while its bytes are still on their way lets
    the request's forward read blocks that do not hold its KV yet."""
    assert _late_load_rounds(model_path, False, "v1", report_early=True).violations


def _late_load_rounds(model_path, async_scheduling: bool, runner: str, report_early: bool):
    from tests.compat.model_free import LateReadingStores

    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 64}, window=WINDOW,
                             num_blocks=1200, max_num_batched_tokens=2048, async_scheduling=async_scheduling,
                             runner=runner)
    for connector in engine.workers:
        late = LateReadingStores(connector._worker.engine, steps=1, load_steps=3, report_loads_early=report_early)
        engine.after_step.append(late.tick)
    try:
        store_round(engine, _prompts(), max_tokens=8)
        for j, prompt in enumerate(_prompts()):
            engine.add(f"r1-{j}", prompt, max_tokens=8)
        engine.run()
    finally:
        engine.shutdown()
    return engine.stats


@pytest.mark.parametrize("block_size", [64, 256])
def test_a_cache_reset_for_new_weights_never_loads_kv_from_before_it(model_path, block_size):
    """An RL weight update mid-run: vLLM resets its caches (`reset_prefix_cache(reset_running_requests
    =True, reset_connector=True)`) while prompts are half computed (256-token offloaded blocks half
    stored), and every position's KV differs from then on. The next round loads only KV computed
    after the reset (kvscope kept half-filled blocks and their store progress before: old pieces
    completed with new ones)."""
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": block_size}, window=WINDOW,
                             num_blocks=1200, max_num_batched_tokens=100)
    try:
        for j, prompt in enumerate(_prompts()):
            engine.add(f"r0-{j}", prompt, max_tokens=8)
        engine.run(pause_after=5)  # a chunk of each prompt is computed and stored
        # vLLM refuses the reset while a load is in flight (README); with its default window retention a
        # prompt loads the shared prefix an earlier one stored, so step on until none is
        while any(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in engine.scheduler.requests.values()):
            engine.run(pause_after=1)
        assert engine.scheduler.has_requests()
        assert engine.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
        engine.update_weights()
        engine.run()
        engine.reset_device_prefix_cache()
        for j, prompt in enumerate(_prompts()):
            engine.add(f"r1-{j}", prompt, max_tokens=8)
        engine.run()
    finally:
        engine.shutdown()
    _assert_no_violations(engine.stats)
    assert engine.stats.external_hit_tokens > 0 and any(r.startswith("r1-") for r in engine.stats.loads)


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_sleep_mode_is_refused_at_start_up(model_path, role):
    """Sleep mode remaps the KV cache under the copy engine's views. vLLM 0.33 asks the connector
    (`supports_sleep_mode`); 0.32 does not, so the connector refuses it when it is built."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from connector import KVScopeConnector
    from connector.vllm_layout import UnsupportedKVCache
    from tests.compat.model_free import _kv_cache_config

    transfer = KVTransferConfig(kv_connector="KVScopeConnector", kv_connector_module_path="connector",
                                kv_role="kv_both", kv_connector_extra_config={"cpu_bytes": 64 << 20})
    config = create_engine_config(EngineArgs(model=model_path, skip_tokenizer_init=True, block_size=16,
                                             kv_transfer_config=transfer))
    assert KVScopeConnector.supports_sleep_mode(transfer) is False
    config.model_config.enable_sleep_mode = True  # the CPU platform has no sleep mode to turn on
    with pytest.raises(UnsupportedKVCache, match="enable_sleep_mode=True"):
        KVScopeConnector(config, getattr(KVConnectorRole, role), _kv_cache_config(64, WINDOW))


@pytest.mark.parametrize("log_stats", [False, True])
def test_a_metrics_port_without_vllms_stats_is_refused_when_vllms_scheduler_binds_the_connector(model_path,
                                                                                                log_stats):
    """vllm.LLM's default (disable_log_stats=True) builds no metrics: the port would serve nothing, silently."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from connector.config import ConfigError
    from tests.compat.model_free import _kv_cache_config

    transfer = KVTransferConfig(kv_connector="KVScopeConnector", kv_connector_module_path="connector",
                                kv_role="kv_both",
                                kv_connector_extra_config={"cpu_bytes": 64 << 20, "metrics_port": 9464})
    config = create_engine_config(EngineArgs(model=model_path, skip_tokenizer_init=True, block_size=16,
                                             kv_transfer_config=transfer))
    config.cache_config.num_gpu_blocks = 64

    def scheduler():
        return Scheduler(vllm_config=config, kv_cache_config=_kv_cache_config(64, WINDOW),
                         structured_output_manager=StructuredOutputManager(config), block_size=16,
                         hash_block_size=16, log_stats=log_stats)

    if log_stats:
        assert scheduler().connector.config.metrics_port == 9464
    else:
        with pytest.raises(ConfigError, match="metrics_port=9464 is not accepted: vLLM's stats are off "
                                              r"\(disable_log_stats"):
            scheduler()


def test_a_bad_config_stops_vllm_while_it_builds_its_config_on_gpus(model_path):
    """On a GPU (full CUDA graphs) vLLM asks the connector class whether it needs piecewise graphs
    while it builds its config, before it loads the model: a bad key or value stops start-up there,
    not minutes later when it builds the connector. The CPU platform has no graphs: patched to ask."""
    from vllm.config import CUDAGraphMode, KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from connector import KVScopeConnector

    def config(extra):
        transfer = KVTransferConfig(kv_connector="KVScopeConnector", kv_connector_module_path="connector",
                                    kv_role="kv_both", kv_connector_extra_config=extra)
        return create_engine_config(EngineArgs(model=model_path, skip_tokenizer_init=True, block_size=16,
                                               kv_transfer_config=transfer))

    with mock.patch.object(CUDAGraphMode, "has_full_cudagraphs", lambda self: True), \
            mock.patch.object(type(current_platform), "support_static_graph_mode", classmethod(lambda cls: True)):
        with pytest.raises(ValueError, match=r"unknown key\(s\) cpu_byte=67108864 \(did you mean cpu_bytes\?\); "
                                             r"accepted keys: cpu_bytes"):
            config({"cpu_byte": 64 << 20})
        with pytest.raises(ValueError, match="trace_sample_ratio=1.5 is not accepted"):
            config({"cpu_bytes": 64 << 20, "trace_sample_ratio": 1.5})
        config({"cpu_bytes": 64 << 20})
    assert KVScopeConnector.requires_piecewise_for_cudagraph({"cpu_bytes": 64 << 20}) is False


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer"])
def test_a_kv_role_other_than_both_is_refused_at_start_up(model_path, kv_role):
    """A host-tier cache stores and loads: the roles of disaggregated prefill would make it do half."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from connector import KVScopeConnector
    from connector.config import ConfigError
    from tests.compat.model_free import _kv_cache_config

    transfer = KVTransferConfig(kv_connector="KVScopeConnector", kv_connector_module_path="connector",
                                kv_role=kv_role, kv_connector_extra_config={"cpu_bytes": 64 << 20})
    config = create_engine_config(EngineArgs(model=model_path, skip_tokenizer_init=True, block_size=16,
                                             kv_transfer_config=transfer))
    with pytest.raises(ConfigError, match=f"kv_role='{kv_role}' is not accepted.*accepted is 'kv_both'"):
        KVScopeConnector(config, KVConnectorRole.SCHEDULER, _kv_cache_config(64, WINDOW))


def _connector_config(model_path, extra: dict, **engine_args):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    transfer = KVTransferConfig(kv_connector="KVScopeConnector", kv_connector_module_path="connector",
                                kv_role="kv_both", kv_connector_extra_config=extra)
    return create_engine_config(EngineArgs(model=model_path, skip_tokenizer_init=True, block_size=16,
                                           kv_transfer_config=transfer, **engine_args))


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
@pytest.mark.parametrize("extra, message", [
    ({"cpu_bytes": 10**30}, r"cpu_bytes=10+ is not accepted: it gives \d+ host slots|cpu_bytes gives a host tier"),
    ({"cpu_bytes": 64 << 20, "block_size": 4096},
     r"block_size=4096 is not accepted: no request of this engine \(max_model_len 2048\)"),
], ids=["tier-beyond-host-memory", "block-longer-than-any-request"])
def test_a_host_tier_that_cannot_work_is_refused_at_start_up(model_path, role, extra, message):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector import KVScopeConnector
    from connector.config import ConfigError
    from tests.compat.model_free import _kv_cache_config

    config = _connector_config(model_path, extra, max_model_len=2048)
    with pytest.raises(ConfigError, match=message):
        KVScopeConnector(config, getattr(KVConnectorRole, role), _kv_cache_config(64, WINDOW))


def test_kvscope_logs_through_vllms_handlers(model_path):
    """vLLM configures only its `vllm` logger: kvscope's start-up summary (INFO) must reach its handlers."""
    import logging

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector import KVScopeConnector
    from tests.compat.model_free import _kv_cache_config

    config = _connector_config(model_path, {"cpu_bytes": 64 << 20})  # (vLLM may configure its logging here)
    ours, theirs = logging.getLogger("connector"), logging.getLogger("vllm")
    saved = (list(ours.handlers), ours.level)
    records: list[logging.LogRecord] = []
    catch = logging.Handler()
    catch.emit = records.append
    theirs.addHandler(catch)
    ours.handlers, ours.level = [], logging.NOTSET
    their_level = theirs.level
    theirs.setLevel(logging.INFO)  # vLLM's default (another test's VLLM_LOGGING_LEVEL may have raised it)
    root = logging.getLogger()
    root_handlers, root.handlers = root.handlers, []  # as in vLLM's processes (pytest adds its own)
    try:
        connector = KVScopeConnector(config, KVConnectorRole.SCHEDULER, _kv_cache_config(64, WINDOW))
        connector.shutdown()
        assert any("host slots of" in r.getMessage() for r in records), [r.getMessage() for r in records]
        records.clear()
        root.handlers = root_handlers  # the user configured logging: the root prints, vLLM's handlers do not
        logging.getLogger("connector.scheduler").warning("kvscope: printed once")
        assert records == []
    finally:
        root.handlers = root_handlers
        theirs.setLevel(their_level)
        theirs.removeHandler(catch)
        ours.handlers, ours.level = saved


def test_kvscope_joins_vllms_handlers_once_vllm_has_some_and_keeps_a_level_already_chosen():
    """Each connector of a process calls `log_through_vllm`: a second handler printed every line twice.
    Before vLLM configured its logger there is nothing to join (and no level to take from it)."""
    import logging

    from connector.vllm_logging import _ThroughVllm, log_through_vllm

    ours, theirs, root = logging.getLogger("connector"), logging.getLogger("vllm"), logging.getLogger()
    saved = [(logger, list(logger.handlers), logger.level) for logger in (ours, theirs, root)]

    def keeping(level: int) -> list[logging.LogRecord]:
        kept: list[logging.LogRecord] = []
        handler = logging.Handler(level)
        handler.emit = kept.append
        theirs.addHandler(handler)
        return kept

    try:
        for logger in (ours, theirs, root):
            logger.handlers, logger.level = [], logging.NOTSET
        log_through_vllm()
        assert ours.handlers == [] and ours.level == logging.NOTSET  # vLLM has not configured its logger yet
        theirs.setLevel(logging.INFO)
        info = keeping(logging.INFO)
        log_through_vllm()
        log_through_vllm()
        assert [type(h) for h in ours.handlers] == [_ThroughVllm] and ours.level == logging.INFO
        warning = keeping(logging.WARNING)  # added later (a dictConfig): it gets kvscope's records too
        logging.getLogger("connector.scheduler").info("kvscope: info")
        logging.getLogger("connector.scheduler").warning("kvscope: warning")
        assert [r.getMessage() for r in info] == ["kvscope: info", "kvscope: warning"]
        assert [r.getMessage() for r in warning] == ["kvscope: warning"]  # each handler's own level
        for level, root_handlers in ((logging.DEBUG, []), (logging.NOTSET, [logging.NullHandler()])):
            ours.handlers, ours.level, root.handlers = [], level, root_handlers
            log_through_vllm()  # a level chosen already, or the user's own logging set up: left as it is
            assert ours.level == level
    finally:
        for logger, handlers, level in saved:
            logger.handlers, logger.level = handlers, level


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
@pytest.mark.parametrize("name", ["pipeline_parallel_size", "decode_context_parallel_size"])
def test_parallelism_kvscope_cannot_follow_is_refused_at_start_up(model_path, role, name):
    """`kvscope check` refuses these flags, but `vllm serve` never runs it: the connector itself must
    refuse them when vLLM builds it (the CPU platform cannot start such an engine: set on the config)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector import KVScopeConnector
    from connector.vllm_layout import UnsupportedKVCache
    from tests.compat.model_free import _kv_cache_config

    config = _connector_config(model_path, {"cpu_bytes": 64 << 20})
    setattr(config.parallel_config, name, 2)
    with pytest.raises(UnsupportedKVCache, match=f"{name}=2 is not supported by kvscope"):
        KVScopeConnector(config, getattr(KVConnectorRole, role), _kv_cache_config(64, WINDOW))


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_a_config_wrong_two_ways_names_the_extra_config_first_as_kvscope_check_does(model_path, role):
    """A bad `kv_connector_extra_config` and refused parallelism: start-up names the key first, as `kvscope
    check` does, so an operator who fixes what one says meets no other problem first in the other."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector import KVScopeConnector
    from connector.config import ConfigError
    from connector.config_check import EngineShape, check_transfer_config
    from tests.compat.model_free import _kv_cache_config

    extra = {"cpu_bytes": 64 << 20, "bogus_key": 1}
    config = _connector_config(model_path, extra)
    config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ConfigError, match="bogus_key") as at_start_up:
        KVScopeConnector(config, getattr(KVConnectorRole, role), _kv_cache_config(64, WINDOW))
    flags = json.dumps({"kv_connector": "KVScopeConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra})
    with pytest.raises(ConfigError) as checked:
        check_transfer_config(flags, EngineShape(pipeline_parallel_size=2))
    assert str(checked.value) == str(at_start_up.value)


def test_the_tokens_a_drafter_may_prefill_again_are_not_final(model_path):
    """vLLM's KV cache manager treats the last `num_prefill_lookahead_tokens - 1` tokens as re-prefillable
    (multi-module MTP rewrites their KV) and does not cache them: nor may kvscope store them. Such a
    drafter cannot be built here: vLLM's count is set on the config."""
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector import KVScopeConnector
    from tests.compat.model_free import _kv_cache_config

    config = _connector_config(model_path, {"cpu_bytes": 64 << 20})
    for lookahead, reprefillable in ((0, 0), (1, 0), (3, 2)):
        with mock.patch.object(VllmConfig, "num_prefill_lookahead_tokens", new_callable=mock.PropertyMock,
                               return_value=lookahead, create=True):
            connector = KVScopeConnector(config, KVConnectorRole.SCHEDULER, _kv_cache_config(64, WINDOW))
        assert connector._scheduler.reprefillable_tokens == reprefillable, lookahead
        connector.shutdown()


def test_the_scheduler_reports_its_host_tier_as_its_data_parallel_engines(model_path):
    """Engine 1 of two data-parallel engines (vLLM sets `data_parallel_index` in each engine process): its stats
    name engine 1's tier, so vLLM's aggregated log of both engines adds the two tiers up."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector import KVScopeConnector
    from tests.compat.model_free import _kv_cache_config

    config = _connector_config(model_path, {"cpu_bytes": 64 << 20})
    for index, engine in ((None, 0), (1, 1)):
        config.parallel_config.data_parallel_index = index
        connector = KVScopeConnector(config, KVConnectorRole.SCHEDULER, _kv_cache_config(64, WINDOW))
        connector._scheduler._update_capacity_stats()
        assert connector._scheduler.take_stats().data["host_engine"] == engine
        connector.shutdown()


def test_a_job_waits_for_every_worker_of_its_engine_not_only_this_hosts(model_path):
    """A job is done when all of its engine's workers reported it, wherever they run: counting only this
    host's (tensor parallelism over two nodes), a load would be done when half its workers had copied,
    and the forward would read blocks the other node had not loaded yet."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector import KVScopeConnector
    from tests.compat.model_free import _kv_cache_config

    config = _connector_config(model_path, {"cpu_bytes": 64 << 20})
    config.parallel_config.world_size, config.parallel_config.nnodes = 4, 2
    connector = KVScopeConnector(config, KVConnectorRole.SCHEDULER, _kv_cache_config(64, WINDOW))
    assert connector._scheduler.world_size == 4
    connector.shutdown()


def test_the_scheduler_side_knows_when_vllm_drafts_tokens(model_path):
    """With drafts a forward's end is not where a Mamba state is kept (the accepted draft decides): the
    connector must tell its scheduler side that vLLM runs speculative decoding. (The mamba-spec scenarios
    pass without it: this pins the wiring.)"""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector import KVScopeConnector
    from tests.compat.model_free import _kv_cache_config

    drafting = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    for speculative_config, witness in ((None, True), (drafting, False)):
        config = _connector_config(model_path, {"cpu_bytes": 64 << 20}, speculative_config=speculative_config)
        connector = KVScopeConnector(config, KVConnectorRole.SCHEDULER, _kv_cache_config(64, WINDOW))
        assert connector._scheduler.states.forward_ends_witness is witness, speculative_config
        connector.shutdown()


def _crowding_warnings(model_path, role: str, rank: int | None = None) -> list[str]:
    """What one connector warns at start-up of this host's memory, with four workers on the host and
    memory for three of their tiers; ``rank``: its tensor-parallel rank (None: vLLM's, unset here)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector import KVScopeConnector, sides
    from tests.compat.model_free import _kv_cache_config

    config = _connector_config(model_path, {"cpu_bytes": 64 << 20})
    ranked = {} if rank is None else {"worker_rank": mock.DEFAULT}
    with mock.patch.multiple(sides, workers_on_this_host=mock.DEFAULT, physical_memory_bytes=mock.DEFAULT,
                             **ranked) as patched, mock.patch.object(sides.logger, "warning") as warning:
        patched["workers_on_this_host"].return_value = 4
        patched["physical_memory_bytes"].return_value = 3 * (64 << 20)
        if rank is not None:
            patched["worker_rank"].return_value = rank
        KVScopeConnector(config, getattr(KVConnectorRole, role), _kv_cache_config(64, WINDOW)).shutdown()
    return [str(call.args[0]) for call in warning.call_args_list if "workers on this host" in str(call.args[0])]


def test_only_the_first_worker_warns_that_this_hosts_tiers_outgrow_its_memory(model_path):
    """Each worker allocates its own tier on its own host, so the workers check the host's memory, not the
    scheduler (it may run on another host); one warning per engine is enough: rank 0's (outside vLLM's
    distributed state, as here, a worker is rank 0)."""
    warnings = _crowding_warnings(model_path, "WORKER")
    assert len(warnings) == 1 and warnings[0].startswith("kvscope: 4 workers on this host"), warnings
    assert _crowding_warnings(model_path, "WORKER", rank=1) == []
    assert _crowding_warnings(model_path, "SCHEDULER") == []


def test_a_worker_connector_shuts_its_worker_down(model_path):
    """vLLM's shutdown of a worker's connector must reach the worker (its copy engine's threads and
    pinned host tier), not only the tracing."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector import KVScopeConnector
    from tests.compat.model_free import _kv_cache_config

    connector = KVScopeConnector(_connector_config(model_path, {"cpu_bytes": 64 << 20}), KVConnectorRole.WORKER,
                                 _kv_cache_config(64, WINDOW))
    worker = connector._worker
    with mock.patch.object(worker, "shutdown", wraps=worker.shutdown) as shutdown:
        connector.shutdown()
    shutdown.assert_called_once_with()


def test_the_hash_block_size_falls_back_to_vllms_cache_config(model_path):
    """Where vLLM's KV cache config names no hash block size, its cache config's (partial hash hits)
    is the one an offloaded block must be a multiple of, not the device block size."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connector import KVScopeConnector
    from connector.config import ConfigError
    from tests.compat.model_free import _kv_cache_config

    config = _connector_config(model_path, {"cpu_bytes": 64 << 20, "block_size": 48})
    config.cache_config.hash_block_size = 32
    kv_cache_config = _kv_cache_config(64, WINDOW)
    assert kv_cache_config.hash_block_size is None
    with pytest.raises(ConfigError, match="block_size=48 is not accepted: it must be a multiple of vLLM's "
                                          "prefix-cache hash block size 32"):
        KVScopeConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)


def test_a_cuda_worker_places_its_store_fence_when_its_caches_are_registered(model_path):
    """Where a CUDA worker fences its stores depends on vLLM's runner and caches (`sides.store_fence`, its own
    test in test_copy_streams): set when vLLM registers the KV caches (a CPU copy engine needs no fence).
    CUDA is faked on CPU caches."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    import connector.connector as connector_module
    from connector import KVScopeConnector
    from connector.worker import KVScopeWorker
    from tests.compat.model_free import PAGE, _kv_cache_config

    config, kv_cache_config = _connector_config(model_path, {"cpu_bytes": 64 << 20}), _kv_cache_config(64, WINDOW)
    real_register = KVScopeWorker.register_kv_caches

    def register_on_cuda(worker, kv_caches):
        real_register(worker, kv_caches)
        worker.engine.is_cuda = True

    caches = {name: torch.zeros(64, PAGE, dtype=torch.int8)
              for group in kv_cache_config.kv_cache_groups for name in group.layer_names}
    connector = KVScopeConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    assert connector._worker.store_fence == FENCE_AT_ONCE  # the default, before vLLM registers its caches
    with mock.patch.object(KVScopeWorker, "register_kv_caches", register_on_cuda), \
            mock.patch.object(connector_module, "store_fence", return_value=FENCE_WHEN_REUSED) as store_fence:
        connector.register_kv_caches(caches)
    try:
        store_fence.assert_called_once_with(config, kv_cache_config)
        assert connector._worker.store_fence == FENCE_WHEN_REUSED
    finally:
        connector._worker.engine.is_cuda = False
        connector.shutdown()


def _prompts_twice(engine: ModelFreeEngine) -> int:
    """Round 0 (requests r0-j), a reset of vLLM's device prefix cache, round 1 (r1-j) of `_prompts`;
    returns round 0's external hit tokens."""
    prompts = _prompts()
    for j, prompt in enumerate(prompts):
        engine.add(f"r0-{j}", prompt)
    engine.run()
    engine.reset_device_prefix_cache()
    round0_hits = engine.stats.external_hit_tokens
    for j, prompt in enumerate(prompts):
        engine.add(f"r1-{j}", prompt)
    engine.run()
    return round0_hits


@pytest.mark.parametrize("mamba_block, hash_block, max_num_batched_tokens",
                         [(64, 16, 2048), (64, 16, 100), (16, 16, 2048), (16, 16, 100)],
                         ids=["partial-hits-one-step", "partial-hits-chunked", "one-step", "chunked"])
def test_mamba_states_are_stored_only_at_their_own_boundary(model_path, mamba_block, hash_block,
                                                             max_num_batched_tokens, caplog):
    """A Mamba group in vLLM's align mode: a block holds the state at its end, except the checkpoint
    a prompt's last chunk saves into the block before its last, which holds the state at the last
    hash boundary: with hash blocks finer than state blocks (vLLM's partial hash hits), not that
    block's end. Stored under that block's key, it would give a later request sharing the prefix
    the state of other tokens. Round 1 loads states and KV, and each step's first state is checked."""
    from tests.compat.model_free import MambaAlign

    caplog.set_level("INFO", logger="connector.store_plans")
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": mamba_block}, window=WINDOW,
                             max_num_batched_tokens=max_num_batched_tokens, mamba=MambaAlign(mamba_block, hash_block))
    try:
        round0_hits = _prompts_twice(engine)  # vLLM keeps few states: round 0 may hit the host tier already
        assert engine.host_tier_leaks() == []
    finally:
        engine.shutdown()
    stats = engine.stats
    _assert_no_violations(stats)
    loaded = loaded_blocks_by_group(stats, [f"r1-{j}" for j in range(4)])
    assert loaded.get(0) and loaded[1], loaded  # states (one per loading request) and KV were loaded
    skipped = [r for r in caplog.records if "holds vLLM's state at token" in r.getMessage()]
    assert len(skipped) == (mamba_block != hash_block), skipped  # said once, where it happens
    if mamba_block == hash_block:  # checkpoints land on block ends: every prompt's last one is a hit
        expected = sum((len(p) - 1) // mamba_block * mamba_block for p in _prompts())
        assert stats.external_hit_tokens - round0_hits == expected


@pytest.mark.parametrize("retention, hits", [(0, None), (64, None), (None, True)],
                         ids=["vllm-default", "periodic", "dense"])
def test_an_offloaded_block_of_several_mamba_state_blocks_is_refused_unless_vllm_keeps_every_state(
        model_path, retention, hits):
    """vLLM keeps a Mamba state at its checkpoints only (unless `prefix_cache_retention_interval` is
    None): an offloaded block of two state blocks would never hold both, so nothing would be stored
    or served. Start-up says so, naming the key and what is accepted; with every state kept, it serves."""
    from connector.config import ConfigError
    from tests.compat.model_free import MambaAlign

    def engine():
        return ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 32}, window=WINDOW,
                               mamba=MambaAlign(16, 16, retention=retention))

    if not hits:
        with pytest.raises(ConfigError, match=r"block_size=32 is not accepted: .* Mamba state blocks of 16 tokens"):
            engine()
        return
    engine = engine()
    try:
        before = _prompts_twice(engine)
    finally:
        engine.shutdown()
    _assert_no_violations(engine.stats)
    assert engine.stats.external_hit_tokens > before


@pytest.mark.parametrize("mamba_block, hash_block", [(64, 16), (16, 16)], ids=["partial-hits", "default"])
@pytest.mark.parametrize("async_scheduling, runner, num_blocks, workers",
                         [(False, "v1", 1200, 1), (True, "v1", 1200, 1), (True, "v2", 1200, 1), (True, "v1", 140, 1),
                          (False, "v1", 1200, 2)],
                         ids=["sync", "async", "v2-async", "async-preempting", "two-workers"])
def test_a_conversation_turn_loads_mamba_states_decode_steps_left(model_path, mamba_block, hash_block,
                                                                  async_scheduling, runner, num_blocks, workers):
    """vLLM keys Mamba states at the prompt's boundaries only; past them, a decode step that ends
    at a block's end leaves the state there (its runner writes the state after each step into the
    block of its last position), which kvscope stores with `mamba_decode_states` true: turn 2 hits
    every whole block of turn 1, state and KV checked."""
    from tests.compat.model_free import MambaAlign

    extra = {"cpu_bytes": 64 << 20, "block_size": mamba_block, "mamba_decode_states": True}
    engine = ModelFreeEngine(model_path, extra, window=WINDOW, async_scheduling=async_scheduling, runner=runner,
                             num_blocks=num_blocks, workers=workers, mamba=MambaAlign(mamba_block, hash_block))
    turn2_hits, expected = _two_turns(engine, mamba_block)
    _assert_no_violations(engine.stats)
    assert bool(engine.stats.resumed) == (num_blocks < 1000)
    assert turn2_hits == expected


@pytest.mark.parametrize("mamba_block, hash_block, async_scheduling, num_blocks",
                         [(16, 16, False, 1200), (16, 16, True, 1200), (64, 16, True, 1200), (16, 16, True, 140)],
                         ids=["default-sync", "default-async", "partial-hits-async", "default-async-preempting"])
def test_by_default_a_conversation_turn_loads_only_prefill_states(
        model_path, mamba_block, hash_block, async_scheduling, num_blocks):
    """`mamba_decode_states` false (the default): turn 2 hits turn 1's prompt's whole blocks and no further (the states
    decode steps left past them are not stored), states and KV checked. With partial hash hits vLLM
    keeps a prompt's last state at its last hash boundary, a block's end for some prompts only (450 and
    644 tokens here, not 547 and 741): the others hit at an earlier state. A request vLLM preempts
    computes its decoded tokens again by a prefill, whose states vLLM keys: those may be stored."""
    from tests.compat.model_free import MambaAlign

    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": mamba_block}, window=WINDOW,
                             async_scheduling=async_scheduling, num_blocks=num_blocks,
                             mamba=MambaAlign(mamba_block, hash_block))
    turn2_hits, through_the_replies = _two_turns(engine, mamba_block)
    _assert_no_violations(engine.stats)
    prompts_blocks = sum(len(p) // mamba_block * mamba_block for p in _prompts())
    assert bool(engine.stats.resumed) == (num_blocks < 1000)
    if engine.stats.resumed:
        assert prompts_blocks <= turn2_hits < through_the_replies
    elif hash_block == mamba_block:
        assert turn2_hits == prompts_blocks
    else:
        assert 0 < turn2_hits < prompts_blocks


@pytest.mark.parametrize("retention, guarded", [(None, True), (128, True), (0, True), (None, False)],
                         ids=["dense", "every-128", "default", "dense-negative-control"])
def test_a_mamba_block_a_chunk_started_inside_keeps_that_state(model_path, retention, guarded, monkeypatch):
    """A request hits vLLM's prefix cache inside a state block (partial hash hits: at 80 of a
    64-token block), gets a private copy of that block (copy-on-write) and, its prompt's
    checkpoint saved in the same chunk, runs past the block's end in one chunk: the block keeps
    the state at 80. vLLM keys it for 128 tokens when it keeps every state (dense or periodic
    retention); kvscope must not store it under that key, or a later request sharing 128 tokens
    would resume from the state at 80. Negative control: with every block taken for its own end's
    state, that block is stored and `c` loads the state at 80 (so the check can fail)."""
    from connector.state_blocks import StateBlocks
    from tests.compat.model_free import MambaAlign

    if not guarded:
        monkeypatch.setattr(StateBlocks, "holds_own_state", staticmethod(lambda *args: True))
    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 64}, window=WINDOW,
                             mamba=MambaAlign(64, 16, retention=retention))
    first = [(31 * i + 3) % 509 + 1 for i in range(90)]
    second = first + [(17 * i + 5) % 509 + 1 for i in range(210)]
    try:
        engine.add("a", first, max_tokens=1)
        engine.run()
        engine.add("b", second, max_tokens=1)  # a local hit at 80 (the checkpoint of `a`)
        engine.run()
        engine.reset_device_prefix_cache()
        engine.add("c", second + [7, 8, 9], max_tokens=1)  # shares 128 tokens and more with `b`
        engine.run()
        assert engine.host_tier_leaks() == []
    finally:
        engine.shutdown()
    if not guarded:
        assert engine.stats.violations and engine.stats.checked_loaded_blocks > 0
        return
    # `c` finds no stored state to resume from at 128 (nor past it): it loads nothing
    _assert_no_violations(engine.stats, loads=False)


@pytest.mark.parametrize("retention", [None, 128], ids=["dense", "every-128"])
def test_nor_for_a_request_that_finds_that_block_in_vllms_prefix_cache(model_path, retention):
    """As above, and before vLLM's device cache is reset, `d` shares 128 tokens with `b` and finds `b`'s
    block in vLLM's prefix cache under its 128-token key: resuming from it, `d` reads the state at 80
    (vLLM's own mix-up, reported for `d` alone). kvscope must not store that block for `d` either: it
    has seen `b`'s forward start inside it, under that key. So `c`, after the reset, reads no wrong state
    (fuzz seed 270492: `c` loaded the state at 80 from the host tier)."""
    from tests.compat.model_free import MambaAlign

    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 64}, window=WINDOW,
                             mamba=MambaAlign(64, 16, retention=retention))
    first = [(31 * i + 3) % 509 + 1 for i in range(90)]
    second = first + [(17 * i + 5) % 509 + 1 for i in range(210)]
    try:
        for req_id, prompt in (("a", first), ("b", second), ("d", second[:128] + [11, 12, 13, 14])):
            engine.add(req_id, prompt, max_tokens=1)
            engine.run()
        assert engine.stats.external_hit_tokens == 0
        engine.reset_device_prefix_cache()
        engine.add("c", second + [7, 8, 9], max_tokens=1)
        engine.run()
        assert engine.host_tier_leaks() == []
    finally:
        engine.shutdown()
    assert {(v.req_id, v.block_index) for v in engine.stats.violations} == {("d", 1)}  # vLLM's, not a load's
    assert engine.stats.checked_blocks > 0


def test_a_block_a_forward_started_inside_is_forgotten_once_vllm_gives_it_out_anew(model_path):
    """What kvscope keeps of such a block lasts only while vLLM keeps the block: requests that cycle a
    small device cache get every block allocated afresh, and then nothing of it is left (else a block
    later recomputed right under the same key would never be stored)."""
    from tests.compat.model_free import MambaAlign

    engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "block_size": 64}, window=WINDOW,
                             mamba=MambaAlign(64, 16, retention=None), num_blocks=100)
    first = [(31 * i + 3) % 509 + 1 for i in range(90)]
    states = engine.scheduler.get_kv_connector()._scheduler.states
    try:
        for req_id, prompt in (("a", first), ("b", first + [(17 * i + 5) % 509 + 1 for i in range(210)])):
            engine.add(req_id, prompt, max_tokens=1)
            engine.run()
        assert len(states._wrong_states) == 1  # `b` started inside its block 1 and left it
        for k in range(4):
            engine.add(f"x{k}", [(13 * i + 7 * k + 1) % 509 + 1 for i in range(600)], max_tokens=1)
            engine.run()
        assert states._wrong_states == {}
        _assert_no_violations(engine.stats, loads=False)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("mamba", [True, False], ids=["mamba", "no-mamba"])
def test_start_up_says_what_mamba_decode_states_true_does(model_path, mamba):
    """Said once, by the scheduler side: decode states are stored too, and what that may cost; without
    a Mamba group the key changes nothing, which an operator who set it should hear."""
    import logging

    from tests.compat.model_free import MambaAlign

    records: list[logging.LogRecord] = []
    catch = logging.Handler()
    catch.emit = records.append
    logger = logging.getLogger("connector.sides")
    level = logger.level
    logger.addHandler(catch)
    logger.setLevel(logging.INFO)  # vLLM's default (another test's VLLM_LOGGING_LEVEL may have raised it)
    try:
        engine = ModelFreeEngine(model_path, {"cpu_bytes": 64 << 20, "mamba_decode_states": True}, window=WINDOW,
                                 mamba=MambaAlign(16, 16) if mamba else None)
        engine.shutdown()
    finally:
        logger.removeHandler(catch)
        logger.setLevel(level)
    said = [(r.levelname, r.getMessage()) for r in records if "mamba_decode_states" in r.getMessage()]
    expected = (("INFO", "kvscope: mamba_decode_states true: the Mamba states decode steps leave are stored too "
                         "(loads through a reply; outputs may part from a recompute's by bf16 rounding)")
                if mamba else
                ("WARNING", "kvscope: mamba_decode_states true changes nothing: this model has no Mamba group"))
    assert said == [expected]
