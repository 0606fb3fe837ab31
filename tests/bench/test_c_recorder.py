"""The C recorder experiment (`bench/c_recorder`) records what kvscope's traced path keeps: for the same
loads, the values the Python floor keeps as tuples (`FloorTracing`), with ids and times that hold together."""

from __future__ import annotations

import os

import pytest

from bench import planner_vs_vllm as pv
from bench.c_recorder import measure
from bench.c_recorder.build import REASON_CODES, build, compiler, decode

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler: the C recorder experiment cannot build")


@pytest.fixture(scope="module")
def hash_fn():
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    fn = get_hash_fn_by_name(pv._vllm_config().cache_config.prefix_caching_hash_algo)
    init_none_hash(fn)
    return fn


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_the_c_records_hold_the_values_the_python_floor_keeps(groups, hash_fn, tmp_path):
    case = pv.make_case(groups, 128, hash_fn)
    recorder = build(str(tmp_path))
    read_end, write_end = os.pipe()
    recorder.configure(write_end, REASON_CODES)
    try:
        c_side = pv.KVScopeSide(case, measure.CTracing(recorder), measure.CScheduler)
        floor_side = pv.KVScopeSide(case, pv.FloorTracing(), pv.FloorScheduler)
        requests = 3
        c_side.call(c_side.prepare(requests))  # its flush writes the batch
        carriers = [job.trace_carrier for job in c_side.sched._pending_loads]
        floor_side.call(floor_side.prepare(requests))
        kept = floor_side.tracing._kept
        assert c_side.planned() == floor_side.planned() == case.expected_block_ids
    finally:
        recorder.configure(-1, REASON_CODES)
        os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        records = decode(pipe.read())
    assert len(records) == len(kept) == requests
    ids = set()
    for record, carrier, (start, end, values) in zip(records, carriers, kept):
        req_id, local, external, num_groups, scan_records, lookup = values
        assert record.request_id == req_id
        assert record.load[2:] == (local, external) and len(record.scans) == num_groups == groups
        # lookup: queried, hit, miss reason, local tokens (times are the lookups' own, taken apart)
        assert record.lookup[2:] == (lookup[2], lookup[3], REASON_CODES[lookup[4]], lookup[5])
        assert record.lookup[0] <= record.lookup[1] <= record.load[0] <= record.load[1]
        for scan, floor_scan in zip(record.scans, scan_records):
            assert scan[3:] == floor_scan[2:3] + floor_scan[4:]  # index, total, null skipped, pending, start
        times = [record.load[0], *(scan[2] for scan in record.scans)]
        assert times == sorted(times) and times[-1] <= record.load[1]
        assert [scan[1] for scan in record.scans] == times[:-1]  # each scan starts where the last ended
        assert carrier == (record.trace_id >> 64, record.trace_id & (1 << 64) - 1, record.load_span_id)
        ids |= {record.trace_id, record.lookup_span_id, record.load_span_id, *(scan[0] for scan in record.scans)}
    assert 0 not in ids and len(ids) == requests * (3 + groups)
    if groups > 1:  # the sliding windows' null blocks are counted as the Python floor counts them
        assert any(scan[5] > 0 for record in records for scan in record.scans)
