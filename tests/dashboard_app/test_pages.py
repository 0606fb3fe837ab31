"""Every page under streamlit.testing's AppTest: the numbers shown match the spans, nothing raises."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import formatting, sources, traces

from .conftest import APP, FIXTURES, MALFORMED, TWO_ROUNDS, raw_spans
from .test_joins import copy, load, store
from .test_reader import engine_line, line, lookup, span
from .vllm_traces import vllm_spans_of

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
    groups = next(d.value for d in at.dataframe if "null_skip_share" in d.value.columns)
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


def test_the_headline_counts_lines_not_problems(monkeypatch, tmp_path):
    no_hit = lookup("r2", span_id="22" * 8)
    no_hit["attributes"].pop()  # lacks kvscope.tokens.hit
    path = tmp_path / "t.jsonl"
    misshapen = json.dumps([{"resourceSpans": {}}, {"resourceSpans": "x"}])  # two problems, spans unknown
    path.write_text(line(lookup("r1", span_id="bad"), no_hit) + "\n" + line(lookup("r3", span_id="33" * 8)) + "\n"
                    + misshapen + "\n")
    at = app(monkeypatch, path)
    assert_ok(at)
    assert ("4 problem(s) while reading the trace files (2 line(s), 2 kvscope span(s) skipped, and an unknown number "
            "in 1 line(s) or file(s) that could not be read): t.jsonl lines 1, 3.") in at.warning[0].value


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
    assert [i.value for i in at.info] == [f"Why the host tier served no more (`{lookup['miss.reason']}`): "
                                          f"{traces.MISS_REASON_TEXT[lookup['miss.reason']]}."]
    spans = at.dataframe[1].value
    # the fixture holds vLLM's request span of every even request: it leads, as the parent row
    assert spans["row"].tolist() == ["vLLM request", "lookup", "load", "group.scan g0 sliding_window",
                                      "group.scan g1 full_attention", "copy load g0 sliding_window rank 0",
                                      "copy load g1 full_attention rank 0"]

    at.text_input(key="request_search").input("").run()
    at.session_state["request_table"] = {"selection": {"rows": [3], "columns": [], "cells": []}}
    at.run()
    assert_ok(at)
    assert at.subheader[0].value == f"Request `{expected.lookups[3]['request.id']}`"

    at.radio(key="request_show").set_value("hits or loads").run()
    shown = at.dataframe[0].value
    hits = {s["request.id"] for s in expected.lookups if s["tokens.hit"] > 0}
    assert set(shown["request_id"]) == hits and len(hits) > 0


def test_requests_page_shows_vllm_latencies_and_copies_per_group(monkeypatch, tmp_path, expected):
    """kvscope's file with a Collector file of vLLM's request spans (odd requests: the fixture has an older
    vLLM's span, without latencies, for the even ones)."""
    at = app(monkeypatch, TWO_ROUNDS)
    at.switch_page("views/request_explorer.py").run()
    assert not {"vllm_queue_ms", "vllm_ttft_ms", "vllm_e2e_ms"} & set(at.dataframe[0].proto.column_order)

    collector = vllm_spans_of(TWO_ROUNDS, {"cmpl-r2-05": 0.25, "cmpl-r2-07": 0.5}, tmp_path / "vllm.jsonl")
    at = app(monkeypatch, TWO_ROUNDS, collector)
    at.switch_page("views/request_explorer.py").run()
    assert_ok(at)
    order = list(at.dataframe[0].proto.column_order)
    assert order[order.index("load_ms"):][:4] == ["load_ms", "vllm_queue_ms", "vllm_ttft_ms", "vllm_e2e_ms"]
    ttft = at.dataframe[0].value.set_index("request_id")["vllm_ttft_ms"]
    joined = ["cmpl-r2-05", "cmpl-r2-07"]
    assert ttft[joined].tolist() == [250.0, 500.0] and ttft.drop(joined).isna().all()

    at.text_input(key="request_search").input("r2-05").run()
    assert_ok(at)
    shown = metrics(at)
    assert (shown["Time to first token (vLLM)"], shown["Queue time (vLLM)"]) == ("250.00 ms", "4.00 ms")
    assert shown["Prefill (vLLM)"] == "100.00 ms"
    assert shown["Load time"] == f"{expected.load_ms['cmpl-r2-05']:.2f} ms"
    assert at.dataframe[1].value["row"].iloc[0] == "vLLM request"
    assert [c.value for c in at.caption if c.value in ("load 1", "store 1")] == ["load 1"]
    per_group = at.dataframe[2].value
    load = expected.loads["cmpl-r2-05"]
    raw = sorted((c for c in expected.copies if c["trace"] == load["trace"] and c["copy.direction"] == "load"),
                 key=lambda c: c["group.index"])
    assert per_group["group"].tolist() == ["g0 sliding_window", "g1 full_attention"]
    assert per_group["copy_ms"].tolist() == pytest.approx([(c["end"] - c["start"]) / 1e6 for c in raw])

    at.text_input(key="request_search").input("r2-03").run()  # no vLLM span: no vLLM numbers, not zeros
    assert_ok(at)
    assert not any("vLLM" in label for label in metrics(at))


def test_overview_shows_why_the_tier_missed(monkeypatch, expected):
    at = app(monkeypatch, TWO_ROUNDS)
    assert_ok(at)
    assert "Why the host tier served no more" in [h.value for h in at.subheader]
    table = next(d.value for d in at.dataframe if "miss_reason" in d.value.columns).set_index("miss_reason")
    assert table["tokens_not_served"].sum() == sum(s["tokens.queried"] - s["tokens.hit"] for s in expected.lookups)


def test_overview_splits_vllm_latency_by_host_tier_outcome_when_vllm_spans_are_read(monkeypatch, tmp_path):
    at = app(monkeypatch, TWO_ROUNDS)  # the fixture's older vLLM spans carry no latencies: no table
    assert_ok(at)
    assert "vLLM latency by host-tier outcome" not in [h.value for h in at.subheader]
    collector = vllm_spans_of(TWO_ROUNDS, {"cmpl-r1-05": 0.9, "cmpl-r2-05": 0.25, "cmpl-r2-07": 0.5},
                              tmp_path / "vllm.jsonl")
    at = app(monkeypatch, TWO_ROUNDS, collector)
    assert_ok(at)
    assert "vLLM latency by host-tier outcome" in [h.value for h in at.subheader]
    table = next(d.value for d in at.dataframe if "outcome" in d.value.columns).set_index("outcome")
    assert table["requests"].to_dict() == {"loaded from the host tier": 2, "no host-tier load": 1}
    assert table.loc["loaded from the host tier", "ttft_p50_ms"] == pytest.approx(375.0)
    assert table.loc["no host-tier load", "ttft_p50_ms"] == pytest.approx(900.0)


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


def test_replay_jumps_to_the_next_request_that_missed(monkeypatch):
    """Replaying request by request to find the misses was one click per request."""
    at = app(monkeypatch, TWO_ROUNDS)
    at.switch_page("views/replay.py").run()
    timeline = traces.replay_timeline(*(lambda r: (traces.requests_table(r.spans), r.spans))(
        traces.read_trace_files([TWO_ROUNDS])))
    served_nothing = (timeline["tokens_queried"] > 0) & (timeline["tokens_loaded"].fillna(0) == 0)
    missed = timeline.loc[served_nothing, "step"].tolist()
    assert 1 in missed and 2 in missed and len(missed) < len(timeline)  # round 1 misses, round 2 hits
    at.slider(key="replay_step").set_value(missed[1]).run()
    at.button(key="replay_next_miss").click().run()
    assert_ok(at)
    assert metrics(at)["Request"] == f"{missed[2]} of 20"
    at.slider(key="replay_step").set_value(missed[-1]).run()
    at.button(key="replay_next_miss").click().run()
    assert metrics(at)["Request"] == f"{missed[-1]} of 20"  # none after the last: it stays, and says so
    assert [t.value for t in at.toast] == ["No request after this one missed the host tier."]
    assert traces.next_miss(timeline, missed[-1]) is None and traces.next_miss(timeline, 0) == missed[0]


def test_next_miss_is_a_request_the_tier_served_nothing_of_not_one_that_hit_nothing():
    """A failed load hit tokens and served none (vLLM recomputed); a request resumed after preemption hit nothing
    at its first lookup and loaded its own blocks back."""
    timeline = pd.DataFrame({"step": [1, 2, 3, 4, 5], "tokens_queried": [64, 64, 64, 64, pd.NA],
                             "tokens_hit": [64, 64, 0, 0, pd.NA],
                             "tokens_loaded": pd.array([64, pd.NA, 48, pd.NA, pd.NA], dtype="Int64")})
    assert traces.next_miss(timeline, 0) == 2  # its load failed
    assert traces.next_miss(timeline, 2) == 4  # step 3 resumed and loaded; step 5 never queried the tier
    assert traces.next_miss(timeline, 4) is None


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
    at.text_input(key="live_url").input("http://" + "a" * 70 + ".com").run()  # a host label over 63 characters
    assert not at.exception and "is not a valid URL" in at.error[0].value


def test_a_folder_holding_no_trace_files_is_named_not_called_no_files_yet(monkeypatch, tmp_path):
    (tmp_path / "trace.JSONL").write_text(line(lookup()) + "\n")
    at = app(monkeypatch, tmp_path, argv=True)
    assert not at.exception
    assert [w.value for w in at.warning] == sources.trace_paths([str(tmp_path)], {}).empty_folders
    assert f"The folder {tmp_path} holds no trace files (only trace.JSONL" in at.warning[0].value
    assert ".jsonl.gz" in at.warning[0].value and not any("No trace files yet" in i.value for i in at.info)
    assert any(str(tmp_path) in c.value for c in at.sidebar.caption)


FIXTURE_FILES = sorted(p for p in FIXTURES.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=[p.name for p in FIXTURE_FILES])
def test_every_fixture_file_renders_every_page(monkeypatch, path):
    """Also covers trace files added to tests/fixtures/traces later (e.g. real engine traces)."""
    at = app(monkeypatch, path)
    assert not at.exception, [e.value for e in at.exception]
    lookups = [s for s in raw_spans(path)
               if s["name"] == "kvscope.lookup" and {"request.id", "tokens.hit", "tokens.queried"} <= s.keys()]
    if lookups:  # every lookup counts, as in kvscope's counters
        rate = sum(s["tokens.hit"] for s in lookups) / sum(s["tokens.queried"] for s in lookups)
        assert number(metrics(at)["Token hit rate"]) == pytest.approx(round(rate * 100, 1))
        assert number(metrics(at)["Requests"]) >= len({(s["trace"], s["request.id"]) for s in lookups})
    for page in PAGES[1:3]:
        at.switch_page(page).run()
        assert not at.exception, (page, [e.value for e in at.exception])


def _with_spans_edited(path: Path, out: Path, edit) -> Path:
    """`path`'s trace lines written to `out`, each span (a dict) passed to `edit` first."""
    lines = []
    for text in path.read_text().splitlines():
        doc = json.loads(text)
        for rs in doc["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    edit(sp)
        lines.append(json.dumps(doc))
    out.write_text("\n".join(lines) + "\n")
    return out


def _rerun_of(path: Path, tmp_path: Path) -> Path:
    """The same benchmark run again a day later: same (client-set) request ids, new trace ids."""
    def a_day_later_in_a_new_trace(sp: dict) -> None:
        sp["traceId"] = sp["traceId"][::-1]
        for field in ("startTimeUnixNano", "endTimeUnixNano"):
            sp[field] = str(int(sp[field]) + 86_400 * 10**9)

    return _with_spans_edited(path, tmp_path / "rerun.jsonl", a_day_later_in_a_new_trace)


def test_a_rerun_with_the_same_request_ids_counts_apart(monkeypatch, tmp_path, expected):
    at = app(monkeypatch, TWO_ROUNDS, _rerun_of(TWO_ROUNDS, tmp_path))
    assert_ok(at)
    shown = metrics(at)
    assert number(shown["Requests"]) == 40
    # each run's load on its own, not the two runs' loads of one request id summed
    assert number(shown["Load time p50"]) == pytest.approx(round(expected.load_quantiles[0], 2))
    slow = at.dataframe[-1].value
    assert slow["load_ms"].iloc[:2].tolist() == pytest.approx([expected.load_ms["cmpl-r2-06"]] * 2)
    assert slow["request"].iloc[0].startswith("cmpl-r2-06 · trace ") and slow["request"].nunique() == 10

    at.switch_page("views/request_explorer.py").run()
    at.text_input(key="request_search").input("cmpl-r2-06").run()
    assert_ok(at)
    table = at.dataframe[0].value
    assert len(table) == 2 and table["request"].nunique() == 2 and table["trace_id"].nunique() == 2
    at.session_state["request_table"] = {"selection": {"rows": [1]}}
    at.run()
    assert at.subheader[0].value == f"Request `{table['request'].iloc[1]}`"
    assert number(metrics(at)["Load time"]) == pytest.approx(round(expected.load_ms["cmpl-r2-06"], 2))
    assert set(at.dataframe[1].value["span_id"]) <= set(_span_ids(table["trace_id"].iloc[1], at))

    at.switch_page("views/replay.py").run()
    assert_ok(at)
    assert metrics(at)["Request"] == "1 of 40"


def _span_ids(trace_id: str, at: AppTest) -> list[str]:
    """The trace's span ids: kvscope's spans and vLLM's request spans (the waterfall shows both)."""
    loaded = at.session_state["kvscope.loaded"]
    return [span_id for spans in (loaded.spans, loaded.vllm)
            for span_id in spans.loc[spans["trace_id"] == trace_id, "span_id"]]


def test_the_selected_request_stays_selected_when_the_rows_change(monkeypatch, expected):
    at = app(monkeypatch, TWO_ROUNDS)
    at.switch_page("views/request_explorer.py").run()
    at.session_state["request_table"] = {"selection": {"rows": [12]}}
    at.run()
    assert at.subheader[0].value == "Request `cmpl-r2-02`"
    at.text_input(key="request_search").input("r2-0").run()  # now the third row
    assert_ok(at)
    assert at.subheader[0].value == "Request `cmpl-r2-02`"
    assert list(at.session_state["request_table"]["selection"]["rows"]) == [2]
    at.text_input(key="request_search").input("").run()
    assert list(at.session_state["request_table"]["selection"]["rows"]) == [12]
    at.radio(key="request_show").set_value("misses").run()  # a hit: not shown any more
    assert_ok(at)
    assert list(at.session_state["request_table"]["selection"]["rows"]) == []
    assert any("first row is shown" in c.value for c in at.caption)
    assert at.subheader[0].value == "Request `cmpl-r1-00`"


def test_request_filters_misses_and_failed_loads(monkeypatch, tmp_path):
    path = tmp_path / "failed.jsonl"
    path.write_text(_failed_load_trace())
    at = app(monkeypatch, path)
    assert_ok(at)
    warning = at.warning[0].value
    assert "1 request(s) had a load that failed on a worker" in warning and "r-failed" in warning
    at.switch_page("views/request_explorer.py").run()
    at.radio(key="request_show").set_value("failed loads").run()
    assert at.dataframe[0].value["request_id"].tolist() == ["r-failed"]
    at.radio(key="request_show").set_value("misses").run()
    assert at.dataframe[0].value["request_id"].tolist() == ["r-miss"]


def test_requests_of_several_engines_show_their_engine_and_filter_by_it(monkeypatch, tmp_path):
    """Data parallelism: the Overview's table by engine, the Requests page's engine column and filter appear
    only when the spans name several engines."""
    t = 1_700_000_000_000_000_000
    path = tmp_path / "dp.jsonl"
    path.write_text("\n".join([
        engine_line({"intValue": "0"}, lookup("r-a", 100, 64, trace="aa" * 16, span_id="a1" * 8, start=t)),
        engine_line({"intValue": "1"}, lookup("r-b", 100, 0, trace="bb" * 16, span_id="b1" * 8, start=t + 10),
                    lookup("r-c", 100, 0, trace="cc" * 16, span_id="c1" * 8, start=t + 20)),
    ]) + "\n")
    at = app(monkeypatch, path)
    assert_ok(at)
    by_engine = at.dataframe[0].value  # the Overview's first table
    assert by_engine[["engine", "requests", "tokens_hit"]].values.tolist() == [[0, 1, 64], [1, 2, 0]]
    at.switch_page("views/request_explorer.py").run()
    assert_ok(at)
    assert at.dataframe[0].value["engine"].tolist() == [0, 1, 1]
    assert at.selectbox(key="request_engine").options == ["all", "0", "1"]
    at.selectbox(key="request_engine").set_value(1).run()
    assert_ok(at)
    assert at.dataframe[0].value["request_id"].tolist() == ["r-b", "r-c"]

    at.switch_page("views/replay.py").run()  # replayed together, or one engine's tier alone
    assert_ok(at)
    assert metrics(at)["Request"] == "1 of 3"
    at.selectbox(key="replay_engine").set_value(1).run()
    assert_ok(at)
    assert metrics(at)["Request"] == "1 of 2" and at.subheader[0].value.startswith("Request `r-b`")

    single = app(monkeypatch, TWO_ROUNDS)  # one engine (or none recorded): no filter, no table by engine
    assert "engine" not in single.dataframe[0].value.columns
    single.switch_page("views/request_explorer.py").run()
    assert_ok(single)
    assert not any(box.key == "request_engine" for box in single.selectbox)
    single.switch_page("views/replay.py").run()
    assert_ok(single)
    assert not any(box.key == "replay_engine" for box in single.selectbox)


def _failed_load_trace() -> str:
    t = 1_700_000_000_000_000_000
    failed = copy("load", 0, "r-failed", trace="aa" * 16, span_id="a3" * 8, parent="a2" * 8, start=t + 20)
    failed["status"] = {"code": 2}
    return "\n".join([
        line(lookup("r-failed", 100, 64, trace="aa" * 16, span_id="a1" * 8, start=t),
             load("r-failed", trace="aa" * 16, span_id="a2" * 8, parent="a1" * 8, start=t + 10), failed,
             lookup("r-failed", 100, 0, trace="aa" * 16, span_id="a4" * 8, parent="a1" * 8, start=t + 30)),
        line(lookup("r-miss", 50, 0, trace="bb" * 16, span_id="b1" * 8, start=t + 40)),
    ]) + "\n"


def test_slowest_load_opens_on_the_requests_page(monkeypatch):
    at = app(monkeypatch, TWO_ROUNDS)
    at.session_state["slowest_loads"] = {"selection": {"rows": [0]}}
    at.run()
    assert_ok(at)
    assert at.title[0].value == "Requests"
    assert at.subheader[0].value == "Request `cmpl-r2-06`"
    assert at.text_input(key="request_search").value == "cmpl-r2-06"
    assert list(at.session_state["request_table"]["selection"]["rows"]) == [0]
    # what its load waited for before its first copy, told from the workers' copies
    spans = traces.read_trace_files([TWO_ROUNDS]).spans
    wait = traces.load_wait(spans, at.session_state["request_table_keys"][0][0], "cmpl-r2-06")
    assert traces.load_wait_text(wait) in [c.value for c in at.caption]


def test_a_miss_reason_of_an_earlier_lookup_lists_its_request(monkeypatch, tmp_path):
    """The Overview counts reasons by lookup, a request's column shows its last lookup's: a reason only an
    earlier lookup had was no option of the filter, which Streamlit then dropped, listing every request."""
    def missed(rid, reason, span_id, trace, start=1_700_000_000_000_000_000):
        sp = lookup(rid, 100, 0, span_id=span_id, trace=trace, start=start)
        sp["attributes"].append({"key": "kvscope.miss.reason", "value": {"stringValue": reason}})
        return sp

    path = tmp_path / "reasons.jsonl"
    path.write_text(line(missed("r1", "storing", "11" * 8, "a1" * 16),
                         missed("r1", "evicted", "12" * 8, "a1" * 16, start=1_700_000_000_000_000_010),
                         missed("r2", "evicted", "21" * 8, "a2" * 16), missed("r3", "evicted", "31" * 8, "a3" * 16))
                    + "\n")
    misses = traces.misses_by_reason(traces.read_trace_files([path]).spans)
    assert misses["miss_reason"].tolist() == ["evicted", "storing"]
    at = app(monkeypatch, path)
    at.session_state["miss_reasons"] = {"selection": {"rows": [1]}}
    at.run()
    assert_ok(at)
    assert at.title[0].value == "Requests"
    assert at.multiselect(key="request_reasons").value == ["storing"]
    assert at.dataframe[0].value["request_id"].tolist() == ["r1"]


def test_the_overview_warns_of_lookups_from_several_processes(monkeypatch, tmp_path):
    from .conftest import two_engine_copy

    at = app(monkeypatch, two_engine_copy(tmp_path, key="service.instance.id"))
    assert_ok(at)
    assert any("lookups of one engine index from several processes" in w.value for w in at.warning)
    at = app(monkeypatch, TWO_ROUNDS)
    assert not any("several processes" in w.value for w in at.warning)


def test_a_miss_reason_opens_its_requests_on_the_requests_page(monkeypatch):
    at = app(monkeypatch, TWO_ROUNDS)
    at.session_state["request_search"] = "r2"  # searched before: the reason's requests are listed whatever it was
    at.session_state["miss_reasons"] = {"selection": {"rows": [1]}}  # "tail" (the table lists "new" first)
    at.run()
    assert_ok(at)
    assert at.title[0].value == "Requests"
    assert at.multiselect(key="request_reasons").value == ["tail"]
    assert at.text_input(key="request_search").value == ""
    shown = at.dataframe[0].value
    requests = traces.requests_table(traces.read_trace_files([TWO_ROUNDS]).spans)
    assert len(shown) == (requests["miss_reason"] == "tail").sum() > 0 and set(shown["miss_reason"]) == {"tail"}
    listed = "Listed: requests with any lookup stopped for a chosen reason."
    assert any(c.value.startswith(listed) for c in at.caption)
    at.multiselect(key="request_reasons").set_value([]).run()
    assert len(at.dataframe[0].value) == len(requests)
    assert not any(c.value.startswith(listed) for c in at.caption)


def test_warnings_for_unparsed_lines_and_loads_without_copies(monkeypatch, tmp_path):
    path = tmp_path / "scheduler-only.jsonl"  # the worker's file (the copies) was not given, last line cut
    path.write_text(line(lookup("r1", span_id="11" * 8), load("r1", span_id="22" * 8, parent="11" * 8)) + "\n"
                    + line(lookup("r2", span_id="33" * 8))[:40])
    at = app(monkeypatch, path)
    assert_ok(at)
    problems, no_copies = at.warning[0].value, at.warning[1].value
    assert "0 kvscope span(s) skipped, and an unknown number in 1 line(s)" in problems
    assert no_copies.startswith("1 of 1 loads have no copy spans: worker trace file missing or cut short")
    at.switch_page("views/request_explorer.py").run()
    at.text_input(key="request_search").input("r1").run()
    assert any("No copy span of its load was recorded" in w.value for w in at.warning)


def test_spans_in_two_files_are_a_note_not_a_problem(monkeypatch, tmp_path):
    """The README has a Collector's file read beside the connector's: the spans in both count once,
    and say so without the problems warning."""
    collector = tmp_path / "collector.jsonl"
    collector.write_bytes(TWO_ROUNDS.read_bytes())
    at = app(monkeypatch, TWO_ROUNDS, collector)
    assert_ok(at)
    assert not at.warning
    spans = len(raw_spans(TWO_ROUNDS))
    captions = " ".join(c.value for c in at.caption)
    assert f"{spans} span(s) were read twice, in one file or in two of the files read" in captions
    assert number(metrics(at)["Requests"]) == 20


def test_files_of_no_request_whose_only_note_is_spans_read_twice_point_to_no_warning(monkeypatch, tmp_path):
    """Spans read twice are a note, not a warning: the page saying why it has no request must not send the
    reader to a warning above that is not there."""
    stores = tmp_path / "a.jsonl"
    stores.write_text(line(store("r", span_id="02" * 8)) + "\n")
    again = tmp_path / "b.jsonl"
    again.write_bytes(stores.read_bytes())
    at = app(monkeypatch, stores, again)
    assert_ok(at)
    assert not at.warning
    assert "hold no kvscope lookup or load spans. Start" in at.info[0].value


def test_a_requests_view_splits_its_load_time(monkeypatch, expected):
    at = app(monkeypatch, TWO_ROUNDS)
    at.switch_page("views/request_explorer.py").run()
    at.text_input(key="request_search").input("r2-06").run()
    assert_ok(at)
    copying = formatting.millis(expected.load_copy_ms["cmpl-r2-06"])
    waited = formatting.millis(expected.load_ms["cmpl-r2-06"] - expected.load_copy_ms["cmpl-r2-06"])
    assert any(c.value.startswith(f"Load time: {copying} copying") and f"and {waited} before the first copy" in c.value
               for c in at.caption)


def test_missing_and_repeated_files_say_why_in_the_headline(monkeypatch, tmp_path):
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "two_rounds.jsonl").write_bytes(TWO_ROUNDS.read_bytes())
    at = app(monkeypatch, folder, folder / "two_rounds.jsonl", tmp_path / "nope.jsonl", argv=True)
    assert_ok(at)
    assert "nope.jsonl (cannot read file: No such file or directory)" in at.warning[0].value
    assert "two_rounds.jsonl (the same file as " in at.warning[0].value
    assert number(metrics(at)["Requests"]) == 20


def test_long_traces_show_their_duration_in_readable_units(monkeypatch, tmp_path):
    day = 86_400 * 10**9
    path = tmp_path / "long.jsonl"
    path.write_text(line(lookup("r1", span_id="11" * 8, start=1_700_000_000 * 10**9),
                         lookup("r2", span_id="22" * 8, start=1_700_000_000 * 10**9 + day + 3 * 3600 * 10**9)) + "\n")
    at = app(monkeypatch, path)
    assert_ok(at)
    assert "2 traced requests over 1.1 d, from 1 file(s)." == at.caption[0].value


def test_a_single_matching_row_is_shown_without_asking_for_a_selection(monkeypatch):
    at = app(monkeypatch, TWO_ROUNDS)
    at.switch_page("views/request_explorer.py").run()
    at.text_input(key="request_search").input("cmpl-r2-03").run()
    assert_ok(at)
    assert at.subheader[0].value == "Request `cmpl-r2-03`"
    assert not any("first row is shown" in c.value for c in at.caption)


def test_copies_in_another_trace_are_reported_not_only_their_loads(monkeypatch, tmp_path):
    """A worker that lost the trace context: its copies joined nothing, and the page blamed a missing
    worker file while its totals summed them."""
    def copy_to_another_trace(sp: dict) -> None:
        if sp["name"] == "kvscope.group.copy":
            sp["traceId"] = "ee" * 16

    moved = _with_spans_edited(TWO_ROUNDS, tmp_path / "moved.jsonl", copy_to_another_trace)
    copies = sum(s["name"] == "kvscope.group.copy" and bool(s["parent"]) for s in raw_spans(TWO_ROUNDS))
    assert copies > 0
    at = app(monkeypatch, moved)
    assert_ok(at)
    warnings = " ".join(w.value for w in at.warning)
    assert f"{copies} copy span(s) belong to no load or store in these files" in warnings
    assert "or their copies in another trace" in warnings


def test_the_problems_warning_counts_lines_apart_from_files_and_says_whether_anything_else_shows(monkeypatch, tmp_path):
    """A file that cannot be read is no line; "Everything else is shown" only where something is."""
    no_hit = lookup("r2", span_id="22" * 8)
    no_hit["attributes"].pop()  # lacks kvscope.tokens.hit
    path = tmp_path / "t.jsonl"
    path.write_text(line(lookup("r1", span_id="11" * 8), no_hit) + "\n")
    at = app(monkeypatch, path)
    assert [w.value for w in at.warning] == [
        "1 problem(s) while reading the trace files (1 line(s), 1 kvscope span(s) skipped): t.jsonl line 1 "
        "(kvscope.lookup span lacks kvscope.tokens.hit). Everything else is shown."]
    at = app(monkeypatch, path, tmp_path / "nope.jsonl")
    assert at.warning[0].value.startswith(
        "2 problem(s) while reading the trace files (1 line(s), 1 kvscope span(s) skipped, and an unknown number "
        "in 1 line(s) or file(s) that could not be read): ")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    at = app(monkeypatch, bad)
    assert at.warning[0].value.endswith("bad.jsonl line 1 (not JSON: Expecting value (column 1)).")


def test_the_sidebar_names_each_file_and_counts_what_was_read(monkeypatch, tmp_path):
    """vLLM's request spans and spans of other tools are counted only where there are some."""
    at = app(monkeypatch, TWO_ROUNDS)
    assert_ok(at)
    assert [(c.value, c.help) for c in at.sidebar.caption] == [
        (":material/description: two_rounds.jsonl", str(TWO_ROUNDS)),
        (f"20 requests · {len(raw_spans(TWO_ROUNDS))} kvscope spans · 10 vLLM request spans", "")]
    path = tmp_path / "t.jsonl"
    path.write_text(line(lookup("r1", span_id="11" * 8)) + "\n"
                    + line(span("GET /", {}, span_id="22" * 8), scope="http.server", version="1.0") + "\n")
    at = app(monkeypatch, path)
    assert_ok(at)
    assert at.sidebar.caption[-1].value == "1 requests · 1 kvscope spans · 1 other spans left out"


def test_a_bug_reading_the_files_is_said_and_nothing_else_runs(monkeypatch):
    """The reader reports bad input as problems; an exception it raises anyway is the app's last guard."""
    from dashboard import data

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(data, "load", broken)
    at = app(monkeypatch, TWO_ROUNDS)
    assert not at.exception and not at.title
    assert [e.value for e in at.error] == ["kvscope could not read these trace files (RuntimeError: boom). Nothing "
                                           "is shown; please report this with the file."]


def test_a_requests_view_shows_its_own_hit_rate_bytes_and_copies_per_group(monkeypatch, expected):
    """Its scan's columns beside a load's copies, not beside a store's (a store scans nothing); no device-cache
    note where the device cache had none of its tokens."""
    at = app(monkeypatch, TWO_ROUNDS)
    at.switch_page("views/request_explorer.py").run()
    at.text_input(key="request_search").input("r2-06").run()
    assert_ok(at)
    shown = metrics(at)
    hit = next(s for s in expected.lookups if s["request.id"] == "cmpl-r2-06")
    assert shown["Request hit rate"] == formatting.percent(hit["tokens.hit"] / hit["tokens.queried"])
    loaded = sum(c["copy.bytes"] for c in expected.copies
                 if c["trace"] == hit["trace"] and c["copy.direction"] == "load")
    assert shown["Loaded from host"] == formatting.data_size(loaded)
    assert not any("device prefix cache" in c.value for c in at.caption)
    assert "**Copies per KV group**" in [m.value for m in at.markdown]
    assert {"scanned", "null_skipped", "pending", "start_index"} <= set(at.dataframe[2].value.columns)
    assert at.dataframe[2].proto.placeholder == "unknown"  # a group's copy on no worker: its time is unknown
    at.text_input(key="request_search").input("r1-00").run()  # round 1: a store only
    assert_ok(at)
    assert [c.value for c in at.caption if c.value in ("load 1", "store 1")] == ["store 1"]
    assert not {"scanned", "null_skipped", "pending", "start_index"} & set(at.dataframe[2].value.columns)


def _attribute(sp: dict, key: str, value: dict) -> dict:
    sp["attributes"] = [a for a in sp["attributes"] if a["key"] != key] + [{"key": key, "value": value}]
    return sp


def test_a_requests_view_explains_its_device_hits_an_unknown_miss_reason_and_a_copy_started_early(
        monkeypatch, tmp_path):
    """Its copy starts 0.5 ms before its load (within the 1 ms allowed): no negative wait before the first copy."""
    t, ms, trace = 1_700_000_000_000_000_000, 1_000_000, "ab" * 16
    path = tmp_path / "t.jsonl"
    path.write_text(line(
        _attribute(lookup("r", 100, 64, trace=trace, span_id="01" * 8, start=t), "kvscope.miss.reason",
                   {"stringValue": "a-later-reason"}),
        _attribute(load("r", trace=trace, span_id="02" * 8, parent="01" * 8, start=t + ms), "kvscope.tokens.local",
                   {"intValue": "32"}),
        copy("load", 4096, "r", trace=trace, span_id="03" * 8, parent="02" * 8, start=t + ms // 2, end=t + 3 * ms),
    ) + "\n")
    at = app(monkeypatch, path)
    at.switch_page("views/request_explorer.py").run()
    assert_ok(at)
    captions = [c.value for c in at.caption]
    assert any(c.startswith("Load time: 2.50 ms copying") and "and 0.00 ms before the first copy" in c
               for c in captions), captions
    assert any(c.startswith("vLLM's device prefix cache had its first 32 tokens") for c in captions), captions
    assert [i.value for i in at.info] == ["Why the host tier served no more (`a-later-reason`): a reason this "
                                          "version of the app does not know."]


def test_a_requests_view_says_its_load_failed_or_that_no_copy_joined_it(monkeypatch, tmp_path):
    path = tmp_path / "failed.jsonl"
    path.write_text(_failed_load_trace())
    at = app(monkeypatch, path)
    at.switch_page("views/request_explorer.py").run()
    at.text_input(key="request_search").input("r-failed").run()
    assert not at.exception
    assert [e.value for e in at.error] == ["A load of this request failed on a worker (copy span with status "
                                           "ERROR): vLLM recomputed its tokens instead. "
                                           + traces.LOAD_FAILED_DEFINITION]
    at.text_input(key="request_search").input("r-miss").run()
    assert_ok(at)
    assert "No copy spans joined this request's loads or stores." in [c.value for c in at.caption]
    assert not at.warning  # no load, so no load without a copy span


def test_a_requests_view_shows_the_vllm_times_its_span_has_and_not_the_others(monkeypatch, tmp_path):
    """A vLLM span without the prefill time (a vLLM that does not record it) still shows the other times."""
    collector = vllm_spans_of(TWO_ROUNDS, {"cmpl-r2-05": 0.25}, tmp_path / "vllm.jsonl")
    collector.write_text(collector.read_text().replace("gen_ai.latency.time_in_model_prefill", "other.attribute"))
    at = app(monkeypatch, TWO_ROUNDS, collector)
    at.switch_page("views/request_explorer.py").run()
    at.text_input(key="request_search").input("r2-05").run()
    assert_ok(at)
    shown = metrics(at)
    assert (shown["Time to first token (vLLM)"], shown["Prefill (vLLM)"]) == ("250.00 ms", "–")


def test_requests_page_counts_its_rows_and_shows_when_each_arrived(monkeypatch, expected):
    """A search that finds nothing shows no request (and raises nothing)."""
    from datetime import datetime, timezone

    at = app(monkeypatch, TWO_ROUNDS)
    at.switch_page("views/request_explorer.py").run()
    assert_ok(at)
    assert at.caption[0].value == "20 of 20 requests. Select a row to see its spans."
    assert "engine" not in at.dataframe[0].proto.column_order  # one engine
    # a file from before kvscope recorded deferrals: no empty deferral columns
    assert not {"deferred_lookups", "deferred_wait_ms"} & set(at.dataframe[0].proto.column_order)
    first = datetime.fromtimestamp(expected.lookups[0]["start"] / 1e9, timezone.utc)
    assert at.caption[1].value.startswith(f"trace `{expected.lookups[0]['trace']}` · arrived at "
                                          f"{first:%Y-%m-%d %H:%M:%S.%f} UTC")
    at.text_input(key="request_search").input("cmpl-r2-03").run()
    assert at.caption[0].value == "1 of 20 requests. Select a row to see its spans."
    at.text_input(key="request_search").input("no such request").run()
    assert_ok(at)
    assert at.caption[0].value == "0 of 20 requests. Select a row to see its spans."
    assert [h.value for h in at.subheader] == ["Trace files"] and len(at.dataframe) == 1  # the sidebar's


def test_live_page_takes_its_url_from_the_environment_and_shows_the_last_hour_in_milliseconds(
        monkeypatch, fake_prometheus):
    """KVSCOPE_PROMETHEUS_URL fills the URL in; the latency chart is drawn in ms (Prometheus answers seconds), and
    the queries asked are shown."""
    from dashboard import charts, prometheus

    asked, drawn = [], []
    fetch_live, live_series = prometheus.fetch_live, charts.live_series
    monkeypatch.setattr(prometheus, "fetch_live", lambda url, range_s, now: asked.append(range_s) or fetch_live(
        url, range_s, now=now))
    monkeypatch.setattr(charts, "live_series", lambda frame, *a: drawn.append(frame) or live_series(frame, *a))
    at = app(monkeypatch)
    monkeypatch.setenv("KVSCOPE_PROMETHEUS_URL", fake_prometheus)
    at.switch_page("views/live.py").run()
    assert_ok(at)
    assert at.text_input(key="live_url").value == fake_prometheus and asked == [3600]
    assert sorted(set(drawn[1]["value"])) == [2.0, 4.0, 8.0]
    live = fetch_live(fake_prometheus, 3600, now=1_700_000_000)
    assert [c.value for c in at.code] == list(live.queries.values())


def test_live_page_draws_what_prometheus_has_and_says_when_it_has_nothing(monkeypatch):
    """A blank URL asks nothing; one series empty still draws the other; both empty say why there may be none."""
    from dashboard import prometheus

    empty = prometheus.matrix_to_frame([], "hit rate")
    latency = prometheus.matrix_to_frame([{"metric": {}, "values": [[1_700_000_000, "0.002"]]}], "p50")
    answers = [prometheus.LiveData(empty, latency, {"p50": "q"}), prometheus.LiveData(empty, empty, {"p50": "q"})]
    monkeypatch.setattr(prometheus, "fetch_live", lambda *a, **k: answers.pop(0))
    at = app(monkeypatch)
    at.switch_page("views/live.py").run()
    at.text_input(key="live_url").input("   ").run()
    assert_ok(at)
    assert [i.value for i in at.info] == ["Enter the URL of a Prometheus server to query it."] and len(answers) == 2
    at.text_input(key="live_url").input("http://prometheus:9090").run()
    assert_ok(at)
    assert not at.info and len(at.get("vega_lite_chart")) == 2
    assert metrics(at)["Load-to-report time p50 (latest)"] == "2.00 ms"
    at.text_input(key="live_url").input("http://prometheus:9091").run()
    assert_ok(at)
    assert at.info[0].value.startswith("Prometheus answered, but has no kvscope samples in this range")
    assert not at.get("vega_lite_chart")


def test_replay_stays_at_the_last_request_and_plays_again_from_the_start(monkeypatch, expected):
    """Step at the last request stays there; Play there starts over at the first. Stored bytes are the stores'."""
    at = app(monkeypatch, TWO_ROUNDS)
    at.switch_page("views/replay.py").run()
    assert at.select_slider(key="replay_speed").value == 0.5
    assert at.subheader[0].value == f"Request `{expected.lookups[0]['request.id']}` at 0.000 s"
    at.slider(key="replay_step").set_value(20).run()
    next(b for b in at.button if b.label == "Step").click().run()
    assert_ok(at)
    shown = metrics(at)
    assert shown["Request"] == "20 of 20"
    assert number(shown["Stored to host so far"]) * 1e6 == pytest.approx(expected.bytes["store"], rel=5e-3)
    arrival_s = (expected.lookups[19]["start"] - expected.lookups[0]["start"]) / 1e9
    assert at.subheader[0].value.endswith(f" at {arrival_s:.3f} s")
    next(b for b in at.button if b.label == "Play").click().run()
    assert_ok(at)
    assert at.session_state["replay_playing"] and metrics(at)["Request"] == "2 of 20"


def test_replay_of_two_requests_has_a_slider_and_of_one_none(monkeypatch, tmp_path):
    """A slider from 1 to 1 is not a slider Streamlit draws."""
    t = 1_700_000_000_000_000_000
    two = tmp_path / "two.jsonl"
    two.write_text(line(lookup("r1", span_id="11" * 8, start=t), lookup("r2", span_id="22" * 8, start=t + 10)) + "\n")
    at = app(monkeypatch, two)
    at.switch_page("views/replay.py").run()
    assert_ok(at)
    assert [s.key for s in at.slider] == ["replay_step"]
    one = tmp_path / "one.jsonl"
    one.write_text(line(lookup("r1", span_id="11" * 8, start=t)) + "\n")
    at = app(monkeypatch, one)
    at.switch_page("views/replay.py").run()
    assert_ok(at)
    assert not at.slider and metrics(at)["Request"] == "1 of 1"


def test_overview_counts_loads_without_copies_among_all_its_loads_and_says_when_no_copy_was_read(monkeypatch, tmp_path):
    from .test_resumed_loads import _two_loads

    resumed = tmp_path / "resumed.jsonl"  # a request resumed after preemption: its second load has no copy span
    resumed.write_text(line(*_two_loads("uncopied", None)) + "\n")
    at = app(monkeypatch, resumed)
    assert not at.exception
    assert at.warning[0].value.startswith("1 of 2 loads have no copy spans")
    scheduler_only = tmp_path / "scheduler-only.jsonl"
    scheduler_only.write_text(line(lookup("r1", span_id="11" * 8), load("r1", span_id="22" * 8, parent="11" * 8),
                                   store("r1", span_id="33" * 8)) + "\n")
    at = app(monkeypatch, scheduler_only)
    assert not at.exception
    assert "No kvscope.group.copy spans in these traces." in [i.value for i in at.info]
    assert ("1 of 1 stores have no copy spans: worker trace file missing or cut short, or their copies in another "
            "trace? Their bytes are in no total.") in [w.value for w in at.warning]
    assert metrics(at)["Stored to host"] == "–"


def test_overview_says_why_it_draws_no_load_latency_chart(monkeypatch, tmp_path):
    """Lookups that hit nothing: an empty chart would read as a broken one."""
    misses = tmp_path / "misses.jsonl"
    misses.write_text(line(lookup("r1", span_id="11" * 8), lookup("r2", span_id="22" * 8)) + "\n")
    at = app(monkeypatch, misses)
    assert_ok(at)
    assert "No loads in these traces: the host tier served no request." in [i.value for i in at.info]
    uncopied = tmp_path / "uncopied.jsonl"
    uncopied.write_text(line(lookup("r1", span_id="11" * 8), load("r1", span_id="22" * 8, parent="11" * 8)) + "\n")
    at = app(monkeypatch, uncopied)
    assert_ok(at)
    no_time = ("None of the 1 loads in these traces has a time: they failed (vLLM recomputed them), or their copy "
               "spans are not in these traces (see Load time in the Definitions).")
    assert [i.value for i in at.info].count(no_time) == 2  # the latency chart's place and the slowest loads'
    assert "slowest_loads" not in [d.key for d in at.dataframe]
    assert len(at.get("vega_lite_chart")) == 1  # hit rate over time only: no latency chart, no copies


def test_overview_load_time_quantiles_are_each_their_own(monkeypatch, tmp_path):
    """21 loads of 1 to 21 ms: nearest-rank p50, p95 and p99 are 11, 20 and 21 ms (with 20 loads or fewer p95 and
    p99 are the same load). The Definitions list the definitions, and the hit rate chart's buckets are 50 ms wide
    for 2.7 s of requests."""
    t, ms, spans = 1_700_000_000_000_000_000, 1_000_000, []
    for k in range(1, 22):
        trace, start = f"{k:032x}", t + 100 * k * ms
        spans += [lookup(f"r{k}", trace=trace, span_id=f"{k:08x}00000001", start=start),
                  load(f"r{k}", trace=trace, span_id=f"{k:08x}00000002", parent=f"{k:08x}00000001", start=start + ms),
                  copy("load", 4096, f"r{k}", trace=trace, span_id=f"{k:08x}00000003", parent=f"{k:08x}00000002",
                       start=start + ms, end=start + ms + k * ms)]
    path = tmp_path / "t.jsonl"
    path.write_text(line(*spans) + "\n")
    at = app(monkeypatch, path)
    assert_ok(at)
    shown = metrics(at)
    assert [shown[f"Load time {p}"] for p in ("p50", "p95", "p99")] == ["11.00 ms", "20.00 ms", "21.00 ms"]
    assert f"- {traces.HIT_RATE_DEFINITION}" in [m.value for m in at.markdown]
    at = app(monkeypatch, TWO_ROUNDS)
    assert "bucket start (s), 0.05 s wide" in at.get("vega_lite_chart")[0].proto.spec


def test_a_slowest_load_of_a_repeated_request_id_opens_that_request(monkeypatch, tmp_path):
    """Two runs with the same request ids: the request opened is the one selected (its trace), searched by its id,
    its trace's id in the selection."""
    at = app(monkeypatch, TWO_ROUNDS, _rerun_of(TWO_ROUNDS, tmp_path))
    slowest = at.dataframe[-1].value.iloc[1]
    at.session_state["slowest_loads"] = {"selection": {"rows": [1]}}
    at.run()
    assert_ok(at)
    assert at.text_input(key="request_search").value == "cmpl-r2-06"
    assert at.subheader[0].value == f"Request `{slowest['request']}`"
    assert not any("first row is shown" in c.value for c in at.caption)


def test_a_trace_of_one_engine_shows_no_engine_table_or_filter(monkeypatch, tmp_path):
    """The spans name engine 0 (an engine that records it, without data parallelism): nothing to compare or pick."""
    t = 1_700_000_000_000_000_000
    path = tmp_path / "one-engine.jsonl"
    path.write_text(engine_line({"intValue": "0"}, lookup("r-a", 100, 64, trace="aa" * 16, span_id="a1" * 8, start=t),
                                lookup("r-b", 100, 0, trace="bb" * 16, span_id="b1" * 8, start=t + 10)) + "\n")
    at = app(monkeypatch, path)
    assert_ok(at)
    assert "By engine" not in [h.value for h in at.subheader]
    at.switch_page("views/request_explorer.py").run()
    assert_ok(at)
    assert not at.selectbox and "engine" not in at.dataframe[0].proto.column_order
    at.switch_page("views/replay.py").run()
    assert_ok(at)
    assert not at.selectbox
