"""Token hit rates: over all requests, and per time bucket of arrival. (None per KV group: a lookup
is joint over all groups, a prefix hits only where every group can serve it.)"""

from __future__ import annotations

import math

import pandas as pd

from dashboard.traces.schema import LOOKUP


HIT_RATE_DEFINITION = (
    "Token hit rate: Σ `tokens.hit` / Σ `tokens.queried` over every `kvscope.lookup` span, as "
    "`kvscope_hit_tokens_total` / `kvscope_lookup_tokens_total` count them: a request whose load failed "
    "may be looked up again; every recorded lookup counts, as in the counters. A request resumed after "
    "preemption records no second lookup."
)


MISSES_COLUMNS = ("miss_reason", "lookups", "tokens_not_served", "share")
MISSES_DEFINITION = (
    "Lookups by the reason their hit stopped (`kvscope.miss.reason`), with the looked-up tokens they were "
    "not served (queried minus hit, the tail included) and that as a share of all tokens not served. "
    "kvscope_missed_tokens_total splits the same tokens finer: block by block, the tail apart."
)


def misses_by_reason(spans: pd.DataFrame) -> pd.DataFrame:
    """Per miss reason (`MISSES_DEFINITION`): lookups, the tokens they did not serve and that share of
    all, most first; empty when no lookup recorded a reason (older trace files)."""
    lookups = spans[(spans["name"] == LOOKUP) & spans["miss_reason"].notna()]
    if lookups.empty:
        return pd.DataFrame(columns=list(MISSES_COLUMNS))
    not_served = (lookups["tokens_queried"].fillna(0) - lookups["tokens_hit"].fillna(0)).astype("int64")
    grouped = not_served.groupby(lookups["miss_reason"].astype(str))
    out = pd.DataFrame({"lookups": grouped.size(), "tokens_not_served": grouped.sum()})
    total = out["tokens_not_served"].sum()
    out["share"] = out["tokens_not_served"] / total if total else math.nan
    out = out.sort_values(["tokens_not_served", "lookups"], ascending=False, kind="stable")
    return out.rename_axis("miss_reason").reset_index()[list(MISSES_COLUMNS)]


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den else math.nan


def hit_rate(requests: pd.DataFrame) -> float:
    """Token hit rate over all requests (NaN when nothing was queried)."""
    return _ratio(requests["tokens_hit"].sum(), requests["tokens_queried"].sum())


_NICE_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60,
                   120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)


def pick_bucket_seconds(duration_s: float, max_buckets: int = 60) -> float:
    """The smallest round bucket width that cuts `duration_s` into at most `max_buckets`."""
    for width in _NICE_BUCKETS_S:
        if duration_s / width <= max_buckets:
            return width
    return _NICE_BUCKETS_S[-1]


def hit_rate_over_time(requests: pd.DataFrame, bucket_s: float | None = None) -> pd.DataFrame:
    """Token hit rate per time bucket of request arrival; buckets without requests are left out, and
    ``run`` numbers the stretches of consecutive buckets (a chart's line must not bridge the gaps)."""
    cols = ["bucket_start", "t_s", "requests", "tokens_queried", "tokens_hit", "hit_rate", "run"]
    if requests.empty:
        return pd.DataFrame(columns=cols)
    t0 = int(requests["arrival_ns"].min())
    if bucket_s is None:
        bucket_s = pick_bucket_seconds((int(requests["arrival_ns"].max()) - t0) / 1e9)
    width_ns = int(round(bucket_s * 1e9))
    bucket = (requests["arrival_ns"] - t0) // width_ns
    out = _token_hit_rates(requests.assign(bucket=bucket).groupby("bucket", sort=True))
    start_ns = t0 + out.index.to_numpy() * width_ns
    out["t_s"] = (start_ns - t0) / 1e9
    out["bucket_start"] = pd.to_datetime(start_ns, unit="ns", utc=True)
    out["run"] = (pd.Series(out.index).diff() != 1).cumsum().to_numpy()
    return out.reset_index(drop=True)[cols]


def _token_hit_rates(grouped) -> pd.DataFrame:
    """Per group of requests: how many, tokens queried and hit, and the token hit rate (NaN for none queried)."""
    out = pd.DataFrame({
        "requests": grouped.size(),
        "tokens_queried": grouped["tokens_queried"].sum(),
        "tokens_hit": grouped["tokens_hit"].sum(),
    })
    out["hit_rate"] = out["tokens_hit"].astype(float) / out["tokens_queried"].astype(float).where(
        out["tokens_queried"] > 0
    )
    return out
