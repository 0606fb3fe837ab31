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


def test_the_traffic_axis_spans_the_whole_replays_total_from_its_first_step(long_timeline):
    """The axis does not grow with the line while the replay plays, and at a first step with nothing copied
    it does not collapse to 0..0 (it read 0.000000)."""
    total = long_timeline[["cum_bytes_loaded", "cum_bytes_stored"]].max().max()
    unit, size = charts.byte_unit(total)
    for step in (1, 5_000, 10_000):
        scale = charts.replay_traffic(long_timeline, step).to_dict()["encoding"]["y"]["scale"]
        assert scale["domain"] == pytest.approx([0, total / size])
    nothing = long_timeline.assign(cum_bytes_loaded=0, cum_bytes_stored=0)
    assert charts.replay_traffic(nothing, 1).to_dict()["encoding"]["y"]["scale"]["domain"] == [0, 1]


def test_the_load_latency_axis_is_logarithmic_over_the_decades_the_values_span():
    """Copies of 13-84 µs beside a request load of 59 ms (it waited for the engine step that ran its copies): a
    linear axis to 60 ms drew the copies as one line at 0. Decade ticks from 10 µs to 100 ms, linear below 1 µs."""
    frame = pd.DataFrame({"series": ["request load", "request load", "copy g0", "copy g0"],
                          "ms": [0.83, 59.17, 0.013, 0.084]})
    x = charts.latency_distribution(frame).to_dict()["encoding"]["x"]
    assert x["scale"] == {"type": "symlog", "constant": 0.001, "domain": pytest.approx([0.01, 100])}
    assert x["axis"]["values"] == pytest.approx([0.01, 0.1, 1, 10, 100])
    # a copy timed at 0 ms (a coarse clock) still draws: the axis starts at 0, its linear part
    with_zero = charts.latency_distribution(pd.concat([frame, pd.DataFrame({"series": ["copy g0"], "ms": [0.0]})]))
    assert with_zero.to_dict()["encoding"]["x"]["scale"]["domain"] == pytest.approx([0, 100])
    assert charts.latency_ticks(pd.Series([0.0])) == [0.0, 0.001]
    assert charts.latency_ticks(pd.Series([1e-5, 2.0])) == pytest.approx([0.001, 0.01, 0.1, 1, 10])  # not below 1 µs
    tiny = pd.DataFrame({"series": ["copy g0", "copy g0"], "ms": [1e-5, 2.0]})
    assert charts.latency_distribution(tiny).to_dict()["encoding"]["x"]["scale"]["domain"] == pytest.approx([0, 10])
    assert charts.latency_ticks(pd.Series([3.0])) == pytest.approx([1, 10])
    charts.latency_distribution(frame.iloc[:0]).to_dict()  # no loads: an empty chart, no error
