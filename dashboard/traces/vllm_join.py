"""Which vLLM request span (`vllm_spans`) belongs to which kvscope request, and its latencies per request.

A kvscope request carries vLLM's span only when it sent a ``traceparent``: both are then in that
trace. vLLM's span names the request by the id its client sees ("cmpl-3f…-0"); its scheduler, where
kvscope records, appends 8 random hex digits to keep ids unique ("cmpl-3f…-0-1a2b3c4d": vLLM's
``InputProcessor.assign_request_id``, unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set). So a
request takes the span of its trace with its own id, else the one with its id less that suffix;
only one-to-one matches count (the same client id sent twice in one trace tells nothing).
"""

from __future__ import annotations

import pandas as pd

from dashboard.traces.schema import REQUEST_KEY

VLLM_TIMES_DEFINITION = (
    "vLLM's own request span (`llm_request`, written when vLLM runs with --otlp-traces-endpoint), joined "
    "to a request that sent a traceparent: same trace, same request id (vLLM's scheduler adds 8 hex digits "
    "to the id its span names). Queue time: waiting to be scheduled; time to first token and end-to-end "
    "latency from the request's arrival at vLLM. Empty for a request without such a span."
)

# requests-table column -> column of the vLLM span frame
VLLM_REQUEST_COLUMNS = {
    "vllm_queue_ms": "queue_ms",
    "vllm_ttft_ms": "ttft_ms",
    "vllm_e2e_ms": "e2e_ms",
    "vllm_prefill_ms": "prefill_ms",
    "vllm_decode_ms": "decode_ms",
    "vllm_prompt_tokens": "prompt_tokens",
}
_SCHEDULER_SUFFIX = r"-[0-9a-f]{8}$"


def vllm_keys(requests: pd.DataFrame, vllm: pd.DataFrame) -> pd.Series:
    """The `vllm_key` of each request's vLLM span (index of `requests`), NA where it has none."""
    keys = pd.Series(pd.NA, index=requests.index, dtype="Int64")
    spans = vllm.loc[vllm["vllm_request_id"].notna(), ["vllm_key", "trace_id", "vllm_request_id"]]
    if requests.empty or spans.empty:
        return keys
    ids = requests[REQUEST_KEY].assign(row=requests.index)
    exact = ids.merge(spans, left_on=REQUEST_KEY, right_on=["trace_id", "vllm_request_id"])
    client_ids = ids.assign(request_id=ids["request_id"].astype(str).str.replace(_SCHEDULER_SUFFIX, "", regex=True))
    client_ids = client_ids[client_ids["request_id"] != ids["request_id"]]
    suffixed = client_ids.merge(spans, left_on=REQUEST_KEY, right_on=["trace_id", "vllm_request_id"])
    # An id equal to vLLM's wins over one less a suffix ("a" and "a-0000abcd" both in one trace).
    suffixed = suffixed[~suffixed["row"].isin(exact["row"]) & ~suffixed["vllm_key"].isin(exact["vllm_key"])]
    pairs = pd.concat([exact, suffixed])
    pairs = pairs[~pairs["row"].duplicated(keep=False) & ~pairs["vllm_key"].duplicated(keep=False)]
    keys.loc[pairs["row"].to_numpy()] = pairs["vllm_key"].to_numpy()
    return keys


def with_vllm_columns(requests: pd.DataFrame, vllm: pd.DataFrame | None) -> pd.DataFrame:
    """`requests` with `vllm_key` and the `VLLM_REQUEST_COLUMNS` of its vLLM span (NA without one)."""
    keys = vllm_keys(requests, vllm) if vllm is not None else pd.Series(pd.NA, index=requests.index, dtype="Int64")
    out = requests.assign(vllm_key=keys)
    matched = keys.notna().to_numpy()
    spans = vllm.set_index("vllm_key").reindex(keys[matched].astype("int64")) if matched.any() else None
    for col, source in VLLM_REQUEST_COLUMNS.items():
        dtype = "Int64" if source.endswith("tokens") else float
        values = pd.Series(pd.NA if dtype == "Int64" else float("nan"), index=requests.index, dtype=dtype)
        if spans is not None:
            values[matched] = spans[source].to_numpy()
        out[col] = values
    return out
