"""`kvscope` command: demo, dashboard, summary, bench, check."""

from __future__ import annotations

import argparse
import random
import sys
import time


def _workload(num_prefixes: int, per_prefix: int, prefix_len: int, suffix_len: int, seed: int):
    rng = random.Random(seed)
    prompts = []
    for p in range(num_prefixes):
        prefix = [rng.randrange(1, 500) for _ in range(prefix_len)]
        for _ in range(per_prefix):
            prompts.append(prefix + [rng.randrange(1, 500) for _ in range(rng.randrange(1, suffix_len))])
    rng.shuffle(prompts)
    return prompts


def demo(args) -> int:
    from tqdm import tqdm

    from .engine_runner import engine_env, generate, get_scheduler_connector, make_llm, metric_values
    from .tiny_models import build_model

    extra = {"cpu_bytes": args.cpu_mib << 20}
    if args.trace_file:
        extra["trace_file"] = args.trace_file
    problem = _demo_problem(args, extra)
    if problem:  # before the model is built and loaded, in one line
        print(f"kvscope demo: {problem}", file=sys.stderr)
        return 2
    engine_env()
    layers = "full attention" if args.model == "llama" else f"sliding window {args.window} + full attention"
    print(f"kvscope demo: building a small random-weight {args.model} model ({layers}) ...", flush=True)
    model = build_model(args.model, window=args.window)
    llm = make_llm(model, extra)
    sched = get_scheduler_connector(llm)._scheduler
    prompts = _workload(args.prefixes, args.per_prefix, args.prefix_len, args.suffix_len, args.seed)
    print(f"workload: {len(prompts)} requests, {args.prefixes} shared prefixes of {args.prefix_len} "
          f"tokens, {args.rounds} rounds with a device prefix-cache reset between rounds", flush=True)
    rows = []
    reference = None
    with tqdm(total=args.rounds * len(prompts), unit="req", desc="generating") as bar:
        for round_index in range(args.rounds):
            if round_index:
                llm.reset_prefix_cache()  # device cache gone: later rounds must come from the host tier
            before = metric_values(llm)
            started = time.perf_counter()
            outs = []
            for start in range(0, len(prompts), args.batch):
                outs += generate(llm, prompts[start:start + args.batch], max_tokens=args.max_tokens)
                bar.update(min(args.batch, len(prompts) - start))
            elapsed = time.perf_counter() - started
            after = metric_values(llm)
            tokens = [o.tokens for o in outs]
            reference = reference or tokens
            d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            rows.append((round_index, d, elapsed, tokens == reference))
    print("\nround  queried  host-tier hits  device hits  hit rate  time   outputs==round 0")
    for round_index, d, elapsed, same in rows:
        queried = d.get("vllm:external_prefix_cache_queries", 0)
        ext = d.get("vllm:external_prefix_cache_hits", 0)
        local = d.get("vllm:prefix_cache_hits", 0)
        rate = ext / queried if queried else 0.0
        print(f"{round_index:5d}  {queried:7.0f}  {ext:14.0f}  {local:11.0f}  {rate:8.1%}  {elapsed:5.2f}s  {same}")
    print("\nloads per KV group (blocks loaded from the host tier / scanned / null skipped):")
    totals = _group_totals(llm)
    for layout in sched.layouts:
        key = f"{layout.index}|{layout.kind.value}"
        t = totals.get(key, {})
        print(f"  group {layout.index} {layout.kind.value:15s} loaded {t.get('loaded', 0):6.0f}  "
              f"scanned {t.get('scanned', 0):6.0f}  null skipped {t.get('null', 0):6.0f}")
    print(f"host tier: {sched.index.used_slots}/{sched.index.num_slots} slots used, "
          f"{sched.index.evicted_total} evicted")
    if args.trace_file:
        get_scheduler_connector(llm).tracing.force_flush()
        print(f"trace file: {args.trace_file} (replay: kvscope dashboard {args.trace_file}; in this terminal: "
              f"kvscope summary {args.trace_file})")
    return 0 if all(same for *_, same in rows) else 1


def _group_totals(llm) -> dict:
    from prometheus_client import REGISTRY

    names = {"kvscope_loaded_blocks_total": "loaded", "kvscope_scan_blocks_total": "scanned",
             "kvscope_null_blocks_skipped_total": "null"}
    out: dict = {}
    for metric in REGISTRY.collect():
        for s in metric.samples:
            if s.name in names:
                key = f"{s.labels.get('group')}|{s.labels.get('kind')}"
                out.setdefault(key, {})[names[s.name]] = out.get(key, {}).get(names[s.name], 0) + s.value
    return out


def dashboard(args) -> int:
    from dashboard.launch import main as launch

    streamlit_args = []
    if args.port is not None:
        streamlit_args += ["--server.port", str(args.port)]
    if args.address is not None:
        streamlit_args += ["--server.address", args.address]
    if args.headless:
        streamlit_args += ["--server.headless", "true"]
    # `--streamlit-option theme.base=dark` (argparse cannot take a separate value that starts with
    # "--") means `--theme.base=dark`, as `--streamlit-option=--theme.base=dark` does
    options = [o if o.startswith("-") else "--" + o for o in args.streamlit_option]
    return launch(args.paths, streamlit_args + options)


def summary(args) -> int:
    import importlib.util
    import os

    if importlib.util.find_spec("pandas") is None:
        print("kvscope summary: pandas is not installed; install the dashboard extra: pip install -e '.[dashboard]'",
              file=sys.stderr)
        return 1
    from dashboard.summary import as_json, as_text, summarize, why_empty

    paths = [p for p in args.paths if p.strip()]  # a blank argument (an unset shell variable) is none
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        print(f"kvscope summary: no such trace file or directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    found = summarize(paths, os.environ, slowest=args.slowest)
    if not found.has_requests:
        print(f"kvscope summary: {why_empty(found)}", file=sys.stderr)
        return 2
    sys.stdout.write(as_json(found) if args.json else as_text(found))
    return 0


def _demo_problem(args, extra: dict) -> str | None:
    """What of the demo's arguments its engine would refuse, or None."""
    from .config import ConfigError, check_host_memory, parse_config, physical_memory_bytes
    from .engine_runner import MAX_MODEL_LEN

    longest = args.prefix_len + args.suffix_len - 1 + args.max_tokens
    if longest > MAX_MODEL_LEN:
        return (f"--prefix-len {args.prefix_len} + --suffix-len {args.suffix_len} - 1 + --max-tokens "
                f"{args.max_tokens} = {longest} tokens, more than the demo engine's {MAX_MODEL_LEN}-token context")
    try:
        config = parse_config(extra)
        check_host_memory(config.cpu_bytes, 1, physical_memory_bytes())
    except ConfigError as exc:
        return str(exc).replace("kv_connector_extra_config.cpu_bytes", "--cpu-mib (cpu_bytes)").replace(
            "kv_connector_extra_config.trace_file", "--trace-file (trace_file)")
    return None


def check(args) -> int:
    """Check a --kv-transfer-config before starting vLLM with it: 0 when it passes, 2 when it does not."""
    from .config import ConfigError
    from .config_check import EngineShape, check_transfer_config, describe

    engine = EngineShape(**{name: getattr(args, name) for name in EngineShape.__dataclass_fields__})
    try:
        result = check_transfer_config(args.kv_transfer_config, engine)
    except ConfigError as exc:
        print(f"kvscope check: {exc}", file=sys.stderr)
        return 2
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(describe(result))
    print("ok. Left to start-up, which needs the model: block sizes, the size of one offloaded block, the "
          "KV cache layouts")
    return 0


def bench(args) -> int:
    from bench.run_all import main as run_all

    return run_all(quick=args.quick)


def _at_least(lowest: int):
    """An argparse type: an integer >= `lowest` (argparse names the option when it is not)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"{value} is too small: accepted are integers >= {lowest}")
        return value

    parse.__name__ = f"integer >= {lowest}"
    return parse


def _bind_address(text: str) -> str:
    """An argparse type: an address of this host that a server can bind (Streamlit would otherwise
    fail with a traceback)."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(text, 0, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(address)
    except (OSError, UnicodeError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not an address of this host to serve on ({exc}): "
                                         "accepted are its IP addresses or host names, e.g. 127.0.0.1 or "
                                         "0.0.0.0 (all)") from None
    return text


def _port(text: str) -> int:
    """An argparse type: a TCP port, 1..65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number: accepted are 1 to 65535") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number: accepted are 1 to 65535")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvscope")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="real vLLM engine + kvscope on a small hybrid model",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Builds a random-weight model, runs requests sharing prefixes for several "
                                   "rounds with a device prefix-cache reset between rounds, and prints the "
                                   "host-tier hits per round, whether outputs equal round 0, and loads per KV group.")
    d.add_argument("--model", default="gemma3", choices=["gemma3", "gptoss", "llama"],
                   help="family of the tiny random-weight model (gemma3, gptoss: sliding window + full "
                        "attention; llama: full attention only; connector/tiny_models.py)")
    d.add_argument("--window", type=_at_least(1), default=64, help="sliding window in tokens")
    d.add_argument("--prefixes", type=_at_least(1), default=4, help="distinct shared prefixes")
    d.add_argument("--per-prefix", type=_at_least(1), default=4, help="requests per prefix in each round")
    d.add_argument("--prefix-len", type=_at_least(1), default=700, help="tokens in each shared prefix")
    d.add_argument("--suffix-len", type=_at_least(2), default=200,
                   help="each request adds a random suffix of 1 to this many tokens minus one")
    d.add_argument("--rounds", type=_at_least(1), default=3, help="rounds of the same requests")
    d.add_argument("--batch", type=_at_least(1), default=4, help="requests given to vLLM at a time")
    d.add_argument("--max-tokens", type=_at_least(1), default=8, help="tokens generated per request (greedy)")
    d.add_argument("--cpu-mib", type=_at_least(1), default=256, help="host tier size (cpu_bytes) in MiB")
    d.add_argument("--trace-file", default=None, help="write the connector's spans here (OTLP/JSON lines)")
    d.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    d.set_defaults(func=demo)
    s = sub.add_parser("dashboard", help="Streamlit replay of trace files")
    s.add_argument("paths", nargs="*", help="trace files or folders of them (default: $KVSCOPE_TRACE_FILES)")
    s.add_argument("--port", type=_port, default=None, help="port to serve on (Streamlit's default: 8501)")
    s.add_argument("--address", default=None, type=_bind_address,
                   help="address to bind, e.g. 0.0.0.0 (Streamlit's default: all)")
    s.add_argument("--headless", action="store_true", help="do not open a browser")
    s.add_argument("--streamlit-option", action="append", default=[], metavar="OPTION",
                   help="passed to `streamlit run`, e.g. --streamlit-option theme.base=dark or "
                        "--streamlit-option=--theme.base=dark (repeatable)")
    s.set_defaults(func=dashboard)
    r = sub.add_parser("summary", help="the replay app's Overview of trace files, as text or JSON",
                       description="Reads trace files as the replay app does and prints its Overview: hit rate, "
                                   "load time quantiles, why lookups missed, KV groups, load latency, slowest "
                                   "loads. Exits 2 when the files hold no kvscope request.")
    r.add_argument("paths", nargs="*", help="trace files or folders of them (default: $KVSCOPE_TRACE_FILES)")
    r.add_argument("--json", action="store_true", help="one JSON document instead of text")
    r.add_argument("--slowest", type=_at_least(0), default=5, help="how many of the slowest loads to list")
    r.set_defaults(func=summary)
    c = sub.add_parser("check", help="check a --kv-transfer-config before vllm serve loads a model with it")
    c.add_argument("kv_transfer_config", help="the JSON given to vllm serve --kv-transfer-config")
    # vllm serve's own flags, as given to it: what start-up checks without the model
    c.add_argument("--tensor-parallel-size", "-tp", type=_at_least(1), default=1)
    c.add_argument("--pipeline-parallel-size", "-pp", type=_at_least(1), default=1)
    c.add_argument("--decode-context-parallel-size", "-dcp", type=_at_least(1), default=1)
    c.add_argument("--prefill-context-parallel-size", "-pcp", type=_at_least(1), default=1)
    c.add_argument("--data-parallel-size", "-dp", type=_at_least(1), default=1)
    c.add_argument("--data-parallel-size-local", "-dpl", type=_at_least(0), default=None,
                   help="engines on this host (default: as vLLM derives it)")
    c.add_argument("--nnodes", "-n", type=_at_least(1), default=1)
    c.add_argument("--distributed-executor-backend", default=None)
    c.add_argument("--enable-sleep-mode", action=argparse.BooleanOptionalAction, default=False)
    c.set_defaults(func=check)
    b = sub.add_parser("bench", help="run the benchmarks, write bench/results.md and .json "
                                     "(--quick: bench/results-quick.*)")
    b.add_argument("--quick", action="store_true")
    b.set_defaults(func=bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
