"""The host tier's hit tokens with prefixes evicted from their tail (now) beside from their head (before).

    python -m bench.eviction_bench [--quick]

A hit needs every offloaded block of a prefix from the first one. The scheduler now marks what a load
reads used tail first and, when a request finishes, its prefix block by block from the last (the run of
blocks from the first that every full-attention group holds; in other groups the blocks a hit at that
run's end needs and the ones it loaded: `KVScopeScheduler._touch_prefix`), so the LRU tier evicts a prefix
from its tail (`tail_first`). Before, a load's pins moved each
key to the most-recent end in prompt order and nothing was marked at finish, so a prefix's head was its
oldest block and went first, stranding the rest (`head_first`, restored here by `HeadFirstScheduler`
over the same `KVScopeScheduler`; connector/ is not changed).

Both orderings serve the same seeded stream of requests in one run, on the real scheduler without an
engine: each request is a shared prefix (a few hundred system prompts / documents of 0.5k-8k tokens,
Zipf-like popularity) plus a unique suffix; it is looked up, loads what it hits (one step), computes and
stores the rest (the next step), and finishes. Requests are served one at a time, or 16 in flight (looked
up in turn, one step loading every hit, the next computing and storing them all, then finishing in
arrival order: other requests' loads and stores come between a request's load and its finish). Cases:
one full-attention group, and a full-attention + sliding-window (1024 tokens) pair; the tier holds 10%,
25% or 50% of the working set (every prefix's whole offloaded blocks, in every group). The first quarter
of the stream warms the tier and is not counted. No device prefix cache: every lookup starts at token 0,
as if vLLM's own cache were too small to keep any prefix. Deterministic: a measurement, not a timing
(`median` is the one value, the share of looked-up tokens hit; no goal). Also printed: the share of
missed tokens whose reason is `evicted` (the scheduler's stats; the index remembers as many gone keys as
it has slots, so a lower bound) and of slots holding stranded prefix blocks. `run(quick)` returns the
records for aggregation.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stand_ins import ROOMY_BLOCK_POOL  # noqa: E402
from bench.table import render_table  # noqa: E402
from connector.groups import GroupKind, GroupLayout  # noqa: E402
from connector.host_store import HostIndex  # noqa: E402
from connector.metadata import KVScopeWorkerMetadata  # noqa: E402
from connector.miss_reasons import EVICTED  # noqa: E402
from connector.planning import NULL_BLOCK_ID  # noqa: E402
from connector.scheduler import KVScopeScheduler  # noqa: E402
from connector.telemetry.tracing import KVScopeTracing  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402

BLOCK = 16  # device and hash block (tokens)
OFFLOAD_BLOCK = 256  # tokens
WINDOW = 1024  # the sliding-window group's window (tokens)
LAYOUTS: dict[str, list[GroupLayout]] = {
    "1g": [GroupLayout(0, GroupKind.FULL_ATTENTION, BLOCK)],
    "2g": [GroupLayout(0, GroupKind.FULL_ATTENTION, BLOCK),
           GroupLayout(1, GroupKind.SLIDING_WINDOW, BLOCK, sliding_window=WINDOW)],
}
CAPACITIES = (0.10, 0.25, 0.50)  # host slots / the working set's
ORDERINGS = ("tail_first", "head_first")  # now, before
IN_FLIGHT = (1, 16)  # requests served together (one load step, one compute step)
WARMUP_SHARE = 0.25  # of the stream, not counted
UNIT = "% of looked-up tokens hit"
SEED = 20261202


# ----------------------------------------------------------------------------- the old ordering
class HeadFirstIndex(HostIndex):
    """The host index's load order as it was (its eviction walk is today's): a load's pin moves its
    key to the most-recent end (in the order the load pins them: prompt order, group by group), and
    `touch` did not exist (a no-op here)."""

    def pin_for_load(self, key):
        slot = super().pin_for_load(key)
        if slot is not None:
            self._entries.move_to_end(key)
        return slot

    def touch(self, keys) -> None:
        pass


class HeadFirstScheduler(KVScopeScheduler):
    """`KVScopeScheduler` with the eviction order it had before: `HeadFirstIndex`, nothing marked at finish."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        index = HeadFirstIndex(self.index.num_slots)
        assert self.stores.index is self.index  # the one other holder of the index
        self.index = self.stores.index = index

    def _touch_prefix(self, hashes, loaded) -> None:
        pass


SCHEDULERS = {"tail_first": KVScopeScheduler, "head_first": HeadFirstScheduler}


# ----------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Workload:
    prefix_tokens: list[int]  # per shared prefix
    requests: list[tuple[int, int]]  # (prefix, suffix tokens), in arrival order

    @property
    def working_set_blocks(self) -> int:
        """Offloaded blocks (per group) that hold every prefix's shared, whole blocks."""
        return sum(tokens // OFFLOAD_BLOCK for tokens in self.prefix_tokens)


def make_workload(num_prefixes: int, num_requests: int, seed: int = SEED, zipf: float = 1.0) -> Workload:
    """Prefixes of 2-32 offloaded blocks (log-uniform) plus a partial one; the prefix of popularity rank r
    drawn with weight 1 / r^zipf (ranks shuffled against lengths); suffixes of 64-1024 tokens."""
    rng = random.Random(seed)
    prefix_tokens = [int(2 ** rng.uniform(1, 5)) * OFFLOAD_BLOCK + rng.randrange(OFFLOAD_BLOCK)
                     for _ in range(num_prefixes)]
    weights = [1 / (rank + 1) ** zipf for rank in range(num_prefixes)]
    chosen = rng.choices(range(num_prefixes), weights=weights, k=num_requests)
    return Workload(prefix_tokens, [(p, rng.randint(64, 1024)) for p in chosen])


def _request(rid: int, prefix: int, prefix_tokens: int, suffix_tokens: int, prefix_hashes: list):
    """What the scheduler reads of a vLLM `Request`: its hash blocks name the prefix up to their end
    (vLLM chains them), so the prefix's whole hash blocks are shared and the rest are the request's own."""
    num_tokens = prefix_tokens + suffix_tokens
    shared = prefix_tokens // BLOCK
    hashes = prefix_hashes[:shared] + [("r", rid, i) for i in range(shared, num_tokens // BLOCK)]
    return SimpleNamespace(request_id=f"r{rid}", num_tokens=num_tokens, num_computed_tokens=0,
                           block_hashes=hashes)


# ----------------------------------------------------------------------------- driving the scheduler
class _Manager:
    """vLLM's KV cache manager as the store planning asks it: each request's device block ids."""

    block_pool = ROOMY_BLOCK_POOL

    def __init__(self):
        self.ids: dict[str, tuple[list[int], ...]] = {}

    def get_blocks(self, req_id):  # as vLLM's KVCacheManager gives them
        return SimpleNamespace(blocks=tuple([KVCacheBlock(i) for i in ids] for ids in self.ids[req_id]))


def new_scheduler(ordering: str, layouts: list[GroupLayout], num_slots: int) -> KVScopeScheduler:
    manager = _Manager()
    sched = SCHEDULERS[ordering](layouts, offload_block_size=OFFLOAD_BLOCK, hash_block_size=BLOCK,
                                 num_slots=num_slots, slot_bytes=1, world_size=1,
                                 tracing=KVScopeTracing.disabled(), kv_cache_manager_getter=lambda: manager)
    sched.bench_manager = manager
    return sched


def _block_ids(layouts: list[GroupLayout], num_tokens: int, computed: int) -> tuple[list[int], ...]:
    """The request's device blocks per group once `computed` tokens are: a window's blocks wholly out of
    it are null (vLLM's placement)."""
    n = -(-num_tokens // BLOCK)
    out = []
    for g, layout in enumerate(layouts):
        first_kept = layout.first_retained_token(computed) // BLOCK
        base = 1 + g * n  # never NULL_BLOCK_ID
        out.append([NULL_BLOCK_ID if i < first_kept else base + i for i in range(n)])
    return tuple(out)


def _step(sched, scheduled: dict[str, tuple[int, int]]) -> None:
    """One engine step (`build_connector_meta`) scheduling, per request id, (computed, new) tokens; every
    load and store of it completed by the (one) worker before the next."""
    ids = sched.bench_manager.ids
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=ids[rid], num_computed_tokens=computed)
                            for rid, (computed, _) in scheduled.items()],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()),
        kv_cache_block_copies=[], num_scheduled_tokens={rid: new for rid, (_, new) in scheduled.items()},
        scheduled_spec_decode_tokens={})
    meta = sched.build_connector_meta(out)
    if any(job.failed_at_plan for job in meta.loads):
        raise AssertionError("a load failed at planning: a block it hit left the tier before the load")
    done = {job.job_id: 1 for job in meta.loads + meta.stores}
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KVScopeWorkerMetadata(completed_jobs=done)))


def serve(sched, requests: list) -> list[int]:
    """Serve requests in flight together: each is looked up and given its blocks (in arrival order); one
    step loads every hit (a request waits a step for its asynchronous load), the next computes and stores
    the rest of every request; then they finish, in arrival order. Returns each request's hit tokens."""
    hits = []
    ids = sched.bench_manager.ids
    for request in requests:
        hit, _ = sched.get_num_new_matched_tokens(request, 0)
        ids[request.request_id] = _block_ids(sched.layouts, request.num_tokens, hit)
        sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda rid=request.request_id: ids[rid]),
                                       hit)
        hits.append(hit)
    if any(hits):
        _step(sched, {})
    _step(sched, {r.request_id: (hit, r.num_tokens - hit) for r, hit in zip(requests, hits)})
    for request in requests:
        request.num_computed_tokens = request.num_tokens
        sched.request_finished(request)
        del ids[request.request_id]
    return hits


def stranded_blocks(sched, workload: Workload) -> int:
    """Full-attention prefix blocks the tier holds that no lookup reaches (an earlier block of their
    prefix is gone): slots the head-first order wastes."""
    ready = sched.index.is_ready
    step = OFFLOAD_BLOCK // BLOCK
    stranded = 0
    for p, tokens in enumerate(workload.prefix_tokens):
        held = [ready((0, ("p", p, (k + 1) * step - 1))) for k in range(tokens // OFFLOAD_BLOCK)]
        reached = held.index(False) if False in held else len(held)
        stranded += sum(held[reached:])
    return stranded


# ----------------------------------------------------------------------------- measurement
@dataclass(frozen=True)
class Outcome:
    lookup_tokens: int
    hit_tokens: int
    evicted_tokens: int  # looked-up tokens missed because their block was evicted (`take_stats`)
    evicted_blocks: int
    stranded_share: float  # of the tier's slots, on average: prefix blocks no lookup reaches

    @property
    def hit_share(self) -> float:
        return self.hit_tokens / self.lookup_tokens

    @property
    def evicted_miss_share(self) -> float:
        missed = self.lookup_tokens - self.hit_tokens
        return self.evicted_tokens / missed if missed else 0.0


@dataclass(frozen=True)
class Result:
    groups: str  # a key of LAYOUTS
    capacity: float
    in_flight: int
    num_slots: int
    counted_requests: int
    outcomes: dict[str, Outcome]  # ordering -> outcome

    @property
    def case(self) -> str:
        return f"{self.groups}/{self.capacity:.0%}/{self.in_flight}"


def simulate(ordering: str, layouts: list[GroupLayout], workload: Workload, num_slots: int, in_flight: int = 1,
             warmup_share: float = WARMUP_SHARE, samples: int = 20) -> Outcome:
    """Serve the workload `in_flight` requests at a time; count what follows the warm-up (whole batches)."""
    sched = new_scheduler(ordering, layouts, num_slots)
    prefix_hashes = [[("p", p, i) for i in range(tokens // BLOCK)] for p, tokens in enumerate(workload.prefix_tokens)]
    n = len(workload.requests)
    warmup = int(n * warmup_share) // in_flight * in_flight
    sample_every = max(in_flight, (n - warmup) // samples // in_flight * in_flight)
    hits, stranded = 0, []
    for first in range(0, n, in_flight):
        if first == warmup:
            sched.take_stats()  # the warm-up's counts are not kept
            hits = 0
        batch = [_request(rid, prefix, workload.prefix_tokens[prefix], suffix, prefix_hashes[prefix])
                 for rid, (prefix, suffix) in enumerate(workload.requests[first:first + in_flight], start=first)]
        hits += sum(serve(sched, batch))
        if first >= warmup and (first - warmup) % sample_every == 0:
            stranded.append(stranded_blocks(sched, workload) / num_slots)
    data = sched.take_stats().data
    if data["hit_tokens"] != hits:
        raise AssertionError(f"{ordering}: the stats count {data['hit_tokens']} hit tokens, the loads {hits}")
    return Outcome(data["lookup_tokens"], data["hit_tokens"], data.get("missed_tokens", {}).get(EVICTED, 0),
                   data.get("evicted_blocks", 0), sum(stranded) / len(stranded))


def measure(groups: str, capacity: float, workload: Workload, in_flight: int = 1) -> Result:
    layouts = LAYOUTS[groups]
    num_slots = max(1, round(capacity * workload.working_set_blocks * len(layouts)))
    outcomes = {ordering: simulate(ordering, layouts, workload, num_slots, in_flight) for ordering in ORDERINGS}
    warmup = int(len(workload.requests) * WARMUP_SHARE) // in_flight * in_flight
    return Result(groups, capacity, in_flight, num_slots, len(workload.requests) - warmup, outcomes)


def workload_for(quick: bool) -> Workload:
    return make_workload(150, 1200) if quick else make_workload(300, 4000)


def measure_all(quick: bool = False, workload: Workload | None = None, groups=tuple(LAYOUTS),
                capacities=CAPACITIES, in_flight=IN_FLIGHT) -> list[Result]:
    workload = workload or workload_for(quick)
    return [measure(g, c, workload, f) for f in in_flight for g in groups for c in capacities]


def to_records(results: list[Result]) -> list[dict]:
    """Per case: the share of looked-up tokens the tier served, each ordering; tail_first / head_first."""
    records = []
    for r in results:
        new, old = (r.outcomes[o] for o in ORDERINGS)
        old_name = f"eviction.head_first[{r.case}]"
        records.append({"name": f"eviction.tail_first[{r.case}]", "median": new.hit_share * 100, "unit": UNIT,
                        "ratio": new.hit_share / old.hit_share, "ratio_of": old_name})
        records.append({"name": old_name, "median": old.hit_share * 100, "unit": UNIT, "ratio": None,
                        "ratio_of": None})
    return records


def run(quick: bool = False) -> list[dict]:
    """Measure every case and return the records for aggregation."""
    return to_records(measure_all(quick))


def format_table(results: list[Result]) -> str:
    rows = [("case", "slots", "hit % tail first", "hit % head first", "tail / head",
             "evicted-miss % tail", "evicted-miss % head", "stranded % tail", "stranded % head")]
    for r in results:
        new, old = (r.outcomes[o] for o in ORDERINGS)
        rows.append((r.case, str(r.num_slots), f"{new.hit_share:.1%}", f"{old.hit_share:.1%}",
                     f"{new.hit_share / old.hit_share:.3f}" if old.hit_share else "inf",
                     f"{new.evicted_miss_share:.1%}", f"{old.evicted_miss_share:.1%}",
                     f"{new.stranded_share:.1%}", f"{old.stranded_share:.1%}"))
    return render_table(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prefixes and requests")
    args = parser.parse_args(argv)
    workload = workload_for(args.quick)
    started = time.perf_counter()
    results = measure_all(args.quick, workload)
    print(f"{len(workload.prefix_tokens)} prefixes, {len(workload.requests)} requests "
          f"({results[0].counted_requests} counted after the warm-up), working set "
          f"{workload.working_set_blocks} offloaded blocks of {OFFLOAD_BLOCK} tokens per group; "
          f"case = groups/host slots as a share of the working set/requests in flight; 1g: full attention, "
          f"2g: + sliding window {WINDOW}")
    print(format_table(results))
    print("hit % = hit tokens / looked-up tokens; tail / head = the ratio of those (above 1: tail first "
          "serves more); evicted-miss % = of the looked-up tokens missed, the share missed because their "
          "block was evicted (the rest: never stored, or the prompt's tail); stranded % = the tier's slots "
          "holding full-attention prefix blocks past a gone one (no lookup reaches them), averaged over the "
          f"counted stream. {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
