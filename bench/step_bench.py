"""The scheduler's work per request with kvscope, with vLLM's own OffloadingConnector, and with no connector.

    python -m bench.step_bench [--quick]

vLLM calls a connector's scheduler side inside every engine step (`build_connector_meta` for
every scheduled request, the lookup for every new one, the workers' reports, the stats), on the
engine core's thread, between the GPU's forward passes. This measures what that adds to vLLM's own
scheduler: one real vLLM `Scheduler` per side, each built from a real `VllmConfig` (tiny model, no
engine started) and a hand-made `KVCacheConfig` (one full-attention group, or one beside a sliding
window of 1024 tokens), each driven through the same requests. Sides: no connector (`none`),
vLLM's `OffloadingConnector` (`vllm`), `KVScopeConnector` with telemetry off (`kvscope_off`: its
metrics are always on) and with tracing on (`kvscope_on`: a trace file, sample ratio 1.0).

No model and no worker: each step's output samples one token per scheduled request, and reports
every load and store job of the step's connector metadata done (as one worker would, through the
connector's own worker metadata), so only the scheduler's side is timed: `schedule()` and
`update_from_output()`, the engine core's two calls per step. The workloads (a round of
`requests` requests at once, prompts of `PROMPT_TOKENS` tokens, `DECODE_TOKENS` generated each):

- `decode`: fresh prompts: computed, stored to the host tier by the connectors, then decoded;
- `reload`: the same prompts again after a device prefix cache reset: the connectors load them
  from the host tier (asserted: every request loads, on both connectors), `none` computes them.

The sides run in lockstep in one process: one engine step of each in turn (the first to step
rotating from round to round), so a slow moment of this machine falls on all of them alike; the
garbage collector is off during a round. Reported: the scheduler's CPU time per request over the
round (µs, the median over rounds) and its ratio to `none` and to `vllm` (the median of the
per-round ratios).
`run(quick)` returns {name, median, unit, ratio, ratio_of} records.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from bench.planner_vs_vllm import GROUP_MIXES, _kv_cache_config  # noqa: E402
from bench.table import render_table  # noqa: E402

DEVICE_BLOCK_SIZE = 16
OFFLOAD_BLOCK_SIZE = 256  # kvscope `block_size`, vLLM `block_size`: the same offloaded blocks
PROMPT_TOKENS = 512
DECODE_TOKENS = 64
HOST_BYTES = 1 << 30  # both tiers hold every prompt of every round
NUM_DEVICE_BLOCKS = 40000  # per group: every request of a round fits, nothing is preempted
SIDES = ("none", "vllm", "kvscope_off", "kvscope_on")
WORKLOADS = ("decode", "reload")
REQUESTS_FULL = (32, 128)
REQUESTS_QUICK = (128,)
UNIT = "us/request"


def new_scheduler(side: str, num_groups: int, trace_dir: str):
    """A real vLLM Scheduler (block hashing, prefix cache, hybrid groups) with the side's connector."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from connector.tiny_models import build_model

    transfer = None
    if side == "vllm":
        transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config={
            "cpu_bytes_to_use": HOST_BYTES, "block_size": OFFLOAD_BLOCK_SIZE})
    elif side in ("kvscope_off", "kvscope_on"):
        extra = {"cpu_bytes": HOST_BYTES, "block_size": OFFLOAD_BLOCK_SIZE}
        if side == "kvscope_on":
            extra["trace_file"] = os.path.join(trace_dir, f"step-{num_groups}g.jsonl")
        transfer = KVTransferConfig(kv_connector="KVScopeConnector", kv_connector_module_path="connector",
                                    kv_role="kv_both", kv_connector_extra_config=extra)
    args = EngineArgs(model=build_model("llama"), skip_tokenizer_init=True, enable_prefix_caching=True,
                      block_size=DEVICE_BLOCK_SIZE, max_model_len=4096, max_num_batched_tokens=8192,
                      max_num_seqs=256, kv_transfer_config=transfer)
    config = args.create_engine_config()
    config.cache_config.num_gpu_blocks = NUM_DEVICE_BLOCKS
    return Scheduler(vllm_config=config, kv_cache_config=_kv_cache_config(GROUP_MIXES[num_groups], NUM_DEVICE_BLOCKS),
                     structured_output_manager=StructuredOutputManager(config), block_size=DEVICE_BLOCK_SIZE,
                     hash_block_size=DEVICE_BLOCK_SIZE, log_stats=True)


def _worker_output(side: str, scheduler_output):
    """What one worker reports for the step: every load and store job of its metadata done; the
    requests whose loads those were, received. None without a connector."""
    from vllm.v1.outputs import KVConnectorOutput

    meta = scheduler_output.kv_connector_metadata
    if side == "vllm":
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

        done = {job_id: 1 for job_id in (*meta.store_jobs, *meta.load_jobs)}
        received = {job.req_id for job in meta.load_jobs.values()}
        return KVConnectorOutput(kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=done),
                                 finished_recving=received or None), len(meta.load_jobs)
    if side.startswith("kvscope"):
        from connector.metadata import KVScopeWorkerMetadata

        done = {job.job_id: 1 for job in (*meta.stores, *meta.loads)}
        received = {job.req_id for job in meta.loads}
        return KVConnectorOutput(kv_connector_worker_meta=KVScopeWorkerMetadata(completed_jobs=done),
                                 finished_recving=received or None), len(meta.loads)
    return None, 0


@dataclass
class Round:
    seconds: float = 0.0  # CPU time in schedule() and update_from_output()
    steps: int = 0
    loads: int = 0  # load jobs the connector planned


def serve_round(schedulers: dict, prompts: dict[str, list[int]], block_hasher, first: int = 0) -> dict[str, Round]:
    """Every side serves the same requests, in lockstep: one engine step of each side in turn (from
    side ``first`` on) until vLLM has nothing left to do on any; each side's scheduler calls timed."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    for side, scheduler in schedulers.items():
        for req_id, prompt in prompts.items():
            params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True)
            scheduler.add_request(Request(req_id, prompt, params, None, block_hasher=block_hasher))
    rounds = {side: Round() for side in schedulers}
    order = list(schedulers)[first:] + list(schedulers)[:first]
    gc.collect()
    gc.disable()  # a collection lands in whichever side's call happens to trigger it
    try:
        busy = order
        while busy:
            for side in busy:
                _step(schedulers[side], side, rounds[side])
            busy = [side for side in busy if schedulers[side].has_requests()]
    finally:
        gc.enable()
    return rounds


def _step(scheduler, side: str, result: Round) -> None:
    """One engine step without a model: every scheduled request samples a token; one worker reports
    the step's transfers done."""
    from vllm.v1.outputs import ModelRunnerOutput

    clock = time.thread_time  # this thread's CPU time: the engine core's thread (steadier than wall time here)
    t0 = clock()
    out = scheduler.schedule()
    t1 = clock()
    connector_output, loads = _worker_output(side, out)
    req_ids = list(out.num_scheduled_tokens)
    # one token per scheduled request (vLLM drops the samples of a prefill chunk that is not the last)
    # vLLM up to 0.33 also takes each request's index (0.34 dropped the field)
    takes_index = "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__
    index = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if takes_index else {}
    runner_output = ModelRunnerOutput(req_ids=req_ids, **index, sampled_token_ids=[[7] for _ in req_ids],
                                      kv_connector_output=connector_output)
    t2 = clock()
    scheduler.update_from_output(out, runner_output)
    result.seconds += (t1 - t0) + (clock() - t2)
    result.steps += 1
    result.loads += loads


@dataclass
class Result:
    case: str  # "{groups}g/{requests}"
    requests: int
    # workload -> side -> per-request seconds of each sampled round
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    steps: dict[str, dict[str, int]] = field(default_factory=dict)  # workload -> side -> steps of a round

    def median(self, workload: str, side: str) -> float:
        return statistics.median(self.samples[workload][side])

    def ratio(self, workload: str, side: str, reference: str) -> float:
        """The median of the per-round ratios (each round ran both sides in lockstep)."""
        pairs = zip(self.samples[workload][side], self.samples[workload][reference])
        return statistics.median(a / b for a, b in pairs)


def measure(num_groups: int, requests: int, rounds: int) -> Result:
    """`rounds` rounds of each workload, every side in lockstep (the first to step rotating); one warm-up round."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    result = Result(f"{num_groups}g/{requests}", requests)
    with tempfile.TemporaryDirectory(prefix="kvscope-step-bench-") as trace_dir:
        schedulers = {side: new_scheduler(side, num_groups, trace_dir) for side in SIDES}
        try:
            hash_fn = get_hash_fn_by_name(schedulers["none"].vllm_config.cache_config.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            block_hasher = get_request_block_hasher(DEVICE_BLOCK_SIZE, hash_fn)
            rng = random.Random(num_groups * 1000 + requests)
            for workload in WORKLOADS:
                result.samples[workload] = {side: [] for side in SIDES}
                result.steps[workload] = {}
            for r in range(rounds + 1):
                prompts = {f"{r}-{i}": [rng.randrange(1, 30000) for _ in range(PROMPT_TOKENS)]
                           for i in range(requests)}
                decode = serve_round(schedulers, prompts, block_hasher, first=r % len(SIDES))
                for side, scheduler in schedulers.items():
                    assert scheduler.reset_prefix_cache(), f"{side}: vLLM could not reset its prefix cache"
                again = {f"{req_id}-again": prompt for req_id, prompt in prompts.items()}
                reload = serve_round(schedulers, again, block_hasher, first=r % len(SIDES))
                for side, scheduler in schedulers.items():
                    assert scheduler.reset_prefix_cache(), f"{side}: vLLM could not reset its prefix cache"
                    if side != "none" and reload[side].loads != requests:
                        raise AssertionError(f"{result.case} {side}: {reload[side].loads} of {requests} requests "
                                             "loaded their prompt from the host tier")
                if r == 0:
                    continue  # warm-up: first calls, first allocations
                for workload, served in (("decode", decode), ("reload", reload)):
                    for side in SIDES:
                        result.samples[workload][side].append(served[side].seconds / requests)
                        result.steps[workload][side] = served[side].steps
        finally:
            for scheduler in schedulers.values():
                scheduler.shutdown()
    return result


def measure_all(quick: bool = False, groups=tuple(sorted(GROUP_MIXES))[:2], requests=None,
                rounds: int | None = None) -> list[Result]:
    requests = requests or (REQUESTS_QUICK if quick else REQUESTS_FULL)
    rounds = rounds or (5 if quick else 9)
    return [measure(g, n, rounds) for g in groups for n in requests]


def to_records(results: list[Result]) -> list[dict]:
    """Per workload and case: each side's scheduler µs per request; connectors / `none`, kvscope / `vllm`."""
    records = []
    for r in results:
        for workload in WORKLOADS:
            def name(side: str) -> str:
                return f"step.{workload}.{side}[{r.case}]"

            for side in SIDES:
                reference = None if side == "none" else ("none" if side == "vllm" else "vllm")
                median = r.median(workload, side)
                records.append({"name": name(side), "median": median * 1e6, "unit": UNIT,
                                "ratio": r.ratio(workload, side, reference) if reference else None,
                                "ratio_of": name(reference) if reference else None})
                if side.startswith("kvscope"):
                    records.append({"name": name(side).replace(f".{side}[", f".{side}_vs_none["),
                                    "median": median * 1e6, "unit": UNIT,
                                    "ratio": r.ratio(workload, side, "none"), "ratio_of": name("none")})
    return records


def run(quick: bool = False) -> list[dict]:
    """Measure every case and return the records for aggregation."""
    return to_records(measure_all(quick))


def format_table(results: list[Result]) -> str:
    rows = [("workload", "case", "steps", *(f"{side} µs" for side in SIDES), "vllm / none",
             "kvscope_off / none", "kvscope_on / none", "kvscope_off / vllm", "kvscope_on / vllm")]
    for r in results:
        for workload in WORKLOADS:
            m = {side: r.median(workload, side) for side in SIDES}
            ratios = [r.ratio(workload, a, b) for a, b in (("vllm", "none"), ("kvscope_off", "none"),
                                                            ("kvscope_on", "none"), ("kvscope_off", "vllm"),
                                                            ("kvscope_on", "vllm"))]
            rows.append((workload, r.case, str(r.steps[workload]["none"]), *(f"{m[s] * 1e6:.1f}" for s in SIDES),
                         *(f"{x:.3f}" for x in ratios)))
    return render_table(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 requests only, fewer rounds")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    results = measure_all(args.quick)
    print(f"vLLM's scheduler time per request (schedule + update_from_output over the round, µs; medians); "
          f"case = KV groups (1g: full attention; 2g: + a 1024-token sliding window)/requests at once; "
          f"prompts of {PROMPT_TOKENS} tokens, {DECODE_TOKENS} generated each; steps = engine steps of a "
          f"round without a connector")
    print(format_table(results))
    print(f"{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
