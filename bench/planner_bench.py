"""Per-request cost of the load planner, beside a plain per-block reference loop.

    python bench/planner_bench.py [--quick]

Both sides plan the same load (1-4 hybrid groups, up to 32k device blocks in the finest group,
vLLM's null placement: sliding-window blocks before the window and all but the last Mamba state
are null) and are timed alternately in one run, so the ratio is robust to machine drift.
`run(quick)` returns the records for aggregation.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.table import render_table  # noqa: E402
from connector.groups import GroupKind, GroupLayout  # noqa: E402
from connector.planning import NULL_BLOCK_ID, GroupScan, LoadPlan, cdiv, plan_load  # noqa: E402

OFFLOAD_BLOCK_SIZE = 256  # tokens
NEW_TOKENS = 100  # tokens still to compute after the hit: their blocks are allocated, not loaded

FULL, SWA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA

# Group mixes by count; the first group is the finest (block size 16).
GROUP_MIXES: dict[int, list[GroupLayout]] = {
    1: [GroupLayout(0, FULL, 16)],
    2: [GroupLayout(0, FULL, 16), GroupLayout(1, SWA, 16, 4096)],
    3: [GroupLayout(0, FULL, 16), GroupLayout(1, SWA, 32, 1000), GroupLayout(2, MAMBA, 64)],
    4: [
        GroupLayout(0, FULL, 16),
        GroupLayout(1, SWA, 16, 4096),
        GroupLayout(2, SWA, 32, 128),
        GroupLayout(3, MAMBA, 128),
    ],
}


def reference_plan(layouts, group_block_ids, num_local_tokens, num_external_tokens, b) -> LoadPlan:
    """The same algorithm as a plain per-block loop, building the same outputs."""
    cached = num_local_tokens + num_external_tokens
    scans = []
    for layout, block_ids in zip(layouts, group_block_ids):
        bs = layout.block_size
        factor = b // bs
        scan = GroupScan(group_index=layout.index)
        if cached > num_local_tokens:
            for i in range(num_local_tokens // bs, min(cdiv(cached, bs), len(block_ids))):
                scan.blocks_total += 1
                block_id = block_ids[i]
                if block_id == NULL_BLOCK_ID:
                    scan.null_skipped += 1
                    continue
                if scan.start < 0:
                    scan.start = i
                k = i // factor
                scan.block_ids.append(block_id)
                scan.sub_indices.append(i % factor)
                if scan.runs and scan.runs[-1][0] == k:
                    scan.runs[-1] = (k, scan.runs[-1][1] + 1)
                else:
                    scan.runs.append((k, 1))
        scans.append(scan)
    return LoadPlan(scans=scans, first_offload_index=num_local_tokens // b)


@dataclass(frozen=True)
class Request:
    name: str
    layouts: list[GroupLayout]
    group_block_ids: list[list[int]]
    num_local_tokens: int
    num_external_tokens: int
    finest_blocks: int

    def args(self):
        return (
            self.layouts,
            self.group_block_ids,
            self.num_local_tokens,
            self.num_external_tokens,
            OFFLOAD_BLOCK_SIZE,
        )


def make_request(num_groups: int, finest_blocks: int) -> Request:
    """A quarter of the prompt local, the rest (offload-block aligned) external, then new tokens."""
    layouts = GROUP_MIXES[num_groups]
    b = OFFLOAD_BLOCK_SIZE
    cached = finest_blocks * layouts[0].block_size // b * b
    local = cached // 4 // b * b
    allocated = cached + NEW_TOKENS
    group_block_ids = []
    next_id = 1
    for g in layouts:
        n = cdiv(allocated, g.block_size)
        if g.kind is SWA:
            first_real = g.first_retained_token(cached) // g.block_size
        elif g.kind is MAMBA:
            first_real = cdiv(cached, g.block_size) - 1
        else:
            first_real = 0
        ids = [NULL_BLOCK_ID] * first_real + list(range(next_id, next_id + n - first_real))
        next_id += n
        group_block_ids.append(ids)
    name = f"{num_groups}g/{finest_blocks}"
    return Request(name, layouts, group_block_ids, local, cached - local, finest_blocks)


def _time_per_call(fn, args, number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn(*args)
    return (time.perf_counter() - t0) / number


def measure(req: Request, repeats: int, min_sample_s: float) -> tuple[float, float]:
    """Median seconds per call of (plan_load, reference), sampled alternately."""
    args = req.args()
    if plan_load(*args) != reference_plan(*args):
        raise AssertionError(f"{req.name}: plan_load and the reference loop disagree")
    one = min(_time_per_call(plan_load, args, 1), _time_per_call(reference_plan, args, 1))
    number = max(1, int(min_sample_s / max(one, 1e-9)))
    ours, ref = [], []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats):
            pair = ((plan_load, ours), (reference_plan, ref))
            for fn, out in pair if r % 2 == 0 else reversed(pair):
                out.append(_time_per_call(fn, args, number))
    finally:
        if gc_was_enabled:
            gc.enable()
    return statistics.median(ours), statistics.median(ref)


@dataclass(frozen=True)
class Result:
    request: Request
    pending_blocks: int
    plan_load_s: float
    reference_s: float


def measure_all(quick: bool, sizes=None, repeats=None, min_sample_s=None) -> list[Result]:
    sizes = sizes or ((1024, 32768) if quick else (1024, 8192, 32768))
    repeats = repeats or (5 if quick else 21)
    min_sample_s = min_sample_s or (0.002 if quick else 0.01)
    results = []
    for num_groups in sorted(GROUP_MIXES):
        for blocks in sizes:
            req = make_request(num_groups, blocks)
            ours, ref = measure(req, repeats, min_sample_s)
            results.append(Result(req, plan_load(*req.args()).num_blocks, ours, ref))
    return results


def to_records(results: list[Result]) -> list[dict]:
    """{name, median, unit, ratio, ratio_of} per measurement; median in µs per request."""
    records = []
    for r in results:
        ref_name = f"planner.reference_loop[{r.request.name}]"
        records.append(
            {
                "name": f"planner.plan_load[{r.request.name}]",
                "median": r.plan_load_s * 1e6,
                "unit": "us",
                "ratio": r.plan_load_s / r.reference_s,
                "ratio_of": ref_name,
            }
        )
        records.append(
            {"name": ref_name, "median": r.reference_s * 1e6, "unit": "us", "ratio": None, "ratio_of": None}
        )
    return records


def run(quick: bool = False) -> list[dict]:
    """Benchmark every scenario and return the records for aggregation."""
    return to_records(measure_all(quick))


def format_table(results: list[Result]) -> str:
    rows = [("scenario", "groups", "blocks", "pending", "plan_load µs", "reference µs", "ratio")]
    for r in results:
        req = r.request
        rows.append(
            (
                req.name,
                str(len(req.layouts)),
                str(req.finest_blocks),
                str(r.pending_blocks),
                f"{r.plan_load_s * 1e6:.1f}",
                f"{r.reference_s * 1e6:.1f}",
                f"{r.plan_load_s / r.reference_s:.2f}",
            )
        )
    return render_table(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = parser.parse_args(argv)
    results = measure_all(quick=args.quick)
    print(
        f"plan_load vs plain reference loop, B={OFFLOAD_BLOCK_SIZE} tokens, "
        f"blocks = device blocks of the finest group (bs 16), median per request"
    )
    print(format_table(results))
    print("ratio = plan_load / reference (below 1: plan_load is faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
