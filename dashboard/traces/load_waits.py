"""What a load waited for before its first copy: other requests' copies on its workers, or nothing.

A load's time runs from its planning (the load span's start) to its last copy's end. Before its first copy
it waits for a worker to run the engine step that starts it. Copies of other requests running on the same
workers meanwhile (queued ahead, or sharing the copy engine) are one cause; with none, the step itself came
late (a long forward before it). The copies are told from the trace files, as the workers timed them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from dashboard.traces.schema import COPY, LOAD, duration_ok


@dataclass(frozen=True)
class LoadWait:
    wait_ms: float  # the first load's planning to its first copy's start
    loads: int  # other requests' load copies that ran on its workers within that wait
    stores: int  # and store copies
    busy_ms: float  # how much of the wait at least one of them ran (their union, within the wait)


def load_wait(spans: pd.DataFrame, trace_id: str, request_id: str) -> LoadWait | None:
    """The first load of the request (`trace_id`, `request_id`) and what ran on its workers before its first
    copy; None without a load, or without a timed copy of it."""
    loads = spans[(spans["name"] == LOAD) & (spans["trace_id"] == trace_id) & (spans["request_id"] == request_id)]
    if loads.empty:
        return None
    load = loads.sort_values(["start_ns", "span_key"], kind="stable").iloc[0]
    copies = spans[(spans["name"] == COPY) & duration_ok(spans)]
    own = copies[copies["owner_key"] == load["span_key"]]
    if own.empty:
        return None
    begin, first = int(load["start_ns"]), int(own["start_ns"].min())
    if first < begin:  # another clock's copy (`clock_ok`): no wait to explain
        return None
    ranks = set(own["worker_rank"].dropna().astype(int)) or None
    others = copies[(copies["owner_key"] != load["span_key"]) | copies["owner_key"].isna()]
    if ranks is not None:
        others = others[others["worker_rank"].isin(list(ranks))]
    during = others[(others["start_ns"] < first) & (others["end_ns"] > begin)]
    starts = np.maximum(during["start_ns"].to_numpy(dtype=np.int64), begin)
    ends = np.minimum(during["end_ns"].to_numpy(dtype=np.int64), first)
    direction = during["copy_direction"].astype(str)
    return LoadWait(wait_ms=(first - begin) / 1e6, loads=int((direction == "load").sum()),
                    stores=int((direction == "store").sum()), busy_ms=_union_ns(starts, ends) / 1e6)


def _union_ns(starts: np.ndarray, ends: np.ndarray) -> int:
    """The length of the union of the intervals [start, end)."""
    total, reach = 0, None
    for start, end in sorted(zip(starts.tolist(), ends.tolist())):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def load_wait_text(wait: LoadWait) -> str:
    """One sentence on what the wait held, for the request view: other requests' copies delayed it only where
    they filled at least half of it (a copy of 0.06 ms in an 18 ms wait says the step came late)."""
    if not (wait.loads or wait.stores):
        return (f"No other request's copy ran on its workers in the {wait.wait_ms:.3f} ms before its first copy: "
                "the engine step that starts it came late (a long step before it, or a busy scheduler), not the "
                "host tier.")
    ran = (f"Before its first copy its workers copied for other requests {wait.busy_ms:.3f} ms of the "
           f"{wait.wait_ms:.3f} ms ({wait.loads} load and {wait.stores} store copies)")
    if wait.busy_ms >= wait.wait_ms / 2:
        return f"{ran}: copies queued ahead, or sharing the copy engine, delayed it."
    return (f"{ran}: most of the wait was for the engine step that starts it (a long step before it, or a busy "
            "scheduler), not for the host tier.")
