"""vLLM's own latencies (its `llm_request` spans, `vllm_join`) split by what the host tier did for each request.

Whether loads from the host tier shorten time to first token is the question an operator asks of the
tier; vLLM's span measures TTFT from the request's arrival, kvscope's spans say whether it loaded.
Prompt lengths differ between requests, so the table gives the median prompt and hit beside the
latencies: compare like with like.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

OUTCOME_DEFINITION = (
    "Requests with vLLM's own request span, by what the host tier did: loaded from it (a load that did not "
    "fail), its load failed (vLLM recomputed), or no host-tier load. TTFT and queue time are vLLM's, from "
    "the request's arrival. Prompts differ in length: compare rows with similar prompt and hit medians."
)
LOADED, FAILED, NO_LOAD = "loaded from the host tier", "load failed (recomputed)", "no host-tier load"
OUTCOME_COLUMNS = ("outcome", "requests", "prompt_tokens_p50", "tokens_hit_p50", "queue_p50_ms", "ttft_p50_ms",
                   "ttft_p90_ms", "e2e_p50_ms")


def vllm_latency_by_outcome(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per outcome that has requests with a vLLM TTFT (`OUTCOME_COLUMNS`); empty without any."""
    timed = requests[requests["vllm_ttft_ms"].notna()]
    if timed.empty:
        return pd.DataFrame(columns=list(OUTCOME_COLUMNS))
    failed = timed["load_failed"].astype(bool)
    outcome = np.where(failed, FAILED, np.where(timed["loads"] > 0, LOADED, NO_LOAD))
    rows = []
    for name in (LOADED, NO_LOAD, FAILED):
        group = timed[outcome == name]
        if group.empty:
            continue
        prompt = group["vllm_prompt_tokens"].astype("Float64").dropna()
        rows.append({
            "outcome": name,
            "requests": len(group),
            "prompt_tokens_p50": float(prompt.median()) if len(prompt) else np.nan,
            "tokens_hit_p50": float(group["tokens_hit"].median()),
            "queue_p50_ms": float(group["vllm_queue_ms"].median()),
            "ttft_p50_ms": float(group["vllm_ttft_ms"].median()),
            "ttft_p90_ms": float(group["vllm_ttft_ms"].quantile(0.9)),
            "e2e_p50_ms": float(group["vllm_e2e_ms"].median()),
        })
    return pd.DataFrame(rows, columns=list(OUTCOME_COLUMNS))
