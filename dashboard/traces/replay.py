"""Requests replayed in arrival order: the cumulative hit rate and host traffic at each step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from dashboard.traces.schema import DIRECTIONS, PAST_TENSE, REQUEST_KEY, copies_of

REPLAY_DEFINITION = (
    "Step i shows the state right before request i+1 arrives: hit rate over requests 1..i, and host "
    "traffic of the copies that had finished by then (all copies at the last step)."
)


REPLAY_COLUMNS = ("step", "request", "request_id", "trace_id", "t_s", "tokens_queried", "tokens_hit", "tokens_loaded",
                  "cum_tokens_queried", "cum_tokens_hit", "cum_hit_rate", "cum_bytes_loaded", "cum_bytes_stored")


def replay_timeline(requests: pd.DataFrame, spans: pd.DataFrame) -> pd.DataFrame:
    """One row per request in arrival order with the cumulative state (see `REPLAY_DEFINITION`)."""
    if requests.empty:
        return pd.DataFrame(columns=list(REPLAY_COLUMNS))
    reqs = requests.sort_values(["arrival_ns", *REQUEST_KEY], kind="stable").reset_index(drop=True)
    out = pd.DataFrame({
        "step": np.arange(1, len(reqs) + 1),
        "request": reqs["request"],
        "request_id": reqs["request_id"],
        "trace_id": reqs["trace_id"],
        "t_s": reqs["t_s"],
        "tokens_queried": reqs["tokens_queried"],
        "tokens_hit": reqs["tokens_hit"],
        "tokens_loaded": reqs["tokens_loaded"],
    })
    out["cum_tokens_queried"] = reqs["tokens_queried"].fillna(0).astype("int64").cumsum()
    out["cum_tokens_hit"] = reqs["tokens_hit"].fillna(0).astype("int64").cumsum()
    out["cum_hit_rate"] = out["cum_tokens_hit"] / out["cum_tokens_queried"].where(out["cum_tokens_queried"] > 0)
    cutoff = np.append(reqs["arrival_ns"].to_numpy()[1:], np.iinfo(np.int64).max)
    for direction in DIRECTIONS:
        copies = copies_of(spans, direction).sort_values("end_ns")
        cum = np.concatenate([[0], copies["copy_bytes"].fillna(0).astype("int64").cumsum().to_numpy()])
        idx = np.searchsorted(copies["end_ns"].to_numpy(), cutoff, side="right")
        out[f"cum_bytes_{PAST_TENSE[direction]}"] = cum[idx]
    return out[list(REPLAY_COLUMNS)]


NEXT_MISS_DEFINITION = ("The next request that queried the host tier and got nothing from it: no load of it "
                        "completed (it hit no token, or its load failed and vLLM recomputed). A request resumed "
                        "after preemption that loaded its own blocks back was served, whatever its first lookup hit.")


def next_miss(timeline: pd.DataFrame, step: int) -> int | None:
    """The first step after `step` whose request the host tier served nothing of (`NEXT_MISS_DEFINITION`); None
    when no later one did. Not `tokens_hit == 0`: a failed load hit and served nothing, a resumed request's load
    served tokens its first lookup did not hit."""
    later = timeline[(timeline["step"] > step) & (timeline["tokens_queried"].fillna(0) > 0)
                     & (timeline["tokens_loaded"].fillna(0) == 0)]
    return int(later["step"].iloc[0]) if len(later) else None


def replay_state(timeline: pd.DataFrame, step: int) -> dict[str, Any]:
    """The state after `step` requests (1-based, clamped to the timeline)."""
    if timeline.empty:
        raise ValueError("no requests to replay")
    step = min(max(int(step), 1), len(timeline))
    return timeline.iloc[step - 1].to_dict()


# Points a replay chart draws per line: Play redraws both charts every step, and drawing every step of a
# long trace (12k requests) made each step slower than the player's timer (Pause took seconds to land).
REPLAY_POINTS = 2000


def replay_points(timeline: pd.DataFrame, step: int, columns: list[str], limit: int = REPLAY_POINTS) -> pd.DataFrame:
    """The rows of steps 1..`step` a chart of `columns` draws: every one up to `limit`; past that, the steps cut
    into runs, and of each run its first and last step and the steps where each column is lowest and highest
    (at most `limit` rows, in step order). The line keeps its shape and always ends at the current step."""
    seen = timeline[timeline["step"] <= step]
    if len(seen) <= limit:
        return seen
    runs = max(1, limit // (2 + 2 * len(columns)))
    run = np.arange(len(seen)) * runs // len(seen)  # positions 0..n-1 -> run 0..runs-1, in order
    keep = np.zeros(len(seen), dtype=bool)
    firsts = np.searchsorted(run, np.arange(runs))
    keep[firsts] = True
    keep[np.append(firsts[1:] - 1, len(seen) - 1)] = True  # each run's last: the current step is the last one's
    for col in columns:
        values = seen[col].astype(float).to_numpy()
        missing = np.isnan(values)  # a hit rate before anything was queried: never a low or a high
        for extreme, idx in ((np.inf, "idxmin"), (-np.inf, "idxmax")):
            keep[getattr(pd.Series(np.where(missing, extreme, values)).groupby(run), idx)().to_numpy()] = True
    return seen[keep]
