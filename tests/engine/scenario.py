"""One engine scenario in its own process: `python -m tests.engine.scenario SPEC.json`.

vLLM keeps per-process globals (the worker's connector among them), so every engine gets a
process of its own; the engine core runs in-process there so tests can reach both sides of
the connector. Prints one line `SCENARIO_JSON {...}` with everything the tests assert on.
"""

from __future__ import annotations

import json
import sys

from connector.engine_runner import (
    engine_env,
    generate,
    get_scheduler_connector,
    get_worker_connector,
    kv_transfer_config,
    make_llm,
    metric_values,
)
from connector.tiny_models import build_model
from connector.worker import FENCE_AT_NEXT_STEP

COUNTERS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries",
            "vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_queries",
            "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def _delta(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}


def kvscope_samples(by: str | None = None) -> dict:
    """kvscope metrics from this process's Prometheus registry, summed over labels
    (or, with `by`, per value of that label)."""
    from prometheus_client import REGISTRY

    out: dict = {}
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if not sample.name.startswith("kvscope_"):
                continue
            if by is None:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
            elif by in sample.labels:
                per = out.setdefault(sample.name, {})
                per[sample.labels[by]] = per.get(sample.labels[by], 0.0) + sample.value
    return out


def before_each_load(hook) -> None:
    """Call ``hook(engine, group, slots, block_ids)`` as each load of this process's worker starts to
    copy, before it reads the host tier: ``engine`` is the worker's `CopyEngine`, ``slots`` the host
    slots read and ``block_ids`` the device blocks written. A hook may check or change what the load
    copies. Hooks set up one after another all run, the one set up last first (each wraps the load before it)."""
    engine = _kvscope(get_worker_connector())._worker.engine
    load = engine.load

    def hooked_load(group, slots, subs, block_ids, *args, **kwargs):
        hook(engine, group, slots, block_ids)
        return load(group, slots, subs, block_ids, *args, **kwargs)

    engine.load = hooked_load


def _corrupt_the_next_load(llm, kind: str, how: str) -> list[int]:
    """Give the model one wrong block in the first load of one group kind, just before that load copies:
    "zero" zeroes its last host block; "swap" swaps its last two, each right KV at the other's position
    (what an off-by-one in where a group's blocks start would load). Returns the slots changed."""
    sched = _kvscope(get_scheduler_connector(llm))._scheduler
    kinds = {layout.index: layout.kind.value for layout in sched.layouts}
    changed: list[int] = []

    def corrupt(engine, group, slots, block_ids):
        if not changed and kinds[group] == kind and len(slots) >= (2 if how == "swap" else 1):
            if how == "zero":
                engine.host[slots[-1]].zero_()
                changed.append(slots[-1])
            else:
                last = engine.host[slots[-1]].clone()
                engine.host[slots[-1]].copy_(engine.host[slots[-2]])
                engine.host[slots[-2]].copy_(last)
                changed.extend(slots[-2:])

    before_each_load(corrupt)
    return changed


def _next_turn(prompts: list[list[int]], outs, new_tokens: int) -> list[list[int]]:
    """A conversation's next turn: each prompt, its completion, and a new message of `new_tokens`."""
    return [p + o.tokens + [(29 * i + 7 * j) % 509 + 1 for i in range(new_tokens)]
            for j, (p, o) in enumerate(zip(prompts, outs))]


def _fence_stores_at_next_step(worker) -> dict:
    """Place the store fence as on CUDA under vLLM's V1 model runner (a no-op on the CPU), and count
    the steps that begin (`handle_preemptions`) with stores to fence: the runner must announce
    every step before binding its metadata, or the worker falls back to fencing at once."""
    fence = {"fenced_at_step_start": 0}
    worker.store_fence = FENCE_AT_NEXT_STEP
    begin_step = worker.begin_step

    def counting_begin_step(meta=None):
        fence["fenced_at_step_start"] += worker._stores_unfenced
        begin_step(meta)

    worker.begin_step = counting_begin_step
    return fence


def _kvscope(connector):
    """kvscope's connector itself, also inside vLLM's MultiConnector (the spec's `multi_connector`)."""
    for child in getattr(connector, "_connectors", None) or (connector,):
        if type(child).__name__ == "KVScopeConnector":
            return child
    raise AssertionError(f"no KVScopeConnector in {connector!r}")


def _inside_multi_connector(extra: dict) -> dict:
    """vLLM's MultiConnector with kvscope as its one child: the kv-transfer-config users write to combine it."""
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [kv_transfer_config(extra)]}}


def run(spec: dict) -> dict:
    engine_env()
    model = build_model(spec["model"], window=spec.get("window", 64), layer_types=spec.get("layer_types"),
                        attention_scale=spec.get("attention_scale", 1.0))
    prompts = spec["prompts"]
    max_tokens = spec.get("max_tokens", 8)
    llm_kwargs = spec.get("llm_kwargs", {})
    # "conversation": round 0 is a first turn of `first_turn_tokens` tokens (EOS ignored); the later
    # rounds send the second turn (prompt, that output, a new message of `new_tokens`).
    conversation = spec.get("conversation")
    samples = spec.get("n", 1)  # samples a prompt (vLLM's parallel sampling: a child request each)
    first_max_tokens = conversation["first_turn_tokens"] if conversation else max_tokens

    def first_turn(llm):
        return generate(llm, spec["prompts"], first_max_tokens, ignore_eos=bool(conversation), n=samples)

    if not spec.get("connector", True):
        llm = make_llm(model, connector=False, **llm_kwargs)
        outs = first_turn(llm)
        rounds = [outs]
        if conversation:  # the second turn over vLLM's device prefix cache: no reset
            rounds.append(generate(llm, _next_turn(prompts, outs, conversation["new_tokens"]), max_tokens))
        return {"rounds": [[o.__dict__ for o in r] for r in rounds]}
    extra = spec.get("extra", {"cpu_bytes": 64 << 20})
    if spec.get("multi_connector"):
        llm_kwargs = {**llm_kwargs, "kv_transfer_config": _inside_multi_connector(extra)}
    llm = make_llm(model, extra, **llm_kwargs)
    single_worker = llm_kwargs.get("tensor_parallel_size", 1) == 1  # else the workers live in other processes
    fence = _fence_stores_at_next_step(_kvscope(get_worker_connector())._worker) if single_worker else {}
    rounds, counters = [], []
    before = metric_values(llm)
    rounds.append(first_turn(llm))  # round 0: cold, stores to the host tier
    if conversation:
        prompts = _next_turn(prompts, rounds[0], conversation["new_tokens"])
    after0 = metric_values(llm)
    # "corrupt_next_load": {"kind": a group kind, "how": "zero" | "swap"}: the controls of the equality tests
    corrupt = spec.get("corrupt_next_load")
    corrupted = _corrupt_the_next_load(llm, corrupt["kind"], corrupt["how"]) if corrupt else []
    counters.append(_delta(after0, before))
    assert llm.reset_prefix_cache(), "device prefix cache reset failed"
    if spec.get("drop_host_blocks"):
        worker = _kvscope(get_worker_connector())._worker
        worker.lost_slots.update(range(worker.num_slots))  # host data lost after the lookup
    # round 1: loads from the host tier (optionally with ids and W3C trace headers per request)
    rounds.append(generate(llm, prompts, max_tokens, trace_headers=spec.get("trace_headers"),
                           request_ids=spec.get("request_ids"), n=samples))
    after1 = metric_values(llm)
    counters.append(_delta(after1, after0))
    rounds.append(generate(llm, prompts, max_tokens, n=samples))  # round 2: device prefix cache, no reset
    counters.append(_delta(metric_values(llm), after1))
    connector = _kvscope(get_scheduler_connector(llm))
    connector.tracing.force_flush()
    if single_worker:
        worker = _kvscope(get_worker_connector())
        worker.tracing.force_flush()
        fence["kept"] = worker._worker.store_fence == FENCE_AT_NEXT_STEP
    sched = connector._scheduler
    return {
        "rounds": [[o.__dict__ for o in r] for r in rounds],
        "counters": counters,
        "kvscope": kvscope_samples(),
        "kvscope_by_kind": kvscope_samples(by="kind"),
        "kvscope_by_reason": kvscope_samples(by="reason"),
        "host": {"used_slots": sched.index.used_slots, "num_slots": sched.index.num_slots,
                 "evicted": sched.index.evicted_total},
        "groups": [layout.kind.value for layout in sched.layouts],
        "block_sizes": [layout.block_size for layout in sched.layouts],
        "offload_block_size": sched.block_size,
        "slot_bytes": sched.slot_bytes,
        "prompts": prompts,  # of rounds 1 and 2
        "fence": fence,
        "corrupted_slots": corrupted,
    }


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = run(json.load(f))
    print("SCENARIO_JSON " + json.dumps(result), flush=True)
