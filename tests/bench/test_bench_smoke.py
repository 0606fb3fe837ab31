"""Smoke test of the benchmarks in a tiny configuration: they run, and their records are
well-formed with finite, positive ratios. No timing assertions (numbers are machine noise here)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from bench import copy_bench, kv_events_bench, planner_bench, planner_bytecodes, planner_vs_vllm, run_all  # noqa: E402


def _check(records: list[dict]) -> None:
    """Well-formed records (`run_all.check_records`: exact keys, finite positive medians and ratios,
    ratio_of exists; only `run_all.MAY_BE_ZERO` records may be 0), serialisable as results.json."""
    assert records
    run_all.check_records(records)
    json.dumps(records)


def test_planner_vs_vllm_tiny():
    results = planner_vs_vllm.measure_all(quick=True, sizes=(128,), groups=(1, 2), repeats=1,
                                          min_sample_s=1e-4)
    records = planner_vs_vllm.to_records(results)
    _check(records)  # the export helper's CPU may read 0 in so tiny a sample (`run_all.MAY_BE_ZERO`)
    # every kvscope side is compared on the same case with vLLM's planner; the instrumented scans
    # with the same scans uninstrumented; telemetry's cost with the uninstrumented planner
    names = {r["name"].split("[")[0] for r in records if r["ratio_of"]}
    cpu = {f"{s}_cpu" for s in planner_vs_vllm.CPU_SIDES[1:]}
    cpu |= {f"{name}_cpu" for name, side in planner_vs_vllm.TELEMETRY_SIDES.items() if side in planner_vs_vllm.CPU_SIDES}
    expected = (set(planner_vs_vllm.SIDES[1:]) | set(planner_vs_vllm.TELEMETRY_SIDES) | {"export_process_cpu"} | cpu
                | {"kvscope_lookup"})
    assert names == {f"planner_vs_vllm.{s}" for s in expected}
    by_name = {r["name"]: r for r in records}
    for r in records:
        if not r["ratio_of"]:
            continue
        side, case = r["name"].split("[")
        side = side.split(".")[1]
        if side == "export_process_cpu":  # the span export helper's CPU, not a side's time
            reference = "kvscope_bare"
            assert r["median"] >= 0
        elif side.endswith("_cpu"):  # the engine process's CPU time: against the same measure
            base = side[: -len("_cpu")]
            reference = "kvscope_bare_cpu" if base in planner_vs_vllm.TELEMETRY_SIDES else "vllm_cpu"
        elif side == "kvscope_lookup":
            reference = "vllm_lookup"
        elif side in planner_vs_vllm.TELEMETRY_SIDES:
            reference = "kvscope_bare"
            assert r["median"] == by_name[f"planner_vs_vllm.{planner_vs_vllm.TELEMETRY_SIDES[side]}[{case}"]["median"]
        else:
            reference = "kvscope_scan_bare" if side in planner_vs_vllm.SCAN_SIDES else "vllm"
        assert r["ratio_of"] == f"planner_vs_vllm.{reference}[{case}"
        assert r["ratio"] == pytest.approx(r["median"] / by_name[r["ratio_of"]]["median"])
    assert {r.pending_blocks for r in results} == {96, 160}  # 1g: 96 blocks; 2g: + 64 in the window


def test_the_floor_side_plans_the_traced_load_and_keeps_its_values():
    """`kvscope_on_floor` bounds what a per-load record costs: it must take the traced path (each
    group's scan values kept), plan the same load as the others, and make no span or carrier."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    case = planner_vs_vllm.make_case(2, 128, hash_fn)
    floor = planner_vs_vllm.KVScopeSide(case, planner_vs_vllm.FloorTracing(), planner_vs_vllm.FloorScheduler)
    floor.call(floor.prepare(1))
    assert floor.planned() == case.expected_block_ids
    assert floor.sched._pending_loads[-1].trace_carrier is None
    [(start, end, values)] = floor.tracing._kept
    req_id, local, external, groups, scans, lookup = values
    assert (local, external, groups) == (case.local, case.external, 2) and start <= end
    pending = [scan[6] for scan in scans]  # (start_ns, end_ns, *SCAN_SPAN values): blocks.pending
    assert pending == [len(ids) for ids in case.expected_block_ids]
    assert lookup[2:4] == (case.local + case.external + planner_vs_vllm.NEW_TOKENS - case.local, case.external)


def test_planner_bytecodes_counts_each_sides_own_path_and_repeats_exactly():
    results = planner_bytecodes.measure_all(quick=True, sizes=(128,), groups=(1, 2))
    records = planner_bytecodes.to_records(results)
    _check(records)
    assert {r["unit"] for r in records} == {"bytecodes"}
    assert len(records) == 2 * len(planner_bytecodes.SIDES)
    for r in results:
        n = r.per_request
        # each side runs the code it stands for: telemetry adds to the planner, tracing to that
        assert n["kvscope_bare"] < n["kvscope_off"] < n["kvscope_on_floor"] < n["kvscope_on_noexport"]
        traced_scans = ("scheduler.py", "_scan_groups_traced")
        assert traced_scans not in r.by_function["kvscope_off"]
        for side in ("kvscope_on_floor", "kvscope_on_noexport", "kvscope_on"):
            assert r.by_function[side][traced_scans] > 0
        assert ("tracing.py", "end_load") in r.by_function["kvscope_on"]
        assert ("tracing.py", "end_load") not in r.by_function["kvscope_on_floor"]  # the bound's own end_load
        extra = dict(planner_bytecodes.extra_by_function(r, "kvscope_on", top=50))
        assert extra[traced_scans] > 0
    one, two = results
    assert two.by_function["kvscope_on"][traced_scans] > one.by_function["kvscope_on"][traced_scans]
    # a count, not a time: the same path counts the same again
    again = planner_bytecodes.measure_all(quick=True, sizes=(128,), groups=(1,))[0]
    assert again.per_request["kvscope_bare"] == one.per_request["kvscope_bare"]
    assert again.by_function["kvscope_off"] == one.by_function["kvscope_off"]


def test_kv_events_bench_tiny():
    results = [kv_events_bench.measure(1024, repeats=2)]
    records = kv_events_bench.to_records(results)
    _check(records)
    assert {r["name"] for r in records} == {f"kv_events.{side}[1k tokens]" for side in kv_events_bench.SIDES}
    assert "kvscope host events" in kv_events_bench.format_table(results)


def test_planner_bench_tiny():
    # measure() asserts that plan_load and the plain reference loop build the same plan
    results = planner_bench.measure_all(quick=True, sizes=(256,), repeats=1, min_sample_s=1e-4)
    records = planner_bench.to_records(results)
    _check(records)
    assert len(records) == 2 * len(planner_bench.GROUP_MIXES)


def test_copy_bench_tiny():
    records = copy_bench.run(quick=True, pages=(16 * 1024,), counts=(1, 4), repeats=1, min_sample_s=1e-4)
    _check(records)
    assert {r["unit"] for r in records} == {"GB/s"}
    assert len(records) == 2 * 2 * 2  # 2 counts x load/store x (engine, contiguous)


def test_results_files(tmp_path, monkeypatch):
    fake = [
        {"name": "planner_vs_vllm.vllm[1g/128]", "median": 30.0, "unit": "us", "ratio": None, "ratio_of": None},
        {"name": "planner_vs_vllm.kvscope_on[1g/128]", "median": 45.0, "unit": "us", "ratio": 1.5,
         "ratio_of": "planner_vs_vllm.vllm[1g/128]"},
        {"name": "e2e.ttft.recompute[2k]", "median": 3.0, "unit": "s", "ratio": None, "ratio_of": None},
        {"name": "e2e.ttft.host_load[2k]", "median": 0.5, "unit": "s", "ratio": 0.2,
         "ratio_of": "e2e.ttft.recompute[2k]"},
    ]
    monkeypatch.setattr(run_all, "_benches", lambda quick: [("fake", lambda: fake)])
    assert run_all.main(quick=True, out_dir=tmp_path) == 0
    assert not (tmp_path / "results.json").exists()  # a quick run leaves the full run's results alone
    assert json.loads((tmp_path / "results-quick.json").read_text()) == fake
    md = (tmp_path / "results-quick.md").read_text()
    assert "| planner_vs_vllm.kvscope_on[1g/128] | 45.00 | us | 1.50 |" in md and "| no |" in md
    assert "2k: 5.0x" in md


def test_bad_records_are_refused():
    zero = {"median": 0.0, "unit": "us", "ratio": 0.0, "ratio_of": "a"}
    run_all.check_records([{"name": "a", "median": 1.0, "unit": "us", "ratio": None, "ratio_of": None},
                           {"name": "planner_vs_vllm.export_process_cpu[1g/128]", **zero}])  # may read 0
    for name in ("planner_vs_vllm.kvscope_on[1g/128]", "planner_vs_vllm.export_process_cpu_total"):
        with pytest.raises(ValueError, match="not a finite positive number"):
            run_all.check_records([{"name": "a", "median": 1.0, "unit": "us", "ratio": None, "ratio_of": None},
                                   {"name": name, **zero}])
    with pytest.raises(ValueError, match="not a finite positive number"):
        run_all.check_records([{"name": "planner_vs_vllm.export_process_cpu[1g/128]", **zero, "median": -1.0}])
    with pytest.raises(ValueError, match="ratio"):
        run_all.check_records([{"name": "a", "median": 1.0, "unit": "s", "ratio": float("nan"), "ratio_of": "a"}])
    with pytest.raises(ValueError, match="keys"):
        run_all.check_records([{"name": "a", "median": 1.0}])


def test_e2e_records_and_the_process_control_row():
    from bench import e2e_bench

    def summary(off: float, on: float) -> dict:
        samples = {"wall": {"off": [off, off], "on": [on, on]}, "cpu": {"off": [off, off], "on": [on, on]}}
        return e2e_bench._summary(samples, "off", "on")

    telemetry = {**summary(100.0, 96.0), "toggled": summary(100.0, 99.0), "process_control": summary(100.0, 97.0)}
    result = {"prefill": {"2048": {"recompute_s": 2.0, "load_s": 0.2, "ratio": 0.1}}, "telemetry": telemetry}
    records = {r["name"]: r for r in e2e_bench.to_records(result)}
    _check(list(records.values()))
    assert records["e2e.generate_tps.telemetry_on"]["ratio"] == pytest.approx(0.96)
    assert records["e2e.generate_tps.tracing_toggled_on"]["ratio"] == pytest.approx(0.99)
    control = records["e2e.generate_tps.process_control_engine_b"]
    assert control["ratio"] == pytest.approx(0.97)
    assert control["ratio_of"] == "e2e.generate_tps.process_control_engine_a"
    assert run_all.goal_of(control) is None  # a control, not a goal
    rows = run_all.goal_summary(list(records.values()))
    assert [r[1:] for r in rows if r[0].startswith("(control")] == [("b / a 0.970", "n/a")]
    corrected = [r for r in rows if "divided by the A/A control" in r[0]]
    assert [r[1:] for r in corrected] == [("0.960 / 0.970 = 0.990 (+1.0% cost)", "yes")]


def test_copy_bench_checks_the_bytes_before_timing(monkeypatch):
    """The copy bench refuses to time a copy engine that moves the wrong bytes."""
    engine = copy_bench.make_engine(16 * 1024, 8, "cpu")
    copy_bench.check_round_trip(engine, [1, 5, 6], [0, 2, 7])
    real_load = engine.load
    monkeypatch.setattr(engine, "load", lambda group, slots, subs, blocks: real_load(group, slots[::-1], subs, blocks))
    with pytest.raises(AssertionError, match="wrong bytes"):
        copy_bench.check_round_trip(engine, [1, 5, 6], [0, 2, 7])
