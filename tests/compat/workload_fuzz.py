"""Randomized workloads for kvscope under vLLM's own scheduler (`model_free.ModelFreeEngine`).

The scheduler-loop tests pin one scenario each; here a seed and a profile give a plan combining them
at random: pure data (JSON), an engine configuration and a multi-round workload (shared prefixes,
conversation turns, cache salts, requests added mid-run, aborts, device prefix-cache resets, rarely a
reset with new weights). `execute(plan)` replays it and reports KV violations (the fake forward checks
every position it reads), requests that never finished and host-tier leaks (with the host tier's KV
cache events, on in every replay, disagreeing with the tier after a round counted as one). vLLM's known
admission stalls (`test_known_vllm_gap_...`), which kvscope's load admission must keep vLLM out of, are
told apart as `stall`, a failure; its known Mamba state mix-up under partial hash hits
(`test_known_vllm_gap_mamba_align_...`) as `vllm_mamba_align`, not kvscope's failure.

    python -m tests.compat.workload_fuzz --seeds 0:500 --minutes 20 --profile full --shrink --out repros/
    python -m tests.compat.workload_fuzz --replay repros/seed-17.json
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import logging
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

WINDOW = 64  # the sliding window (tokens) of the model's sliding-window layers
MAX_STEPS = 4000  # engine steps one `run` may take before its requests count as unfinished
SHRINK_SECONDS = 300
# Probabilities per seed. "fast" keeps a seed around a second (the pytest seeds); "full" adds what is
# slow or rare: late-landing copies (CUDA's DMA timing) and a worker whose loads all fail in some rounds.
# "mamba-spec" draws every plan with a Mamba group and drafts (ngram, EAGLE or single-module MTP), half of
# them with vLLM's `enable_mamba_shared_prefix_checkpoint`; the others never combine the two, and their
# seeds keep their plans (pinned tests and past campaigns name them).
PROFILES = {
    "fast": {"mamba": 0.08, "two_workers": 0.1, "spec": 0.15, "fail_loads": 0.0, "late": 0.0},
    "full": {"mamba": 0.15, "two_workers": 0.25, "spec": 0.3, "fail_loads": 0.12, "late": 0.15},
    "mamba-spec": {"mamba_with_drafts": True, "two_workers": 0.25, "fail_loads": 0.12, "late": 0.15},
    # "full" with the window drawn too (drawn last: "full"'s seeds keep their plans), around where a
    # window starts to drop an offloaded block's first pieces before its key exists, with and without drafts
    "windows": {"mamba": 0.15, "two_workers": 0.25, "spec": 0.5, "fail_loads": 0.12, "late": 0.15,
                "windows": (16, 17, 33, 47, 48, 49, 50, 51, 52, 64, 111, 113, 200)},
    # "full" with every seed's copies landing late, stores up to 30 steps late: blocks vLLM freed reach
    # loads while the stores that read them are pending (`TransferJob.waits_for_stores`)
    "late": {"mamba": 0.15, "two_workers": 0.25, "spec": 0.3, "fail_loads": 0.12, "late": 1.0,
             "store_lags": (1, 3, 10, 30)},
    # "full" in a small device cache every time (drawn last): preemptions, and loads kvscope defers for
    # device KV room (`load_admission`), among them loads of requests resumed after a preemption
    "tight": {"mamba": 0.15, "two_workers": 0.25, "spec": 0.3, "fail_loads": 0.12, "late": 0.15,
              "device_blocks": (100, 120, 150, 200)},
    # "full" with a Mamba group every time and `mamba_decode_states` false (kvscope's default): only states a
    # prefill computed are stored (preempted requests computing their decoded tokens again among them). The
    # other profiles store decode states too (true), as every profile did before the key existed
    "prefill-states": {"mamba": 1.0, "two_workers": 0.25, "spec": 0.0, "fail_loads": 0.12, "late": 0.15,
                       "prefill_states": True},
    # "full" with vLLM's prefix cache keeping the sliding window's blocks as the engine does by default (its
    # `prefix_cache_retention_interval` 0: only where a later request can resume, at prompt ends and shared-prefix
    # junctions) or periodically (drawn last). The other profiles keep every one (None): device hits then reach
    # as far as the host tier's, where here kvscope serves what the device dropped
    "sparse-windows": {"mamba": 0.15, "two_workers": 0.25, "spec": 0.3, "fail_loads": 0.12, "late": 0.15,
                       "window_retentions": (0, 0, 64, 256)},
}
# "tight" with "sparse-windows"' retention: vLLM's default in a small device cache (a Mamba plan is "tight"'s own:
# its state retention is drawn apart)
PROFILES["tight-sparse"] = {**PROFILES["tight"], "window_retentions": PROFILES["sparse-windows"]["window_retentions"]}
# "tight-sparse" under vLLM 0.34's `--max-num-inflight-kv-loads` (drawn last), with a running batch of a few
# requests: loads kvscope says `may_load_async` for start while the batch is full
PROFILES["inflight-loads"] = {**PROFILES["tight-sparse"], "inflight_loads": (1, 1, 2, 4), "max_num_seqs": (2, 3, 4, 16)}


# ----------------------------------------------------------------------------- plans (pure data)
def make_plan(seed: int, profile: str = "fast") -> dict:
    """The plan of one seed: {"seed", "config", "rounds": [{"phases": [...], "between"}]}."""
    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r}: accepted are {', '.join(PROFILES)}")
    r = random.Random(seed)
    config = _config(r, PROFILES[profile])
    prefixes = [[f"{seed}p{i}", r.choice([20, 100, 200, 300, 300, 500, 700])] for i in range(r.randint(1, 3))]
    # one request alone must fit the device cache (vLLM refuses a max_model_len that does not): during a
    # prefill both groups (sliding window and full) can hold a block per 16 tokens
    cap = min(1500, (config["num_blocks"] - 6) // 2 * 16 - 8)
    small_device = config["num_blocks"] < 400
    requests: list[dict] = []
    rounds = []
    n_rounds = r.choice([1, 2, 2, 3, 3, 4])
    for k in range(n_rounds):
        phases = []
        for p in range(r.randint(1, 3)):
            adds = []
            for _ in range(r.randint(1, 4 if small_device else 5)):
                n = len(requests)
                adds.append(_request(r, f"{seed}s{n}", f"k{k}-{n}", prefixes, requests, small_device, cap))
                requests.append(adds[-1])
            phases.append(_phase(r, adds, last=p == 2))
        x = r.random()
        between = "reset" if x < 0.7 else "weights" if x < 0.75 and k < n_rounds - 1 else "none"
        rounds.append({"phases": phases, "between": between})
    return {"seed": seed, "config": config, "rounds": rounds}


def _config(r: random.Random, odds: dict) -> dict:
    config: dict = {}
    if odds.get("mamba_with_drafts"):
        _mamba_with_drafts(r, config)
    elif r.random() < odds["mamba"]:
        state_block = r.choice([16, 64])
        config["mamba"] = {"block": state_block, "hash_block": 16, "retention": r.choice([0, 0, None, 128])}
        config["block_size"] = state_block * _state_blocks_per_offload_block(r, config["mamba"])
    else:
        config["block_size"] = r.choice([16, 32, 64, 64, 128, 256])
        if r.random() < odds["spec"]:
            config["spec_tokens"] = r.choice([1, 2, 3])
            config["spec_method"] = "eagle" if r.random() < 0.25 else "ngram"
    config["workers"] = 2 if r.random() < odds["two_workers"] else 1
    config["async_scheduling"] = r.random() < 0.5
    config["runner"] = r.choice(["v1", "v1", "v2"])
    if config["runner"] == "v2" and "spec_tokens" in config and r.random() < 0.5:
        config["runner"] = "v2-spec"  # vLLM 0.33's V2 runner with drafts: stores after the step's results
    config["num_blocks"] = r.choice([1200, 1200, 400, 200, 150, 120, 100])  # under 400: preemptions
    config["max_num_batched_tokens"] = r.choice([2048, 2048, 512, 256, 100, 64])  # chunked prefills
    # host slots (one offloaded block each): a handful means evictions
    config["cpu_bytes"] = r.choice([2, 4, 8, 16, 32, 64, 10_000, 10_000, 10_000]) * config["block_size"] * 512
    if r.random() < odds["fail_loads"]:
        config["fail_loads"] = {"rank": r.randrange(config["workers"])}  # in odd rounds: 1 and 3
    if r.random() < odds["late"]:
        config["late"] = {"store_steps": r.choice(odds.get("store_lags", (1, 3))), "load_steps": r.choice([0, 0, 2])}
    if "windows" in odds:
        config["window"] = r.choice(odds["windows"])
    if "device_blocks" in odds:
        config["num_blocks"] = r.choice(odds["device_blocks"])
    if "mamba" in config:
        config["mamba_decode_states"] = not odds.get("prefill_states", False)
    elif "window_retentions" in odds:
        config["window_retention"] = r.choice(odds["window_retentions"])
    if "inflight_loads" in odds:
        config["engine_args"] = {"max_num_inflight_kv_loads": r.choice(odds["inflight_loads"]),
                                 "max_num_seqs": r.choice(odds["max_num_seqs"])}
    return config


def _state_blocks_per_offload_block(r: random.Random, mamba: dict) -> int:
    """1, 2 or 4; 1 unless vLLM keeps every state (retention None): kvscope refuses an offloaded block
    of several checkpointed state blocks (none would ever be stored). Drawn either way, so a seed's
    other draws stay what they were."""
    factor = r.choice([1, 2, 4])
    return factor if mamba["retention"] is None else 1


def _mamba_with_drafts(r: random.Random, config: dict) -> None:
    """A Mamba group (as `_config` draws it) and drafts. vLLM takes both together: the Mamba group gets a
    state block per draft (`MambaSpec.num_speculative_blocks`), its runners move states by the accepted
    tokens (`mamba_utils.preprocess_mamba`, `postprocess_mamba_fused_kernel`), and with EAGLE or MTP
    the checkpoints drop the last block as the attention groups do. MTP here is single-module (no
    draft model to read): multi-module MTP re-prefills a tail the fake drafter does not model."""
    state_block = r.choice([16, 64])
    config["mamba"] = {"block": state_block, "hash_block": 16, "retention": r.choice([0, 0, None, 128])}
    if r.random() < 0.5:  # in effect with EAGLE or MTP and 64-token Mamba blocks (finer hashes)
        config["mamba"]["shared_prefix_checkpoint"] = True
    config["block_size"] = state_block * _state_blocks_per_offload_block(r, config["mamba"])
    config["spec_tokens"] = r.choice([1, 2, 3])
    config["spec_method"] = r.choice(["ngram", "ngram", "eagle", "mtp"])


def _request(r: random.Random, segment: str, req_id: str, prefixes, earlier: list[dict], small_device: bool,
             cap: int) -> dict:
    """A prompt of segments: [key, n] n random tokens; ["gen", n] the n tokens the fake model samples
    there (a conversation's next turn sends the previous turn's output back)."""
    if earlier and r.random() < 0.3:  # an earlier prompt again: maybe its next turn, maybe extended
        previous = r.choice(earlier)
        prompt, salt = copy.deepcopy(previous["prompt"]), previous["salt"]
        if r.random() < 0.5:
            prompt.append(["gen", previous["max_tokens"]])
        if r.random() < 0.6:
            prompt.append([segment, r.randint(1, 80)])
    else:
        prompt, salt = [], r.choice([None] * 14 + ["a", "b"])
        if r.random() < 0.85:
            key, length = r.choice(prefixes)
            prompt.append([key, length if r.random() < 0.7 else r.randint(1, length)])
        n = r.choice([1, 5, 15, 16, 17, 40, 63, 64, 65, 120, 200, 400])
        prompt.append([segment, r.randint(1, 600) if r.random() < 0.3 else n])
    long_output = r.random() >= (0.7 if small_device else 0.9)
    max_tokens = r.choice([150, 250]) if long_output else r.choice([1, 2, 2, 5, 16, 33, 64])
    excess = sum(n for _, n in prompt) - (cap - max_tokens)
    if excess > 0:
        prompt[-1][1] = max(1, prompt[-1][1] - excess)
        if sum(n for _, n in prompt) > cap - max_tokens:
            prompt = [[segment, cap - max_tokens]]
    return {"id": req_id, "prompt": prompt, "max_tokens": max_tokens, "salt": salt}


def _phase(r: random.Random, adds: list[dict], last: bool) -> dict:
    """Requests added together; with `pause_after`, the engine steps that many times before the next
    phase adds its own. Aborts: a request after its n-th scheduling, or as soon as it loads
    (`abort_on_schedule`), or one at the pause (`abort_after`)."""
    phase = {"adds": adds, "pause_after": None if last else r.choice([None, 1, 2, 3, 5, 10]),
             "abort_on_schedule": [], "abort_after": []}
    if r.random() < 0.25:
        phase["abort_on_schedule"].append({"id": r.choice(adds)["id"], "after": r.choice([0, 0, 1, 3]),
                                           "when_loading": r.random() < 0.5})
    if phase["pause_after"] is not None and r.random() < 0.2:
        phase["abort_after"].append(r.choice(adds)["id"])
    return phase


def prompt_tokens(plan_seed: int, prompt: list) -> list[int]:
    from tests.compat.model_free import true_token

    tokens: list[int] = []
    for key, n in prompt:
        if key == "gen":
            tokens += [true_token(p) for p in range(len(tokens), len(tokens) + n)]
        else:
            segment = random.Random(f"{plan_seed}/{key}")
            tokens += [segment.randint(1, 500) for _ in range(n)]
    return tokens


def missing_feature(plan: dict) -> str | None:
    """Why the installed vLLM cannot replay `plan`, or None."""
    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    if plan["config"]["runner"] == "v2-spec" and \
            "defer_finalize" not in inspect.signature(ActiveKVConnector.post_forward).parameters:
        return "this vLLM's V2 runner has no deferred finalize (speculative decoding)"
    if plan["config"].get("mamba", {}).get("shared_prefix_checkpoint") and \
            "enable_mamba_shared_prefix_checkpoint" not in CacheConfig.__dataclass_fields__:
        return "this vLLM has no enable_mamba_shared_prefix_checkpoint"
    if "max_num_inflight_kv_loads" in plan["config"].get("engine_args", {}) and \
            "max_num_inflight_kv_loads" not in SchedulerConfig.__dataclass_fields__:
        return "this vLLM has no --max-num-inflight-kv-loads (0.34 on)"
    return None


# ----------------------------------------------------------------------------- replay
KNOWN_VERDICTS = ("ok", "vllm_mamba_align")  # not kvscope's failures


@dataclass
class WorkloadResult:
    """What a replay found wrong, the vLLM stalls it got past, and counts of what it exercised."""

    violations: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)  # requests short of their tokens, a run that never ended
    leaks: list[str] = field(default_factory=list)
    # the requests of each recognised vLLM admission stall: kvscope's load admission let loads into it
    vllm_stalls: list[list[str]] = field(default_factory=list)
    # the violations are all vLLM's own Mamba align mix-up (`_vllm_mamba_align`), no kvscope load involved
    vllm_mamba_align: bool = False
    steps: int = 0
    checked_blocks: int = 0
    checked_loaded_blocks: int = 0
    external_hit_tokens: int = 0
    evictions: int = 0
    preemptions: int = 0  # requests vLLM preempted and resumed
    aborts: int = 0  # requests aborted while vLLM still had them
    drafts_rejected: int = 0
    failed_loads: int = 0
    checkpoint_clobbers: int = 0  # vLLM's Mamba checkpoint exported over the running state (`model_free`)
    clobbered_stored: int = 0  # kvscope store jobs reading such a block (`model_free.LoopStats`)
    loads_after_stores: int = 0  # late copies: loads that waited for the stores in flight (`waits_for_stores`)
    deferred_loads: int = 0  # loads kvscope deferred for device KV room (`load_admission`)
    # loads planned in a step that began with the running batch full (vLLM 0.34's `--max-num-inflight-kv-loads`,
    # `may_load_async`)
    loads_beside_full_batch: int = 0

    @property
    def failure(self) -> str | None:
        """What went wrong, in one word (the shrinker keeps it), or None."""
        violations = [] if self.vllm_mamba_align else self.violations
        for kind, found in (("violation", violations), ("unfinished", self.unfinished), ("leak", self.leaks),
                            ("stall", self.vllm_stalls)):
            if found:
                return kind
        return None

    @property
    def verdict(self) -> str:
        if self.failure:
            return self.failure
        return "vllm_mamba_align" if self.vllm_mamba_align else "ok"


class _Stop(Exception):
    """The plan cannot go on (the reason is already in the result)."""


def execute(plan: dict, traced: bool = True) -> WorkloadResult:
    """Replay `plan` on a fresh engine; `traced`: with a trace file, whose spans must agree with kvscope's stats.
    Unexpected errors (from kvscope, vLLM or the fake forward) propagate."""
    with tempfile.TemporaryDirectory(prefix="kvscope-fuzz-trace-") as trace_dir, \
            _played(plan, Path(trace_dir) / "spans.jsonl" if traced else None) as replay:
        return replay.finish()


@contextmanager
def _played(plan: dict, trace_file: Path | None = None) -> Iterator[_Replay]:
    """`plan`'s rounds run on a fresh engine, which is shut down when the block ends."""
    replay = _Replay(plan, trace_file)
    try:
        try:
            replay.rounds()
        except _Stop:
            pass
        yield replay
    finally:
        replay.engine.shutdown()


class _Replay:
    """One plan on one engine: its requests, aborts and resets, round by round."""

    def __init__(self, plan: dict, trace_file: Path | None = None):
        self.plan, self.result, self.trace_file = plan, WorkloadResult(), trace_file
        self.engine = _engine(plan["config"], trace_file)
        self.added: dict[str, int] = {}  # req id -> tokens it must end with (prompt and output)
        self.aborted: set[str] = set()
        self.schedulings: dict[str, int] = {}
        self.triggers: dict[str, dict] = {}  # req id -> its `abort_on_schedule` entry
        # the requests running as the step's scheduling began: a load planned while they fill the batch started
        # beside it (`loads_beside_full_batch`), not in a slot that was free
        self.running_before = 0
        scheduler = self.engine.scheduler
        schedule = scheduler.schedule

        def noted_schedule():
            self.running_before = len(scheduler.running)
            return schedule()

        scheduler.schedule = noted_schedule

    def rounds(self) -> None:
        engine, fail_loads = self.engine, self.plan["config"].get("fail_loads")
        for k, round_ in enumerate(self.plan["rounds"]):
            if fail_loads:
                engine.workers[fail_loads["rank"]]._worker.fail_all_loads = k % 2 == 1
            weights_due = round_["between"] == "weights"  # at the round's first pause, else at its end
            for phase in round_["phases"]:
                for req in phase["adds"]:
                    tokens = prompt_tokens(self.plan["seed"], req["prompt"])
                    engine.add(req["id"], tokens, req["max_tokens"], cache_salt=req["salt"])
                    self.added[req["id"]] = len(tokens) + req["max_tokens"]
                self.triggers.update((entry["id"], entry) for entry in phase["abort_on_schedule"])
                if phase["pause_after"] is not None:
                    self.run(phase["pause_after"])
                    if weights_due:
                        self.reset_for_new_weights()
                        weights_due = False
                    self.abort(phase["abort_after"])
            self.run()
            if weights_due:
                self.reset_for_new_weights()
                self.run()
            engine.step_once()  # a reset's events go out with the next step (the next request's)
            if engine.stats.violations:
                raise _Stop
            self.result.leaks = [f"after round {k}: {leak}" for leak in
                                 engine.host_tier_leaks() + engine.kv_event_mismatches()]
            if self.result.leaks:
                raise _Stop
            if round_["between"] == "reset":
                engine.reset_device_prefix_cache()
        if engine.scheduler.has_requests():
            self.result.unfinished.append("the scheduler still has requests")
        self.result.unfinished += [f"{rid}: {len(engine.tokens[rid])} of {n} tokens" for rid, n in self.added.items()
                                   if rid not in self.aborted and len(engine.tokens[rid]) < n]

    def run(self, pause_after: int | None = None) -> None:
        try:
            self.engine.run(max_steps=MAX_STEPS, on_scheduled=self.on_scheduled, pause_after=pause_after)
        except AssertionError as exc:
            if "still unfinished" not in str(exc):
                raise
            stuck = _stalled_by_vllm(self.engine)
            if stuck is None or self.aborted.intersection(stuck):  # aborted, and still there: not vLLM's stall
                states = ", ".join(f"{r.request_id} {r.status.name}" for r in self.engine.scheduler.requests.values())
                self.result.unfinished.append(f"{exc}: {states or 'no request left, connector work pending'}")
                raise _Stop from exc
            # what a client would do: give up on them, and the plan goes on (kvscope must release them)
            self.result.vllm_stalls.append(stuck)
            self.abort(stuck)
            self.run(pause_after)

    def on_scheduled(self, out) -> None:
        """Aborts due at this scheduling: where a client's abort lands, before the workers see the step."""
        loading = {job.req_id for job in getattr(out.kv_connector_metadata, "loads", ())}
        if loading and self.running_before >= self.engine.scheduler.scheduler_config.max_num_seqs:
            self.result.loads_beside_full_batch += len(loading)
        for rid in set(out.num_scheduled_tokens) | loading:
            self.schedulings[rid] = self.schedulings.get(rid, 0) + 1
        due = [rid for rid, t in self.triggers.items() if rid not in self.aborted and (
            rid in loading if t["when_loading"] else self.schedulings.get(rid, 0) > t["after"])]
        for rid in due:
            del self.triggers[rid]
        self.abort(due)

    def abort(self, req_ids) -> None:
        req_ids = [rid for rid in req_ids if rid not in self.aborted]
        self.result.aborts += sum(rid in self.engine.scheduler.requests for rid in req_ids)
        self.aborted.update(req_ids)
        if req_ids:
            self.engine.abort(req_ids)

    def reset_for_new_weights(self) -> None:
        """An RL weight update. vLLM refuses it (RuntimeError) while a request waits for an async load:
        step until it accepts, as a trainer would retry."""
        for _ in range(200):
            try:
                if self.engine.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
                    self.engine.update_weights()
                    return
            except RuntimeError:
                pass
            self.run(pause_after=1)
        self.result.unfinished.append("reset_prefix_cache(reset_connector=True) refused for 200 steps")
        raise _Stop

    def finish(self) -> WorkloadResult:
        stats, result = self.engine.stats, self.result
        result.violations = [str(v) for v in stats.violations]
        result.vllm_mamba_align = (_vllm_mamba_align(self.plan["config"], self.engine)
                                   or _same_without_kvscope_hits(self.plan, self.engine))
        if not result.failure:
            result.leaks = (self.engine.host_tier_leaks() + self.engine.kv_event_mismatches()
                            + self.engine.telemetry_mismatches() + self.span_mismatches())
        for name in ("steps", "checked_blocks", "checked_loaded_blocks", "external_hit_tokens", "drafts_rejected",
                     "checkpoint_clobbers", "clobbered_stored"):
            setattr(result, name, getattr(stats, name))
        kvscope = self.engine.scheduler.get_kv_connector()._scheduler
        result.evictions, result.deferred_loads = kvscope.index.evicted_total, kvscope.admission.deferrals
        result.loads_after_stores = sum(late.loads_after_stores for late in self.engine.late_copies)
        result.preemptions, result.failed_loads = len(stats.resumed), len(stats.failed_recving)
        return result

    def span_mismatches(self) -> list[str]:
        """Where the trace file's spans, or the replay app reading it, disagree with kvscope's stats
        (`span_agreement`); none untraced."""
        from tests.compat.span_agreement import replay_app_mismatches, span_stat_mismatches, trace_file_attributes

        if self.trace_file is None:
            return []
        for connector in [self.engine.scheduler.get_kv_connector(), *self.engine.workers]:
            if not connector.tracing.force_flush():
                return ["telemetry: the spans could not be flushed to the trace file"]
        data = self.engine.stats.connector.data if self.engine.stats.connector is not None else {}
        return (span_stat_mismatches(trace_file_attributes(self.trace_file), data)
                + replay_app_mismatches(self.trace_file, data))


def _engine(config: dict, trace_file: Path | None = None):
    from connector.tiny_models import build_model
    from tests.compat.model_free import LateReadingStores, MambaAlign, ModelFreeEngine

    options = {}
    if "mamba" in config:
        mamba = config["mamba"]
        options["mamba"] = MambaAlign(mamba["block"], mamba["hash_block"], retention=mamba["retention"],
                                      shared_prefix_checkpoint=mamba.get("shared_prefix_checkpoint", False))
    if "spec_tokens" in config:
        options.update(spec_tokens=config["spec_tokens"], spec_method=config["spec_method"])
    window = config.get("window", WINDOW)
    extra = {"cpu_bytes": config["cpu_bytes"], "block_size": config["block_size"]}
    if "mamba_decode_states" in config:
        extra["mamba_decode_states"] = config["mamba_decode_states"]
    if trace_file is not None:
        extra["trace_file"] = str(trace_file)
    # plans without it (every profile's but sparse-windows' and tight-sparse') keep every window block, as when
    # they were drawn
    options["window_retention"] = config.get("window_retention")
    engine = ModelFreeEngine(build_model("gemma3", window=window), extra, window=window,
                             num_blocks=config["num_blocks"], max_num_batched_tokens=config["max_num_batched_tokens"],
                             workers=config["workers"], async_scheduling=config["async_scheduling"],
                             runner=config["runner"], kv_events=True, engine_args=config.get("engine_args"),
                             **options)
    engine.late_copies = []
    if "late" in config:
        fence = _cuda_store_fence(engine, engine.runner)  # "v1" is the CPU runner on vLLM 0.34
        for connector in engine.workers:
            late = LateReadingStores(connector._worker.engine, steps=config["late"]["store_steps"],
                                     load_steps=config["late"]["load_steps"])
            engine.late_copies.append(late)
            engine.after_step.append(late.tick)
            connector._worker.store_fence = fence  # copies that land late are CUDA's: so is their fence
    return engine


def _cuda_store_fence(engine, runner: str) -> str:
    """Where a CUDA worker would fence its stores under this runner and these caches
    (`sides.store_fence`; vLLM's config here names the V1 runner, its V2 needing Triton)."""
    from unittest import mock

    from connector import sides

    with mock.patch.object(sides, "uses_v2_model_runner", return_value=runner != "v1"):
        return sides.store_fence(engine.vllm_config, engine.kv_cache_config)


def _vllm_mamba_align(config: dict, engine) -> bool:
    """Whether every violation is vLLM's own Mamba mix-up under partial hash hits (0.32 and 0.33).

    With hash blocks finer than Mamba blocks, a chunk that starts inside a block skips the stop at
    that block's end (it saves its checkpoint inside the chunk), yet vLLM caches the block it copied
    for the partial hit under that end's key: a later request resumes from a state of fewer tokens.
    The chunk can also start inside the block at a shared-prefix junction (vLLM's
    `enable_mamba_shared_prefix_checkpoint` with EAGLE or MTP, whose dropped block moves the junction
    off a block boundary: seed 261049 of "mamba-spec"), or at a checkpoint EAGLE's drop moved (260158).
    Told apart where every violation is a Mamba state and kvscope loaded nothing at all, or where each
    wrong state came from vLLM's prefix cache alone: the request's lookup found no host-tier tokens past
    its device hit, and vLLM's own forward or state copy wrote the block last, no kvscope load
    (`model_free.Violation.from_vllm_cache`). kvscope's hits still change the schedule that leads there:
    a failed load sends a request back to vLLM's prefix cache (seeds 276150 on 0.33, 354198 on 0.32)."""
    if not _mamba_state_violations_only(config, engine):
        return False
    return not engine.stats.external_hit_tokens or all(v.from_vllm_cache for v in engine.stats.violations)


def _mamba_state_violations_only(config: dict, engine) -> bool:
    """Violations there are, every one a Mamba state of the wrong token count, with hash blocks finer than
    Mamba blocks: the form of vLLM's align mix-up (`_vllm_mamba_align`)."""
    mamba, stats = config.get("mamba"), engine.stats
    if not mamba or mamba["hash_block"] >= mamba["block"] or not stats.violations:
        return False
    kinds = [layout.kind.value for layout in engine.scheduler.get_kv_connector()._scheduler.layouts]
    return all(kinds[v.group] == "mamba" and "not the state after" in v.reason for v in stats.violations)


def _same_without_kvscope_hits(plan: dict, engine) -> bool:
    """Whether the Mamba violations of a run where kvscope loaded something are vLLM's own mix-up all the
    same: the plan replayed with kvscope offering no hit gives every one of them again (same request,
    group, block and reason; steps may shift), so vLLM's device prefix cache, not a load, gave those
    states. (Seed 211678: a request kvscope never loaded read vLLM's wrong state, while another loaded.)"""
    from unittest import mock

    from connector.scheduler import KVScopeScheduler

    stats = engine.stats
    if not stats.external_hit_tokens or not _mamba_state_violations_only(plan["config"], engine):
        return False
    no_hits = mock.patch.object(KVScopeScheduler, "get_num_new_matched_tokens", lambda self, req, computed: (0, False))
    with no_hits, _played(plan) as replay:
        again = {(v.req_id, v.group, v.block_index, v.reason) for v in replay.engine.stats.violations}
        loaded = replay.engine.stats.external_hit_tokens
    return not loaded and {(v.req_id, v.group, v.block_index, v.reason) for v in stats.violations} <= again


def _stalled_by_vllm(engine) -> list[str] | None:
    """The requests of vLLM's known admission stalls, or None when the engine is stuck otherwise.

    vLLM admits async loads whose remaining prefills need more device blocks together than are free,
    or whose first one's next chunk does (`_next_chunk_blocks`: more than vLLM's estimate counts);
    with nothing running nothing can be preempted, and they wait for ever. Or a failed load frees
    its request's blocks, that request stays first in the queue and cannot be admitted, and vLLM
    never reaches the requests behind it that hold blocks (README, "Device KV headroom"). kvscope's
    part is done: no job waits for a report, every stuck request's load was reported finished, one
    that loaded holds its blocks, and one that failed either holds none (sent back to waiting) or
    waits for vLLM to take the report; one never loaded holds nothing and waits behind them. A load
    kvscope lost or left unreported fails these."""
    scheduler = engine.scheduler
    kvscope = scheduler.get_kv_connector()._scheduler
    if scheduler.running or kvscope.has_unreported_jobs():
        return None
    stuck = list(scheduler.requests.values())
    loaded, failed = engine.stats.finished_recving, engine.stats.failed_recving
    manager = scheduler.kv_cache_manager

    def settled(r) -> bool:
        holds = any(manager.get_block_ids(r.request_id))
        if r.request_id not in loaded:  # never loaded: only waiting behind the others, holding nothing
            return not holds and r.status.name == "WAITING"
        if r.request_id not in failed:
            return holds
        # kvscope offers a request whose load failed no hit again (or it would stall on its own reserve)
        if not kvscope._requests[r.request_id].load_failed:
            return False
        return not holds or r.request_id in scheduler.finished_recving_kv_req_ids

    if not stuck or not all(settled(r) for r in stuck):
        return None
    free = manager.block_pool.get_num_free_blocks()
    needed = sum(scheduler._request_remaining_blocks(r) for r in stuck if r.request_id in loaded)
    head = scheduler.kv_holding_waiting.peek_request() if len(scheduler.kv_holding_waiting) else None
    if needed <= free and not (head is not None and head.request_id in loaded and head.request_id not in failed
                               and _next_chunk_blocks(scheduler, head) > free):
        return None
    return sorted(r.request_id for r in stuck)


def _next_chunk_blocks(scheduler, request) -> int:
    """The blocks vLLM's `allocate_slots` asks for the request's next chunk. vLLM admits an async load
    against a capped estimate of what the request still needs (`_request_remaining_blocks`); a
    sliding-window group's chunk after the load can need more (every block the chunk spans), and
    the request heads the queue of those holding KV: vLLM's scan stops there (seed 160364)."""
    manager = scheduler.kv_cache_manager
    computed = request.num_computed_tokens
    chunk = scheduler.scheduler_config.max_num_batched_tokens
    threshold = scheduler.scheduler_config.long_prefill_token_threshold
    if 0 < threshold < chunk:  # vLLM cuts a long prefill's chunk to it
        chunk = threshold
    # vLLM frees the blocks out of the window before asking (`remove_skipped_blocks`): it tried every
    # step of the stall, so those are free by now and the count below is what it asks for
    end = min(request.num_tokens, computed + chunk)
    return manager.coordinator.get_num_blocks_to_allocate(
        request_id=request.request_id,
        num_tokens=min(end + scheduler.num_lookahead_tokens, scheduler.max_model_len),
        new_computed_blocks=manager.empty_kv_cache_blocks.blocks, num_encoder_tokens=0,
        total_computed_tokens=computed, num_local_computed_tokens=computed, num_tokens_main_model=end,
        prefill_end=max(request.num_prompt_tokens, request.num_tokens - 1))


# ----------------------------------------------------------------------------- shrinking
def shrink(plan: dict, failure: str, budget_s: float = SHRINK_SECONDS) -> dict:
    """Greedily the simplest plan still failing with `failure` (a `WorkloadResult.failure`, or an
    unexpected error's type): take the first simplification that does, start over, until none does."""
    deadline = time.monotonic() + budget_s

    def failure_of(candidate: dict) -> str | None:
        try:
            return execute(candidate).failure
        except Exception as exc:  # noqa: BLE001 - an error is a failure kind too
            return type(exc).__name__

    best, changed = plan, True
    while changed and time.monotonic() < deadline:
        changed = False
        for candidate in _simplifications(best):
            if time.monotonic() > deadline:
                break
            if failure_of(candidate) == failure:
                best, changed = candidate, True
                print(f"  shrunk: {describe(best)}", flush=True)
                break
    return best


def _simplifications(plan: dict):
    """Fewer rounds, phases and requests first, then fewer events, then a plainer engine."""
    def edited(change) -> dict:  # `change` runs at once: the loop variables it reads are current
        candidate = copy.deepcopy(plan)
        change(candidate)
        return candidate

    def phase(p: dict, i: int, j: int) -> dict:
        return p["rounds"][i]["phases"][j]

    rounds = plan["rounds"]
    for i in range(len(rounds) if len(rounds) > 1 else 0):
        yield edited(lambda p: p["rounds"].pop(i))
    for i, round_ in enumerate(rounds):
        for j in range(len(round_["phases"]) if len(round_["phases"]) > 1 else 0):
            yield edited(lambda p: p["rounds"][i]["phases"].pop(j))
    for i, j, adds in [(i, j, ph["adds"]) for i, r in enumerate(rounds) for j, ph in enumerate(r["phases"])]:
        for m in range(len(adds) if len(adds) > 1 else 0):
            yield edited(lambda p: _drop_request(phase(p, i, j), m))
    for i, round_ in enumerate(rounds):
        if round_["between"] != "none":
            yield edited(lambda p: p["rounds"][i].update(between="none"))
        for j, ph in enumerate(round_["phases"]):
            if ph["abort_on_schedule"] or ph["abort_after"]:
                yield edited(lambda p: phase(p, i, j).update(abort_on_schedule=[], abort_after=[]))
            if ph["pause_after"] is not None:
                yield edited(lambda p: phase(p, i, j).update(pause_after=None, abort_after=[]))
            for m, req in enumerate(ph["adds"]):
                if req["salt"] is not None or req["max_tokens"] > 2:
                    yield edited(lambda p: phase(p, i, j)["adds"][m].update(salt=None,
                                                                           max_tokens=min(2, req["max_tokens"])))
    plain = {"workers": 1, "async_scheduling": False, "runner": "v1", "num_blocks": 1200,
             "max_num_batched_tokens": 2048, "cpu_bytes": max(plan["config"]["cpu_bytes"], 64 << 20)}
    for key, value in plain.items():
        if plan["config"][key] != value:
            yield edited(lambda p: p["config"].update({key: value}))
    for keys in (("late",), ("fail_loads",), ("spec_tokens", "spec_method")):
        if keys[0] in plan["config"]:
            yield edited(lambda p: [p["config"].pop(key) for key in keys])
    if plan["config"].get("mamba", {}).get("shared_prefix_checkpoint"):
        yield edited(lambda p: p["config"]["mamba"].pop("shared_prefix_checkpoint"))


def _drop_request(phase: dict, index: int) -> None:
    gone = phase["adds"].pop(index)["id"]
    phase["abort_on_schedule"] = [entry for entry in phase["abort_on_schedule"] if entry["id"] != gone]
    phase["abort_after"] = [rid for rid in phase["abort_after"] if rid != gone]


def describe(plan: dict) -> str:
    n_requests = sum(len(phase["adds"]) for round_ in plan["rounds"] for phase in round_["phases"])
    return f"{len(plan['rounds'])} rounds, {n_requests} requests, config {json.dumps(plan['config'])}"


# ----------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.compat.workload_fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0:1000", help="A:B, the seeds A to B-1")
    parser.add_argument("--minutes", type=float, default=30, help="stop starting seeds after this long")
    parser.add_argument("--profile", default="fast", choices=sorted(PROFILES))
    parser.add_argument("--shrink", action="store_true", help="shrink each failing plan, write it to --out")
    parser.add_argument("--out", type=Path, help="where shrunk plans go (default: a fresh temporary folder)")
    parser.add_argument("--replay", type=Path, help="replay one plan (JSON, as --shrink writes them) and exit")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # vLLM's and kvscope's warnings about the workloads' pressure
    if args.replay:
        verdict = _report(json.loads(args.replay.read_text()), "replay")
        return int(verdict not in KNOWN_VERDICTS)
    lo, hi = map(int, args.seeds.split(":"))
    deadline = time.monotonic() + args.minutes * 60
    verdicts: dict[int, str] = {}
    for seed in range(lo, hi):
        if time.monotonic() > deadline:
            break
        plan = make_plan(seed, args.profile)
        if reason := missing_feature(plan):
            print(f"seed {seed} skipped: {reason}", flush=True)
            continue
        verdicts[seed] = _report(plan, f"seed {seed}")
        if args.shrink and verdicts[seed] not in KNOWN_VERDICTS:
            args.out = args.out or Path(tempfile.mkdtemp(prefix="kvscope-fuzz-"))
            _write_repro(plan, verdicts[seed], args.out)
    failures = [seed for seed, verdict in verdicts.items() if verdict not in KNOWN_VERDICTS]
    stalls = [seed for seed, verdict in verdicts.items() if verdict == "stall"]
    mamba = [seed for seed, verdict in verdicts.items() if verdict == "vllm_mamba_align"]
    print(f"\n{len(verdicts)} seeds, vLLM Mamba align mix-ups: {mamba}, failures: {failures} (admission stalls among "
          f"them: {stalls})")
    return int(bool(failures))


def _report(plan: dict, name: str) -> str:
    """Replay `plan`, print one line (and the first problems); the verdict, or an unexpected error's type."""
    start = time.monotonic()
    try:
        result = execute(plan)
    except Exception as exc:  # noqa: BLE001 - reported, and the next seed runs
        print(f"{name} {type(exc).__name__} {time.monotonic() - start:.1f}s {exc!r} {describe(plan)}", flush=True)
        return type(exc).__name__
    counts = {k: v for k, v in asdict(result).items() if isinstance(v, int)}
    print(f"{name} {result.verdict} {time.monotonic() - start:.1f}s {counts} {json.dumps(plan['config'])}", flush=True)
    for problem in result.violations[:4] + result.unfinished[:4] + result.leaks[:4]:
        print(f"  {problem}", flush=True)
    return result.verdict


def _write_repro(plan: dict, failure: str, out: Path) -> None:
    small = shrink(plan, failure)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"seed-{plan['seed']}.json"
    path.write_text(json.dumps(small, indent=1) + "\n")
    print(f"  repro: python -m tests.compat.workload_fuzz --replay {path}  ({describe(small)})", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
