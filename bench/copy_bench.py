"""Block copies of the copy engine between a device KV cache and the host tier, beside one
contiguous copy of the same number of bytes.

    python -m bench.copy_bench [--quick]

`connector.copy_engine.CopyEngine` is built without an engine: one fake layer cache of shape
(num_blocks, heads, block_size, 2 * head_size) in bf16, a `SlotLayout` with that one layer, and a
stand-in for vLLM's `KVCacheConfig` (the engine reads only `num_blocks`). Loads (host -> device)
and stores (device -> host) move `n` blocks between scattered device blocks and scattered host
slots, as a real load does; the reference is one `copy_` of `n * page` contiguous bytes between
the same two buffers, timed alternately with the engine in the same run. GB/s = 1e9 bytes/s.

On this backend the "device" is CPU memory. With CUDA available, the same cases also run on the
GPU (pinned host memory, the engine's load and store streams, H2D / D2H), else that part reports
"skipped: no GPU". `run(quick)` returns {name, median, unit, ratio, ratio_of} records.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.table import render_table  # noqa: E402
from connector.copy_engine import CopyEngine  # noqa: E402
from connector.vllm_layout import SlotLayout  # noqa: E402

HEADS, HEAD_SIZE = 8, 64
ELEM = 2  # bf16
BYTES_PER_TOKEN = HEADS * 2 * HEAD_SIZE * ELEM  # one layer, K and V

KiB, MiB = 1 << 10, 1 << 20
PAGES_FULL = (16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
PAGES_QUICK = (16 * KiB, 256 * KiB, 4 * MiB)
COUNTS_FULL = (1, 16, 256, 4096)
COUNTS_QUICK = (1, 64, 1024)
MAX_BYTES_FULL = 256 * MiB  # per side of one copy: bounds memory (2x) and time
MAX_BYTES_QUICK = 64 * MiB


@dataclass(frozen=True)
class Case:
    device: str  # "cpu" or "cuda"
    direction: str  # "load" (host -> device) or "store"
    page: int  # bytes per device block (one layer)
    blocks: int

    @property
    def name(self) -> str:
        return f"{self.device}.{self.direction}[{_size(self.page)}x{self.blocks}]"


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB}MiB" if nbytes >= MiB else f"{nbytes // KiB}KiB"


def make_engine(page: int, num_blocks: int, device: str) -> CopyEngine:
    """A CopyEngine over one fake layer cache of `num_blocks` blocks of `page` bytes."""
    block_size = page // BYTES_PER_TOKEN
    assert block_size * BYTES_PER_TOKEN == page, f"page {page} is not a whole number of tokens"
    cache = torch.zeros((num_blocks, HEADS, block_size, 2 * HEAD_SIZE), dtype=torch.bfloat16, device=device)
    layout = SlotLayout(slot_bytes=page, group_layers=[[("layer0", 0, page)]], group_factors=[1])
    config = SimpleNamespace(num_blocks=num_blocks)  # all the engine reads of a KVCacheConfig
    engine = CopyEngine({"layer0": cache}, config, layout, num_slots=num_blocks)
    if engine.is_cuda and not engine._host_buffer.pinned:  # pageable copies are not what kvscope runs
        engine.close()
        raise RuntimeError("the host tier could not be pinned (cudaHostRegister failed): see the log")
    engine.host.fill_(1)  # touch every host page before timing
    return engine


def _sync(engine: CopyEngine) -> None:
    if engine.is_cuda:
        torch.cuda.synchronize(engine.device)  # every stream: the engine's load and store streams too


def _engine_copy(engine: CopyEngine, direction: str, slots, subs, blocks):
    copy = engine.load if direction == "load" else engine.store

    def run():
        result = copy(0, slots, subs, blocks)
        if result.pending_events is not None:
            result.pending_events[1].synchronize()
    return run


def _contiguous_copy(engine: CopyEngine, direction: str, n: int, page: int):
    """One copy_ of n * page bytes between the same device and host buffers."""
    region = engine.groups[0][0]
    assert region.view.is_contiguous(), "the fake cache must be contiguous for a one-copy reference"
    device = region.view.reshape(-1)[: n * page]
    host = engine.host.reshape(-1)[: n * page]
    src, dst = (host, device) if direction == "load" else (device, host)

    def run():
        dst.copy_(src, non_blocking=engine.is_cuda)
        _sync(engine)
    return run


def _seconds(fn, number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


@dataclass(frozen=True)
class Result:
    case: Case
    engine_gbps: float
    contiguous_gbps: float


def check_round_trip(engine: CopyEngine, blocks: list[int], slots: list[int]) -> None:
    """Store random bytes from `blocks`, load them back into the blocks in reverse order, and
    compare: on a GPU this checks the batched copy path on real hardware before it is timed."""
    view = engine.groups[0][0].view
    view[blocks] = torch.randint(-128, 128, (len(blocks), view.shape[1]), dtype=torch.int8, device=view.device)
    expected = view[blocks].clone()
    subs = [0] * len(blocks)
    for copy, targets in ((engine.store, blocks), (engine.load, blocks[::-1])):
        result = copy(0, slots, subs, targets)
        if result.pending_events is not None:
            result.pending_events[1].synchronize()
    if not torch.equal(view[blocks[::-1]], expected):
        raise AssertionError(f"copy engine round trip on {view.device} moved the wrong bytes")


def measure(engine: CopyEngine, case: Case, repeats: int, min_sample_s: float, seed: int = 0) -> Result:
    rng = random.Random(seed)
    n = case.blocks
    blocks = rng.sample(range(engine.groups[0][0].view.shape[0]), n)  # scattered device blocks
    slots = rng.sample(range(engine.num_slots), n)  # scattered host slots
    subs = [0] * n
    check_round_trip(engine, blocks, slots)
    ours = _engine_copy(engine, case.direction, slots, subs, blocks)
    ref = _contiguous_copy(engine, case.direction, n, case.page)
    ours(), ref()  # warm up
    one = max(_seconds(ours, 1), _seconds(ref, 1))
    number = max(1, min(10_000, int(min_sample_s / max(one, 1e-9))))
    t_ours, t_ref = [], []
    for r in range(repeats):
        pair = ((ours, t_ours), (ref, t_ref))
        for fn, out in pair if r % 2 == 0 else reversed(pair):
            out.append(_seconds(fn, number))
    nbytes = n * case.page
    return Result(case, nbytes / statistics.median(t_ours) / 1e9, nbytes / statistics.median(t_ref) / 1e9)


def cases(quick: bool, device: str, pages=None, counts=None, max_bytes=None) -> list[Case]:
    pages = pages or (PAGES_QUICK if quick else PAGES_FULL)
    counts = counts or (COUNTS_QUICK if quick else COUNTS_FULL)
    max_bytes = max_bytes or (MAX_BYTES_QUICK if quick else MAX_BYTES_FULL)
    out = []
    for page in pages:
        fitting = sorted({max(1, min(c, max_bytes // page)) for c in counts})
        for blocks in fitting:
            for direction in ("load", "store"):
                out.append(Case(device, direction, page, blocks))
    return out


def measure_all(quick: bool, device: str = "cpu", pages=None, counts=None, max_bytes=None,
                repeats: int | None = None, min_sample_s: float | None = None) -> list[Result]:
    repeats = repeats or (5 if quick else 11)
    min_sample_s = min_sample_s or (0.01 if quick else 0.03)
    todo = cases(quick, device, pages, counts, max_bytes)
    results = []
    threads = torch.get_num_threads()
    # One intra-op thread: a parallel copy_ waits on every OpenMP thread, and on a shared
    # machine a descheduled one turns a 1 MiB copy into milliseconds. Both sides alike.
    torch.set_num_threads(1)
    try:
        for page in sorted({c.page for c in todo}):
            of_page = [c for c in todo if c.page == page]
            engine = make_engine(page, max(c.blocks for c in of_page), device)
            try:
                for case in of_page:
                    results.append(measure(engine, case, repeats, min_sample_s))
            finally:
                # Unpinned before the next page size's host tier: a freed buffer left registered could make
                # the next one's registration fail, and its cases measure pageable copies.
                _sync(engine)
                engine.close()
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(threads)
    return results


def gpu_note() -> str | None:
    """Why the GPU cases did not run, or None when they can."""
    return None if torch.cuda.is_available() else "skipped: no GPU"


def to_records(results: list[Result]) -> list[dict]:
    records = []
    for r in results:
        ref = f"copy.contiguous.{r.case.name}"
        records.append({"name": ref, "median": r.contiguous_gbps, "unit": "GB/s", "ratio": None, "ratio_of": None})
        records.append({"name": f"copy.engine.{r.case.name}", "median": r.engine_gbps, "unit": "GB/s",
                        "ratio": r.engine_gbps / r.contiguous_gbps, "ratio_of": ref})
    return records


def run(quick: bool = False, **kwargs) -> list[dict]:
    """CPU cases, plus the GPU cases when CUDA is available."""
    results = measure_all(quick, "cpu", **kwargs)
    if gpu_note() is None:
        results += measure_all(quick, "cuda", **kwargs)
    return to_records(results)


def format_table(results: list[Result]) -> str:
    rows = [("case", "engine GB/s", "contiguous GB/s", "engine/contiguous")]
    for r in results:
        rows.append((r.case.name, f"{r.engine_gbps:.2f}", f"{r.contiguous_gbps:.2f}",
                     f"{r.engine_gbps / r.contiguous_gbps:.2f}"))
    return render_table(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = parser.parse_args(argv)
    print(format_table(measure_all(args.quick, "cpu")))
    if gpu_note() is None:
        print(format_table(measure_all(args.quick, "cuda")))
    else:
        print(f"GPU: {gpu_note()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
