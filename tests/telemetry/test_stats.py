"""KVScopeStats: the payload that travels worker -> scheduler -> front end."""

from __future__ import annotations

import copy
import pickle

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.telemetry.metrics import KVScopeStats


def _worker_stats() -> KVScopeStats:
    s = KVScopeStats()
    s.record_copy(0, "full_attention", "load", blocks=4, nbytes=4096, duration_s=0.002)
    s.record_copy(1, "sliding_window", "store", blocks=2, nbytes=1024, duration_s=0.001)
    return s


def _scheduler_stats() -> KVScopeStats:
    s = KVScopeStats()
    s.record_lookup(queried_tokens=100, hit_tokens=64)
    s.record_scans(0, "full_attention", blocks_total=8, null_skipped=0, durations_s=[3e-6])
    s.record_scans(1, "sliding_window", blocks_total=8, null_skipped=6, durations_s=[2e-6])
    s.record_loaded_blocks(0, "full_attention", blocks=4)
    s.record_loaded_blocks(1, "sliding_window", blocks=2)
    s.record_request_load(0.004)
    s.record_evictions(3)
    s.record_load_failures(1)
    s.record_deferred_loads(2)
    s.record_deferral_wait(0.02)
    s.set_host_usage(used_bytes=10_000, capacity_bytes=1 << 30)
    return s


def _assert_plain(obj) -> None:
    if isinstance(obj, dict):
        for key, value in obj.items():
            assert isinstance(key, str)
            _assert_plain(value)
    elif isinstance(obj, list):
        for value in obj:
            _assert_plain(value)
    else:
        assert type(obj) in (int, float), type(obj)


def test_data_is_plain_with_string_keys():
    stats = _scheduler_stats().aggregate(_worker_stats())
    _assert_plain(stats.data)
    assert stats.data["scan_blocks"] == {"0|full_attention": 8, "1|sliding_window": 8}
    assert stats.data["copy_duration_s"] == {"0|full_attention|load": [0.002], "1|sliding_window|store": [0.001]}


def test_numpy_like_values_are_stored_as_python_numbers():
    class IntLike:
        def __int__(self):
            return 5

        def __float__(self):
            return 0.5

    s = KVScopeStats()
    s.record_copy(IntLike(), "mamba", "load", IntLike(), IntLike(), IntLike())
    _assert_plain(s.data)
    msgspec.msgpack.encode(s.data)


def test_numpy_counts_are_stored_as_python_ints():
    """Counts often come out of numpy (block id arrays): a numpy int in the payload fails vLLM's
    msgpack encoding of the stats, so every counter stores a plain int."""
    import numpy as np

    s = KVScopeStats()
    s.record_evictions(np.int64(2))
    s.record_load_failures(np.int64(1))
    s.record_deferred_loads(np.int64(1))
    s.record_lookup(np.int64(16), np.int64(8))
    _assert_plain(s.data)
    msgspec.msgpack.encode(s.data)


def test_aggregate_sums_concatenates_and_keeps_latest_gauge():
    a, b = _scheduler_stats(), _scheduler_stats()
    b.set_host_usage(used_bytes=20_000, capacity_bytes=1 << 30)
    a.aggregate(b).aggregate(_worker_stats())
    d = a.data
    assert d["lookup_tokens"] == 200 and d["hit_tokens"] == 128
    assert d["null_blocks_skipped"] == {"1|sliding_window": 12}
    assert d["scan_duration_s"]["0|full_attention"] == [3e-6, 3e-6]
    assert d["request_load_duration_s"] == [0.004, 0.004]
    assert d["load_deferral_wait_s"] == [0.02, 0.02]
    assert d["host_used_bytes"] == 20_000
    assert d["evicted_blocks"] == 6 and d["load_failures"] == 2 and d["deferred_loads"] == 4
    assert d["store_bytes"] == {"1|sliding_window": 1024}
    assert d["loaded_blocks"] == {"0|full_attention": 8, "1|sliding_window": 4}
    assert d["load_bytes"] == {"0|full_attention": 4096}  # only from the workers' copies


def test_aggregate_does_not_alias_the_other_payload():
    a, b = KVScopeStats(), _scheduler_stats()
    a.aggregate(b)
    a.record_scans(0, "full_attention", 1, 0, [1e-6])
    assert b.data["scan_duration_s"]["0|full_attention"] == [3e-6]


def test_empty_reset_and_take():
    s = KVScopeStats()
    assert s.is_empty() and s.take() is None
    s.record_lookup(0, 0)
    s.record_evictions(0)
    s.record_deferred_loads(0)
    assert s.is_empty()  # nothing happened, nothing to ship
    s.record_lookup(10, 5)
    taken = s.take()
    assert taken is not None and taken.data["hit_tokens"] == 5
    assert s.is_empty()
    s.record_evictions(1)
    s.reset()
    assert s.is_empty() and s.aggregate(KVScopeStats()) is s


def test_aggregating_no_payload_keeps_the_stats():
    """``aggregate(None)`` (no other payload) returns the stats themselves, unchanged."""
    s = _scheduler_stats()
    before = copy.deepcopy(s.data)
    assert s.aggregate(None) is s and s.data == before


@pytest.mark.parametrize("roundtrip", ["pickle", "msgspec_data", "msgspec_object", "vllm_msgpack"])
def test_survives_serialization(roundtrip):
    stats = _scheduler_stats().aggregate(_worker_stats())
    if roundtrip == "pickle":
        back = pickle.loads(pickle.dumps(stats))
    elif roundtrip == "msgspec_data":
        back = KVScopeStats.from_data(msgspec.msgpack.decode(msgspec.msgpack.encode(stats.data)))
    elif roundtrip == "msgspec_object":
        back = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=KVScopeStats)
    else:  # what the engine core does with SchedulerStats.kv_connector_stats (= to_dict())
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        back = KVScopeStats.from_data(MsgpackDecoder(dict).decode(MsgpackEncoder().encode(stats.to_dict())))
    assert isinstance(back, KVScopeStats)
    assert back.data == stats.data
    assert back.reduce() == stats.reduce()


def test_reduce_summary():
    r = _scheduler_stats().aggregate(_worker_stats()).reduce()
    assert r["lookup_tokens"] == 100 and r["hit_tokens"] == 64 and r["hit_rate"] == 0.64
    assert r["loaded_blocks"] == 6
    assert r["loaded_gb"] == pytest.approx(4096 / 1e9, rel=1e-3)  # the workers' load copies
    assert r["stored_gb"] == pytest.approx(1024 / 1e9, rel=1e-3)
    assert r["scan_us_mean"] == pytest.approx(2.5)
    assert r["load_copies"] == 1 and r["load_copy_ms_mean"] == pytest.approx(2.0)
    assert r["store_copy_ms_mean"] == pytest.approx(1.0)
    assert r["request_load_ms_mean"] == pytest.approx(4.0)
    assert r["deferral_wait_ms_mean"] == pytest.approx(20.0)
    assert r["evicted_blocks"] == 3 and r["load_failures"] == 1 and r["deferred_loads"] == 2
    assert all(isinstance(v, (int, float)) for v in r.values())
    assert KVScopeStats().reduce() == {}


def test_reduce_reports_a_lookup_that_hit_nothing():
    """A step whose lookups all missed still says how many tokens were looked up (hit rate 0), and
    a rate that does not end is rounded for the log line."""
    s = KVScopeStats()
    s.record_lookup(queried_tokens=48, hit_tokens=0)
    assert s.reduce() == {"lookup_tokens": 48, "hit_tokens": 0, "hit_rate": 0.0}
    s.record_lookup(queried_tokens=48, hit_tokens=32)
    assert s.reduce()["hit_rate"] == 0.3333


def test_reduce_reports_missed_tokens_per_reason_and_host_usage():
    """vLLM's log line is the offline user's only view of why the tier missed and how full it is."""
    s = KVScopeStats()
    s.record_missed("evicted", 32)
    s.record_missed("tail", 4)
    s.set_host_usage(used_bytes=3_000_000, capacity_bytes=4_000_000_000)
    assert s.reduce() == {"missed_tokens_evicted": 32, "missed_tokens_tail": 4,
                          "host_used_gb": 0.003, "host_capacity_gb": 4.0, "host_engines": 1}


def test_reduce_averages_every_observation():
    """Counts and means are over all copies, loads and deferral waits of the interval, not the first
    one, rounded for the log line (scans to ns, copies, loads and waits to 0.1 µs)."""
    s = KVScopeStats()
    for duration_s in (0.001, 0.002, 0.002):
        s.record_copy(0, "full_attention", "load", blocks=1, nbytes=1, duration_s=duration_s)
        s.record_request_load(duration_s)
        s.record_deferral_wait(duration_s)
    s.record_scans(0, "full_attention", blocks_total=3, null_skipped=0, durations_s=[1e-6, 2e-6, 2e-6])
    r = s.reduce()
    assert r["load_copies"] == 3 and r["load_copy_ms_mean"] == 1.6667
    assert r["request_loads"] == 3 and r["request_load_ms_mean"] == 1.6667
    assert r["deferral_wait_ms_mean"] == 1.6667
    assert r["scan_us_mean"] == 1.667
    assert "store_copies" not in r


def test_a_count_of_one_is_recorded():
    """One block loaded, one byte copied: the smallest count is still a count."""
    s = KVScopeStats()
    s.record_loaded_blocks(0, "mamba", blocks=1)
    s.record_scans(0, "mamba", blocks_total=1, null_skipped=1, durations_s=[])
    s.record_missed("new", 1)
    assert s.data == {"loaded_blocks": {"0|mamba": 1}, "scan_blocks": {"0|mamba": 1},
                      "null_blocks_skipped": {"0|mamba": 1}, "missed_tokens": {"new": 1}}


def test_zero_durations_are_observed_and_negative_ones_dropped():
    """A clock too coarse to see a fast scan gives 0: still one observation (the histogram's count is
    the number of scans). A negative duration (a clock stepped back) would lower the histogram's sum."""
    s = KVScopeStats()
    s.record_scans(0, "full_attention", blocks_total=1, null_skipped=0, durations_s=[0.0, -0.5])
    s.record_copy(0, "full_attention", "store", blocks=1, nbytes=1, duration_s=0.0)
    s.record_copy(0, "full_attention", "store", blocks=1, nbytes=1, duration_s=-0.5)
    s.record_request_load(0.0)
    s.record_request_load(-0.5)
    assert s.data["scan_duration_s"] == {"0|full_attention": [0.0]}
    assert s.data["copy_duration_s"] == {"0|full_attention|store": [0.0]}
    assert s.data["request_load_duration_s"] == [0.0]


def test_zero_deferral_waits_are_observed_and_negative_ones_dropped():
    """A load admitted within the clock's resolution waited 0 (still one deferred load in the histogram's
    count); a negative wait (a clock stepped back) would lower kvscope_load_deferral_wait_seconds' sum."""
    s = KVScopeStats()
    s.record_deferral_wait(0.0)
    s.record_deferral_wait(-0.5)
    assert s.data == {"load_deferral_wait_s": [0.0]}


def test_bad_copy_direction_is_rejected():
    with pytest.raises(ValueError, match="direction"):
        KVScopeStats().record_copy(0, "mamba", "sideways", 1, 1, 0.1)


@settings(deadline=None)  # a busy 2-core machine can stall one example past 200 ms
@given(st.lists(st.tuples(st.integers(-10, 10_000), st.integers(-10, 20_000)), max_size=30))
def test_hit_tokens_never_exceed_lookup_tokens(lookups):
    total = KVScopeStats()
    for queried, hit in lookups:
        one = KVScopeStats()
        one.record_lookup(queried, hit)
        assert one.data.get("hit_tokens", 0) <= one.data.get("lookup_tokens", 0)
        total.aggregate(one)
    assert 0 <= total.data.get("hit_tokens", 0) <= total.data.get("lookup_tokens", 0)


# An argument for each parameter name of the recording methods (a new name fails the test below
# until it is given one here).
_SAMPLE_ARGUMENTS = {
    "group": 1, "kind": "sliding_window", "direction": "store", "blocks": 3, "nbytes": 3072, "duration_s": 0.002,
    "queried_tokens": 64, "hit_tokens": 32, "reason": "evicted", "tokens": 32, "blocks_total": 8, "null_skipped": 5,
    "n": 2, "durations_s": [1e-6, 2e-6], "used_bytes": 1024, "capacity_bytes": 4096, "engine": 2, "wait_s": 0.04,
    "groups": [(0, "full_attention"), (1, "sliding_window")],
}


def test_everything_a_recording_method_writes_survives_aggregation():
    """vLLM aggregates the workers' payloads into the scheduler's (an empty one first): a data key
    `aggregate` does not know is dropped there, and its metric loses exactly the steps that had copies."""
    import inspect

    recorders = [name for name in vars(KVScopeStats) if name.startswith(("record_", "set_", "declare_"))]
    assert {"record_copy", "record_scans", "set_host_usage", "declare_groups"} <= set(recorders)
    for name in recorders:
        method = getattr(KVScopeStats, name)
        params = [p for p in inspect.signature(method).parameters if p != "self"]
        recorded = KVScopeStats()
        getattr(recorded, name)(**{p: _SAMPLE_ARGUMENTS[p] for p in params})
        assert recorded.data, name
        aggregated = KVScopeStats().aggregate(KVScopeStats(data=pickle.loads(pickle.dumps(recorded.data))))
        assert aggregated.data == recorded.data, name


def test_aggregate_does_not_alias_the_other_payloads_request_loads():
    """The request load times aggregated in are copied, not shared: recording into the aggregate must not
    change the payload it came from (a payload vLLM aggregates again would count those loads twice)."""
    a, b = KVScopeStats(), _scheduler_stats()
    a.aggregate(b)
    a.record_request_load(0.5)
    assert b.data["request_load_duration_s"] == [0.004]
    assert a.data["request_load_duration_s"] == [0.004, 0.5]


def test_a_copy_that_could_not_be_timed_counts_its_blocks_and_bytes_with_no_duration():
    """A copy whose interval could not be measured (duration None) still moved its bytes: they count in
    the byte totals, and no duration is made up for it (nor does the copy fail the worker's stats)."""
    s = KVScopeStats()
    s.record_copy(0, "full_attention", "load", blocks=2, nbytes=2048, duration_s=None)
    assert s.data == {"copy_blocks": {"0|full_attention|load": 2}, "copy_bytes": {"0|full_attention|load": 2048},
                      "load_bytes": {"0|full_attention": 2048}}


def _usage(used: int, capacity: int, engine: int) -> dict:
    stats = KVScopeStats()
    stats.set_host_usage(used, capacity, engine)
    stats.record_lookup(10, 5)
    return stats.data


def test_vllms_aggregated_log_of_two_engines_sums_their_tiers_latest_usage():
    """`--aggregate-engine-logging` under data parallelism: vLLM's one `KVConnectorLogging` aggregates every
    engine's payloads into one, and each engine has a tier of its own. Its line said the usage of whichever
    engine reported last (1 of 3 GB here), not the 3 GB the engines' tiers hold."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    gb = 10**9
    logging_ = KVConnectorLogging(KVTransferConfig(kv_connector="KVScopeConnector", kv_role="kv_both",
                                                   kv_connector_module_path="connector"))
    for payload in (_usage(1 * gb, 4 * gb, 0), _usage(5 * gb, 4 * gb, 1),   # engine 1 reports twice:
                    _usage(2 * gb, 4 * gb, 1), _usage(1 * gb, 4 * gb, 0)):  # its latest counts
        logging_.observe(payload)
    lines = []
    logging_.log(lambda fmt, *args: lines.append(fmt % args))
    (line,) = lines
    assert "host_used_gb=3.0, host_capacity_gb=8.0, host_engines=2" in line
    assert "lookup_tokens=40" in line
    # the next interval, engine 1 idle (it sends nothing): the line says it covers one engine's tier
    logging_.observe(_usage(1 * gb, 4 * gb, 0))
    logging_.log(lambda fmt, *args: lines.append(fmt % args))
    assert "host_used_gb=1.0, host_capacity_gb=4.0, host_engines=1" in lines[-1]


def test_one_engines_payloads_keep_its_latest_usage_and_no_table_of_engines():
    one = KVScopeStats(data=_usage(1_000, 4_000, 3))
    one.aggregate(KVScopeStats(data=_usage(2_000, 4_000, 3)))
    assert "host_usage_by_engine" not in one.data
    assert one.data["host_used_bytes"] == 2_000 and one.reduce()["host_used_gb"] == 2e-6  # not 3,000 bytes
    assert one.reduce()["host_engines"] == 1
    # payloads without usage (a worker's, an interval with no change) leave it alone
    one.aggregate(KVScopeStats(data={"lookup_tokens": 1}))
    assert one.data["host_used_bytes"] == 2_000 and "host_usage_by_engine" not in one.data


def test_aggregates_of_engines_merge_each_engines_latest_usage():
    """An aggregate of engines 0 and 1 aggregated with engine 1's newer payload, then with an aggregate of
    engines 1 and 2 (the order vLLM gives): every engine once, with its latest usage."""
    a = KVScopeStats(data=_usage(100, 1_000, 0)).aggregate(KVScopeStats(data=_usage(200, 1_000, 1)))
    a.aggregate(KVScopeStats(data=_usage(250, 1_000, 1)))
    b = KVScopeStats(data=_usage(300, 1_000, 1)).aggregate(KVScopeStats(data=_usage(400, 1_000, 2)))
    a.aggregate(b)
    assert a.data["host_usage_by_engine"] == {"0": [100, 1_000], "1": [300, 1_000], "2": [400, 1_000]}
    assert a.reduce()["host_used_gb"] == 8e-7  # 100 + 300 + 400 bytes
    assert a.reduce()["host_engines"] == 3
    # an engine's usage that arrives first in a payload without one of its own, then others'
    first = KVScopeStats(data={"lookup_tokens": 1}).aggregate(KVScopeStats(data=_usage(100, 1_000, 0)))
    first.aggregate(KVScopeStats(data=_usage(200, 1_000, 1)))
    assert first.data["host_usage_by_engine"] == {"0": [100, 1_000], "1": [200, 1_000]}
    # what crosses from the engine process to the front end: the engine's index with its gauges
    sent = msgspec.msgpack.decode(msgspec.msgpack.encode(_usage(100, 1_000, 2)))
    assert (sent["host_engine"], sent["host_used_bytes"]) == (2, 100)
