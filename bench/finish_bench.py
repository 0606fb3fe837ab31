"""What a finished request costs the scheduler in marking its prefix used, beside a per-block reference loop.

    python -m bench.finish_bench [--quick]

When a request finishes, `KVScopeScheduler.request_finished` marks its prefix used tail first
(`_touch_prefix`: the run of offloaded blocks every full-attention group holds, and in the other
groups the few blocks a hit at that run's end needs), on vLLM's engine-core thread. Beside it, the
same marking as a plain loop over every offloaded block and every group (`reference_touch`: how
`_touch_prefix` did it before `connector.prefix_recency`), building the same keys in the same order
(asserted). Both mark a tier holding the whole prefix in every group; they are timed alternately
in one run (garbage collector off), the median of each. `run(quick)` returns the records for aggregation.
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

from bench.stand_ins import ROOMY_KV_CACHE_MANAGER  # noqa: E402
from bench.table import render_table  # noqa: E402
from connector.groups import GroupKind, GroupLayout  # noqa: E402
from connector.lookup import needed_offload_blocks  # noqa: E402
from connector.prefix_recency import finished_prefix_keys  # noqa: E402
from connector.scheduler import KVScopeScheduler  # noqa: E402
from connector.telemetry.tracing import KVScopeTracing  # noqa: E402

BLOCK = 16  # device and hash block (tokens)
FULL, SWA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA
MIXES: dict[str, list[GroupLayout]] = {
    "full": [GroupLayout(0, FULL, BLOCK)],
    "full+window": [GroupLayout(0, FULL, BLOCK), GroupLayout(1, SWA, BLOCK, 4096)],
    "full+mamba": [GroupLayout(0, FULL, BLOCK), GroupLayout(1, MAMBA, BLOCK)],
    "2full+2window": [GroupLayout(0, FULL, BLOCK), GroupLayout(1, SWA, BLOCK, 4096),
                      GroupLayout(2, FULL, BLOCK), GroupLayout(3, SWA, BLOCK, 128)],
}
# (prompt tokens, offloaded block): kvscope's default block_size is the device block's
SIZES_FULL = ((8192, 16), (32768, 16), (131072, 16), (131072, 256))
SIZES_QUICK = ((8192, 16), (131072, 16))


def reference_keys(layouts, hashes, reachable: int, offload_block_size: int, loaded) -> list[tuple]:
    """`finished_prefix_keys` as a plain loop: every block from the run's last, every group in turn."""
    end = reachable * offload_block_size
    needed = [(layout.index, needed_offload_blocks(layout, 0, end, offload_block_size)) for layout in layouts]
    loaded = set(loaded)
    keys = []
    for k in range(reachable - 1, -1, -1):
        for group, blocks in needed:
            key = (group, hashes[k])
            if k in blocks or key in loaded:
                keys.append(key)
    return keys


def reference_touch(sched: KVScopeScheduler, hashes: list, loaded: list) -> None:
    """`KVScopeScheduler._touch_prefix` as a plain loop (the run found key by key, then `reference_keys`)."""
    is_ready = sched.index.is_ready
    full = [layout.index for layout in sched.layouts if layout.kind is FULL]
    reachable = 0
    for key_hash in hashes:
        if not all(is_ready((group, key_hash)) for group in full):
            break
        reachable += 1
    sched.index.touch(reference_keys(sched.layouts, hashes, reachable, sched.block_size, loaded))


@dataclass(frozen=True)
class Case:
    mix: str
    tokens: int
    offload_block: int

    @property
    def name(self) -> str:
        return f"{self.mix}/{self.tokens // 1024}k/B{self.offload_block}"


def _scheduler_holding_the_prefix(case: Case) -> tuple[KVScopeScheduler, list[bytes]]:
    layouts = MIXES[case.mix]
    blocks = case.tokens // case.offload_block
    sched = KVScopeScheduler(layouts=layouts, offload_block_size=case.offload_block, hash_block_size=BLOCK,
                             num_slots=len(layouts) * blocks + 1, slot_bytes=1, world_size=1,
                             tracing=KVScopeTracing.disabled(), kv_cache_manager_getter=lambda: ROOMY_KV_CACHE_MANAGER)
    hashes = [b"prefix-%d" % k for k in range(blocks)]
    for layout in layouts:
        for key_hash in hashes:
            key = (layout.index, key_hash)
            assert sched.index.reserve_for_store(key) is not None
            sched.index.complete_store(key)
    return sched, hashes


def measure(case: Case, repeats: int) -> tuple[float, float]:
    """Median seconds of (`_touch_prefix`, `reference_touch`) for one finish, timed alternately."""
    sched, hashes = _scheduler_holding_the_prefix(case)
    full = [layout.index for layout in sched.layouts if layout.kind is FULL]
    reachable = sched.index.ready_run(full, hashes)
    if (finished_prefix_keys(sched.layouts, hashes, reachable, case.offload_block, [])
            != reference_keys(sched.layouts, hashes, reachable, case.offload_block, [])):
        raise AssertionError(f"{case.name}: finished_prefix_keys and the reference loop disagree")
    sides = ((lambda: sched._touch_prefix(hashes, [])), (lambda: reference_touch(sched, hashes, [])))
    times: tuple[list[float], list[float]] = ([], [])
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                sides[i]()
                times[i].append(time.perf_counter() - t0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return statistics.median(times[0]), statistics.median(times[1])


@dataclass(frozen=True)
class Result:
    case: Case
    touch_s: float
    reference_s: float


def measure_all(quick: bool, sizes=None, mixes=None, repeats=None) -> list[Result]:
    sizes = sizes or (SIZES_QUICK if quick else SIZES_FULL)
    repeats = repeats or (7 if quick else 21)
    return [Result(case, *measure(case, repeats))
            for case in (Case(mix, tokens, block) for mix in (mixes or MIXES) for tokens, block in sizes)]


def to_records(results: list[Result]) -> list[dict]:
    """{name, median, unit, ratio, ratio_of} per measurement; median in µs per finish."""
    records = []
    for r in results:
        ref_name = f"finish.reference_loop[{r.case.name}]"
        records.append({"name": f"finish.touch_prefix[{r.case.name}]", "median": r.touch_s * 1e6, "unit": "us",
                        "ratio": r.touch_s / r.reference_s, "ratio_of": ref_name})
        records.append({"name": ref_name, "median": r.reference_s * 1e6, "unit": "us", "ratio": None,
                        "ratio_of": None})
    return records


def run(quick: bool = False) -> list[dict]:
    """Benchmark every case and return the records for aggregation."""
    return to_records(measure_all(quick))


def format_table(results: list[Result]) -> str:
    rows = [("case", "offloaded blocks", "_touch_prefix ms", "reference ms", "ratio")]
    for r in results:
        rows.append((r.case.name, str(r.case.tokens // r.case.offload_block), f"{r.touch_s * 1e3:.2f}",
                     f"{r.reference_s * 1e3:.2f}", f"{r.touch_s / r.reference_s:.2f}"))
    return render_table(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = parser.parse_args(argv)
    results = measure_all(quick=args.quick)
    print("a finished request's prefix marked used: _touch_prefix vs a per-block reference loop, "
          "median per finish, the whole prefix held in every group")
    print(format_table(results))
    print("ratio = _touch_prefix / reference (below 1: faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
