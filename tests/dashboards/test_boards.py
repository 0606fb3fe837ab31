"""The generated boards: current with their code, and built to the shared conventions."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from .paths import DASHBOARDS_DIR, GRAFANA_DIR, REPO, RULES_DIR
from .promcheck import iter_panels

BOARD_FILES = sorted(DASHBOARDS_DIR.glob("*.json"))


def _board(path):
    return json.loads(path.read_text())


def test_committed_json_is_what_the_generator_renders(build_module):
    rendered = build_module.render_all()
    assert set(rendered) == {p.name for p in BOARD_FILES}, "committed boards differ from the generated set"
    for path in BOARD_FILES:
        assert path.read_text() == rendered[path.name], (
            f"{path.name} is stale: run `python grafana/build.py` and commit the result"
        )


def test_rendering_is_deterministic_across_processes():
    """Two interpreters with different hash seeds (set and dict orders) write the same JSON."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import build; "
            "print(json.dumps(build.render_all(), sort_keys=True))")
    outputs = [
        subprocess.run([sys.executable, "-c", code, str(GRAFANA_DIR)], cwd=REPO, capture_output=True, text=True,
                       timeout=120, check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        for seed in ("1", "2")
    ]
    assert outputs[0] == outputs[1] and len(outputs[0]) > 1000


def test_build_check_cli_passes_on_committed_json():
    pytest.importorskip("grafana_foundation_sdk")
    result = subprocess.run(
        [sys.executable, str(GRAFANA_DIR / "build.py"), "--check"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_detects_a_stale_board(build_module, tmp_path):
    for path in BOARD_FILES:
        shutil.copy(path, tmp_path / path.name)
    assert build_module.stale_files(tmp_path) == []
    edited = tmp_path / BOARD_FILES[0].name
    edited.write_text(edited.read_text().replace('"title"', '"title" ', 1))
    (tmp_path / "hand-made.json").write_text("{}")
    problems = build_module.stale_files(tmp_path)
    assert len(problems) == 2
    assert edited.name in problems[0] and "hand-made.json" in problems[1]


def test_build_check_cli_fails_on_a_stale_board(build_module, monkeypatch, capsys):
    """CI runs `build.py --check`: on a stale board it must exit non-zero, or a board edited by hand
    (or code changed without regenerating) passes and Grafana shows JSON the code no longer renders."""
    monkeypatch.setattr(build_module, "stale_files", lambda: ["kvscope-overview.json: differs"])
    assert build_module.main(["--check"]) == 1
    assert "grafana/dashboards is stale" in capsys.readouterr().err


def test_json_is_sorted_and_indented():
    for path in BOARD_FILES:
        text = path.read_text()
        assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n", path.name


def test_expected_boards_exist():
    assert {"kvscope-overview.json", "kvscope-groups.json"} <= {p.name for p in BOARD_FILES}


@pytest.mark.parametrize("path", BOARD_FILES, ids=lambda p: p.name)
def test_board_conventions(path):
    board = _board(path)
    assert board["uid"] == path.stem
    assert "kvscope" in board["tags"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model_name", "instance", "engine"):  # alerts fire per instance and engine: each can be picked
        v = variables[name]
        assert v["type"] == "query"
        assert v["query"].startswith("label_values(") and v["query"].rstrip(")").endswith(name)
        assert v["includeAll"] and v["allValue"] == ".*"

    panels = [p for p in iter_panels(board["panels"]) if p["type"] != "row"]
    assert panels
    ids = [p["id"] for p in iter_panels(board["panels"])]
    assert len(ids) == len(set(ids)) and 0 not in ids, "panel ids must be unique and set"
    for panel in panels:
        title = panel["title"]
        assert len(panel.get("description", "")) >= 80, f"{title}: needs a description (what it means, what to do)"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        assert panel["targets"], f"{title}: no queries"
        for target in panel["targets"]:
            assert 'model_name=~"$model_name"' in target["expr"], f"{title}: query not filtered by model_name"
            assert 'engine=~"$engine"' in target["expr"], f"{title}: query not filtered by engine"
            assert 'instance=~"$instance"' in target["expr"], f"{title}: query not filtered by instance"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), title
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{title}: no unit"


def test_the_groups_board_never_adds_up_groups_of_different_models():
    """A group index is a cache of one model: group 1 of a sliding-window model and group 1 of a
    full-attention model differ in block size and kind. Every sum on the per-group board keeps
    model_name (with All models selected, one series per model)."""
    board = _board(next(p for p in BOARD_FILES if p.stem == "kvscope-groups"))
    sums = 0
    for panel in iter_panels(board["panels"]):
        for target in panel.get("targets", ()):
            for match in re.finditer(r"\bsum\b\s*(by\s*\(([^)]*)\))?", target["expr"]):
                sums += 1
                by = [label.strip() for label in (match.group(2) or "").split(",")]
                assert "model_name" in by, f"{panel['title']}: {match.group(0)!r} adds up models in {target['expr']!r}"
    assert sums > 10


@pytest.mark.parametrize("path", BOARD_FILES, ids=lambda p: p.name)
def test_panels_fit_the_grid_without_overlap(path):
    taken: dict[tuple[int, int], str] = {}
    for panel in iter_panels(_board(path)["panels"]):
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]


def test_overview_answers_the_questions_it_promises():
    """The overview covers each question of the issue (checked by the metrics its panels use)."""
    board = _board(DASHBOARDS_DIR / "kvscope-overview.json")
    exprs = " ".join(t["expr"] for p in iter_panels(board["panels"]) for t in p.get("targets", []))
    for needle in (
        "kvscope:hit_tokens:rate5m",  # hit rate stat (recording rules, as alerted)
        "rate(kvscope_hit_tokens_total",  # hit rate over time
        "kvscope_loaded_blocks_total",  # per-group loaded share
        "kvscope_null_blocks_skipped_total",  # null skips per group
        "histogram_quantile(0.95, sum by (le, model_name) (rate(kvscope_request_load_duration_seconds_bucket",
        "histogram_quantile(0.99, sum by (le, model_name, group, kind, direction) (rate(kvscope_copy_duration_seconds_bucket",
        "kvscope_load_bytes_total", "kvscope_store_bytes_total",
        "kvscope_host_used_bytes", "kvscope_host_capacity_bytes",
        "kvscope_evicted_blocks_total", "kvscope_load_failures_total",
        "kvscope_deferred_loads_total",  # loads waiting for device KV room
        # how long they wait, per engine
        "histogram_quantile(0.99, sum by (le, instance, model_name, engine) "
        "(rate(kvscope_load_deferral_wait_seconds_bucket",
        "kvscope_dropped_trace_records_total",  # traces that lost spans
    ):
        assert needle in exprs, needle


PERCENT, SECONDS, BYTES_PER_S = "percentunit", "s", "Bps"
# The unit of what each panel's queries compute (ratios 0..1, seconds, bytes/s, ...): Grafana prints the
# numbers in it, so a panel with another unit shows the right number as a wrong one (0.6 as "0.6%").
PANEL_UNITS = {
    "kvscope-overview": {
        "Token hit rate (5m)": PERCENT, "Token hit rate over time": PERCENT,
        "Tokens looked up and hit": "suffix: tokens/s", "Missed because evicted (5m)": PERCENT,
        "Looked-up tokens not served, by reason": "suffix: tokens/s",
        "Blocks loaded / blocks scanned, per KV group": PERCENT,
        "Null blocks skipped / blocks scanned, per KV group": PERCENT,
        "Request load latency p99 (5m)": SECONDS, "Request load latency p50 / p95 / p99": SECONDS,
        "Copy latency p50 / p99, per group and direction": SECONDS,
        "Copy throughput, per group and direction": BYTES_PER_S, "Host tier usage (fullest)": PERCENT,
        "Host tier used vs capacity": "bytes", "Evictions": "suffix: entries/s",
        "Loads deferred for device KV room": "suffix: loads/min", "Wait for device KV room p50 / p99": SECONDS,
        "Load failures in range": "short",
        "Load failures over time": "suffix: blocks/min", "Trace records dropped in range": "short",
        "Trace records dropped over time": "suffix: records/min",
    },
    "kvscope-groups": {
        "Blocks scanned, skipped and loaded": "suffix: blocks/s", "Scan duration p50 / p99": SECONDS,
        "Copy latency p50 / p99 by direction": SECONDS, "Copy throughput by direction": BYTES_PER_S,
        "Bandwidth while copying": BYTES_PER_S, "Copies per second and mean copy size": "short",
    },
}


def _panels(stem):
    return {p["title"]: p for p in iter_panels(_board(DASHBOARDS_DIR / f"{stem}.json")["panels"]) if p["type"] != "row"}


@pytest.mark.parametrize("stem", sorted(PANEL_UNITS))
def test_every_panel_shows_its_numbers_in_their_unit(stem):
    panels = _panels(stem)
    assert {title: p["fieldConfig"]["defaults"]["unit"] for title, p in panels.items()} == PANEL_UNITS[stem]


def _row_of_panels(stem):
    """Panel title -> the title of the row above it."""
    rows, row = {}, None
    for panel in iter_panels(_board(DASHBOARDS_DIR / f"{stem}.json")["panels"]):
        if panel["type"] == "row":
            row = panel["title"]
        else:
            rows[panel["title"]] = row
    return rows


def test_the_deferral_wait_sits_beside_the_deferred_loads():
    """How many loads were deferred and how long their requests waited read together: one row, side by side."""
    panels = _panels("kvscope-overview")
    count, wait = panels["Loads deferred for device KV room"], panels["Wait for device KV room p50 / p99"]
    rows = _row_of_panels("kvscope-overview")
    assert rows[count["title"]] == rows[wait["title"]] == "Device KV headroom"
    assert count["gridPos"]["y"] == wait["gridPos"]["y"]
    assert count["gridPos"]["x"] + count["gridPos"]["w"] == wait["gridPos"]["x"]
    # each line is the quantile its legend names
    assert [(t["expr"].split(",")[0], t["legendFormat"].split()[0]) for t in wait["targets"]] == [
        ("histogram_quantile(0.5", "p50"), ("histogram_quantile(0.99", "p99")]


def test_the_mean_copy_size_is_in_bytes_on_its_own_axis():
    """The copies panel mixes copies/s (query A) with bytes per load (query B): only B is in bytes."""
    (override,) = _panels("kvscope-groups")["Copies per second and mean copy size"]["fieldConfig"]["overrides"]
    assert override["matcher"] == {"id": "byFrameRefID", "options": "B"}
    assert {"id": "unit", "value": "bytes"} in override["properties"]


def test_only_the_misses_by_reason_are_stacked():
    """Missed tokens by reason add up to the looked-up tokens not served (the stack is that gap); stacking
    any other panel would add up series that do not."""
    stacked = {
        title for stem in PANEL_UNITS for title, p in _panels(stem).items()
        if (p["fieldConfig"]["defaults"].get("custom") or {}).get("stacking", {}).get("mode", "none") != "none"
    }
    assert stacked == {"Looked-up tokens not served, by reason"}


def _steps(panel):
    return [(s["value"], s["color"]) for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]


@pytest.mark.parametrize(("stat", "alert", "condition"), [
    ("Request load latency p99 (5m)", "KVScopeLoadLatencyHigh", r"kvscope:request_load_duration_seconds:p99_rate5m > "),
    ("Missed because evicted (5m)", "KVScopeHostTierTooSmall", r"kvscope:evicted_miss_ratio:rate5m > "),
])
def test_a_stat_turns_red_where_its_alert_fires(stat, alert, condition):
    """The load p99 stat's description and the README say red is KVScopeLoadLatencyHigh's threshold; the
    evicted share was orange while KVScopeHostTierTooSmall fired (red at 0.2, the alert at 0.1)."""
    alerts = yaml.safe_load((RULES_DIR / "kvscope-alerts.yaml").read_text())["groups"][0]["rules"]
    (expr,) = [a["expr"] for a in alerts if a.get("alert") == alert]
    threshold = float(re.match(condition + r"([0-9.]+)", expr.strip())[1])
    assert _steps(_panels("kvscope-overview")[stat])[-1] == (threshold, "red")


# Every stat's colours, as the panel descriptions and the README explain them: a hit rate under 20% is
# poor, over 50% good; evicted misses above a few percent mean a tier too small (red at its alert's
# threshold); the load p99 is red at its alert's threshold; load failures and dropped records should be 0,
# so one is already a colour; a full host tier is the LRU's steady state, so its usage has one colour.
STAT_STEPS = {
    "Token hit rate (5m)": [(None, "red"), (0.2, "orange"), (0.5, "green")],
    "Missed because evicted (5m)": [(None, "green"), (0.05, "orange"), (0.1, "red")],
    "Request load latency p99 (5m)": [(None, "green"), (0.25, "orange"), (0.5, "red")],
    "Host tier usage (fullest)": [(None, "blue")],
    "Load failures in range": [(None, "green"), (1, "red")],
    "Trace records dropped in range": [(None, "green"), (1, "orange")],
}


def test_every_stat_changes_colour_where_its_description_says():
    stats = {title: p for title, p in _panels("kvscope-overview").items() if p["type"] == "stat"}
    assert {title: _steps(p) for title, p in stats.items()} == STAT_STEPS


def test_every_stat_reads_its_value_now():
    """A range query's last value outlived a stopped engine for the board's whole time range (the review's hit
    rate of 0.38, minutes after the traffic ended): every stat is one instant query, without a sparkline."""
    stats = [p for p in _panels("kvscope-overview").values() if p["type"] == "stat"]
    assert len(stats) == len(STAT_STEPS)
    for panel in stats:
        assert [(t.get("instant"), t.get("range")) for t in panel["targets"]] == [(True, False)], panel["title"]
        assert panel["options"]["graphMode"] == "none", panel["title"]


def test_time_series_follow_the_zoom_and_stats_in_range_count_the_whole_range():
    """As the README says: a panel's rate is `rate(...[$__rate_interval])` (per second, smoothed over at least
    four scrapes whatever the zoom; not irate's last two samples nor a fixed window), and a count "in range" is
    `increase(...[$__range])`, over the dashboard's whole time range."""
    windows = 0
    for path in BOARD_FILES:
        for panel in iter_panels(_board(path)["panels"]):
            for target in panel.get("targets", ()):
                expr = target["expr"]
                calls = re.findall(r"\b(\w+)\(\w+\{[^{}]*\}\[([^\]]+)\]\)", expr)
                assert len(calls) == expr.count("["), f"{panel['title']}: a range selector outside rate/increase"
                for function, window in calls:
                    windows += 1
                    in_range = panel["title"].endswith(" in range")
                    expected = ("increase", "$__range") if in_range else ("rate", "$__rate_interval")
                    assert (function, window) == expected, f"{panel['title']}: {function}(...[{window}]) in {expr!r}"
    assert windows > 30
