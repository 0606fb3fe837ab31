"""End to end on the vLLM CPU engine with kvscope: loading a prompt's KV from the host tier vs
recomputing it, and generate throughput with telemetry off vs on.

    python -m bench.e2e_bench [--quick]

Model: `tiny_models.build_model("big-llama")` (random weights, 8 layers, hidden 1024), run in
float32: this benchmark should be dominated by prefill compute, and on CPUs without native
bf16 matmuls (no AVX512_BF16/AMX) vLLM's bf16 path is several times slower than fp32, which
would only stretch the run. Each engine lives in its own process (vLLM keeps per-process
globals), with the engine core in-process there, driven over stdin/stdout by this module.

Prefill: per prompt length, pairs of (recompute, host load) in one engine: a fresh random
prompt, the device prefix cache reset, generated with max_tokens=1 (the wall time is the time
to first token; nothing in the device cache, nothing in the host tier: a full recompute, which
also stores the prompt to the host tier); the device prefix cache reset again; the same prompt
again (its full blocks now come from the host tier; the last, partial block is recomputed as
vLLM always recomputes at least one token). A fresh engine's first loads and recomputes run
several times slower, so a few warm-up pairs, and one more per length, are discarded. Reported:
median seconds of each side, prefill throughput (prompt tokens / time to first token), and the
median of the per-pair ratios load / recompute.

Telemetry: two engines with kvscope, identical but for telemetry (off; on = trace file, sample
ratio 1.0), alive at the same time in two processes: one process cannot hold both configs, so
the same workload runs alternately on one and the other (ABBA order, warm-ups discarded) and the
per-run throughputs are compared: median of each side and the median of the ratios of adjacent
runs. Two processes can differ by a few percent for reasons of their own (memory placement,
warm-up), so as a control the `on` engine also runs the workload alternately with its tracer
swapped for a disabled one and back (`set_tracing`: what the connector does with tracing off)
and that same-process ratio is reported too; and, as an A/A control, the two processes run the
workload alternately with neither tracing (`process_control`, engine b / engine a): how far two
identically behaving processes differ here, which the two-engine ratio cannot resolve below. Workload per run: device prefix cache reset, 8 requests
sharing 2 stored 1024-token prefixes (loaded from the host tier) with fresh 128-token suffixes
(computed, then stored), generating `max_tokens` greedy tokens each; throughput = generated
tokens per second of wall time, and per CPU second of the engine process (all its threads, the
span exporter's included): on a machine shared with other work, CPU time is far less noisy than
wall time, and tracing overhead is CPU work.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

MODEL = "big-llama"
DTYPE = "float32"
MAX_MODEL_LEN = 8192  # the model's max_position_embeddings
DEVICE_BLOCK = 128  # the CPU backend's block size: the offload block size too
CPU_BYTES = 1 << 30  # host tier per engine
MARK = "E2E_RESULT "
READY = "E2E_READY"

LENGTHS_QUICK = (1024, 2048, 4096)
LENGTHS_FULL = (1024, 2048, 4096, 8191)  # "8k": one position left for the first token
PREFIX_LEN, SUFFIX_LEN, NUM_PREFIXES, NUM_REQUESTS = 1024, 128, 2, 8


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(length)]


# ----------------------------------------------------------------------------- worker process
class _Worker:
    """One engine in this process; executes the parent's commands."""

    def __init__(self, extra: dict):
        from connector.engine_runner import engine_env, make_llm
        from connector.tiny_models import build_model

        engine_env()
        self.llm = make_llm(build_model(MODEL), extra, dtype=DTYPE, max_model_len=MAX_MODEL_LEN,
                            max_num_batched_tokens=MAX_MODEL_LEN, max_num_seqs=NUM_REQUESTS)
        self.prefixes = [_prompt(10_000 + i, PREFIX_LEN) for i in range(NUM_PREFIXES)]

    def _timed(self, prompts: list[list[int]], max_tokens: int):
        from connector.engine_runner import generate

        t0, c0 = time.perf_counter(), time.process_time()
        outs = generate(self.llm, prompts, max_tokens=max_tokens)
        self.last_cpu_s = time.process_time() - c0  # every thread of this process
        return time.perf_counter() - t0, outs

    def _reset_device_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("device prefix cache reset failed")

    def prefill_pair(self, tokens: int, seed: int) -> dict:
        prompt = _prompt(seed, tokens)
        self._reset_device_cache()
        cold_s, cold = self._timed([prompt], 1)
        cold_cpu_s = self.last_cpu_s
        self._reset_device_cache()
        load_s, loaded = self._timed([prompt], 1)
        return {"recompute_s": cold_s, "load_s": load_s, "recompute_cpu_s": cold_cpu_s,
                "load_cpu_s": self.last_cpu_s, "recompute_cached": cold[0].num_cached_tokens,
                "load_cached": loaded[0].num_cached_tokens, "same_output": cold[0].tokens == loaded[0].tokens}

    def workload(self, seed: int, max_tokens: int) -> dict:
        rng = random.Random(seed)
        prompts = [self.prefixes[i % NUM_PREFIXES] + [rng.randrange(1, 500) for _ in range(SUFFIX_LEN)]
                   for i in range(NUM_REQUESTS)]
        self._reset_device_cache()
        seconds, outs = self._timed(prompts, max_tokens)
        generated = sum(len(o.tokens) for o in outs)
        return {"seconds": seconds, "cpu_seconds": self.last_cpu_s, "generated": generated,
                "cached": sum(o.num_cached_tokens for o in outs)}

    def set_tracing(self, enabled: bool) -> dict:
        """Switch the connector's tracing off (a disabled tracer) or back to the configured one."""
        from connector.engine_runner import get_scheduler_connector, get_worker_connector
        from connector.telemetry.tracing import KVScopeTracing

        sched, worker = get_scheduler_connector(self.llm), get_worker_connector()
        if not hasattr(self, "_configured"):
            self._configured = (sched.tracing, worker.tracing)
        sched_tracing, worker_tracing = self._configured if enabled else (KVScopeTracing.disabled(),) * 2
        sched.tracing = sched._scheduler.tracing = sched_tracing
        worker.tracing = worker._worker.tracing = worker_tracing
        return {"enabled": sched_tracing.enabled}

    def finish(self) -> dict:
        from connector.engine_runner import get_scheduler_connector, get_worker_connector

        get_scheduler_connector(self.llm).tracing.force_flush()
        get_worker_connector().tracing.force_flush()
        return {}


def worker_main(spec_json: str) -> int:
    worker = _Worker(json.loads(spec_json))
    print(READY, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        result = worker.finish() if op == "quit" else getattr(worker, op)(**cmd)
        print(MARK + json.dumps(result), flush=True)
        if op == "quit":
            break
    return 0


# ----------------------------------------------------------------------------- parent side
class EngineProcess:
    def __init__(self, name: str, extra: dict, log_dir: str):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.e2e_bench", "--worker", json.dumps(extra)],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            text=True, bufsize=1,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK) or line.startswith(READY):
                self._lines.put(line.rstrip("\n"))
            else:
                self._log.write(line)
        self._lines.put(None)

    def _expect(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.name} engine: no answer in {timeout:.0f} s (log: {self.log_path})")
            if line is None:
                raise RuntimeError(f"{self.name} engine exited (rc={self.proc.wait()}); "
                                   f"log tail:\n{_tail(self.log_path)}")
            if line.startswith(prefix):
                return line[len(prefix):]

    def wait_ready(self, timeout: float = 600) -> None:
        self._expect(READY, timeout)

    def call(self, op: str, timeout: float = 600, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect(MARK, timeout))

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("quit", timeout=120)
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        finally:
            self._log.close()


def _tail(path: str, n: int = 4000) -> str:
    try:
        return Path(path).read_text()[-n:]
    except OSError:
        return ""


def _settle() -> None:
    time.sleep(0.3)  # let the other engine's OpenMP threads stop spinning


def _iqr(values: list[float]) -> tuple[float, float]:
    if len(values) < 4:
        return min(values), max(values)
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def warm_up(engine: EngineProcess, pairs: int, tokens: int, log=print) -> None:
    """The first loads and recomputes of a fresh engine run several times slower: discard some."""
    t0 = time.perf_counter()
    for p in range(pairs):
        engine.call("prefill_pair", tokens=tokens, seed=7_000_000 + p)
    log(f"  {engine.name}: {pairs} warm-up pairs of {tokens} tokens in {time.perf_counter() - t0:.0f} s")


def measure_prefill(engine: EngineProcess, lengths, pairs: int, log=print) -> dict[int, dict]:
    out = {}
    for tokens in lengths:
        rows = []
        for p in range(pairs + 1):  # the first pair warms up this prompt length
            _settle()
            row = engine.call("prefill_pair", tokens=tokens, seed=tokens * 1000 + p)
            expected = (tokens - 1) // DEVICE_BLOCK * DEVICE_BLOCK
            if row["recompute_cached"] != 0 or row["load_cached"] != expected:
                raise AssertionError(f"{tokens} tokens: cached {row['recompute_cached']} cold, "
                                     f"{row['load_cached']} loaded; expected 0 and {expected}")
            if p:
                rows.append(row)
        ratios = [r["load_s"] / r["recompute_s"] for r in rows]
        out[tokens] = {
            "recompute_s": statistics.median(r["recompute_s"] for r in rows),
            "load_s": statistics.median(r["load_s"] for r in rows),
            "ratio": statistics.median(ratios),
            "ratio_iqr": _iqr(ratios),
            "recompute_cpu_s": statistics.median(r["recompute_cpu_s"] for r in rows),
            "load_cpu_s": statistics.median(r["load_cpu_s"] for r in rows),
            "cpu_ratio": statistics.median(r["load_cpu_s"] / r["recompute_cpu_s"] for r in rows),
            "loaded_tokens": rows[0]["load_cached"],
            "same_output": all(r["same_output"] for r in rows),
            "pairs": len(rows),
        }
        o = out[tokens]
        log(f"  prefill {tokens:5d} tokens: recompute {o['recompute_s']:.3f} s, host load {o['load_s']:.3f} s, "
            f"load/recompute {o['ratio']:.3f} (CPU time {o['cpu_ratio']:.3f})")
    return out


def _alternate(sides: dict, runs: int, max_tokens: int, label: str) -> dict[str, dict[str, list[float]]]:
    """Run the workload `runs` times on each of two sides, alternately (ABBA); tokens/s per run."""
    (a, run_a), (b, run_b) = sides.items()
    samples: dict[str, dict[str, list[float]]] = {"wall": {a: [], b: []}, "cpu": {a: [], b: []}}
    for r in range(runs):
        for name, fn in ((a, run_a), (b, run_b)) if r % 2 == 0 else ((b, run_b), (a, run_a)):
            _settle()
            row = fn(seed=1 + r, max_tokens=max_tokens)
            if row["cached"] < NUM_REQUESTS * PREFIX_LEN:
                raise AssertionError(f"{label} {name}: only {row['cached']} tokens came from the host tier")
            samples["wall"][name].append(row["generated"] / row["seconds"])
            samples["cpu"][name].append(row["generated"] / row["cpu_seconds"])
    return samples


def _summary(samples: dict, off: str, on: str) -> dict:
    out: dict = {"runs": len(samples["wall"][off]), "samples": samples}
    for clock, prefix in (("wall", ""), ("cpu", "cpu_")):
        ratios = [y / x for x, y in zip(samples[clock][off], samples[clock][on])]
        out[f"off_{prefix}tps"] = statistics.median(samples[clock][off])
        out[f"on_{prefix}tps"] = statistics.median(samples[clock][on])
        out[f"{prefix}ratio"] = statistics.median(ratios)
        out[f"{prefix}ratio_iqr"] = _iqr(ratios)
    return out


def _log_summary(log, label: str, t: dict) -> None:
    log(f"  {label}: off {t['off_tps']:.1f} tok/s, on {t['on_tps']:.1f} tok/s, on/off {t['ratio']:.3f} "
        f"(IQR {t['ratio_iqr'][0]:.2f}..{t['ratio_iqr'][1]:.2f}); per CPU second: on/off {t['cpu_ratio']:.3f} "
        f"(IQR {t['cpu_ratio_iqr'][0]:.2f}..{t['cpu_ratio_iqr'][1]:.2f})")


def measure_telemetry(off: EngineProcess, on: EngineProcess, runs: int, max_tokens: int, warmups: int = 2,
                      log=print) -> dict:
    """Two engines, one per config (as configured in production); then, as a control free of
    differences between processes, tracing switched off and on at run time in the `on` engine."""
    for w in range(warmups):  # the first stores the shared prefixes; all discarded
        for engine in (off, on):
            engine.call("workload", seed=-1 - w, max_tokens=max_tokens)
    two = _summary(_alternate({"off": lambda **kw: off.call("workload", **kw),
                               "on": lambda **kw: on.call("workload", **kw)}, runs, max_tokens,
                              "telemetry"), "off", "on")
    _log_summary(log, "generate throughput, two engines", two)

    def toggled(enabled: bool):
        def run(**kw):
            on.call("set_tracing", enabled=enabled)
            return on.call("workload", **kw)
        return run

    one = _summary(_alternate({"off": toggled(False), "on": toggled(True)}, runs, max_tokens,
                              "telemetry toggle"), "off", "on")
    _log_summary(log, "generate throughput, one engine, tracing toggled", one)
    # An A/A control for the two-engine figure: the same two processes, neither tracing. What it
    # shows is the difference between the processes themselves, not telemetry.
    same = _summary(_alternate({"off": lambda **kw: off.call("workload", **kw), "on": toggled(False)}, runs,
                               max_tokens, "process control"), "off", "on")
    on.call("set_tracing", enabled=True)
    _log_summary(log, "generate throughput, two engines, neither tracing (process control)", same)
    return {**two, "toggled": one, "process_control": same}


def measure_all(quick: bool, log=print) -> dict:
    from connector.tiny_models import build_model

    build_model(MODEL)  # once, before two processes race to build it
    lengths = LENGTHS_QUICK if quick else LENGTHS_FULL
    pairs = 3 if quick else 5
    runs = 4 if quick else 12
    warmups = 2 if quick else 3
    max_tokens = 16 if quick else 32
    with tempfile.TemporaryDirectory(prefix="kvscope-e2e-bench-") as tmp:
        trace_file = os.path.join(tmp, "trace.jsonl")
        engines = [
            EngineProcess("telemetry-off", {"cpu_bytes": CPU_BYTES}, tmp),
            EngineProcess("telemetry-on", {"cpu_bytes": CPU_BYTES, "trace_file": trace_file,
                                           "trace_sample_ratio": 1.0}, tmp),
        ]
        try:
            t0 = time.perf_counter()
            for engine in engines:
                engine.wait_ready()
            log(f"  two engines started in {time.perf_counter() - t0:.0f} s")
            warm_up(engines[0], warmups, lengths[0], log)
            prefill = measure_prefill(engines[0], lengths, pairs, log)
            warm_up(engines[1], warmups, lengths[0], log)
            telemetry = measure_telemetry(engines[0], engines[1], runs, max_tokens, log=log)
        finally:
            for engine in engines:
                engine.close()
        telemetry["trace_spans"] = count_spans(trace_file)
        log(f"  telemetry on: {telemetry['trace_spans']} spans written for "
            f"{(2 + 2 * runs) * NUM_REQUESTS} traced workload requests and {2 * warmups} "
            f"warm-up prefill requests")
    return {"prefill": prefill, "telemetry": telemetry, "max_tokens": max_tokens}


def count_spans(path: str) -> int:
    """Spans in an OTLP/JSON lines trace file (0 when there is none)."""
    if not os.path.exists(path):
        return 0
    n = 0
    with open(path) as f:
        for line in f:
            if line.strip():
                doc = json.loads(line)
                n += sum(len(scope.get("spans", ())) for rs in doc.get("resourceSpans", ())
                         for scope in rs.get("scopeSpans", ()))
    return n


def _k(tokens: int) -> str:
    return f"{round(tokens / 1024)}k"


def to_records(result: dict) -> list[dict]:
    records = []
    for tokens, row in result["prefill"].items():
        k = _k(int(tokens))
        ref = f"e2e.ttft.recompute[{k}]"
        records.append({"name": ref, "median": row["recompute_s"], "unit": "s", "ratio": None, "ratio_of": None})
        records.append({"name": f"e2e.ttft.host_load[{k}]", "median": row["load_s"], "unit": "s",
                        "ratio": row["ratio"], "ratio_of": ref})
        ref_tps = f"e2e.prefill_tps.recompute[{k}]"
        records.append({"name": ref_tps, "median": int(tokens) / row["recompute_s"], "unit": "tok/s",
                        "ratio": None, "ratio_of": None})
        records.append({"name": f"e2e.prefill_tps.host_load[{k}]", "median": int(tokens) / row["load_s"],
                        "unit": "tok/s", "ratio": 1 / row["ratio"], "ratio_of": ref_tps})
    t = result["telemetry"]
    # (source, record tag, names of its two sides); the second side's ratio is to the first
    sources = [(t, "telemetry", ("off", "on")), (t["toggled"], "tracing_toggled", ("off", "on"))]
    if "process_control" in t:
        sources.append((t["process_control"], "process_control", ("engine_a", "engine_b")))
    for source, tag, (first, second) in sources:
        for kind, unit, suffix in (("generate_tps", "tok/s", ""), ("generate_tps_cpu", "tok/CPU-s", "cpu_")):
            ref = f"e2e.{kind}.{tag}_{first}"
            records.append({"name": ref, "median": source[f"off_{suffix}tps"], "unit": unit, "ratio": None,
                            "ratio_of": None})
            records.append({"name": f"e2e.{kind}.{tag}_{second}", "median": source[f"on_{suffix}tps"],
                            "unit": unit, "ratio": source[f"{suffix}ratio"], "ratio_of": ref})
    return records


def run(quick: bool = False, log=print) -> list[dict]:
    return to_records(measure_all(quick, log))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer lengths, pairs and runs")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: engine process
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker)
    result = measure_all(args.quick)
    print(json.dumps(result["prefill"], indent=1))
    print(json.dumps(result["telemetry"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
