"""What the host tier's KV cache events cost the scheduler, beside what vLLM's own device events cost it.

    python bench/kv_events_bench.py [--quick]

For the same request (a prompt of 4k or 16k tokens, 16-token device and hash blocks, 256-token offloaded
blocks): kvscope describing each offloaded block and turning the stores into `BlockStored` events
(`HostTierEvents.describe` and `take`), and vLLM's `BlockPool.cache_full_blocks` caching the same blocks on
the device with its events on and off. Timed alternately in one run (the ratios are robust to drift);
per 256 tokens. The scheduler pays kvscope's side only with `--kv-events-config` on, where it pays
vLLM's events too. `run(quick)` returns the records for aggregation.
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

import torch  # noqa: E402

from bench.table import render_table  # noqa: E402

BLOCK = 16  # device and hash block (tokens)
OFFLOAD_BLOCK = 256  # tokens
SIDES = ("vllm_device_events_off", "vllm_device_events_on", "kvscope_host_events")


@dataclass(frozen=True)
class Result:
    tokens: int
    seconds: dict[str, float]  # side -> median seconds per offloaded block's worth of tokens


def _request(num_tokens: int):
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    tokens = [(31 * i + 7) % 32000 + 1 for i in range(num_tokens)]
    return Request("bench", tokens, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BLOCK, hash_fn))


def _host_events():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    from connector.groups import GroupKind, GroupLayout
    from connector.host_tier_events import HostTierEvents

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    return HostTierEvents([GroupLayout(0, GroupKind.FULL_ATTENTION, BLOCK)], [KVCacheGroupSpec(["l0"], spec)],
                          OFFLOAD_BLOCK, BLOCK)


def _kvscope_side(request, events):
    from connector.host_store import JOURNAL_STORED

    hashes = request.block_hashes
    step = OFFLOAD_BLOCK // BLOCK

    def run():
        journal = [(JOURNAL_STORED, (0, hashes[(k + 1) * step - 1]), events.describe(request, 0, k))
                   for k in range(len(hashes) // step)]
        out = events.take(journal)
        events._announced.clear()  # the next repeat announces the same blocks anew
        return out
    return run


def _vllm_side(request, events_on: bool):
    """vLLM caching the request's blocks on the device (a fresh pool per call, made before timing)."""
    from vllm.v1.core.block_pool import BlockPool

    num_blocks = len(request.block_hashes)

    def prepare():
        pool = BlockPool(num_blocks + 1, enable_caching=True, hash_block_size=BLOCK,
                         enable_kv_cache_events=events_on)
        return pool, pool.get_new_blocks(num_blocks)

    def run(prepared):
        pool, blocks = prepared
        pool.cache_full_blocks(request, blocks, 0, num_blocks, BLOCK, 0)
        return pool.take_events()
    return prepare, run


def measure(num_tokens: int, repeats: int) -> Result:
    request = _request(num_tokens)
    per = num_tokens // OFFLOAD_BLOCK
    kvscope = _kvscope_side(request, _host_events())
    vllm = {on: _vllm_side(request, on) for on in (False, True)}
    samples: dict[str, list[float]] = {side: [] for side in SIDES}
    gc.disable()
    try:
        for _ in range(repeats):  # alternated: drift hits every side alike
            for on, side in ((False, SIDES[0]), (True, SIDES[1])):
                prepare, run = vllm[on]
                prepared = prepare()
                start = time.perf_counter()
                run(prepared)
                samples[side].append((time.perf_counter() - start) / per)
            start = time.perf_counter()
            events = kvscope()
            samples[SIDES[2]].append((time.perf_counter() - start) / per)
            assert len(events) == per
    finally:
        gc.enable()
    return Result(num_tokens, {side: statistics.median(values) for side, values in samples.items()})


def measure_all(quick: bool = False) -> list[Result]:
    return [measure(n, 5 if quick else 31) for n in ((4096,) if quick else (4096, 16384))]


def to_records(results: list[Result]) -> list[dict]:
    records = []
    for r in results:
        case = f"[{r.tokens // 1024}k tokens]"
        # vLLM's events against its caching without them; kvscope's against vLLM's caching with events (the
        # scheduler pays both once events are on)
        references = {SIDES[1]: SIDES[0], SIDES[2]: SIDES[1]}
        for side in SIDES:
            base = references.get(side)
            records.append({"name": f"kv_events.{side}{case}", "median": r.seconds[side] * 1e6,
                            "unit": "µs/256 tokens", "ratio": r.seconds[side] / r.seconds[base] if base else None,
                            "ratio_of": f"kv_events.{base}{case}" if base else None})
    return records


def run(quick: bool = False) -> list[dict]:
    return to_records(measure_all(quick))


def format_table(results: list[Result]) -> str:
    rows = [("prompt", "vLLM caching, events off µs", "vLLM caching, events on µs", "kvscope host events µs",
             "kvscope / vLLM with events")]
    for r in results:
        s = r.seconds
        rows.append((f"{r.tokens} tokens", f"{s[SIDES[0]] * 1e6:.1f}", f"{s[SIDES[1]] * 1e6:.1f}",
                     f"{s[SIDES[2]] * 1e6:.1f}", f"{s[SIDES[2]] / s[SIDES[1]]:.2f}"))
    return render_table(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one size, fewer repeats")
    args = parser.parse_args(argv)
    print(f"per {OFFLOAD_BLOCK} tokens (one offloaded block; {OFFLOAD_BLOCK // BLOCK} device blocks), median")
    print(format_table(measure_all(args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
