"""The overview's headline numbers and its slowest loads."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from dashboard.traces.hit_rates import hit_rate
from dashboard.traces.request_table import load_rows
from dashboard.traces.schema import COPY, LOOKUP, STORE, copies_of


def top_slow_loads(requests: pd.DataFrame, n: int = 10) -> pd.DataFrame:
    """The `n` requests with the longest load time, split into copying and the wait before it, with the
    tokens of the loads it sums and the bytes every load copied (a load that failed on one worker: what the
    others copied)."""
    timed = requests[requests["load_ms"].notna()]
    return timed.nlargest(n, "load_ms")[
        ["request", "t_s", "load_ms", "load_copy_ms", "load_wait_ms", "tokens_loaded", "bytes_loaded", "request_id",
         "trace_id"]
    ].reset_index(drop=True)


def request_numbers(requests: pd.DataFrame) -> dict[str, float]:
    """What the request table alone says: requests, hits, failed loads, load time quantiles, and the
    requests kvscope deferred for device KV room with their median and longest wait, and those of them that ended
    (aborted) while still waiting."""
    load_ms = requests["load_ms"].dropna().astype(float)
    # nearest rank: every quantile is a load that happened (interpolating between two far apart is none)
    q = np.percentile(load_ms, [50, 95, 99], method="inverted_cdf") if len(load_ms) else [math.nan] * 3
    wait_ms = requests["deferred_wait_ms"].dropna().astype(float)
    wait_p50 = float(np.percentile(wait_ms, 50, method="inverted_cdf")) if len(wait_ms) else math.nan
    return {
        "requests": int(len(requests)),
        "requests_with_hit": int((requests["tokens_hit"].fillna(0) > 0).sum()),
        "requests_load_failed": int(requests["load_failed"].sum()),
        "tokens_queried": int(requests["tokens_queried"].sum()),
        "tokens_hit": int(requests["tokens_hit"].sum()),
        "hit_rate": hit_rate(requests),
        "loads_timed": int(len(load_ms)),
        "load_p50_ms": float(q[0]),
        "load_p95_ms": float(q[1]),
        "load_p99_ms": float(q[2]),
        "requests_deferred": int(requests["deferred_lookups"].notna().sum()),
        "deferral_wait_p50_ms": wait_p50,
        "deferral_wait_max_ms": float(wait_ms.max()) if len(wait_ms) else math.nan,
        "requests_ended_waiting": int(requests["ended_waiting"].sum()),
    }


def overview_numbers(requests: pd.DataFrame, spans: pd.DataFrame) -> dict[str, float]:
    """Headline numbers for the overview page."""
    copies = copies_of(spans)
    by_dir = copies.groupby(copies["copy_direction"].astype(str))["copy_bytes"].sum()
    loads = load_rows(spans)
    start = spans["start_ns"].min() if len(spans) else 0
    end = spans["end_ns"].max() if len(spans) else 0
    stores_without_copies = _stores_without_copies(spans)
    return {
        **request_numbers(requests),
        "loads": int(len(loads)),
        "loads_without_copies": int((loads["copies"] == 0).sum()),
        # copies whose parent is no load or store of the files (another trace id: a worker that lost the trace
        # context, or the scheduler's file missing): in the byte totals, in no request's. A copy without
        # parent (a store traced in its own trace) is not one of them.
        "copies_without_owner": int((copies["owner_key"].isna() & (copies["parent_span_id"] != "")).sum()),
        # unknown (NaN) where loads ran and no load copy is in the files (the workers' file missing): not 0 B
        "bytes_loaded": (math.nan if "load" not in by_dir and (loads["copies"] == 0).any()
                         else int(by_dir.get("load", 0))),
        "stores": int((spans["name"] == STORE).sum()),
        "stores_without_copies": stores_without_copies,
        **_transfers_short_of_workers(spans),
        # unknown where stores ran and no store copy is in the files, as for loads
        "bytes_stored": math.nan if "store" not in by_dir and stores_without_copies else int(by_dir.get("store", 0)),
        "spans": int(len(spans)),
        "duration_s": (int(end) - int(start)) / 1e9,
    }


def _transfers_short_of_workers(spans: pd.DataFrame) -> dict[str, int]:
    """Loads and stores with copy spans from fewer workers than the most any has (under tensor parallelism every
    worker copies its share of each): a worker's trace file cut short. Their bytes and copy times are partial."""
    copies = spans.loc[(spans["name"] == COPY) & spans["owner_key"].notna(), ["owner_key", "worker_rank"]]
    ranks = copies.dropna(subset=["worker_rank"]).groupby("owner_key")["worker_rank"].nunique()
    workers = int(ranks.max()) if len(ranks) else 0
    return {"workers": workers, "transfers_short_of_workers": int((ranks < workers).sum())}


def _stores_without_copies(spans: pd.DataFrame) -> int:
    """`kvscope.store` spans with no copy span (failed ones included) in the files: the workers' file missing.
    0 where some store copies belong to no store (files of kvscope versions that traced a store's copies in a
    trace of their own): those may be theirs."""
    copied = spans.loc[(spans["name"] == COPY) & (spans["copy_direction"].astype(str) == "store"), "owner_key"]
    if copied.isna().any():
        return 0
    stores = spans.loc[spans["name"] == STORE, "span_key"]
    return int((~stores.isin(copied)).sum())


ENGINE_COLUMNS = ("engine", "requests", "tokens_queried", "tokens_hit", "hit_rate", "requests_load_failed",
                  "load_p50_ms", "load_p95_ms")
ENGINE_DEFINITION = (
    "Under data parallelism each vLLM engine (`kvscope.engine`, its data-parallel index, the metrics' "
    "`engine` label) has a host tier of its own: a prefix one engine stored is a miss on another. Per "
    "engine: the requests it looked up, their token hit rate, failed loads and load time quantiles "
    "(nearest rank, as above)."
)


def engine_summary(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per engine (`ENGINE_COLUMNS`, `ENGINE_DEFINITION`) the requests ran on, in engine order;
    empty for trace files that name none."""
    known = requests[requests["engine"].notna()]
    rows = []
    for engine, of_engine in known.groupby(known["engine"].astype("int64"), sort=True):
        numbers = request_numbers(of_engine)
        rows.append({"engine": int(engine), **{col: numbers[col] for col in ENGINE_COLUMNS[1:]}})
    return pd.DataFrame(rows, columns=list(ENGINE_COLUMNS))


def engines_run_apart(spans: pd.DataFrame) -> dict[int | None, int]:
    """Per engine index (None: files that name none) whose lookups came from more than one process
    (`service.instance.id`, a UUID per process unless set), how many: separate servers or restarts of one,
    each with a host tier of its own, that the numbers pool (`engines_run_apart_note`)."""
    lookups = spans[(spans["name"] == LOOKUP) & spans["service_instance"].notna()]
    if lookups.empty:
        return {}
    counts = lookups.groupby(lookups["engine"].astype("Int64"), dropna=False)["service_instance"].nunique()
    return {(None if pd.isna(engine) else int(engine)): int(n) for engine, n in counts.items() if n > 1}


def engines_run_apart_note(apart: dict[int | None, int]) -> str:
    """What `engines_run_apart` found, said once for every engine it names; "" when none."""
    if not apart:
        return ""
    said = "; ".join(f"{'no engine named' if engine is None else f'engine {engine}'}: {n} processes"
                     for engine, n in sorted(apart.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)))
    return (f"These files hold lookups of one engine index from several processes ({said}; told apart by the "
            "OpenTelemetry resource's service.instance.id): separate servers, or restarts of one, each with a "
            "host tier of its own. The numbers here pool them: read each server's run apart (its own trace "
            "file) to see one tier's story.")
