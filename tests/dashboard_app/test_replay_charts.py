"""The replay's charts on a long trace draw a bounded number of points, keep the line's shape (its first point,
its highs and lows) and end at the current step's values."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from dashboard import charts, traces

STEPS = 12_000


@pytest.fixture(scope="module")
def long_timeline() -> pd.DataFrame:
    """12,000 requests: a hit rate wobbling around 50% with one spike to 90% (step 5003) and one dip to 5% (step
    7001); bytes loaded growing by 0-3 MB a step, stored by 1 MB every other step."""
    step = np.arange(1, STEPS + 1)
    rate = 0.5 + 0.01 * np.sin(step / 50)
    rate[5002], rate[7000] = 0.9, 0.05
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({col: pd.Series(dtype=object) for col in traces.REPLAY_COLUMNS}).reindex(range(STEPS))
    return frame.assign(step=step, request=[f"r{i}" for i in step], cum_hit_rate=rate,
                        cum_bytes_loaded=np.cumsum(rng.integers(0, 3_000_000, STEPS)),
                        cum_bytes_stored=np.cumsum((step % 2) * 1_000_000))


def test_the_hit_rate_chart_draws_at_most_2000_points_ending_at_the_current_step(long_timeline):
    for step in (STEPS, 9_000):
        drawn = charts.replay_hit_rate(long_timeline, step).data
        assert len(drawn) <= 2_000
        assert drawn["step"].iloc[0] == 1 and drawn["step"].iloc[-1] == step
        assert drawn["step"].is_monotonic_increasing
        assert drawn["cum_hit_rate"].iloc[-1] == long_timeline["cum_hit_rate"].iloc[step - 1]
        assert {5003, 7001} <= set(drawn["step"])  # the spike and the dip are drawn
    for few in (1_500, 2_000):  # few steps, up to the limit: every one
        assert charts.replay_hit_rate(long_timeline, few).data["step"].tolist() == list(range(1, few + 1))


def test_the_traffic_chart_draws_at_most_2000_points_a_line_ending_at_the_current_step(long_timeline):
    drawn = charts.replay_traffic(long_timeline, 10_000).data
    for direction, column in (("load", "cum_bytes_loaded"), ("store", "cum_bytes_stored")):
        line = drawn[drawn["direction"] == direction]
        assert len(line) <= 2_000
        assert line["step"].iloc[-1] == 10_000 and line["bytes"].iloc[-1] == long_timeline[column].iloc[9_999]
        # cumulative lines: their runs' extremes are their ends, so the limit buys finer runs, not extremes
        assert len(line) > 1_500


def test_steps_whose_hit_rate_is_unknown_are_drawn_without_a_high_or_low(long_timeline):
    """The first 100 requests queried no token, so the hit rate is unknown (NaN) up to step 100: whole runs of
    such steps are no error and keep their first and last step (1 and 24); the spike and the dip are still drawn."""
    unknown = long_timeline.assign(cum_hit_rate=long_timeline["cum_hit_rate"].where(long_timeline["step"] > 100))
    drawn = charts.replay_hit_rate(unknown, STEPS).data
    assert len(drawn) <= 2_000 and {1, 24, 5003, 7001, STEPS} <= set(drawn["step"])


def test_the_traffic_axis_keeps_the_unit_of_the_whole_replay_from_its_first_step(long_timeline):
    """At step 1 under 3 MB had been loaded, but the replay loads 18 GB in all: the axis reads GB from the start
    (a unit changing while the replay plays would make the line jump)."""
    assert charts.replay_traffic(long_timeline, 1).to_dict()["encoding"]["y"]["title"] == "host traffic (GB)"
