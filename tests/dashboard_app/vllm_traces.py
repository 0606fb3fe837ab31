"""vLLM's own request spans (`llm_request`) as vLLM 0.32 writes them, for the dashboard tests.

Shaped after vllm/v1/engine/output_processor.py (``do_tracing``): latencies in seconds as doubles,
token counts as ints, the client's request id; scope ``vllm.tracing.otel``. kvscope's id of the same
request is the client's id with 8 hex digits added by vLLM's scheduler.
"""

from __future__ import annotations

import json
from pathlib import Path

from .test_reader import line, span

VLLM_SCOPE = "vllm.tracing.otel"


def llm_request(request_id: str, *, trace: str, span_id: str, start: int, end: int, queue_s: float = 0.004,
                ttft_s: float = 0.12, e2e_s: float = 0.9, prefill_s: float = 0.1, decode_s: float = 0.7,
                prompt_tokens: int = 544, parent: str = "") -> dict:
    return span("llm_request", {
        "gen_ai.latency.time_to_first_token": ttft_s, "gen_ai.latency.e2e": e2e_s,
        "gen_ai.latency.time_in_queue": queue_s, "gen_ai.usage.prompt_tokens": prompt_tokens,
        "gen_ai.usage.completion_tokens": 16, "gen_ai.latency.time_in_model_prefill": prefill_s,
        "gen_ai.latency.time_in_model_decode": decode_s, "gen_ai.latency.time_in_model_inference": prefill_s + decode_s,
        "gen_ai.request.id": request_id, "gen_ai.request.max_tokens": 16,
    }, trace=trace, span_id=span_id, parent=parent, start=start, end=end)


def vllm_line(*spans: dict) -> str:
    return line(*spans, scope=VLLM_SCOPE, version="")


def vllm_spans_of(trace_file: Path, request_ids: dict[str, float], out: Path) -> Path:
    """A Collector file of vLLM's request spans for requests of a kvscope trace file: request id -> TTFT in
    seconds; each in its request's trace, from 0.2 ms before its first lookup to 300 ms after."""
    lookups = {}
    for text in trace_file.read_text().splitlines():
        for rs in json.loads(text)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    if sp["name"] == "kvscope.lookup":
                        rid = next(a["value"]["stringValue"] for a in sp["attributes"]
                                   if a["key"] == "kvscope.request.id")
                        lookups.setdefault(rid, sp)
    spans = []
    for i, (rid, ttft_s) in enumerate(request_ids.items()):
        lookup = lookups[rid]
        start = int(lookup["startTimeUnixNano"]) - 200_000
        spans.append(llm_request(rid, trace=lookup["traceId"], span_id=f"{0xF00 + i:016x}", start=start,
                                 end=start + 300_000_000, ttft_s=ttft_s))
    out.write_text(vllm_line(*spans) + "\n")
    return out
