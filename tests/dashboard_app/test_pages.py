"""Every page under streamlit.testing's AppTest: the numbers shown match the spans, nothing raises."""

from __future__ import annotations

import re
import sys

import pytest
from streamlit.testing.v1 import AppTest

from .conftest import APP, FIXTURES, MALFORMED, TWO_ROUNDS, raw_spans

PAGES = ["views/overview.py", "views/request_explorer.py", "views/replay.py", "views/live.py"]


def app(monkeypatch, *paths, argv: bool = False) -> AppTest:
    """The app on `paths`, given via KVSCOPE_TRACE_FILES or (argv=True) as `streamlit run` arguments."""
    monkeypatch.delenv("KVSCOPE_TRACE_FILES", raising=False)
    monkeypatch.delenv("KVSCOPE_PROMETHEUS_URL", raising=False)
    if argv:
        monkeypatch.setattr(sys, "argv", [str(APP), *map(str, paths)])
    elif paths:
        monkeypatch.setenv("KVSCOPE_TRACE_FILES", ",".join(map(str, paths)))
    return AppTest.from_file(str(APP), default_timeout=60).run()


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def number(text: str) -> float:
    """The number in a metric value such as '48.1%', '1.91 ms' or '3,968'."""
    return float(re.search(r"-?[\d,]*\.?\d+", text).group().replace(",", ""))


def assert_ok(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def test_overview_numbers_match_the_spans(monkeypatch, expected):
    at = app(monkeypatch, TWO_ROUNDS)
    assert_ok(at)
    assert at.title[0].value == "Overview"
    shown = metrics(at)
    assert number(shown["Requests"]) == len(expected.lookups)
    assert number(shown["Token hit rate"]) == pytest.approx(round(expected.hit_rate * 100, 1))
    assert shown["Token hit rate"].endswith("%")
    assert number(shown["Tokens hit"]) == sum(s["tokens.hit"] for s in expected.lookups)
    assert number(shown["Tokens queried"]) == sum(s["tokens.queried"] for s in expected.lookups)
    assert number(shown["Requests with a hit"]) == sum(1 for s in expected.lookups if s["tokens.hit"] > 0)
    for label, value in zip(("p50", "p95", "p99"), expected.load_quantiles):
        assert number(shown[f"Load time {label}"]) == pytest.approx(round(value, 2))
    assert number(shown["Loaded from host"]) * 1e6 == pytest.approx(expected.bytes["load"], rel=5e-3)
    assert number(shown["Stored to host"]) * 1e6 == pytest.approx(expected.bytes["store"], rel=5e-3)
    groups = at.dataframe[0].value
    assert groups["group"].tolist() == ["g0 sliding_window", "g1 full_attention"]
    sw = [s for s in expected.scans if s["group.index"] == 0]
    assert groups["null_skip_share"].iloc[0] == pytest.approx(
        sum(s["group.blocks.null_skipped"] for s in sw) / sum(s["group.blocks.total"] for s in sw))
    slow = at.dataframe[-1].value
    assert slow["request_id"].iloc[0] == max(expected.load_ms, key=expected.load_ms.get)
    assert len(at.get("vega_lite_chart")) == 3  # hit rate over time, latency, throughput
    assert not at.warning


def test_command_line_paths_win_over_the_environment(monkeypatch, expected):
    monkeypatch.setenv("KVSCOPE_TRACE_FILES", str(MALFORMED))
    monkeypatch.setattr(sys, "argv", [str(APP), str(TWO_ROUNDS)])
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    assert_ok(at)
    assert number(metrics(at)["Requests"]) == 20


def test_problems_are_listed_with_line_numbers(monkeypatch):
    at = app(monkeypatch, MALFORMED, argv=True)
    assert_ok(at)
    assert "6 problem(s)" in at.warning[0].value and "2 kvscope span(s) skipped" in at.warning[0].value
    assert "collector_malformed.jsonl lines 3, 4, 5, 6, 7, 10." in at.warning[0].value
    problems = at.dataframe[0].value
    assert problems["line"].tolist() == [3, 4, 5, 6, 7, 10]
    assert "lacks kvscope.tokens.external" in problems.set_index("line").loc[6, "reason"]
    # The rest still shows: c1 (hit), c2 (lookup only), c4 (miss).
    shown = metrics(at)
    assert number(shown["Requests"]) == 3
    assert number(shown["Token hit rate"]) == pytest.approx(round((288 + 64) / (300 + 100 + 200) * 100, 1))


@pytest.mark.parametrize("page", PAGES[:3])
def test_trace_pages_without_files_say_how_to_add_them(monkeypatch, page):
    at = app(monkeypatch)
    at.switch_page(page).run()
    assert_ok(at)
    assert "No trace files yet" in at.info[0].value and "KVSCOPE_TRACE_FILES" in at.info[0].value


def test_empty_file_then_upload(monkeypatch, tmp_path, expected):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    at = app(monkeypatch, empty)
    assert_ok(at)
    assert "hold no kvscope" in at.info[0].value
    at.file_uploader(key="uploads").set_value(("two_rounds.jsonl", TWO_ROUNDS.read_bytes(), "application/json"))
    at.run()
    assert_ok(at)
    assert number(metrics(at)["Requests"]) == 20
    assert number(metrics(at)["Token hit rate"]) == pytest.approx(round(expected.hit_rate * 100, 1))
    at.switch_page("views/replay.py").run()  # the upload stays across pages
    assert metrics(at)["Request"] == "1 of 20"


def test_requests_page_search_select_and_waterfall(monkeypatch, expected):
    at = app(monkeypatch, TWO_ROUNDS)
    at.switch_page("views/request_explorer.py").run()
    assert_ok(at)
    table = at.dataframe[0].value
    assert table["request_id"].tolist() == [s["request.id"] for s in expected.lookups]
    assert at.subheader[0].value == f"Request `{expected.lookups[0]['request.id']}`"

    at.text_input(key="request_search").input("r2-06").run()
    assert_ok(at)
    assert at.dataframe[0].value["request_id"].tolist() == ["cmpl-r2-06"]
    shown = metrics(at)
    assert number(shown["Load time"]) == pytest.approx(round(expected.load_ms["cmpl-r2-06"], 2))
    lookup = next(s for s in expected.lookups if s["request.id"] == "cmpl-r2-06")
    assert shown["Tokens hit / queried"] == f"{lookup['tokens.hit']} / {lookup['tokens.queried']}"
    spans = at.dataframe[1].value
    assert spans["row"].tolist() == ["lookup", "load", "group.scan g0 sliding_window", "group.scan g1 full_attention",
                                      "copy load g0 sliding_window rank 0", "copy load g1 full_attention rank 0"]

    at.text_input(key="request_search").input("").run()
    at.session_state["request_table"] = {"selection": {"rows": [3], "columns": [], "cells": []}}
    at.run()
    assert_ok(at)
    assert at.subheader[0].value == f"Request `{expected.lookups[3]['request.id']}`"

    at.toggle(key="request_only_hits").set_value(True).run()
    shown = at.dataframe[0].value
    hits = {s["request.id"] for s in expected.lookups if s["tokens.hit"] > 0}
    assert set(shown["request_id"]) == hits and len(hits) > 0


def test_replay_steps_and_cumulative_state(monkeypatch, expected):
    at = app(monkeypatch, TWO_ROUNDS)
    at.switch_page("views/replay.py").run()
    assert_ok(at)
    assert metrics(at)["Request"] == "1 of 20"
    assert metrics(at)["Cumulative token hit rate"] == "0.0%"

    next(b for b in at.button if b.label == "Step").click().run()
    assert metrics(at)["Request"] == "2 of 20"

    at.slider(key="replay_step").set_value(15).run()
    assert_ok(at)
    shown = metrics(at)
    assert shown["Request"] == "15 of 20"
    assert number(shown["Cumulative token hit rate"]) == pytest.approx(round(expected.cumulative_hit_rate(15) * 100, 1))
    cutoff = expected.lookups[15]["start"]
    loaded = sum(c["copy.bytes"] for c in expected.copies if c["copy.direction"] == "load" and c["end"] <= cutoff)
    assert number(shown["Loaded from host so far"]) * 1e6 == pytest.approx(loaded, rel=5e-3)
    assert at.subheader[0].value.startswith(f"Request `{expected.lookups[14]['request.id']}`")
    arrived = at.dataframe[-1].value
    assert arrived["step"].tolist() == list(range(15, 5, -1))  # newest first, ten rows

    next(b for b in at.button if b.label == "Back").click().run()
    assert metrics(at)["Request"] == "14 of 20"
    next(b for b in at.button if b.label == "Start").click().run()
    assert metrics(at)["Request"] == "1 of 20"


def test_replay_play_advances_and_stops_at_the_end(monkeypatch):
    at = app(monkeypatch, TWO_ROUNDS)
    at.switch_page("views/replay.py").run()
    at.slider(key="replay_step").set_value(19).run()
    next(b for b in at.button if b.label == "Play").click().run()
    assert_ok(at)
    # While playing, each run of the player fragment moves one request on.
    assert at.session_state["replay_playing"] and metrics(at)["Request"] == "20 of 20"
    assert any(b.label == "Pause" for b in at.button)
    at.run()  # at the end it stops by itself
    assert_ok(at)
    assert not at.session_state["replay_playing"] and metrics(at)["Request"] == "20 of 20"


def test_live_page_shows_prometheus_numbers(monkeypatch, fake_prometheus):
    at = app(monkeypatch, TWO_ROUNDS)
    at.switch_page("views/live.py").run()
    assert_ok(at)
    assert "Enter the URL" in at.info[0].value
    at.text_input(key="live_url").input(fake_prometheus).run()
    assert_ok(at)
    shown = metrics(at)
    assert shown["Token hit rate (latest)"] == "75.0%"  # the last finite sample
    assert shown["Load-to-report time p50 (latest)"] == "2.00 ms"
    assert shown["Load-to-report time p99 (latest)"] == "8.00 ms"
    assert len(at.get("vega_lite_chart")) == 2


def test_live_page_explains_an_unreachable_url(monkeypatch, closed_port_url):
    at = app(monkeypatch)
    at.switch_page("views/live.py").run()
    at.text_input(key="live_url").input(closed_port_url).run()
    assert not at.exception
    assert f"Could not reach Prometheus at {closed_port_url}" in at.error[0].value
    at.text_input(key="live_url").input("localhost:9090").run()
    assert "is not an HTTP URL" in at.error[0].value


FIXTURE_FILES = sorted(p for p in FIXTURES.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=[p.name for p in FIXTURE_FILES])
def test_every_fixture_file_renders_every_page(monkeypatch, path):
    """Also covers trace files added to tests/fixtures/traces later (e.g. real engine traces)."""
    at = app(monkeypatch, path)
    assert not at.exception, [e.value for e in at.exception]
    last_lookup = {}
    for s in sorted(raw_spans(path), key=lambda s: s["start"]):
        if s["name"] == "kvscope.lookup" and {"request.id", "tokens.hit", "tokens.queried"} <= s.keys():
            last_lookup[s["request.id"]] = s
    if last_lookup:
        rate = sum(s["tokens.hit"] for s in last_lookup.values()) / sum(s["tokens.queried"] for s in last_lookup.values())
        assert number(metrics(at)["Token hit rate"]) == pytest.approx(round(rate * 100, 1))
        assert number(metrics(at)["Requests"]) >= len(last_lookup)
    for page in PAGES[1:3]:
        at.switch_page(page).run()
        assert not at.exception, (page, [e.value for e in at.exception])
