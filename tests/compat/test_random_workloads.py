"""Random workloads (`workload_fuzz`) under vLLM's own scheduler with kvscope, over a fixed set of seeds.

Each seed is a random engine configuration and a multi-round workload, replayed with every KV position
a forward reads checked (`model_free`). The seeds were picked from a sweep of the "fast" profile: most
of them load from the host tier, and together they cover async scheduling, the V2 runner (and vLLM
0.33's V2 runner with speculative decoding), two workers, speculative decoding, Mamba state groups,
host-tier evictions, preemptions, chunked prefills, aborts, device prefix-cache resets and resets with
new weights. `test_the_seeds_cover_what_they_were_picked_for` notices when a change to the generator
makes them cover less. More seeds: `python -m tests.compat.workload_fuzz --profile full --shrink`.
"""

from __future__ import annotations

import pytest

from connector.scheduler import KVScopeScheduler
from tests.compat import workload_fuzz
from tests.compat.model_free import without_load_admission
from tests.compat.span_agreement import trace_file_attributes
from tests.compat.workload_fuzz import execute, make_plan, missing_feature

SEEDS = [
    0, 2, 22, 34, 42, 48, 53, 55, 59, 66, 67, 71, 99, 102, 105, 106, 124, 130, 158, 159, 164, 173, 174, 182,
    194, 201, 206, 208, 213, 220, 224, 238, 241, 249, 261, 265, 268, 272, 276, 277, 283, 292, 294, 299, 301,
    307, 309, 310, 314, 320, 330, 340, 349, 351, 355, 357, 362, 373, 378, 383, 395, 396, 430, 439, 440, 456,
    468, 471, 473, 484, 486, 510, 519, 532, 555, 557, 577, 581, 593, 618, 623, 627, 633, 634, 640, 643, 644,
    647, 652, 653, 660, 677, 680, 698, 706, 712, 715, 721, 725, 737, 741, 748, 763, 767, 771, 781, 782, 797,
    192, 205, 339, 719,  # the V2 runner with speculative decoding (vLLM 0.33 on)
]
PLANS = {seed: make_plan(seed, "fast") for seed in SEEDS}
RUNNABLE = [seed for seed in SEEDS if missing_feature(PLANS[seed]) is None]


def _seed_param(seed: int):
    reason = missing_feature(PLANS[seed])
    return pytest.param(seed, id=f"seed{seed}", marks=pytest.mark.skipif(reason is not None, reason=str(reason)))


@pytest.fixture(scope="module")
def result_of():
    """Each seed's result, computed once for the module: the per-seed tests and the summaries share them."""
    results = {}

    def result(seed: int):
        if seed not in results:
            results[seed] = execute(PLANS[seed])
        return results[seed]

    return result


@pytest.mark.parametrize("seed", [_seed_param(seed) for seed in SEEDS])
def test_a_random_workload_reads_the_kv_it_wrote_finishes_and_leaks_nothing(result_of, seed):
    """No forward reads wrong KV, every request ends with all its tokens, the host tier holds nothing
    after, the trace file's spans tell what the stats count (`span_agreement`), and none meets vLLM's
    known admission stall (kvscope's load admission keeps vLLM out of it)."""
    result = result_of(seed)
    shown = "\n".join(result.violations[:10])
    assert not result.violations, f"{len(result.violations)} blocks read wrong KV:\n{shown}"
    assert not result.unfinished, result.unfinished[:10]
    assert not result.leaks, result.leaks[:10]
    assert not result.vllm_stalls, f"vLLM's admission stall, which kvscope must prevent: {result.vllm_stalls}"
    assert result.checked_blocks > 0


def test_the_seeds_load_from_the_host_tier(result_of):
    """Blocks a forward re-reads of its own KV always check out: the suite means something only if
    forwards read blocks that loads filled, in a good share of the seeds."""
    loaded = [result_of(seed).checked_loaded_blocks for seed in RUNNABLE]
    assert sum(loaded) > 0
    assert 3 * sum(blocks > 0 for blocks in loaded) >= len(RUNNABLE), loaded


def test_the_seeds_cover_what_they_were_picked_for(result_of):
    """Configurations from the plans, events from the replays: each is in several seeds."""
    configs = [PLANS[seed]["config"] for seed in RUNNABLE]
    results = [result_of(seed) for seed in RUNNABLE]
    rounds = [PLANS[seed]["rounds"] for seed in RUNNABLE]
    covered = {
        "async scheduling": sum(c["async_scheduling"] for c in configs),
        "the V2 runner": sum(c["runner"] != "v1" for c in configs),
        "two workers": sum(c["workers"] == 2 for c in configs),
        "speculative decoding": sum("spec_tokens" in c for c in configs),
        "Mamba": sum("mamba" in c for c in configs),
        "chunked prefills": sum(_longest_prompt(PLANS[seed]) > PLANS[seed]["config"]["max_num_batched_tokens"]
                                for seed in RUNNABLE),
        "device prefix-cache resets": sum(any(r["between"] == "reset" for r in rs[:-1]) for rs in rounds),
        "resets with new weights": sum(any(r["between"] == "weights" for r in rs) for rs in rounds),
        "evictions": sum(r.evictions > 0 for r in results),
        "preemptions": sum(r.preemptions > 0 for r in results),
        "aborts": sum(r.aborts > 0 for r in results),
    }
    assert all(count >= 3 for count in covered.values()), covered


def _longest_prompt(plan: dict) -> int:
    return max(sum(n for _, n in request["prompt"])
               for round_ in plan["rounds"] for phase in round_["phases"] for request in phase["adds"])


def test_the_known_vllm_stall_is_told_apart_from_other_failures_and_kvscope_keeps_out_of_it(monkeypatch):
    """vLLM admits three async loads whose prefills need more device blocks together than are free, and
    stalls with nothing running (`test_known_vllm_gap_async_loads_admitted_past_their_reserve_stall_the_
    scheduler`). kvscope's load admission defers the loads that could: the plan runs through. Without
    it the replay names the stall (a failure: kvscope must keep vLLM out of it), aborts the stuck
    requests as a client would, and goes on. When vLLM closes the gap, the stall's recognition can go."""
    def request(req_id, prompt, max_tokens=2):
        return {"id": req_id, "prompt": prompt, "max_tokens": max_tokens, "salt": None}

    def phase(*adds):
        return {"adds": list(adds), "pause_after": None, "abort_on_schedule": [], "abort_after": []}

    first = [["shared", 700], ["a", 525]]
    plan = {"seed": 0, "config": {"block_size": 256, "workers": 1, "async_scheduling": False, "runner": "v1",
                                  "num_blocks": 200, "max_num_batched_tokens": 512, "cpu_bytes": 64 << 20},
            "rounds": [{"phases": [phase(request("first", first))], "between": "reset"},
                       {"phases": [phase(request("b", [["shared", 700], ["b", 307]]),
                                         request("c", [*first, ["gen", 2], ["c", 54]]),
                                         request("d", [["shared", 700], ["d", 63]], 1))], "between": "none"},
                       {"phases": [phase(request("after", [["shared", 700], ["e", 100]]))], "between": "none"}]}
    result = execute(plan)
    assert result.verdict == "ok" and not result.vllm_stalls and result.external_hit_tokens > 0
    without_load_admission(monkeypatch)
    result = execute(plan)
    assert result.vllm_stalls == [["b", "c", "d"]] and result.aborts == 3
    assert result.verdict == "stall" and result.failure == "stall"


# V1 and V2, async scheduling, ngram, EAGLE and MTP, the shared-prefix checkpoint; all but 260032 load
# from the host tier, and 260032 meets vLLM's checkpoint exported over the running state (`model_free`)
MAMBA_SPEC_SEEDS = [260014, 260032, 260056, 260063, 260085, 260088]


@pytest.mark.parametrize("seed", [pytest.param(seed, id=f"seed{seed}") for seed in MAMBA_SPEC_SEEDS])
def test_the_mamba_spec_profile_combines_a_mamba_group_with_drafts(seed):
    """The "mamba-spec" profile draws a Mamba group and drafts together, which "fast" and "full" never
    do: the replay's drafts are verified and rejected with the Mamba states moved as vLLM's runners
    move them (`ModelFreeEngine._plan_state_moves`), and every state a step resumes from checks out."""
    plan = make_plan(seed, "mamba-spec")
    config = plan["config"]
    assert "mamba" in config and config["spec_tokens"] >= 1, config
    if reason := missing_feature(plan):
        pytest.skip(reason)
    result = execute(plan)
    assert result.verdict == "ok", (result.violations[:6], result.unfinished[:6], result.leaks[:6])
    assert result.drafts_rejected > 0 and result.checked_blocks > 0
    assert result.checked_loaded_blocks > 0 or result.checkpoint_clobbers > 0


def test_the_mamba_spec_profile_draws_every_drafter_and_the_shared_prefix_checkpoint():
    configs = [make_plan(seed, "mamba-spec")["config"] for seed in range(260000, 260060)]
    assert all("mamba" in c and c["spec_tokens"] for c in configs)
    assert {c["spec_method"] for c in configs} == {"ngram", "eagle", "mtp"}
    assert any(c["mamba"].get("shared_prefix_checkpoint") and c["spec_method"] != "ngram"
               and c["mamba"]["block"] > c["mamba"]["hash_block"] for c in configs)


# Windows of 50 and 51 tokens beside 64-token blocks with drafts (the window group stores ahead only
# because the drafts are counted), V1 runner, sync and async, ngram and EAGLE; each loads from the host tier
WINDOWS_SEEDS = [1079, 1290, 1339, 1813]


@pytest.mark.parametrize("seed", [pytest.param(seed, id=f"seed{seed}") for seed in WINDOWS_SEEDS])
def test_the_windows_profile_replays_windows_where_drafts_decide_what_stores_ahead(seed):
    plan = make_plan(seed, "windows")
    config = plan["config"]
    assert config["block_size"] == 64 and config["window"] in (50, 51) and config["spec_tokens"] >= 2, config
    if reason := missing_feature(plan):
        pytest.skip(reason)
    result = execute(plan)
    assert result.verdict == "ok", (result.violations[:6], result.unfinished[:6], result.leaks[:6])
    assert result.checked_loaded_blocks > 0 and result.drafts_rejected > 0


# vLLM's engine default for a sliding window's prefix cache (`prefix_cache_retention_interval` 0: blocks kept only
# where a later request can resume, at prompt ends and shared-prefix junctions), sync and async; the host tier
# serves what the device cache dropped. (The other profiles' engines keep every window block.)
SPARSE_WINDOWS_SEEDS = [25, 34, 48]


@pytest.mark.parametrize("seed", [pytest.param(seed, id=f"seed{seed}") for seed in SPARSE_WINDOWS_SEEDS])
def test_the_sparse_windows_profile_keeps_window_blocks_as_vllms_engine_does_and_reads_what_it_wrote(seed):
    plan = make_plan(seed, "sparse-windows")
    assert plan["config"]["window_retention"] == 0 and "mamba" not in plan["config"], plan["config"]
    if reason := missing_feature(plan):
        pytest.skip(reason)
    result = execute(plan)
    assert result.verdict == "ok", (result.violations[:6], result.unfinished[:6], result.leaks[:6])
    assert result.checked_loaded_blocks > 0


# Small device caches: each preempts requests and defers loads for device KV room (found by the "tight" profile)
TIGHT_SEEDS = [34, 53, 112, 246, 262]


@pytest.mark.parametrize("seed", [pytest.param(seed, id=f"seed{seed}") for seed in TIGHT_SEEDS])
def test_the_tight_profile_preempts_and_defers_loads_and_reads_what_it_wrote(seed):
    plan = make_plan(seed, "tight")
    assert plan["config"]["num_blocks"] <= 200
    if reason := missing_feature(plan):
        pytest.skip(reason)
    result = execute(plan)
    assert result.verdict == "ok", (result.violations[:6], result.unfinished[:6], result.leaks[:6])
    assert result.preemptions > 0 and result.deferred_loads > 0 and result.checked_loaded_blocks > 0


# "tight-sparse": vLLM's default window retention in a small device cache; each seed defers loads and aborts
# requests (found ending a request while kvscope deferred its load)
TIGHT_SPARSE_SEEDS = [293, 406]


@pytest.mark.parametrize("seed", [pytest.param(seed, id=f"seed{seed}") for seed in TIGHT_SPARSE_SEEDS])
def test_the_tight_sparse_profile_defers_loads_with_vllms_default_retention_and_reads_what_it_wrote(seed):
    plan = make_plan(seed, "tight-sparse")
    assert plan["config"]["num_blocks"] <= 200 and plan["config"]["window_retention"] == 0
    if reason := missing_feature(plan):
        pytest.skip(reason)
    result = execute(plan)
    assert result.verdict == "ok", (result.violations[:6], result.unfinished[:6], result.leaks[:6])
    assert result.deferred_loads > 0 and result.aborts > 0 and result.checked_loaded_blocks > 0


# "inflight-loads": vLLM 0.34's `--max-num-inflight-kv-loads` with a running batch of a few requests. Run alone, each
# seed starts one load in a step that began with the batch full; in the whole suite seed 63 once started none (the
# count, not the verdict, moved with what ran before it in the process): so any one of them must
INFLIGHT_SEEDS = [19, 63, 73]


def test_the_inflight_loads_profile_starts_loads_beside_a_full_batch_and_reads_what_it_wrote(monkeypatch):
    plans = [make_plan(seed, "inflight-loads") for seed in INFLIGHT_SEEDS]
    assert all(plan["config"]["engine_args"]["max_num_inflight_kv_loads"] >= 1 for plan in plans)
    if reason := missing_feature(plans[0]):
        pytest.skip(reason)
    results = [execute(plan) for plan in plans]
    for result in results:
        assert result.verdict == "ok", (result.violations[:6], result.unfinished[:6], result.leaks[:6])
        assert result.checked_loaded_blocks > 0
    assert any(result.loads_beside_full_batch for result in results), [r.loads_beside_full_batch for r in results]
    monkeypatch.setattr(KVScopeScheduler, "may_load_async", lambda self, request: False)  # vLLM's default answer
    for plan in plans:  # vLLM then starts no load beside a full batch
        alone = execute(plan)
        assert alone.verdict == "ok" and alone.loads_beside_full_batch == 0


def test_a_tight_seed_that_aborts_a_request_while_its_load_is_deferred_observes_its_wait():
    """Seed 54 aborts a request at a pause while kvscope defers its load: its wait is observed as every
    other deferred load's (`telemetry_mismatches`: as many waits as deferred loads; found failing with
    the observation at the request's end taken out)."""
    result = execute(make_plan(54, "tight"))
    assert result.verdict == "ok", (result.violations[:6], result.unfinished[:6], result.leaks[:6])
    assert result.deferred_loads >= 2 and result.aborts > 0


def test_a_tight_seed_that_admits_a_resumed_request_with_nothing_to_load_tells_its_wait_in_a_span(tmp_path):
    """Seed 410 (a Mamba hybrid, a 100-block device cache, a host tier that evicts): request k0-6, resumed after
    a preemption, has its 384-token load deferred for device KV room; vLLM then finds no device blocks for it
    for two steps, in which its hit is evicted from the host tier, and admits it with nothing to load. No
    lookup span tells a resumed request's wait, and no load span follows: a `kvscope.deferral` span with
    outcome "admitted" does, and the spans agree with the stats (`span_agreement`, in the verdict)."""
    trace_file = tmp_path / "spans.jsonl"
    plan = make_plan(410, "tight")
    if reason := missing_feature(plan):
        pytest.skip(reason)
    with workload_fuzz._played(plan, trace_file) as replay:
        result = replay.finish()
    assert result.verdict == "ok", (result.violations[:6], result.unfinished[:6], result.leaks[:6])
    waits = [attrs for name, attrs in trace_file_attributes(trace_file) if name == "kvscope.deferral"]
    assert [(w["kvscope.request.id"], w["kvscope.deferred.outcome"], w["kvscope.tokens.external"]) for w in waits] \
        == [("k0-6", "admitted", 384)]
    assert result.preemptions > 0 and result.evictions > 0
