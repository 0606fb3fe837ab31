"""kvscope trace files -> pandas frames, and the shaping behind every dashboard view.

Pure: no Streamlit, no clock, no network. `reader` turns OTLP/JSON lines into one row per kvscope
span plus the problems it skipped; the other modules shape that span frame into the tables and
series the pages show, and never re-read files:

- `file_formats`: gzip, zstd, Prometheus text, pretty-printed JSON -> JSON lines;  `problems`: what was skipped;
- `collector_files`: the Collector's protobuf and zstd framings -> JSON lines;  `protobuf_json`: one protobuf
  export -> its JSON line;
- `schema`: the span contract as frame columns;  `request_table`: one row per request;
- `hit_rates`, `group_stats`, `headline`: the overview;  `waterfall`, `group_copies`: one request;  `replay`;
- `vllm_spans`: vLLM's own request spans, read beside kvscope's;  `vllm_join`: which is which request's.

The names pages use are re-exported here (``traces.requests_table(...)``).
"""

from dashboard.traces.group_stats import (
    COPY_THROUGHPUT_DEFINITION,
    copy_throughput,
    group_summary,
    load_latency_distribution,
    load_latency_quantiles,
    null_skip_by_group,
)
from dashboard.traces.group_copies import (
    GROUP_COPY_COLUMNS,
    GROUP_COPY_DEFINITION,
    GROUP_SCAN_COLUMNS,
    request_group_copies,
)
from dashboard.traces.headline import (
    ENGINE_COLUMNS,
    ENGINE_DEFINITION,
    engine_summary,
    engines_run_apart,
    engines_run_apart_note,
    overview_numbers,
    request_numbers,
    top_slow_loads,
)
from dashboard.traces.hit_rates import (
    HIT_RATE_DEFINITION,
    MISSES_COLUMNS,
    MISSES_DEFINITION,
    hit_rate,
    hit_rate_over_time,
    misses_by_reason,
    pick_bucket_seconds,
)
from dashboard.traces.load_waits import LoadWait, load_wait, load_wait_text
from dashboard.traces.problems import DUPLICATE_SPAN, Problem, problem_lines, problem_reasons, problems_frame
from dashboard.traces.line_decoder import DecodedSpans, decode_lines, supported_version, unsupported_version_reason
from dashboard.traces.reader import Traces, TraceSource, decode_spans, read_trace_files
from dashboard.traces.replay import (
    REPLAY_COLUMNS,
    REPLAY_DEFINITION,
    REPLAY_POINTS,
    NEXT_MISS_DEFINITION,
    next_miss,
    replay_points,
    replay_state,
    replay_timeline,
)
from dashboard.traces.request_table import (
    DEFERRAL_DEFINITION,
    LOAD_FAILED_DEFINITION,
    LOAD_TIME_DEFINITION,
    LOOKUP_MISS_REASON_DEFINITION,
    MISS_REASON_DEFINITION,
    MISS_REASON_TEXT,
    REQUEST_COLUMNS,
    REQUEST_FILTERS,
    engines_of,
    find_request,
    load_rows,
    miss_reasons_of,
    of_engine,
    request_labels,
    requests_table,
    search_requests,
)
from dashboard.traces.schema import (
    ATTRIBUTE_COLUMNS,
    COPY,
    DEFERRAL,
    GROUP_KINDS,
    LOAD,
    LOOKUP,
    REQUEST_KEY,
    SCAN,
    SCOPE_NAME,
    SPAN_COLUMNS,
    SPAN_NAMES,
    STORE,
    group_label,
)
from dashboard.traces.vllm_join import VLLM_REQUEST_COLUMNS, VLLM_TIMES_DEFINITION, vllm_keys
from dashboard.traces.vllm_outcomes import OUTCOME_COLUMNS, OUTCOME_DEFINITION, vllm_latency_by_outcome
from dashboard.traces.vllm_spans import VLLM_COLUMNS, VLLM_REQUEST_SPAN
from dashboard.traces.waterfall import DEVICE_KV_WAIT, VLLM_KIND, waterfall_rows

__all__ = [
    "ATTRIBUTE_COLUMNS", "COPY", "DUPLICATE_SPAN", "ENGINE_COLUMNS", "ENGINE_DEFINITION", "GROUP_COPY_COLUMNS",
    "COPY_THROUGHPUT_DEFINITION", "DEFERRAL", "DEFERRAL_DEFINITION", "DEVICE_KV_WAIT", "GROUP_SCAN_COLUMNS",
    "GROUP_COPY_DEFINITION", "GROUP_KINDS",
    "HIT_RATE_DEFINITION",
    "LOAD", "LOAD_FAILED_DEFINITION", "LOOKUP_MISS_REASON_DEFINITION", "MISS_REASON_DEFINITION", "MISS_REASON_TEXT",
    "MISSES_COLUMNS",
    "MISSES_DEFINITION",
    "LOAD_TIME_DEFINITION", "LOOKUP", "OUTCOME_COLUMNS", "OUTCOME_DEFINITION", "REPLAY_COLUMNS", "REPLAY_DEFINITION",
    "REQUEST_COLUMNS", "REQUEST_FILTERS",
    "REQUEST_KEY", "SCAN", "SCOPE_NAME",
    "SPAN_COLUMNS", "SPAN_NAMES", "STORE", "VLLM_COLUMNS", "VLLM_KIND", "VLLM_REQUEST_COLUMNS", "VLLM_REQUEST_SPAN",
    "VLLM_TIMES_DEFINITION", "DecodedSpans", "Problem", "TraceSource", "Traces", "copy_throughput",
    "decode_lines", "decode_spans", "engine_summary", "engines_of", "engines_run_apart", "engines_run_apart_note",
    "find_request", "group_label", "group_summary",
    "hit_rate",
    "hit_rate_over_time", "load_latency_distribution", "LoadWait", "load_wait", "load_wait_text", "miss_reasons_of",
    "misses_by_reason", "NEXT_MISS_DEFINITION", "next_miss",
    "load_rows", "load_latency_quantiles", "null_skip_by_group",
    "of_engine", "overview_numbers", "pick_bucket_seconds", "request_numbers", "problem_lines", "problem_reasons",
    "problems_frame",
    "read_trace_files",
    "REPLAY_POINTS", "replay_points", "replay_state", "replay_timeline",
    "request_group_copies", "request_labels", "requests_table", "search_requests",
    "supported_version",
    "top_slow_loads",
    "unsupported_version_reason", "vllm_keys", "vllm_latency_by_outcome", "waterfall_rows",
]
