"""What kvscope's load admission costs: engine steps to first token with it on and off, in one run.

    python -m bench.admission_bench [--quick]

Load admission (`connector/load_admission.py`) defers a host-tier load while the requests whose
loads vLLM has not yet run could, with it, need more device blocks than the cache has: without it
vLLM (0.32 to 0.34) can stall for good. Its bound is loose on purpose (every block a request spans in
every group, a sliding window counted whole), so under device-KV pressure it starts loads one after
another that vLLM might have run together. This counts what that costs in engine steps.

Three real vLLM `Scheduler`s with `KVScopeConnector` (telemetry off), built as `step_bench` builds
them, one with load admission (`admission`), one with its bound counting every sliding-window group
whole, as it did before it read vLLM's per-group cap (`uncapped`), one with every load starting at once
(`unadmitted`), serve the same rounds in lockstep: a round of `REQUESTS` fresh prompts (computed and
stored to the host tier), a device prefix cache reset, then the same prompts again, loaded from the
host tier. No
model and no worker: each step samples a token per scheduled request and one worker reports the
step's stores done at once and each load done `load_steps` steps after the step that planned it (1:
at once). Per device cache size (`blocks`, the pool all groups share) and load time, for the reload
round: the engine steps from its start to each request's
first token (the mean over requests, and the last), the round's steps, and the loads deferred.
Steps do not depend on this machine's speed: the counts are exact and repeat run to run; on a GPU
each step costs about a forward pass of the batch. A side that schedules nothing for `STALL_STEPS`
steps while requests wait has stalled: its round is cut there and reported as such.

`run(quick)` returns {name, median, unit, ratio, ratio_of} records.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from bench.planner_vs_vllm import GROUP_MIXES, _kv_cache_config  # noqa: E402
from bench.step_bench import DEVICE_BLOCK_SIZE, OFFLOAD_BLOCK_SIZE  # noqa: E402
from bench.table import render_table  # noqa: E402

PROMPT_TOKENS = 2048  # shorter than a 1024-token window plus a chunk: vLLM's cap changes nothing
LONG_PROMPT_TOKENS = 6144  # longer: the cap counts the window group 193 blocks, not 384
DECODE_TOKENS = 4
REQUESTS = 8
MAX_NUM_BATCHED_TOKENS = 2048
HOST_BYTES = 1 << 30  # the host tier holds every prompt
STALL_STEPS = 300
SIDES = ("admission", "uncapped", "unadmitted")
# (KV groups, device blocks, prompt tokens) per case, from a cache two loads barely fit in to one all
# eight fit in at once (a request's bound: 2 groups x 128 blocks at 2g, 4 x 128 at 4g; with 6144-token
# prompts 384 + 193, uncapped 2 x 384)
CASES_FULL = (*((2, blocks, PROMPT_TOKENS) for blocks in (450, 600, 900, 1300, 2100)),
              *((4, blocks, PROMPT_TOKENS) for blocks in (900, 1300, 2100, 4200)),
              *((2, blocks, LONG_PROMPT_TOKENS) for blocks in (1200, 1800, 2600, 4700, 6200)))
CASES_QUICK = ((2, 600, PROMPT_TOKENS), (2, 1800, LONG_PROMPT_TOKENS))
LOAD_STEPS_FULL = (1, 4)  # a load done in the step after it is planned, or over 4 steps (a big model's KV)
LOAD_STEPS_QUICK = (1,)
UNIT = "steps"


def new_scheduler(side: str, num_groups: int, num_blocks: int):
    """A real vLLM Scheduler with kvscope (telemetry off) and a device cache of ``num_blocks`` blocks."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from connector.tiny_models import build_model

    transfer = KVTransferConfig(kv_connector="KVScopeConnector", kv_connector_module_path="connector",
                                kv_role="kv_both",
                                kv_connector_extra_config={"cpu_bytes": HOST_BYTES, "block_size": OFFLOAD_BLOCK_SIZE})
    args = EngineArgs(model=build_model("llama"), skip_tokenizer_init=True, enable_prefix_caching=True,
                      block_size=DEVICE_BLOCK_SIZE, max_model_len=8192,
                      max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                      max_num_seqs=256, kv_transfer_config=transfer)
    config = args.create_engine_config()
    config.cache_config.num_gpu_blocks = num_blocks
    scheduler = Scheduler(vllm_config=config, kv_cache_config=_kv_cache_config(GROUP_MIXES[num_groups], num_blocks),
                          structured_output_manager=StructuredOutputManager(config), block_size=DEVICE_BLOCK_SIZE,
                          hash_block_size=DEVICE_BLOCK_SIZE, log_stats=True)
    admission = scheduler.get_kv_connector()._scheduler.admission
    if side == "uncapped":
        admission.window_caps = {}  # every sliding-window group counted whole
    elif side == "unadmitted":
        admission.may_start = lambda *args, **kwargs: True  # every load starts at once: vLLM decides
    return scheduler


@dataclass
class Round:
    load_steps: int = 1
    steps: int = 0
    first_token_step: dict[str, int] = field(default_factory=dict)  # request id -> step of its first token
    loads: int = 0
    stalled: bool = False
    in_flight: list[tuple[int, int, str]] = field(default_factory=list)  # (step it is done, job id, request id)


def serve_round(schedulers: dict, prompts: dict[str, list[int]], block_hasher,
                load_steps: int = 1) -> dict[str, Round]:
    """Every side serves the same requests, one step of each in turn, until each is done or stalled."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    for scheduler in schedulers.values():
        for req_id, prompt in prompts.items():
            params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True)
            scheduler.add_request(Request(req_id, prompt, params, None, block_hasher=block_hasher))
    rounds = {side: Round(load_steps) for side in schedulers}
    idle = dict.fromkeys(schedulers, 0)
    busy = list(schedulers)
    while busy:
        for side in busy:
            scheduled = _step(schedulers[side], side, rounds[side])
            idle[side] = 0 if scheduled else idle[side] + 1
            if idle[side] >= STALL_STEPS:
                _abort_all(schedulers[side], prompts)
                rounds[side].stalled = True
        busy = [side for side in busy if schedulers[side].has_requests()]
    return rounds


def _abort_all(scheduler, prompts) -> None:
    from vllm.v1.request import RequestStatus

    scheduler.finish_requests(list(prompts), RequestStatus.FINISHED_ABORTED)


def _step(scheduler, side: str, result: Round) -> int:
    """One engine step without a model (`step_bench._step`), noting each request's first token; the
    number of requests it scheduled."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = scheduler.schedule()
    connector_output = _worker_output(out, result)
    req_ids = list(out.num_scheduled_tokens)
    takes_index = "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__  # (0.34 dropped the field)
    index = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if takes_index else {}
    runner_output = ModelRunnerOutput(req_ids=req_ids, **index, sampled_token_ids=[[7] for _ in req_ids],
                                      kv_connector_output=connector_output)
    scheduler.update_from_output(out, runner_output)
    result.steps += 1
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        first = request is None or request.num_output_tokens > 0  # (gone: finished this step)
        if first and req_id not in result.first_token_step:
            result.first_token_step[req_id] = result.steps
    return len(req_ids)


def _worker_output(scheduler_output, result: Round):
    """One worker's report for the step: its stores done, and the loads due this step."""
    from vllm.v1.outputs import KVConnectorOutput

    from connector.metadata import KVScopeWorkerMetadata

    meta = scheduler_output.kv_connector_metadata
    step = result.steps + 1
    result.in_flight += [(step + result.load_steps - 1, job.job_id, job.req_id) for job in meta.loads]
    result.loads += len(meta.loads)
    due = [load for load in result.in_flight if load[0] <= step]
    result.in_flight = [load for load in result.in_flight if load[0] > step]
    done = {job.job_id: 1 for job in meta.stores} | {job_id: 1 for _, job_id, _ in due}
    return KVConnectorOutput(kv_connector_worker_meta=KVScopeWorkerMetadata(completed_jobs=done),
                             finished_recving={req_id for _, _, req_id in due} or None)


@dataclass
class Result:
    case: str  # "{groups}g/{blocks}/{prompt tokens}/L{load steps}"
    reload: dict[str, Round]
    deferrals: dict[str, int]  # loads each admitting side deferred in the reload round

    def mean_first_token(self, side: str) -> float:
        return statistics.fmean(self.reload[side].first_token_step.values())

    def last_first_token(self, side: str) -> int:
        return max(self.reload[side].first_token_step.values())


def measure(num_groups: int, num_blocks: int, load_steps: int = 1, requests: int = REQUESTS,
            prompt_tokens: int = PROMPT_TOKENS) -> Result:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    schedulers = {side: new_scheduler(side, num_groups, num_blocks) for side in SIDES}
    try:
        hash_fn = get_hash_fn_by_name(schedulers["admission"].vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        block_hasher = get_request_block_hasher(DEVICE_BLOCK_SIZE, hash_fn)
        rng = random.Random(num_groups * 100_000 + num_blocks)
        prompts = {f"r{i}": [rng.randrange(1, 30000) for _ in range(prompt_tokens)] for i in range(requests)}
        stored = serve_round(schedulers, prompts, block_hasher)
        for side, scheduler in schedulers.items():
            if stored[side].stalled:
                raise AssertionError(f"{num_groups}g/{num_blocks} {side}: the storing round stalled")
            assert scheduler.reset_prefix_cache(), f"{side}: vLLM could not reset its prefix cache"
        admissions = {side: schedulers[side].get_kv_connector()._scheduler.admission for side in SIDES[:2]}
        deferred_before = {side: admission.deferrals for side, admission in admissions.items()}
        again = {f"{req_id}-again": prompt for req_id, prompt in prompts.items()}
        reload = serve_round(schedulers, again, block_hasher, load_steps)
        case = f"{num_groups}g/{num_blocks}/{prompt_tokens}/L{load_steps}"
        for side, served in reload.items():
            if not served.stalled and served.loads != requests:
                raise AssertionError(f"{case} {side}: {served.loads} of {requests} requests loaded their prompt "
                                     "from the host tier")
        for side in SIDES[:2]:
            if reload[side].stalled:
                raise AssertionError(f"{case} {side}: vLLM stalled with kvscope's load admission on")
        return Result(case, reload, {side: admission.deferrals - deferred_before[side]
                                     for side, admission in admissions.items()})
    finally:
        for scheduler in schedulers.values():
            scheduler.shutdown()


def measure_all(quick: bool = False, cases: tuple[tuple[int, int, int], ...] | None = None,
                load_steps: tuple[int, ...] | None = None) -> list[Result]:
    cases = cases or (CASES_QUICK if quick else CASES_FULL)
    load_steps = load_steps or (LOAD_STEPS_QUICK if quick else LOAD_STEPS_FULL)
    return [measure(groups, blocks, steps, prompt_tokens=tokens) for steps in load_steps
            for groups, blocks, tokens in cases]


def to_records(results: list[Result]) -> list[dict]:
    """Per case: the mean steps to first token of each admitting side, as a ratio to every load starting at
    once (not when that stalled), and the round's steps likewise."""
    records = []
    for r in results:
        unadmitted = r.reload["unadmitted"]
        for metric, value in (("first_token_steps", Result.mean_first_token), ("round_steps", None)):
            def name(side: str) -> str:
                return f"admission.{metric}.{side}[{r.case}]"

            def steps(side: str) -> float:
                return value(r, side) if value else r.reload[side].steps

            off = None if unadmitted.stalled else steps("unadmitted")
            if off is not None:
                records.append({"name": name("unadmitted"), "median": off, "unit": UNIT, "ratio": None,
                                "ratio_of": None})
            for side in SIDES[:2]:
                records.append({"name": name(side), "median": steps(side), "unit": UNIT,
                                "ratio": steps(side) / off if off else None,
                                "ratio_of": name("unadmitted") if off else None})
    return records


def run(quick: bool = False) -> list[dict]:
    return to_records(measure_all(quick))


def format_table(results: list[Result]) -> str:
    rows = [("case", "deferred (on / uncapped)", "first token, mean: on", "uncapped", "off", "on / off",
             "uncapped / off", "last first token: on", "uncapped", "off")]
    for r in results:
        stalled = "stalled" if r.reload["unadmitted"].stalled else None
        mean = {side: r.mean_first_token(side) for side in SIDES if not (side == "unadmitted" and stalled)}
        rows.append((r.case, f"{r.deferrals['admission']} / {r.deferrals['uncapped']}",
                     f"{mean['admission']:.1f}", f"{mean['uncapped']:.1f}", stalled or f"{mean['unadmitted']:.1f}",
                     stalled or f"{mean['admission'] / mean['unadmitted']:.2f}",
                     stalled or f"{mean['uncapped'] / mean['unadmitted']:.2f}",
                     str(r.last_first_token("admission")), str(r.last_first_token("uncapped")),
                     stalled or str(r.last_first_token("unadmitted"))))
    return render_table(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two cases only")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    results = measure_all(args.quick)
    print(f"Reload round of {REQUESTS} requests ({DECODE_TOKENS} tokens generated each) loaded from the host tier; "
          f"engine steps to each request's first token with kvscope's load admission on, on with every window "
          f"counted whole (uncapped), and off (every load starts at once: vLLM's own admission alone); case = KV "
          f"groups (2g: full attention + a 1024-token window; 4g: 2 full + windows of 4096 and 128)/device "
          f"blocks/prompt tokens/L: steps a load takes; max_num_batched_tokens {MAX_NUM_BATCHED_TOKENS}")
    print(format_table(results))
    print(f"{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
