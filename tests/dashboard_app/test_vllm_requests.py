"""vLLM's own request spans beside kvscope's: read from the same file or another, joined by trace and
request id, shown per request and leading the request's waterfall."""

from __future__ import annotations

import base64
import json

import pandas as pd
import pytest

from dashboard import traces

from .conftest import TWO_ROUNDS
from .test_joins import copy, load
from .test_reader import line, lookup, span, write
from .vllm_traces import llm_request, vllm_line

T = 1_700_000_000_000_000_000
MS = 1_000_000
TRACE_A, TRACE_B, TRACE_X = "a1" * 16, "b2" * 16, "c3" * 16
CLIENT = "99" * 8  # the client's span, from the traceparent it sent: parent of vLLM's span and of the lookup
VLLM_COLUMNS = list(traces.VLLM_REQUEST_COLUMNS)


def kvscope_request(rid: str, trace: str, n: int, start: int = T) -> list[dict]:
    """A request's lookup, load and load copy (4 ms after the load starts)."""
    return [lookup(rid, trace=trace, span_id=f"{n:02x}" * 8, parent=CLIENT, start=start),
            load(rid, trace=trace, span_id=f"{n + 1:02x}" * 8, parent=CLIENT, start=start + MS),
            copy("load", 4096, rid, trace=trace, span_id=f"{n + 2:02x}" * 8, parent=f"{n + 1:02x}" * 8,
                 start=start + 2 * MS, end=start + 5 * MS)]


def read_requests(*paths) -> tuple[traces.Traces, pd.DataFrame]:
    read = traces.read_trace_files(list(paths))
    return read, traces.requests_table(read.spans, read.vllm_requests).set_index("request_id")


def test_a_request_with_a_vllm_span_has_its_latencies_and_one_without_has_none(tmp_path):
    """One Collector file: vLLM's span names the client's id, kvscope the scheduler's (8 hex digits added)."""
    path = write(tmp_path,
                 line(*kvscope_request("cmpl-7-0-1a2b3c4d", TRACE_A, 0x10),
                      *kvscope_request("cmpl-8-0-5e6f7a8b", TRACE_B, 0x20)),  # no traceparent: its own trace
                 vllm_line(llm_request("cmpl-7-0", trace=TRACE_A, span_id="e1" * 8, parent=CLIENT, start=T - MS,
                                       end=T + 900 * MS, queue_s=0.004, ttft_s=0.12, e2e_s=0.9, prefill_s=0.1,
                                       prompt_tokens=544),
                           span("load_model", {}, trace=TRACE_X, span_id="e2" * 8)))  # another vLLM span
    read, requests = read_requests(path)
    assert read.problems == []
    assert len(read.vllm_requests) == 1 and read.other_spans == 2 and read.spans_left_out == 1
    joined = requests.loc["cmpl-7-0-1a2b3c4d"]
    assert joined[VLLM_COLUMNS].tolist() == pytest.approx([4.0, 120.0, 900.0, 100.0, 700.0, 544])
    assert joined["load_ms"] == pytest.approx(4.0) and joined["lookups"] == 1  # kvscope's, in the same row
    alone = requests.loc["cmpl-8-0-5e6f7a8b"]
    assert alone[[*VLLM_COLUMNS, "vllm_key"]].isna().all()  # nothing, not zeros
    assert alone["load_ms"] == pytest.approx(4.0)


def test_two_files_join_by_trace_id(tmp_path):
    """kvscope's trace file and a Collector file of vLLM's spans (hex ids, and base64 as protobuf-JSON tools
    write them); a span with a request's id in another trace is not that request's."""
    kvscope = write(tmp_path, line(*kvscope_request("r-1-00000000", TRACE_A, 0x10),
                                   *kvscope_request("r-2-00000000", TRACE_B, 0x20)), name="kvscope.jsonl")
    b64 = base64.b64encode(bytes.fromhex(TRACE_A)).decode()
    collector = write(tmp_path,
                      vllm_line(llm_request("r-1", trace=b64, span_id=base64.b64encode(b"\xe1" * 8).decode(),
                                            start=T - MS, end=T + 300 * MS, ttft_s=0.25)),
                      vllm_line(llm_request("r-2", trace=TRACE_X, span_id="e2" * 8, start=T - MS, end=T + MS)),
                      name="collector.jsonl")
    copy_of_collector = write(tmp_path, collector.read_text(), name="collector-copy.jsonl")  # the same spans again
    read, requests = read_requests(kvscope, collector, copy_of_collector)
    assert read.problems == [] and len(read.vllm_requests) == 2  # each span once
    assert requests.loc["r-1-00000000", "vllm_ttft_ms"] == pytest.approx(250.0)
    assert read.vllm_requests.loc[requests.loc["r-1-00000000", "vllm_key"], "span_id"] == "e1" * 8
    assert pd.isna(requests.loc["r-2-00000000", "vllm_key"])  # its id, another trace


def test_the_same_request_id_in_two_traces_stays_two_requests(tmp_path):
    """Two runs with client-set ids (and VLLM_DISABLE_REQUEST_ID_RANDOMIZATION): one request id, two traces,
    each row with its own run's vLLM span."""
    run1 = write(tmp_path, line(*kvscope_request("bench-1", TRACE_A, 0x10)),
                 vllm_line(llm_request("bench-1", trace=TRACE_A, span_id="e1" * 8, start=T, end=T + MS, ttft_s=0.1)),
                 name="run1.jsonl")
    run2 = write(tmp_path, line(*kvscope_request("bench-1", TRACE_B, 0x10, start=T + 86_400_000 * MS)),
                 vllm_line(llm_request("bench-1", trace=TRACE_B, span_id="e1" * 8, start=T + 86_400_000 * MS,
                                       end=T + 86_400_001 * MS, ttft_s=0.3)), name="run2.jsonl")
    read = traces.read_trace_files([run1, run2])
    requests = traces.requests_table(read.spans, read.vllm_requests)
    assert len(requests) == 2 and requests["request_id"].tolist() == ["bench-1", "bench-1"]
    assert requests.set_index("trace_id")["vllm_ttft_ms"].to_dict() == pytest.approx({TRACE_A: 100.0, TRACE_B: 300.0})


def test_only_one_to_one_matches_join():
    """Within one trace (one traceparent for a batch of prompts): each id joins its own span, an id equal to
    vLLM's wins over one less the scheduler's suffix, and the same client id sent twice joins nothing."""
    requests = pd.DataFrame({"trace_id": TRACE_A, "request_id": [
        "cmpl-x-1-0000aaaa", "cmpl-x-10-0000bbbb",  # batch: "-1" must not take "-10"'s span
        "a", "a-1234abcd",  # "a" is vLLM's id itself
        "dup-aaaaaaaa", "dup-bbbbbbbb",  # the client sent "dup" twice in one trace
    ]})
    vllm = pd.DataFrame({"vllm_key": range(5), "trace_id": TRACE_A,
                         "vllm_request_id": ["cmpl-x-10", "cmpl-x-1", "a", "dup", "dup"]})
    assert traces.vllm_keys(requests, vllm).fillna(-1).tolist() == [1, 0, 2, -1, -1, -1]  # -1: none


def test_a_match_one_side_of_which_is_not_alone_joins_nothing():
    """Two requests with one client id and one vLLM span of it, or one request and two vLLM spans of its id (both in
    one trace): which is whose cannot be told, so neither request joins, not the first one found."""
    requests = pd.DataFrame({"trace_id": [TRACE_A, TRACE_A, TRACE_B],
                             "request_id": ["dup-aaaaaaaa", "dup-bbbbbbbb", "r-0000cccc"]})
    vllm = pd.DataFrame({"vllm_key": range(3), "trace_id": [TRACE_A, TRACE_B, TRACE_B],
                         "vllm_request_id": ["dup", "r", "r"]})
    assert traces.vllm_keys(requests, vllm).isna().all()


def test_vllm_spans_are_found_by_name_and_bad_ones_are_no_kvscope_problem(tmp_path):
    older = line(span("llm_request", {"gen_ai.request.id": "r-1", "gen_ai.latency.time_to_first_token": "0.5"},
                      trace=TRACE_A, span_id="e1" * 8), scope="vllm.llm_engine", version="0.8.0")  # older vLLM
    no_ids = vllm_line(llm_request("r-2", trace="not-an-id", span_id="e2" * 8, start=T, end=T))
    not_json = '{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "llm_request"'
    path = write(tmp_path, older, no_ids, not_json, line(lookup("r-1-00000000", trace=TRACE_A)))
    read = traces.read_trace_files([path])
    assert len(read.vllm_requests) == 1 and read.vllm_requests["ttft_ms"].tolist() == [500.0]
    assert read.vllm_requests["source_line"].tolist() == [1]  # numbered from 1, as the kvscope reader does
    assert [(p.line, p.spans) for p in read.problems] == [(3, None)]  # the broken line, once, by the kvscope reader


def test_the_waterfall_leads_with_the_vllm_span(tmp_path):
    path = write(tmp_path, line(*kvscope_request("cmpl-7-0-1a2b3c4d", TRACE_A, 0x10),
                                *kvscope_request("cmpl-8-0-5e6f7a8b", TRACE_B, 0x20)),
                 vllm_line(llm_request("cmpl-7-0", trace=TRACE_A, span_id="e1" * 8, parent=CLIENT, start=T - 2 * MS,
                                       end=T + 900 * MS, ttft_s=0.12)))
    read = traces.read_trace_files([path])
    requests = traces.requests_table(read.spans, read.vllm_requests)
    rows = traces.waterfall_rows(read.spans, requests, "cmpl-7-0-1a2b3c4d", TRACE_A, read.vllm_requests)
    assert rows["row"].tolist() == ["vLLM request", "lookup", "load", "copy load g0 full_attention"]
    assert rows[["start_ms", "end_ms"]].iloc[0].tolist() == pytest.approx([0.0, 902.0])  # from vLLM's arrival
    assert rows["start_ms"].iloc[1] == pytest.approx(2.0)
    assert rows["span_id"].iloc[0] == "e1" * 8 and "latency.time_to_first_token=0.12" in rows["attributes"].iloc[0]
    alone = traces.waterfall_rows(read.spans, requests, "cmpl-8-0-5e6f7a8b", TRACE_B, read.vllm_requests)
    assert alone["row"].tolist() == ["lookup", "load", "copy load g0 full_attention"]


def test_the_fixtures_vllm_spans_join_every_even_request():
    """two_rounds.jsonl holds an older vLLM's request span (id and prompt tokens, no latencies) for even requests."""
    read = traces.read_trace_files([TWO_ROUNDS])
    requests = traces.requests_table(read.spans, read.vllm_requests).set_index("request_id")
    joined = requests["vllm_key"].notna()
    assert sorted(joined[joined].index) == [f"cmpl-r{r}-{i:02d}" for r in (1, 2) for i in range(0, 10, 2)]
    assert (requests.loc[joined, "vllm_prompt_tokens"] == requests.loc[joined, "tokens_queried"]).all()
    assert requests["vllm_ttft_ms"].isna().all() and read.spans_left_out == 0


def test_the_vllm_columns_keep_their_types_whether_or_not_a_request_joined():
    """`vllm_key` and the prompt tokens are nullable integers and the latencies floats: without vLLM spans given,
    and with some requests joined."""
    read = traces.read_trace_files([TWO_ROUNDS])
    expected = {"vllm_key": "Int64", **{col: "Int64" if col.endswith("tokens") else "float64" for col in VLLM_COLUMNS}}
    for requests in (traces.requests_table(read.spans), traces.requests_table(read.spans, read.vllm_requests)):
        assert requests.dtypes[list(expected)].astype(str).to_dict() == expected


def test_the_same_collector_file_given_twice_leaves_no_span_out(tmp_path):
    """A vLLM span read twice (the same export in two files) is one request span and no span left out."""
    kvscope = write(tmp_path, line(*kvscope_request("cmpl-7-0-1a2b3c4d", TRACE_A, 0x10)), name="kvscope.jsonl")
    export = vllm_line(llm_request("cmpl-7-0", trace=TRACE_A, span_id="e1" * 8, start=T, end=T + MS))
    first, second = write(tmp_path, export, name="a.jsonl"), write(tmp_path, export, name="b.jsonl")
    read = traces.read_trace_files([kvscope, first, second])
    assert len(read.vllm_requests) == 1 and read.other_spans == 2 and read.spans_left_out == 0


@pytest.mark.parametrize("tokens", [{"intValue": str(2 ** 64)}, {"doubleValue": 1e19}, {"intValue": "-" + "9" * 20}])
def test_a_token_count_beyond_int64_is_unknown_not_a_crash(tmp_path, tokens):
    sp = llm_request("cmpl-7-0", trace=TRACE_A, span_id="e1" * 8, start=T, end=T + MS)
    for attribute in sp["attributes"]:
        if attribute["key"] == "gen_ai.usage.prompt_tokens":
            attribute["value"] = tokens
    path = write(tmp_path, line(*kvscope_request("cmpl-7-0-1a2b3c4d", TRACE_A, 0x10)), vllm_line(sp))
    read, requests = read_requests(path)
    joined = requests.loc["cmpl-7-0-1a2b3c4d"]
    assert pd.isna(joined["vllm_prompt_tokens"]) and joined["vllm_ttft_ms"] == pytest.approx(120.0)


def test_a_lone_surrogate_in_a_vllm_span_is_replaced_not_a_crash(tmp_path):
    """JSON may escape half a UTF-16 pair ("\\ud800"); the waterfall encodes attributes as UTF-8."""
    sp = llm_request("cmpl-7-0", trace=TRACE_A, span_id="e1" * 8, start=T, end=T + MS)
    sp["attributes"].append({"key": "gen_ai.response.model", "value": {"stringValue": "tiny\ud800"}})
    path = write(tmp_path, line(*kvscope_request("cmpl-7-0-1a2b3c4d", TRACE_A, 0x10)), vllm_line(sp))
    assert "\\ud800" in path.read_text()  # json.dumps escapes it: the file holds the escape, as a writer's would
    read = traces.read_trace_files([path])
    requests = traces.requests_table(read.spans, read.vllm_requests)
    rows = traces.waterfall_rows(read.spans, requests, "cmpl-7-0-1a2b3c4d", TRACE_A, read.vllm_requests)
    assert rows["attributes"].iloc[0].endswith("response.model=tiny\ufffd")
    rows["attributes"].iloc[0].encode()  # what the page does with it


def test_vllm_latency_by_host_tier_outcome():
    """TTFT and queue medians per outcome, from the requests with vLLM's span only."""
    requests = pd.DataFrame({
        "loads": [1, 1, 0, 0, 1, 0],
        "load_failed": [False, False, False, False, True, False],
        "tokens_hit": [512, 256, 0, 0, 512, 0],
        "vllm_prompt_tokens": pd.array([600, 300, 600, 200, 600, pd.NA], dtype="Int64"),
        "vllm_queue_ms": [1.0, 3.0, 2.0, 4.0, 5.0, float("nan")],
        "vllm_ttft_ms": [20.0, 40.0, 100.0, 60.0, 150.0, float("nan")],  # the last: no vLLM span
        "vllm_e2e_ms": [200.0, 220.0, 300.0, 260.0, 400.0, float("nan")],
    })
    table = traces.vllm_latency_by_outcome(requests).set_index("outcome")
    assert list(table.index) == ["loaded from the host tier", "no host-tier load", "load failed (recomputed)"]
    assert table["requests"].tolist() == [2, 2, 1]
    assert table.loc["loaded from the host tier", ["prompt_tokens_p50", "tokens_hit_p50", "queue_p50_ms",
                                                   "ttft_p50_ms", "e2e_p50_ms"]].tolist() == [450, 384, 2, 30, 210]
    assert table.loc["loaded from the host tier", "ttft_p90_ms"] == pytest.approx(38.0)
    assert table.loc["no host-tier load", "ttft_p50_ms"] == 80.0
    assert traces.vllm_latency_by_outcome(requests.assign(vllm_ttft_ms=float("nan"))).empty


def test_a_vllm_span_with_a_time_python_would_guess_at_is_left_out(tmp_path):
    # int() reads true as 1 and 1.5 as 1: such a span has no time of its own, so it joins no request; a status
    # code of true is no status code
    odd = [llm_request(f"r-{i}", trace=TRACE_A, span_id=f"e{i}" * 8, start=T, end=T + MS) for i in range(4)]
    odd[0]["startTimeUnixNano"] = True
    odd[1]["endTimeUnixNano"] = 1.5
    odd[2]["status"] = {"code": True}
    odd[3]["startTimeUnixNano"] = float(T)  # a whole JSON number: the same time
    read = traces.read_trace_files([write(tmp_path, vllm_line(*odd))])
    assert read.vllm_requests["vllm_request_id"].tolist() == ["r-2", "r-3"]
    assert read.vllm_requests["status_code"].tolist() == [0, 0]
    assert read.vllm_requests["start_ns"].tolist() == [T, T]


def test_a_token_count_that_is_no_whole_number_is_unknown_and_an_unknown_status_unset(tmp_path):
    """544.5 prompt tokens is no count: unknown, not rounded to one. A status code OTLP does not define (7) reads
    as unset, as for kvscope's own spans the reader takes only 0, 1 and 2."""
    sp = llm_request("cmpl-7-0", trace=TRACE_A, span_id="e1" * 8, start=T, end=T + MS)
    for attribute in sp["attributes"]:
        if attribute["key"] == "gen_ai.usage.prompt_tokens":
            attribute["value"] = {"doubleValue": 544.5}
    sp["status"] = {"code": 7}
    path = write(tmp_path, line(*kvscope_request("cmpl-7-0-1a2b3c4d", TRACE_A, 0x10)), vllm_line(sp))
    read, requests = read_requests(path)
    assert pd.isna(requests.loc["cmpl-7-0-1a2b3c4d", "vllm_prompt_tokens"])
    assert read.vllm_requests["status_code"].tolist() == [0]


def test_a_vllm_span_under_the_pre_1_0_otlp_field_name_is_read(tmp_path):
    """OTLP/JSON before 1.0 named scopeSpans instrumentationLibrarySpans, which the kvscope reader takes too."""
    doc = json.loads(vllm_line(llm_request("cmpl-7-0", trace=TRACE_A, span_id="e1" * 8, start=T, end=T + MS)))
    resource = doc["resourceSpans"][0]
    resource["instrumentationLibrarySpans"] = resource.pop("scopeSpans")
    path = write(tmp_path, line(*kvscope_request("cmpl-7-0-1a2b3c4d", TRACE_A, 0x10)), json.dumps(doc))
    read, requests = read_requests(path)
    assert requests.loc["cmpl-7-0-1a2b3c4d", "vllm_ttft_ms"] == pytest.approx(120.0)


def test_a_vllm_span_past_int64_nanoseconds_is_left_out_and_an_infinite_latency_is_unknown(tmp_path):
    """2^63 ns is past what the frame's int64 times hold; a latency of "Infinity" (OTLP/JSON's word for it) is no
    time to show or to take a median of."""
    past, infinite = (llm_request(f"r-{i}", trace=TRACE_A, span_id=f"e{i}" * 8, start=T, end=T + MS) for i in range(2))
    past["endTimeUnixNano"] = str(1 << 63)
    for attribute in infinite["attributes"]:
        if attribute["key"] == "gen_ai.latency.time_to_first_token":
            attribute["value"] = {"doubleValue": "Infinity"}
    read = traces.read_trace_files([write(tmp_path, vllm_line(past, infinite))])
    assert read.vllm_requests["vllm_request_id"].tolist() == ["r-1"]
    assert pd.isna(read.vllm_requests["ttft_ms"].iloc[0]) and read.vllm_requests["e2e_ms"].iloc[0] == 900.0
