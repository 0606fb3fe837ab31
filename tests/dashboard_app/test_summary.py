"""`kvscope summary`: the Overview's figures in a terminal, checked against an independent reading of the fixture
traces (`Expected`), and its answers when there is nothing to summarize."""

from __future__ import annotations

import json

import pytest

from connector.cli import main
from dashboard import formatting, summary, traces

from .conftest import MALFORMED, TWO_ROUNDS, raw_spans, two_engine_copy


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["summary", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_text_tells_the_hit_rate_load_times_and_bytes_of_the_fixture(capsys, expected):
    code, out, err = _run(capsys, str(TWO_ROUNDS))
    assert code == 0 and not err
    queried = sum(s["tokens.queried"] for s in expected.lookups)
    hit = sum(s["tokens.hit"] for s in expected.lookups)
    assert out.startswith(f"{len(expected.lookups)} traced requests over ")
    assert (f"token hit rate  {formatting.percent(expected.hit_rate)} ({formatting.count(hit)} of "
            f"{formatting.count(queried)} tokens queried") in out
    p50, p95, p99 = (formatting.millis(q) for q in expected.load_quantiles)
    assert f"load time       p50 {p50}, p95 {p95}, p99 {p99} ({len(expected.loads)} timed)" in out
    assert (f"loaded {formatting.data_size(expected.bytes['load'])}, "
            f"stored {formatting.data_size(expected.bytes['store'])}") in out
    for title in ("why the host tier served no more:", "KV groups:", "load latency:", "slowest loads:"):
        assert title in out
    # the reasons' tokens are each lookup's whole shortfall, not the metric's block-by-block split: said under them
    assert out.split("why the host tier served no more:\n", 1)[1].split("\n\n", 1)[0].endswith(
        traces.MISSES_DEFINITION)
    slowest = max(expected.load_ms, key=expected.load_ms.get)
    table = out.split("slowest loads:\n", 1)[1].splitlines()
    assert slowest[:8] in table[1] and f"{expected.load_ms[slowest]:.3f}" in table[1]  # the slowest first
    assert len(table) == 1 + 5  # heading, --slowest's default of 5


def test_the_json_holds_the_same_figures_and_no_nan(capsys, expected):
    code, out, _ = _run(capsys, "--json", "--slowest", "2", str(TWO_ROUNDS))
    assert code == 0
    document = json.loads(out)  # strict JSON: NaN would not parse as a value a script could use
    numbers = document["numbers"]
    assert numbers["hit_rate"] == pytest.approx(expected.hit_rate)
    assert [numbers[f"load_p{p}_ms"] for p in (50, 95, 99)] == pytest.approx(expected.load_quantiles)
    assert (numbers["bytes_loaded"], numbers["bytes_stored"]) == (expected.bytes["load"], expected.bytes["store"])
    assert numbers["deferral_wait_p50_ms"] is None  # no request deferred: unknown, not NaN
    assert [row["load_ms"] for row in document["slowest_loads"]] == pytest.approx(
        sorted(expected.load_ms.values(), reverse=True)[:2])
    assert {row["group"] for row in document["groups"]} == {"g0 sliding_window", "g1 full_attention"}
    assert document["files"] == [str(TWO_ROUNDS)] and document["problems"] == []


def test_lines_it_could_not_read_are_named_and_the_rest_summarized(capsys):
    code, out, _ = _run(capsys, str(MALFORMED))
    assert code == 0
    assert "problem(s) while reading, everything else shown: " in out
    readable = {s["request.id"] for s in raw_spans(MALFORMED) if s["name"] == "kvscope.lookup"}
    assert out.startswith(f"{len(readable)} traced requests")


@pytest.mark.parametrize("setup, said", [
    (lambda tmp: [str(tmp / "missing.jsonl")], "no such trace file or directory"),
    (lambda tmp: [], "no trace files: give their paths"),
    (lambda tmp: [" "], "no trace files: give their paths"),  # a blank argument is none
    (lambda tmp: (tmp / "notes.txt").write_text("x") and [str(tmp)], "holds no trace files (only notes.txt"),
    (lambda tmp: (tmp / "t.jsonl").write_text('{"resourceSpans": []}\n') and [str(tmp / "t.jsonl")],
     "the trace files hold no kvscope lookup or load spans: "),
    (lambda tmp: (tmp / "t.jsonl").write_text("not json\n") and [str(tmp / "t.jsonl")],
     "hold no kvscope lookup or load spans that could be read: "),
    (lambda tmp: (tmp / "t.jsonl").write_text("not json\n") and [str(tmp / "t.jsonl")],
     "(t.jsonl line 1 (not JSON"),
])
def test_nothing_to_summarize_exits_2_saying_why(capsys, tmp_path, monkeypatch, setup, said):
    monkeypatch.delenv("KVSCOPE_TRACE_FILES", raising=False)
    code, out, err = _run(capsys, *setup(tmp_path))
    assert code == 2 and not out
    assert said in err


def test_what_each_problem_is_is_said_not_only_its_line_numbers(capsys, tmp_path):
    # the app lists every problem in a table; a terminal had only "t.jsonl lines 1, 2", the reasons in --json alone
    lines = TWO_ROUNDS.read_text().splitlines()
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([lines[0].replace('"version":"0.1.0"', '"version":"9.9"'),
                               lines[1].replace('"version":"0.1.0"', '"version":"9.9"'), "[1]", *lines[2:]]) + "\n")
    code, out, _ = _run(capsys, str(path))
    assert code == 0
    assert "t.jsonl lines 1, 2: kvscope scope version '9.9' is not supported" in out
    assert "t.jsonl line 3: expected a JSON object" in out
    (tmp_path / "all.jsonl").write_text("\n".join(line.replace('"version":"0.1.0"', '"version":"9.9"')
                                                  for line in lines[:3]) + "\n")
    code, out, err = _run(capsys, str(tmp_path / "all.jsonl"))  # nothing left to summarize: said on stderr
    assert code == 2 and not out
    assert "all.jsonl lines 1, 2, 3: kvscope scope version '9.9' is not supported" in err


def test_problem_reasons_name_each_reason_once_and_how_many_more():
    problems = [traces.Problem("/d/a.jsonl", line, f"reason {line % 7}") for line in range(1, 30)]
    problems.append(traces.Problem("/d/b.jsonl", 0, "reason 1"))
    said = traces.problem_reasons(problems)
    assert said[0] == "a.jsonl lines 1, 8, 15, 22, 29; b.jsonl: reason 1"
    assert len(said) == 6 and said[-1] == "and 2 more reason(s): --json lists every problem"


def test_the_paths_default_to_kvscope_trace_files(capsys, monkeypatch, expected):
    monkeypatch.setenv("KVSCOPE_TRACE_FILES", str(TWO_ROUNDS))
    code, out, _ = _run(capsys)
    assert code == 0 and out.startswith(f"{len(expected.lookups)} traced requests")


def test_plain_turns_numpy_and_missing_values_into_json_values():
    import numpy as np
    import pandas as pd

    assert [summary._plain(v) for v in (np.int64(3), np.float32(0.5), np.bool_(True), float("nan"), pd.NA,
                                        None, "g0")] == [3, 0.5, True, None, None, None, "g0"]


def test_spans_read_twice_count_once_and_are_no_problem(capsys, tmp_path, expected):
    """A Collector's copy beside the connector's own file: every span twice, counted once, nothing skipped."""
    copy = tmp_path / "collector-copy.jsonl"
    copy.write_text(TWO_ROUNDS.read_text())
    code, out, _ = _run(capsys, str(TWO_ROUNDS), str(copy))
    assert code == 0 and "problem(s)" not in out
    assert out.startswith(f"{len(expected.lookups)} traced requests over ") and "from 2 file(s)" in out
    _, as_json, _ = _run(capsys, "--json", str(TWO_ROUNDS), str(copy))
    document = json.loads(as_json)
    assert document["problems"] == [] and document["spans_read_twice"] == len(expected.spans)
    assert document["numbers"]["requests"] == len(expected.lookups)


def test_each_quantile_and_warning_is_told_in_its_place():
    """The fixture's p95 and p99 are one load (10 loads, nearest rank): distinct numbers here, and every warning."""
    import dataclasses

    base = summary.summarize([str(TWO_ROUNDS)], {})
    numbers = {**base.numbers, "load_p50_ms": 1.0, "load_p95_ms": 2.5, "load_p99_ms": 7.25, "requests_load_failed": 2,
               "loads_without_copies": 3, "loads": 9, "copies_without_owner": 4, "requests_deferred": 5,
               "deferral_wait_p50_ms": 12.0, "deferral_wait_max_ms": 40.0, "requests_ended_waiting": 1}
    text = summary.as_text(dataclasses.replace(base, numbers=numbers))
    assert "load time       p50 1.00 ms, p95 2.50 ms, p99 7.25 ms" in text
    assert "warning: 2 request(s) had a load that failed on a worker" in text
    assert "warning: 3 of 9 loads have no copy spans" in text
    assert "warning: 4 copy span(s) belong to no load or store" in text
    assert "warning: 5 request(s) waited for device KV room: 12.00 ms median, at most 40.00 ms; 1 ended waiting" in text
    assert "warning" not in summary.as_text(base)


def test_lookups_from_two_processes_of_one_engine_index_are_warned_of(capsys, tmp_path):
    """Two servers' files read together, each its engine 0: two host tiers, pooled in every number."""
    path = two_engine_copy(tmp_path, key="service.instance.id")
    code, out, _ = _run(capsys, "--json", str(path))
    assert code == 0 and json.loads(out)["engines_run_apart"] == {"none": 2}
    _, text, _ = _run(capsys, str(path))
    assert "warning: These files hold lookups of one engine index from several processes (no engine named: " \
           "2 processes;" in text
    _, out, _ = _run(capsys, "--json", str(TWO_ROUNDS))
    assert json.loads(out)["engines_run_apart"] == {}


def test_two_engines_get_a_table_by_engine(capsys, tmp_path):
    """Data parallelism: every other line of the fixture from engine 1."""
    dp_file = two_engine_copy(tmp_path)
    code, out, _ = _run(capsys, "--json", str(dp_file))
    rows = json.loads(out)["by_engine"]
    assert code == 0 and [r["engine"] for r in rows] == [0, 1] and sum(r["requests"] for r in rows) == 20
    _, text, _ = _run(capsys, str(dp_file))
    table = text.split("\nby engine:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert table[0].split() == ["engine", "requests", "tokens", "queried", "tokens", "hit", "hit", "rate", "failed",
                                "loads", "load", "p50", "(ms)", "load", "p95", "(ms)"]
    for row, by_engine in zip(table[1:], rows, strict=True):  # the hit rate as a percentage, as the app shows it
        assert formatting.percent(by_engine["hit_rate"]) in row.split()
    _, single, _ = _run(capsys, str(TWO_ROUNDS))
    assert "by engine" not in single  # one engine: no table
