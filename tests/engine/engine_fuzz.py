"""Randomized multi-round workloads on the real CPU engine, with kvscope against without it.

`workload_fuzz` drives vLLM's scheduler with a fake forward; this runs the real engine: the model's own
attention backends read what kvscope's worker copied in. A seed draws a tiny model (full attention, sliding
window, gpt-oss's sinks, or Qwen3-Next's linear attention), engine settings (device block size, chunked
prefill, async scheduling, n-gram drafts, the prefix cache off, a small device cache that preempts, an fp8 KV
cache, float32 weights and KV cache), a host tier (tight ones evict) and a few rounds of prompts sharing
documents' prefixes or continuing an earlier round's output, some aborted mid-run, some with tenants' cache
salts, most rounds after a device prefix-cache reset so that they load from the host tier. The same plan runs
in two engine processes at once, with kvscope and without, and their greedy outputs must agree: the same
tokens, each logprob within `logprob_tolerance` (0.01; 0.05 beside linear attention or preemption; 0.001 in
float32, preempting or not). Where the tokens part at a step where each run saw both picks among its best
tokens, with the same logprobs within that tolerance and within `TIE_MARGIN` of each other, the seed is a `tie`
(bf16 sums in another order may pick either), not a failure; where they part otherwise, the plan runs once more
without kvscope and without vLLM's prefix cache, and if kvscope's completion is that recompute's, the seed is
`vllm_cache` (vLLM's prefix cache parted the baseline from a recompute, not kvscope: Qwen3-Next's
linear-attention states). Where kvscope's engine first scheduled the prompts in another order (a request
waiting for its load lets the next go first) and vLLM without kvscope, given the prompts in that order, agrees
with kvscope's whole run, the seed is `vllm_order`: on the CPU backend a request's logits move with its place
in the batch. Where vLLM without kvscope, keeping every sliding-window block and Mamba state in its prefix
cache (`prefix_cache_retention_interval` None), agrees with kvscope's whole run, the seed is `vllm_dense`: by
default vLLM keeps those only at prompt ends and recomputes by prefill what kvscope loads, as computed by decode
steps (seed 4099). Where a Qwen3-Next plan stored the Mamba states decode steps left and kvscope's engine run again
without them (`mamba_decode_states` false) agrees with the baseline, the seed is `decode_state` (the recurrent
kernel's state against a prefill's chunked one, in bf16: seed 4048). kvscope's hit and looked-up tokens must
equal vLLM's external prefix-cache hits and queries, its trace file's spans must tell what its metrics count
and the replay app reading that file show the same run (`span_agreement`), every load must write only device
blocks the loading request alone holds, and once every request is done it must hold no host block, job or
request state (`connector_leaks`).

    python -m tests.engine.engine_fuzz --seeds 0:100 --minutes 60 --out repros/
    python -m tests.engine.engine_fuzz --replay repros/seed-17.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.connector_leaks import connector_leaks

ROOT = Path(__file__).resolve().parents[2]
# bf16: a loaded block was summed in other chunks than its recompute. Qwen3-Next's linear-attention states
# moved logprobs by up to 0.039 (runs of 159 seeds); attention-only models by 0.004 at most, while one zeroed
# host block of an unsharpened model moved one by 0.025: their tolerance is tighter.
LOGPROB_TOLERANCE = 0.05
ATTENTION_ONLY_TOLERANCE = 0.01
# float32: kvscope's runs parted from vLLM's by 1.2e-5 at most (40 seeds, preempting ones among them), most
# by 5e-7: 80 times below it. One zeroed host block of an unsharpened model moved a logprob by 0.023.
FLOAT32_TOLERANCE = 0.001
TIE_MARGIN = 0.05  # two tokens' logprobs this close: either may win in bf16
BEST_TOKENS = 5  # logprobs kept per step: a near-tie may be among three tokens
MAX_PROMPT_TOKENS = 3000  # of the engines' 4096-token context, leaving room for the completion
SMALL_CONTEXT = 1536  # tokens: the context of plans with a small device cache, so that prompts contend
# engine steps in a row with requests left and none running: vLLM's admission stall (`load_admission`), or
# a load never reported; a load on the CPU takes a step or two
STALL_STEPS = 500
# Models with sliding-window or Mamba groups: vLLM's prefix cache keeps their blocks sparsely by default
# (`prefix_cache_retention_interval` 0), kvscope's tier all of them (`recheck`: `vllm_dense`).
DENSE_RETENTION_MODELS = ("gemma3", "gptoss", "qwen3next")
ENGINE_TIMEOUT_S = 600
_BLOCK_SIZE_REFUSAL = re.compile(r"ConfigError: kv_connector_extra_config\.block_size=\d+ is not accepted: it must "
                                 r"be a multiple of every KV group's device block size .*")


# ----------------------------------------------------------------------------- plans (pure data)
def make_plan(seed: int) -> dict:
    """One seed's plan: {"seed", "model", "window", "llm_kwargs", "extra", "docs", "rounds", "attention_scale"}.

    A round is {"reset_before", "reset_connector", "max_tokens", "prompts"}; a prompt is
    {"doc", "cut", "suffix"} (a document's first `cut` tokens, then `suffix`) or {"continues":
    [round, index], "suffix"} (that prompt, its completion, then `suffix`: a conversation's turn), either
    with "abort_after_steps" when the request is aborted after that many engine steps (not compared),
    and with "cache_salt" when it is a tenant's."""
    r = random.Random(seed)
    model = r.choice(["llama", "gemma3", "gemma3", "gptoss", "qwen3next"])
    plan: dict = {"seed": seed, "model": model, "window": r.choice([32, 64, 128])}
    mamba = model == "qwen3next"
    # vLLM sizes Mamba's blocks itself; the CPU attention backend takes 16 only beside a sliding window
    device_block = None if mamba else r.choice([32, 64] if model == "llama" else [16, 32, 64])
    llm_kwargs: dict = {"async_scheduling": r.random() < 0.4, "max_num_seqs": r.choice([2, 4, 8])}
    if device_block:
        llm_kwargs["block_size"] = device_block
    if r.random() < 0.5:
        llm_kwargs["max_num_batched_tokens"] = r.choice([128, 256, 512])
    if not mamba and r.random() < 0.2:  # drafts the target may reject: only verified tokens' blocks store
        llm_kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": r.choice([2, 3, 5]),
                                            "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        llm_kwargs["async_scheduling"] = False  # vLLM refuses the CPU's n-gram drafts with it
    # vLLM still hashes blocks for the connector: the host tier is the only cache (kvscope refuses Mamba
    # groups without prefix caching: vLLM then keeps no state per block)
    if r.random() < 0.1 and not mamba:
        llm_kwargs["enable_prefix_caching"] = False
    small_cache = device_block is not None and r.random() < 0.3
    if small_cache:
        _shrink_device_cache(r, plan, llm_kwargs, device_block)
    extra: dict = {"cpu_bytes": r.choice([256 << 10, 1 << 20, 4 << 20, 4 << 20, 64 << 20, 64 << 20])}
    if device_block and r.random() < 0.4:
        extra["block_size"] = device_block * r.choice([1, 2, 4])
    docs = [[r.randint(1, 500) for _ in range(r.randint(20, 1200))] for _ in range(r.randint(1, 4))]
    rounds = []
    for index in range(r.randint(2, 4)):
        prompts = []
        for _ in range(r.randint(1, 6)):
            suffix = [r.randint(1, 500) for _ in range(r.choice([0, 0, 1, 5, 17, 100]))]
            finished = [(k, i) for k in range(index) for i, p in enumerate(rounds[k]["prompts"])
                        if "abort_after_steps" not in p]
            if finished and r.random() < 0.25:
                prompt = {"continues": list(r.choice(finished)), "suffix": suffix}
            else:
                doc = r.randrange(len(docs))
                length = len(docs[doc])
                cut = r.choice([length, length, r.randint(1, length), max(1, length // 64 * 64)])
                prompt = {"doc": doc, "cut": cut, "suffix": suffix}
            if r.random() < 0.12:  # aborted mid-run, a load or its stores perhaps in flight
                prompt["abort_after_steps"] = r.randint(1, 6)
            prompts.append(prompt)
        rounds.append({"reset_before": index > 0 and r.random() < 0.7,
                       "reset_connector": index > 0 and r.random() < 0.1,
                       "max_tokens": r.randint(1, 12) * (20 if small_cache else 1), "prompts": prompts})
    # random weights attend almost evenly, so that one wrong block barely moves the outputs: most plans
    # sharpen attention (`tiny_models._sharpen_attention`), so that single positions decide them. Not
    # Qwen3-Next's: sharpened, bf16 rounding in its linear attention parts runs past any tolerance. Under
    # chunked prefill its runs without kvscope, with vLLM's prefix cache and without it, part by 0.098
    # (seed 1010); a state loaded where an earlier completion's decode steps reached it parts from the
    # prefill's by 0.012, then the tokens (seed 2022). Both within 0.004 at scale 1.
    scale = 1.0 if mamba else r.choice([1.0, 6.0, 6.0])
    # Drawn last, so that the draws above stay what they were for every seed.
    if model in ("llama", "gemma3") and r.random() < 0.15:
        llm_kwargs["kv_cache_dtype"] = "fp8"  # a byte a KV element: host slots half a bf16 one's
    if r.random() < 0.2:  # tenants: a salt is part of every block's key, on the device and in the host tier
        for prompt in (p for round_ in rounds for p in round_["prompts"]):
            salt = r.choice([None, "tenant-a", "tenant-b"])
            if salt:
                prompt["cache_salt"] = salt
    # float32 weights and KV cache: there runs batched otherwise part by about 1e-6 (1.2e-5 at most), so
    # such plans are held to `FLOAT32_TOLERANCE` even where kvscope changes the schedule. Half of those with a
    # device block size of their own get a small device cache too: preempted requests loading back, checked
    # as tightly as any. (vLLM's CPU linear attention, Qwen3-Next's, runs only in bf16.)
    if not mamba and "kv_cache_dtype" not in llm_kwargs and r.random() < 0.3:
        llm_kwargs["dtype"] = "float32"
        extra["cpu_bytes"] *= 2  # a block's bytes double: the host tier keeps as many blocks as in bf16
        if device_block and not small_cache and r.random() < 0.5:
            _shrink_device_cache(r, plan, llm_kwargs, device_block)
            for round_ in rounds:
                round_["max_tokens"] *= 20
        if model != "llama" and "num_gpu_blocks_override" in llm_kwargs:
            # vLLM refused 1.5-2 contexts beside a sliding window in float32 (it asked for 2.1: seeds 3508, 3595)
            llm_kwargs["num_gpu_blocks_override"] = int(llm_kwargs["num_gpu_blocks_override"] * 1.5)
    if mamba:  # most store decode states too (not kvscope's default): where runs part, `recheck` tells why
        extra["mamba_decode_states"] = r.random() < 0.7
    plan.update(llm_kwargs=llm_kwargs, extra=extra, docs=docs, rounds=rounds, attention_scale=scale)
    return plan


def with_dense_retention(plan: dict) -> dict:
    """The plan with vLLM keeping every sliding-window block and Mamba state in its prefix cache, not only
    those at prompt ends (`prefix_cache_retention_interval` None, in both engines), where the model has such
    groups: kvscope's hits then start where the device's longer ones end, and its block size rules for Mamba
    groups change (`config`)."""
    if plan["model"] not in DENSE_RETENTION_MODELS:
        return plan
    return {**plan, "llm_kwargs": {**plan["llm_kwargs"], "prefix_cache_retention_interval": None}}


def _shrink_device_cache(r: random.Random, plan: dict, llm_kwargs: dict, device_block: int) -> None:
    """A device cache of 1.05-2 contexts, and long completions: vLLM admits a prompt only where it fits,
    so requests are preempted (and their prefixes looked up again) as their completions grow. (A
    sliding-window group's blocks share the pool: one context's worth is refused beside one.)"""
    factors = [1.05, 1.2, 1.5] if plan["model"] == "llama" else [1.5, 1.75, 2.0]
    llm_kwargs["max_model_len"] = SMALL_CONTEXT
    llm_kwargs["num_gpu_blocks_override"] = int(SMALL_CONTEXT // device_block * r.choice(factors))
    plan["max_prompt_tokens"] = SMALL_CONTEXT - 20 * 12


def prompt_tokens(plan: dict, prompt: dict, earlier: list[tuple[list[list[int]], list[dict]]]) -> list[int]:
    """A prompt's tokens; ``earlier`` holds each finished round's prompts and completions."""
    if "continues" in prompt:
        round_index, index = prompt["continues"]
        prompts, outs = earlier[round_index]
        tokens = prompts[index] + outs[index]["tokens"] + prompt["suffix"]
    else:
        tokens = plan["docs"][prompt["doc"]][:prompt["cut"]] + prompt["suffix"]
    return tokens[:plan.get("max_prompt_tokens", MAX_PROMPT_TOKENS)]


# ----------------------------------------------------------------------------- one engine (child process)
def _generate(llm, round_index: int, prompts: list[list[int]], max_tokens: int,
              aborts: dict[int, int], salts: list[str | None], order: list[int] | None = None) -> list[dict]:
    """Greedy completions with each step's chosen logprob and its `BEST_TOKENS` best tokens' logprobs. The
    requests go in together, in ``order`` (prompt indices; by default as listed), prompt ``i`` with cache
    salt ``salts[i]``; prompt ``i`` in ``aborts`` is aborted after ``aborts[i]`` engine steps (its
    completion is then {"aborted": True})."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, logprobs=BEST_TOKENS, detokenize=False, temperature=0.0)
    ids = [f"{round_index}-{i}" for i in range(len(prompts))]
    for i in order if order is not None else range(len(prompts)):
        tokens = TokensPrompt(prompt_token_ids=prompts[i])
        if salts[i]:
            tokens["cache_salt"] = salts[i]
        engine.add_request(ids[i], tokens, params)
    scheduler = engine.engine_core.engine_core.scheduler
    finished, steps, idle = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        idle = 0 if scheduler.running or not scheduler.has_requests() else idle + 1
        if idle == STALL_STEPS:
            from tests.engine.scenario import kvscope_samples

            deferred = kvscope_samples().get("kvscope_deferred_loads_total", 0.0)
            states = ", ".join(f"{r.request_id} {r.status.name} {r.num_computed_tokens}/{r.num_tokens}"
                               for r in scheduler.requests.values())
            raise RuntimeError(f"stalled: {STALL_STEPS} steps without a running request; {states}; "
                               f"{scheduler.kv_cache_manager.block_pool.get_num_free_blocks()} free blocks; "
                               f"{deferred:.0f} loads deferred by kvscope")
        due = [ids[i] for i, after in aborts.items() if after == steps and ids[i] not in finished]
        if due:
            engine.abort_request(due)
    result = []
    for i, request_id in enumerate(ids):
        if i in aborts:
            result.append({"aborted": True})
            continue
        digest = hashlib.sha256(json.dumps(prompts[i]).encode()).hexdigest()[:16]
        (o,) = finished[request_id].outputs
        chosen, best = [], []
        for step, token in zip(o.logprobs or [], o.token_ids):
            chosen.append(step[token].logprob)
            best.append({str(t): lp.logprob for t, lp in step.items()})  # JSON keys are strings
        result.append({"tokens": list(o.token_ids), "logprobs": chosen, "best": best, "prompt": digest})
    return result


def _connector_problems(llm, trace_file: str) -> list[str]:
    """kvscope's telemetry against vLLM's counters and itself (its metrics against the spans of its
    ``trace_file`` and the replay app reading it: `span_agreement`), and what it still holds with every
    request done (`connector_leaks`)."""
    from connector.engine_runner import get_scheduler_connector, get_worker_connector, metric_values
    from tests.compat.span_agreement import (prometheus_stats, replay_app_mismatches, span_stat_mismatches,
                                             trace_file_attributes)
    from tests.engine.scenario import _kvscope, kvscope_samples

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    # Offline, `generate` stops stepping once every output is done; a server's engine core steps on while
    # kvscope has unreported jobs (`has_pending_push_work`), so a store of the last step reports. As it would:
    for _ in range(100):
        if not scheduler.has_requests():
            break
        llm.llm_engine.step()
    vllm_counts, ours = metric_values(llm), kvscope_samples()
    problems = []
    for kind, theirs in (("hit", "vllm:external_prefix_cache_hits"), ("lookup", "vllm:external_prefix_cache_queries")):
        if ours.get(f"kvscope_{kind}_tokens_total", 0.0) != vllm_counts.get(theirs, 0.0):
            problems.append(f"telemetry: kvscope_{kind}_tokens_total {ours.get(f'kvscope_{kind}_tokens_total')} "
                            f"!= {theirs} {vllm_counts.get(theirs)}")
    hit, looked_up = ours.get("kvscope_hit_tokens_total", 0.0), ours.get("kvscope_lookup_tokens_total", 0.0)
    if ours.get("kvscope_missed_tokens_total", 0.0) != looked_up - hit:
        problems.append(f"telemetry: kvscope_missed_tokens_total {ours.get('kvscope_missed_tokens_total')} "
                        f"!= lookup - hit {looked_up - hit}")
    # a wait is observed once per deferred load whose wait ended: admitted, or aborted (that one with the next
    # step's stats: none may follow the run's last abort)
    waits = ours.get("kvscope_load_deferral_wait_seconds_count", 0.0)
    deferred = ours.get("kvscope_deferred_loads_total", 0.0)
    if waits > deferred:
        problems.append(f"telemetry: {waits:.0f} deferral waits observed, {deferred:.0f} loads deferred")
    connectors = [_kvscope(get_scheduler_connector(llm)), _kvscope(get_worker_connector())]
    if all(connector.tracing.force_flush() for connector in connectors):
        stats = prometheus_stats()
        problems += (span_stat_mismatches(trace_file_attributes(trace_file), stats)
                     + replay_app_mismatches(trace_file, stats))
    else:
        problems.append("telemetry: the spans could not be flushed to the trace file")
    leaks = connector_leaks(connectors[0]._scheduler, scheduler.requests, connectors[1:])
    return problems + [f"leak: {leak}" for leak in leaks]


def load_destination_problem(group: int, block_ids: list[int], req_to_blocks: dict, loading: str) -> str | None:
    """What is wrong with request ``loading``'s load writing ``block_ids`` of one group, given vLLM's block
    tables of that group (request id -> its blocks): None when that request alone holds every one of them."""
    wanted = set(block_ids)
    holders: dict[int, list[str]] = {}
    for req_id, blocks in req_to_blocks.items():
        for block in blocks:
            if block.block_id in wanted:
                holders.setdefault(block.block_id, []).append(req_id)
    if all(holders.get(b) == [loading] for b in wanted):
        return None
    return f"{loading}'s load into group {group} blocks {sorted(wanted)}: held by {holders}"


def _watch_load_destinations(llm) -> list[str]:
    """Check, as each load copies, that every device block it writes is held by the loading request alone
    in vLLM's block tables: a load writing another request's block, or a block vLLM shares from its prefix
    cache, would change KV that no output comparison can tie to kvscope. Returns the list that the
    problems found go into."""
    from connector.engine_runner import get_worker_connector
    from tests.engine.scenario import _kvscope, before_each_load

    managers = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.coordinator.single_type_managers
    problems: list[str] = []
    worker = _kvscope(get_worker_connector())._worker
    run_job, running = worker._run, []  # request ids of the jobs in `_run`, the innermost last

    def run_tracked(job):  # the hook below sees only blocks: note whose job copies
        running.append(job.req_id)
        try:
            return run_job(job)
        finally:
            running.pop()

    def check(engine, group, slots, block_ids):
        problem = load_destination_problem(group, block_ids, managers[group].req_to_blocks, running[-1])
        if problem:
            problems.append(problem)

    worker._run = run_tracked
    before_each_load(check)
    return problems


def _record_admissions(llm) -> list[str]:
    """The list that each request's vLLM id goes into as the scheduler first schedules it."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule, admitted = scheduler.schedule, []

    def recorded(*args, **kwargs):
        output = schedule(*args, **kwargs)
        admitted.extend(new.req_id for new in output.scheduled_new_reqs)
        return output

    scheduler.schedule = recorded
    return admitted


def admission_order(admitted: list[str], round_index: int, count: int) -> list[int]:
    """A round's prompt indices in the order the engine first scheduled them, from vLLM's ids (the fuzz's
    "round-prompt" and a suffix of vLLM's) in ``admitted``; prompts never scheduled (aborted while
    waiting) last, as listed."""
    first: dict[int, int] = {}
    for position, req_id in enumerate(admitted):
        round_, prompt = (int(part) for part in req_id.split("-")[:2])
        if round_ == round_index:
            first.setdefault(prompt, position)
    return sorted(range(count), key=lambda i: (i not in first, first.get(i, 0), i))


def run_engine(plan: dict, with_connector: bool, corrupt_host: bool = False) -> dict:
    """Run the plan's rounds on one engine. ``corrupt_host`` zeroes one host block, the tier's highest
    slot in use (its newest), before each round after the first: the self-check that a single wrong
    block is caught."""
    from connector.engine_runner import engine_env, get_scheduler_connector, get_worker_connector, make_llm
    from connector.tiny_models import build_model

    engine_env()
    # kvscope's engine always traces (to a file of the plan's, or one of its own): its spans must tell what
    # its metrics count (`_connector_problems`)
    trace_dir = None
    if with_connector and "trace_file" not in plan["extra"]:
        trace_dir = tempfile.TemporaryDirectory(prefix="kvscope-engine-fuzz-trace-")
        plan = {**plan, "extra": {**plan["extra"], "trace_file": str(Path(trace_dir.name) / "spans.jsonl")}}
    model = build_model(plan["model"], window=plan["window"], attention_scale=plan.get("attention_scale", 1.0))
    llm = make_llm(model, plan["extra"] if with_connector else None, connector=with_connector, **plan["llm_kwargs"])
    foreign_writes = _watch_load_destinations(llm) if with_connector else []
    admitted = _record_admissions(llm)
    earlier: list[tuple[list[list[int]], list[dict]]] = []
    for index, round_ in enumerate(plan["rounds"]):
        if round_["reset_before"]:
            assert llm.reset_prefix_cache(reset_connector=with_connector and round_["reset_connector"])
        if corrupt_host and index:
            from tests.engine.scenario import _kvscope

            index_of_tier = _kvscope(get_scheduler_connector(llm))._scheduler.index
            newest = max(entry.slot for entry in index_of_tier._entries.values())
            _kvscope(get_worker_connector())._worker.engine.host[newest].zero_()
        prompts = [prompt_tokens(plan, p, earlier) for p in round_["prompts"]]
        aborts = {i: p["abort_after_steps"] for i, p in enumerate(round_["prompts"]) if "abort_after_steps" in p}
        salts = [p.get("cache_salt") for p in round_["prompts"]]
        earlier.append((prompts, _generate(llm, index, prompts, round_["max_tokens"], aborts, salts,
                                           round_.get("order"))))
    result: dict = {"rounds": [outs for _, outs in earlier],
                    "admission_orders": [admission_order(admitted, index, len(round_["prompts"]))
                                         for index, round_ in enumerate(plan["rounds"])]}
    if with_connector:
        from connector.engine_runner import metric_values
        from tests.engine.scenario import kvscope_samples

        result["problems"] = foreign_writes[:5] + _connector_problems(llm, plan["extra"]["trace_file"])
        counts = metric_values(llm)
        result["external_hit_tokens"] = counts.get("vllm:external_prefix_cache_hits", 0.0)
        result["preemptions"] = counts.get("vllm:num_preemptions", 0.0)
        # loads kvscope deferred for device KV room (`load_admission`), as its metric counts them
        samples = kvscope_samples()
        result["deferred_loads"] = samples.get("kvscope_deferred_loads_total", 0.0)
        result["deferral_waits"] = samples.get("kvscope_load_deferral_wait_seconds_count", 0.0)  # admitted ones
        result["deferral_wait_s"] = samples.get("kvscope_load_deferral_wait_seconds_sum", 0.0)
    if trace_dir is not None:
        trace_dir.cleanup()
    return result


# ----------------------------------------------------------------------------- comparing two runs (pure)
def logprob_tolerance(plan: dict) -> float:
    """How far a plan's logprobs may move: `ATTENTION_ONLY_TOLERANCE`, but beside linear attention, and
    with a device cache small enough to preempt. There kvscope rightly changes vLLM's schedule (it loads
    a preempted request's blocks, which vLLM alone recomputes), and on the CPU backend a request's logits
    move with the requests batched beside it: seed 1035 of a campaign preempting more, a request that was
    never preempted nor loaded, parted by 0.136 over 100 decode steps; two engines without kvscope whose
    caches differ by 4 blocks parted by 0.053. In float32 every plan's is `FLOAT32_TOLERANCE`."""
    if plan["llm_kwargs"].get("dtype") == "float32":
        return FLOAT32_TOLERANCE
    if plan["model"].startswith("qwen3next") or "num_gpu_blocks_override" in plan["llm_kwargs"]:
        return LOGPROB_TOLERANCE
    return ATTENTION_ONLY_TOLERANCE


def compare(ours: dict, theirs: dict, tolerance: float = LOGPROB_TOLERANCE) -> tuple[str, list[str]]:
    """("ok" | "tie" | "failed", what differs). Nothing after a tie is compared: a continuing prompt
    carries the parted completion, and a different completion leaves the host tier other blocks."""
    problems = list(ours.get("problems", []))
    for index, (a_round, b_round) in enumerate(zip(ours["rounds"], theirs["rounds"])):
        for i, (a, b) in enumerate(zip(a_round, b_round)):
            if "aborted" in a or "aborted" in b:
                continue
            where = f"round {index} prompt {i}"
            steps = next((k for k, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
            gap = max((abs(x - y) for x, y in zip(a["logprobs"][:steps], b["logprobs"][:steps])), default=0.0)
            if gap > tolerance:
                problems.append(f"logprobs at {where} differ by {gap:.3f}")
            elif steps is not None and _tie(a["best"][steps], b["best"][steps],
                                            (a["tokens"][steps], b["tokens"][steps]), tolerance):
                return ("failed" if problems else "tie"), problems + [f"tie at {where} step {steps}"]
            if steps is not None or len(a["tokens"]) != len(b["tokens"]):
                return "failed", problems + [f"tokens part at {where} step {steps}: {a['tokens']} vs {b['tokens']}"]
    return ("failed" if problems else "ok"), problems


def first_parting(ours: dict, theirs: dict) -> tuple[int, int] | None:
    """(round, prompt) of the first completion pair whose tokens part, as `compare` walks them."""
    for index, (a_round, b_round) in enumerate(zip(ours["rounds"], theirs["rounds"])):
        for i, (a, b) in enumerate(zip(a_round, b_round)):
            if "aborted" not in a and "aborted" not in b and a["tokens"] != b["tokens"]:
                return index, i
    return None


def recompute_agrees(ours: dict, recompute: dict, where: tuple[int, int], tolerance: float = LOGPROB_TOLERANCE) -> bool:
    """Whether our completion at ``where`` is a recompute's (vLLM without kvscope and without its prefix
    cache) of the same prompt: the same tokens, logprobs within ``tolerance``."""
    index, i = where
    a, b = ours["rounds"][index][i], recompute["rounds"][index][i]
    if "aborted" in b or a["prompt"] != b["prompt"] or a["tokens"] != b["tokens"]:
        return False
    return max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])), default=0.0) <= tolerance


def largest_logprob_gap(ours: dict, theirs: dict) -> float:
    """The largest logprob difference up to where each completion pair parts (aborted requests left
    out): how close to its tolerance the seed came."""
    gaps = [0.0]
    for a_round, b_round in zip(ours["rounds"], theirs["rounds"]):
        for a, b in zip(a_round, b_round):
            if "aborted" in a or "aborted" in b:
                continue
            for x, y, token_a, token_b in zip(a["logprobs"], b["logprobs"], a["tokens"], b["tokens"]):
                if token_a != token_b:
                    break
                gaps.append(abs(x - y))
    return max(gaps)


def _tie(ours: dict[str, float], theirs: dict[str, float], picks: tuple[int, int], tolerance: float) -> bool:
    """Two runs picked different tokens (``picks``: ours, theirs) at a step where each run saw both picks
    among its best tokens, with the same logprobs within ``tolerance``, under `TIE_MARGIN` apart: bf16's
    order of sums chose. (Not only the two best: a third token as near may be either run's pick.)"""
    mine, other = (str(t) for t in picks)
    if not {mine, other} <= ours.keys() & theirs.keys():
        return False
    if any(abs(ours[t] - theirs[t]) > tolerance for t in (mine, other)):
        return False
    return abs(ours[mine] - ours[other]) < TIE_MARGIN and abs(theirs[mine] - theirs[other]) < TIE_MARGIN


# ----------------------------------------------------------------------------- driving processes
def _start(plan_path: str, role: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "tests.engine.engine_fuzz", "--run", plan_path, role],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"error": f"timed out after {ENGINE_TIMEOUT_S} s", "stderr": err[-4000:]}
    for line in out.splitlines():
        if line.startswith("ENGINE_FUZZ_JSON "):
            return json.loads(line[len("ENGINE_FUZZ_JSON "):])
    return {"error": f"exit {proc.returncode}", "stderr": err[-4000:]}


def execute(plan: dict, roles: tuple[str, ...] = ("kvscope", "baseline")) -> dict[str, dict]:
    """Each role's result, the engines running at once (one process each: vLLM keeps per-process state)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(plan, f)
    try:
        procs = {role: _start(f.name, role) for role in roles}
        return {role: _result(proc) for role, proc in procs.items()}
    finally:
        os.unlink(f.name)


def verdict(results: dict[str, dict], ours: str = "kvscope",
            tolerance: float = LOGPROB_TOLERANCE) -> tuple[str, list[str]]:
    """A seed's outcome from its engines' results: "refused" when the baseline engine itself could not
    run the plan's settings (not kvscope's doing), or when kvscope refused a host block size that is
    no multiple of the device block size vLLM chose (the CPU attention backend may double the one
    asked for, which the plan cannot know); "failed" when only kvscope's engine broke otherwise."""
    base, mine = results["baseline"], results[ours]
    if "error" in base:
        return "refused", [base["error"], base["stderr"][-600:]]
    if "error" in mine:
        refusal = _BLOCK_SIZE_REFUSAL.search(mine["stderr"])
        if refusal:
            return "refused", [refusal.group(0)]
        return "failed", [mine["error"], mine["stderr"][-3000:]]
    return compare(mine, base, tolerance)


def in_admission_order(plan: dict, orders: list[list[int]]) -> dict | None:
    """The plan with each round's prompts submitted in ``orders`` (each round's `admission_order` in
    kvscope's engine), or None where that is the order they are listed in already."""
    if all(order == list(range(len(round_["prompts"]))) for order, round_ in zip(orders, plan["rounds"])):
        return None
    return {**plan, "rounds": [{**round_, "order": order} for round_, order in zip(plan["rounds"], orders)]}


def recheck(plan: dict, results: dict[str, dict], outcome: str, problems: list[str]) -> tuple[str, list[str]]:
    """A seed failed on its outputs alone (no error, no problem kvscope's engine found in itself): look for
    vLLM parting from itself.

    - Where the tokens part, run the plan once more without kvscope and without vLLM's prefix cache. If
      kvscope's parted completion is that recompute's, the baseline's device prefix cache parted from a
      recompute, not kvscope: `vllm_cache`. (Seen with Qwen3-Next's linear attention: a state vLLM cached
      at a block boundary continues in other sums than one computed through.)
    - Else, where kvscope stored the Mamba states decode steps left (`mamba_decode_states` true), run
      kvscope again with it false (kvscope's default). If that run agrees with the baseline (`compare`: "ok" or
      "tie"), the parting came with loading such a state: `decode_state`. (Seed 4048: a state at 768
      tokens that decode steps 763-767 reached, loaded, parted a logprob by 0.065 at decode step 9; the
      state differs from a prefill's of the same tokens by 0.4% (relative norm), where changing the token
      68 places back moves it by 6.7%: bf16 numbers of the recurrent kernel against the chunked one, not
      another state. The model-free fuzz checks every such state's identity.)
    - Else, where the model has sliding-window or Mamba groups, run the plan without kvscope, vLLM keeping
      every such block and state in its prefix cache (`prefix_cache_retention_interval` None; its default
      keeps them only at prompt ends and shared-prefix junctions, so the baseline recomputes a reply that
      kvscope loads). If kvscope's whole run agrees with that one, vLLM's own cache gives kvscope's outputs:
      `vllm_dense`. (Seed 4099, gpt-oss-like: a continued conversation loaded its reply's blocks, whose
      KV decode steps computed; the dense baseline gave kvscope's run to the bit, the default one
      recomputed the reply by prefill (its full-attention KV then differs by bf16 rounding, up to 0.004), and
      one logprob parted by 0.110, at one decode step of 180.)
    - Else, where kvscope's engine first scheduled some prompts in another order than the baseline's (a
      request waits for its load, so one behind it goes first), run the plan without kvscope, its prompts
      submitted in that order. If kvscope's whole run agrees with that one (`compare`: "ok", or "tie":
      equal up to a near-tie both saw), vLLM alone gives kvscope's outputs once the prompts come in that
      order: `vllm_order`. (Seed 3245: a prompt batched first rather than second, because the prompt
      before it waited for its load, parted at decode step 64 on the CPU backend at attention scale 1;
      vLLM without kvscope, those two prompts swapped, gave kvscope's round to the bit.)"""
    ours = results["kvscope"]
    if "error" in ours or ours["problems"]:
        return outcome, problems
    tolerance = logprob_tolerance(plan)
    where = first_parting(ours, results["baseline"])
    if where is not None:
        recompute = execute(plan, ("recompute",))["recompute"]
        if "error" not in recompute and recompute_agrees(ours, recompute, where, tolerance):
            return "vllm_cache", problems + [f"kvscope's completion at round {where[0]} prompt {where[1]} is a "
                                             "recompute's without any prefix cache"]
    if plan["model"].startswith("qwen3next") and plan["extra"].get("mamba_decode_states", False):
        prefill_states = {**plan, "extra": {**plan["extra"], "mamba_decode_states": False}}
        again = execute(prefill_states, ("kvscope",))["kvscope"]
        if "error" not in again and not again["problems"]:
            agreement, ties = compare(again, results["baseline"], tolerance)
            if agreement in ("ok", "tie"):
                return "decode_state", problems + ["kvscope's run agrees with vLLM's once the Mamba states decode "
                                                   "steps left are not stored (mamba_decode_states false)"] + ties
    if plan["model"] in DENSE_RETENTION_MODELS and "prefix_cache_retention_interval" not in plan["llm_kwargs"]:
        dense = execute(plan, ("dense",))["dense"]
        agreement, ties = compare(ours, dense, tolerance) if "error" not in dense else ("failed", [])
        if agreement in ("ok", "tie"):
            return "vllm_dense", problems + ["kvscope's run is vLLM's own once its prefix cache keeps every "
                                             "sliding-window block and Mamba state "
                                             "(prefix_cache_retention_interval None)"] + ties
    reordered_plan = in_admission_order(plan, ours["admission_orders"])
    if reordered_plan is None:
        return outcome, problems
    reordered = execute(reordered_plan, ("baseline",))["baseline"]
    agreement, ties = compare(ours, reordered, tolerance) if "error" not in reordered else ("failed", [])
    if agreement not in ("ok", "tie"):
        return outcome, problems
    return "vllm_order", problems + [f"kvscope's run is vLLM's own with the prompts submitted in the order "
                                     f"kvscope's engine first scheduled them: {ours['admission_orders']}"] + ties


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0:20", help="A:B, the seeds A..B-1")
    parser.add_argument("--minutes", type=float, default=30.0, help="stop starting seeds after this long")
    parser.add_argument("--out", type=Path, help="folder for the plans of seeds that failed")
    parser.add_argument("--replay", type=Path, help="run one saved plan")
    parser.add_argument("--dense-retention", action="store_true",
                        help="both engines keep every sliding-window block and Mamba state in vLLM's prefix cache "
                             "(prefix_cache_retention_interval None), where the model has such groups")
    parser.add_argument("--run", nargs=2, metavar=("PLAN", "ROLE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        plan = json.loads(Path(args.run[0]).read_text())
        role = args.run[1]
        if role == "recompute":
            plan = {**plan, "llm_kwargs": {**plan["llm_kwargs"], "enable_prefix_caching": False}}
        if role == "dense":  # vLLM alone, keeping every sliding-window block and Mamba state (`recheck`)
            plan = with_dense_retention(plan)
        if plan.get("trace_dir"):  # each role with a connector traces to a file of its own
            plan = {**plan, "extra": {**plan["extra"], "trace_file": str(Path(plan["trace_dir"]) / f"{role}.jsonl")}}
        if role == "unadmitted":  # kvscope starting every load it finds: vLLM's admission alone decides
            from connector.load_admission import LoadAdmission

            LoadAdmission.may_start = lambda self, *args, **kwargs: True
        result = run_engine(plan, with_connector=role not in ("baseline", "recompute", "dense"),
                            corrupt_host=role == "corrupted")
        print("ENGINE_FUZZ_JSON " + json.dumps(result), flush=True)
        return
    plans = [json.loads(args.replay.read_text())] if args.replay else []
    if not plans:
        first, last = (int(x) for x in args.seeds.split(":"))
        plans = (make_plan(seed) for seed in range(first, last))
    if args.dense_retention:
        plans = (with_dense_retention(plan) for plan in plans)
    deadline, counts = time.monotonic() + 60 * args.minutes, {}
    for plan in plans:
        if time.monotonic() > deadline:
            break
        started = time.monotonic()
        results = execute(plan)
        outcome, problems = verdict(results, tolerance=logprob_tolerance(plan))
        if outcome == "failed":
            outcome, problems = recheck(plan, results, outcome, problems)
        counts[outcome] = counts.get(outcome, 0) + 1
        summary = {k: plan.get(k) for k in ("model", "window", "attention_scale", "llm_kwargs", "extra")}
        hits, preempted, deferred = (results["kvscope"].get(k, 0)
                                     for k in ("external_hit_tokens", "preemptions", "deferred_loads"))
        gap = largest_logprob_gap(results["kvscope"], results["baseline"]) if outcome in ("ok", "tie") else None
        print(f"seed {plan['seed']} {outcome} {time.monotonic() - started:.0f}s hits={hits:.0f} "
              f"preemptions={preempted:.0f} deferred={deferred:.0f} gap={gap} {json.dumps(summary)}", flush=True)
        for problem in problems:
            print(f"    {problem}", flush=True)
        if outcome == "failed" and args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"seed-{plan['seed']}.json").write_text(json.dumps(plan))
    print(f"{sum(counts.values())} seeds: {counts}", flush=True)


if __name__ == "__main__":
    main()
