"""The CUDA path of CopyEngine, run on the CPU with recording stand-ins for CUDA streams and events.

No GPU is lent to this project's CI; these tests run the real `_copy_cuda`, `poll` and
`fence_compute_stream` code with the copies done on CPU tensors (so the bytes are checked) and
every stream dependency recorded, to pin the ordering the CUDA path relies on:
- a store waits for the compute stream (it reads what the step's forward wrote);
- a load waits for the compute stream (vLLM may still be zeroing its destination blocks) and, when
  the scheduler says a destination block is one an in-flight store still reads, for the stores
  before it;
- later compute waits for stores only: a load in flight never holds up the next forward (vLLM keeps
  a loading request's blocks until the load is reported done, even when the request is aborted);
- that wait goes in at once after the stores, or, under vLLM's V1 model runner (which saves before
  the sampling and announces each step before writing the KV cache), at the next step's start;
- a job's blocks go to vLLM's `swap_blocks_batch` in one call (here: memmove of the same pointer
  triples), falling back to a copy per block, for good, if that op ever fails.
"""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import pytest
import torch

from connector import copy_engine as copy_engine_module
from connector.sides import store_fence, uses_v2_model_runner
from connector.metadata import LOAD, STORE, GroupTransfer, KVScopeMetadata, TransferJob
from connector.telemetry.tracing import KVScopeTracing
from connector.worker import FENCE_AT_NEXT_STEP, FENCE_AT_ONCE, FENCE_WHEN_REUSED, KVScopeWorker
from tests.unit.test_copy_engine import _block_bytes, _shared_attention_engine, memmove_batch


class _Stream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log
        self.cuda_stream = id(self)  # a stream of its own

    def wait_stream(self, other: _Stream) -> None:
        self.log.append((self.name, "waits for", other.name))

    def synchronize(self) -> None:
        self.log.append((self.name, "synchronized"))


class _Event:
    """As CUDA's: an elapsed time needs two events made for timing and recorded (else it raises)."""

    def __init__(self, enable_timing: bool = False):
        self.timing, self.stream = enable_timing, None

    def record(self, stream=None) -> None:
        self.stream = stream

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: _Event) -> float:
        if not (self.timing and other.timing and self.stream and other.stream):
            raise RuntimeError("both events must be recorded, and made with enable_timing=True")
        return 0.5  # ms


@pytest.fixture
def cuda_engine(monkeypatch):
    """A CopyEngine on CPU tensors taking its CUDA path, with streams that record their waits."""
    log: list = []
    compute = _Stream("compute", log)
    fake_cuda = type("FakeCuda", (), {
        "Stream": staticmethod(lambda device=None: _Stream("new", log)),
        "Event": _Event,
        "current_stream": staticmethod(lambda device=None: compute),
        "stream": staticmethod(lambda s: nullcontext()),
    })
    monkeypatch.setattr(copy_engine_module.torch, "cuda", fake_cuda)
    engine, t0, t1 = _shared_attention_engine()
    engine.is_cuda = True
    engine.load_stream, engine.store_stream = _Stream("load", log), _Stream("store", log)
    return engine, t0, log


def test_store_then_load_round_trip_on_the_cuda_path(cuda_engine):
    engine, t0, log = cuda_engine
    before = _block_bytes(t0, 3).clone()
    stored = engine.store(0, [1], [0], [3])
    assert stored.pending_events is not None and engine.poll(stored) and stored.pending_events is None
    assert stored.end_ns >= stored.start_ns > 0  # the device interval, mapped to wall clock
    t0.view(torch.int8).zero_()
    loaded = engine.load(0, [1], [0], [5])
    assert engine.poll(loaded)
    assert torch.equal(_block_bytes(t0, 5), before)


def test_next_forward_waits_for_stores_not_loads(cuda_engine):
    engine, _, log = cuda_engine
    engine.load(0, [0], [0], [2])
    engine.store(1, [1], [0], [4])
    log.clear()
    engine.fence_compute_stream()
    assert log == [("compute", "waits for", "store")]


def test_each_copy_waits_for_what_it_must(cuda_engine):
    engine, _, log = cuda_engine
    engine.store(0, [1], [0], [3])
    assert log == [("store", "waits for", "compute")]
    log.clear()
    engine.load(0, [1], [0], [5])  # by default as if a destination block were one a store still reads
    assert sorted(log) == [("load", "waits for", "compute"), ("load", "waits for", "store")]
    log.clear()
    engine.load(0, [1], [0], [6], waits_for_stores=False)  # no store in flight reads block 6
    assert log == [("load", "waits for", "compute")]


def test_a_compute_stream_that_became_a_copy_stream_is_said_once(cuda_engine, monkeypatch, caplog):
    """torch's stream pool (32 a priority, round robin) can hand vLLM's compute stream out after the engine
    took its copy streams: the copies stay ordered (one stream), but the forward waits behind loads."""
    engine, _, log = cuda_engine
    with caplog.at_level("ERROR", logger="connector.copy_engine"):
        engine.store(0, [1], [0], [3])
        assert not caplog.records  # the compute stream is none of the copy streams
        monkeypatch.setattr(copy_engine_module.torch.cuda, "current_stream",
                            staticmethod(lambda device=None: engine.load_stream))
        engine.load(0, [1], [0], [5])
        engine.load(0, [1], [0], [6])
    (record,) = caplog.records
    assert "compute stream is one of kvscope's copy streams" in record.getMessage()


def test_a_worker_load_waits_for_the_stores_only_when_its_job_says(cuda_engine):
    """The scheduler tells which loads write a block an unreported store reads
    (`TransferJob.waits_for_stores`); the others start without waiting for the stores in flight."""
    engine, _, log = cuda_engine
    worker = _worker_on(engine)
    for waits in (True, False):
        log.clear()
        job = TransferJob(1 + waits, f"r{waits}", LOAD, [GroupTransfer(0, [5], [1], [0])], waits_for_stores=waits)
        worker.start_load_kv(KVScopeMetadata(loads=[job]))
        assert (("load", "waits for", "store") in log) == waits, log


def test_a_job_is_one_batched_call(cuda_engine):
    engine, t0, _ = cuda_engine
    calls = []

    def op(src, dst, sizes, is_src_access_order_any=False):
        calls.append((len(sizes), is_src_access_order_any))
        memmove_batch(src, dst, sizes)

    engine._swap_blocks_batch = op
    before = [_block_bytes(t0, b).clone() for b in (3, 8)]
    stored = engine.store(0, [1, 2], [0, 0], [3, 8])
    assert calls == [(2 * 2, False)]  # two blocks of two layers, one call; in stream order
    assert stored.keep_alive is not None  # the pointer arrays outlive the call until the copy is done
    assert engine.poll(stored) and stored.keep_alive is None
    loaded = engine.load(0, [2, 1], [0, 0], [6, 5])
    # a load's source, ready host slots pinned for it, is written by nothing: read in any order
    assert calls == [(4, False), (4, True)] and engine.poll(loaded)
    assert torch.equal(_block_bytes(t0, 5), before[0]) and torch.equal(_block_bytes(t0, 6), before[1])


def test_a_failing_batched_op_falls_back_to_block_copies(cuda_engine, caplog):
    engine, t0, _ = cuda_engine
    calls = []

    def broken(src, dst, sizes, is_src_access_order_any=False):
        calls.append(1)
        raise RuntimeError("no cuMemcpyBatchAsync here")

    engine._swap_blocks_batch = broken
    before = _block_bytes(t0, 3).clone()
    with caplog.at_level("ERROR", logger="connector.copy_engine"):
        engine.store(0, [1], [0], [3])
        engine.load(0, [1], [0], [7])
    assert calls == [1] and engine._swap_blocks_batch is None  # tried once, then block by block
    assert torch.equal(_block_bytes(t0, 7), before)
    assert sum("swap_blocks_batch failed" in r.getMessage() for r in caplog.records) == 1


def test_the_batched_copy_is_vllms_own_swap_blocks_batch_where_this_build_has_it():
    custom_ops = pytest.importorskip("vllm._custom_ops")
    if not hasattr(custom_ops, "swap_blocks_batch"):
        pytest.skip("this vLLM build has no swap_blocks_batch: copies go block by block")
    assert copy_engine_module._batched_copy_op() is custom_ops.swap_blocks_batch


def _worker_on(engine) -> KVScopeWorker:
    worker = KVScopeWorker(None, engine.layout, engine.num_slots, ["full_attention", "full_attention"], 0,
                           KVScopeTracing.disabled())
    worker.engine = engine
    return worker


def _a_store(job_id: int) -> KVScopeMetadata:
    return KVScopeMetadata(stores=[TransferJob(job_id, f"req-{job_id}", STORE, [GroupTransfer(0, [3], [1], [0])])])


def test_stores_are_fenced_at_once_by_default(cuda_engine):
    engine, _, log = cuda_engine
    worker = _worker_on(engine)
    worker.wait_for_save(_a_store(1))
    assert log[-1] == ("compute", "waits for", "store")
    log.clear()
    worker.begin_step(KVScopeMetadata())
    worker.check_stores_fenced(KVScopeMetadata())
    assert log == []


def test_under_the_v1_runner_stores_are_fenced_when_the_next_step_begins(cuda_engine):
    """vLLM's V1 runner saves before the sampling: a fence at once would hold the sampling up
    behind the stores. Its next step calls handle_preemptions before any KV cache write."""
    engine, _, log = cuda_engine
    worker = _worker_on(engine)
    worker.store_fence = FENCE_AT_NEXT_STEP
    worker.wait_for_save(_a_store(1))
    assert ("compute", "waits for", "store") not in log
    log.clear()
    worker.begin_step(KVScopeMetadata())
    assert log == [("compute", "waits for", "store")]
    log.clear()
    worker.check_stores_fenced(KVScopeMetadata())
    worker.begin_step(KVScopeMetadata())  # nothing stored since
    assert log == []


def test_when_reused_only_a_step_reallocating_a_store_source_waits(cuda_engine):
    """Caches nothing rewrites in place or zeroes: no step waits for the stores, except one that
    allocates a block a store still reads (the scheduler's `fence_stores`), when it begins."""
    engine, _, log = cuda_engine
    worker = _worker_on(engine)
    worker.store_fence = FENCE_WHEN_REUSED
    worker.wait_for_save(_a_store(1))
    assert ("compute", "waits for", "store") not in log
    for fence_stores in (False, True):
        log.clear()
        meta = KVScopeMetadata(fence_stores=fence_stores)
        worker.begin_step(meta)
        worker.check_stores_fenced(meta)
        assert log == ([("compute", "waits for", "store")] if fence_stores else [])
    assert worker.store_fence == FENCE_WHEN_REUSED


@pytest.mark.parametrize("mode", [FENCE_AT_NEXT_STEP, FENCE_WHEN_REUSED])
def test_a_step_that_was_not_announced_is_fenced_when_its_metadata_is_bound(cuda_engine, caplog, mode):
    engine, _, log = cuda_engine
    worker = _worker_on(engine)
    worker.store_fence = mode
    worker.wait_for_save(_a_store(1))
    log.clear()
    worker.check_stores_fenced(KVScopeMetadata(fence_stores=True))  # bound without handle_preemptions first
    assert log == [("compute", "waits for", "store")]
    assert "did not call handle_preemptions" in caplog.text
    assert worker.store_fence == FENCE_AT_ONCE
    log.clear()
    worker.wait_for_save(_a_store(2))
    assert log[-1] == ("compute", "waits for", "store")  # at once from now on


def test_an_announced_step_covers_only_itself_a_later_unannounced_one_is_still_fenced(cuda_engine, caplog):
    """`begin_step` announces one step: a runner that announced the last step but binds this one's
    metadata without it must still have the stores fenced before this step's forward writes the KV cache."""
    engine, _, log = cuda_engine
    worker = _worker_on(engine)
    worker.store_fence = FENCE_AT_NEXT_STEP
    worker.begin_step(KVScopeMetadata())
    worker.check_stores_fenced(KVScopeMetadata())  # step 1, announced
    worker.wait_for_save(_a_store(1))
    log.clear()
    worker.check_stores_fenced(KVScopeMetadata())  # step 2, bound without handle_preemptions
    assert log == [("compute", "waits for", "store")]
    assert "did not call handle_preemptions" in caplog.text
    assert worker.store_fence == FENCE_AT_ONCE


def test_an_unannounced_step_with_no_fence_due_does_not_wait_for_the_stores(cuda_engine, caplog):
    """Under `when_reused` a step that reallocates no store source need not wait for the stores (they
    may still run): an unannounced one switches the fence to at once for later stores, without a
    fence of its own that would hold its forward up behind them."""
    engine, _, log = cuda_engine
    worker = _worker_on(engine)
    worker.store_fence = FENCE_WHEN_REUSED
    worker.wait_for_save(_a_store(1))
    log.clear()
    worker.check_stores_fenced(KVScopeMetadata(fence_stores=False))
    assert log == []
    assert "did not call handle_preemptions" in caplog.text
    assert worker.store_fence == FENCE_AT_ONCE


def test_where_the_fence_goes_by_runner_and_cache():
    class Rejecting:
        @property
        def use_v2_model_runner(self):
            raise ValueError("HiSparse requires Model Runner V2")

    def config(v2):
        return type("Config", (), {"use_v2_model_runner": v2})()

    def cache(zeroing):
        return type("KVCacheConfig", (), {"needs_kv_cache_zeroing": zeroing})()

    with mock.patch("connector.sides.has_v1_model_runner", return_value=True):
        assert uses_v2_model_runner(object()) is None and uses_v2_model_runner(Rejecting()) is None
        assert store_fence(object(), cache(True)) == FENCE_AT_ONCE  # an unknown runner
    assert store_fence(Rejecting(), cache(False)) == FENCE_AT_ONCE  # a config that cannot tell
    # vLLM 0.34 on: no V1 runner and no switch, so V2 (its CPU runner too): fenced as V2 is
    with mock.patch("connector.sides.has_v1_model_runner", return_value=False):
        assert uses_v2_model_runner(object()) is True
        assert store_fence(object(), cache(True)) == FENCE_AT_ONCE
        assert store_fence(object(), cache(False)) == FENCE_WHEN_REUSED
    for v2 in (False, True):
        assert store_fence(config(v2), cache(False)) == FENCE_WHEN_REUSED
    # blocks zeroed when allocated: V2 zeroes before handle_preemptions, V1 after
    assert store_fence(config(True), cache(True)) == FENCE_AT_ONCE
    assert store_fence(config(False), cache(True)) == FENCE_AT_NEXT_STEP
    assert store_fence(config(False), object()) == FENCE_AT_NEXT_STEP  # a vLLM that cannot tell: as zeroing


def test_vllm_has_its_v1_model_runner_up_to_0_33():
    """Where vLLM's config has no runner switch (0.34 on), the runner is V2 only when vLLM has no V1 runner."""
    import vllm

    from connector.sides import has_v1_model_runner

    major_minor = tuple(int(part) for part in vllm.__version__.split(".")[:2])
    assert has_v1_model_runner() is (major_minor < (0, 34))


def test_a_store_failing_part_way_is_reported_once_nothing_copies_any_more(cuda_engine, monkeypatch):
    """A copy that raises after enqueueing part of its blocks leaves no event behind: the worker
    waits for the copy streams before the job's failure releases its host slots and blocks."""
    engine, _, log = cuda_engine
    worker = _worker_on(engine)

    def enqueue_then_fail(*args):
        log.append(("store", "enqueued part"))
        raise RuntimeError("the copy failed part way")

    monkeypatch.setattr(engine, "_enqueue", enqueue_then_fail)
    worker.wait_for_save(_a_store(7))
    assert log.index(("store", "enqueued part")) < log.index(("store", "synchronized"))
    assert ("load", "synchronized") in log
    meta = worker.build_worker_meta()
    assert meta is not None and meta.failed_jobs == {7: 1}


def test_stores_fenced_at_once_need_no_announced_step(cuda_engine, caplog):
    """A runner that binds metadata without handle_preemptions is fine when stores are fenced at once:
    no second fence, no error."""
    engine, _, log = cuda_engine
    worker = _worker_on(engine)
    worker.wait_for_save(_a_store(1))
    log.clear()
    with caplog.at_level("ERROR", logger="connector.worker"):
        worker.check_stores_fenced(KVScopeMetadata(fence_stores=True))
    assert log == [] and "handle_preemptions" not in caplog.text


def test_an_unannounced_step_is_fenced_for_stores_left_unfenced_even_when_it_reuses_no_block(cuda_engine, caplog):
    """Under the V1 runner's fence the stores wait for the next step; a step bound without
    handle_preemptions must still fence them (the forward writes the KV cache), and only once."""
    engine, _, log = cuda_engine
    worker = _worker_on(engine)
    worker.store_fence = FENCE_AT_NEXT_STEP
    worker.wait_for_save(_a_store(1))
    log.clear()
    worker.check_stores_fenced(KVScopeMetadata(fence_stores=False))
    assert log == [("compute", "waits for", "store")]
    log.clear()
    worker.begin_step(KVScopeMetadata())  # nothing stored since: nothing to wait for
    worker.check_stores_fenced(KVScopeMetadata())
    assert log == []


def test_a_step_polls_each_copy_in_flight_once_not_once_per_later_job():
    """On CUDA a step's stores are still in flight while the step starts them: polling every copy in
    flight after each job was O(jobs²) a step (1024 jobs: 524,800 polls, half a second)."""
    from types import SimpleNamespace

    from connector.copy_engine import CopyResult

    class InFlightEngine:
        is_cuda, num_blocks, polls = True, 1 << 20, 0

        def store(self, group, slots, subs, block_ids):
            return CopyResult(0, len(block_ids), 0, 0, pending_events=object())

        def poll(self, copy):
            self.polls += 1
            return False

        def fence_compute_stream(self):
            pass

    worker = KVScopeWorker(None, SimpleNamespace(group_factors=[1, 1]), 1 << 20, ["full_attention"] * 2, 0,
                           KVScopeTracing.disabled())
    worker.engine = InFlightEngine()
    jobs = [TransferJob(i, f"r{i}", STORE, [GroupTransfer(g, [2 * i + g + 1], [2 * i + g], [0]) for g in (0, 1)])
            for i in range(64)]
    worker.wait_for_save(KVScopeMetadata(stores=jobs))
    assert worker.engine.polls == 64  # one look at each job (its first copy not done)
    assert len(worker._in_flight) == 64


class _FailingClock:
    def interval(self, start, end):
        raise RuntimeError("the device-event clock failed")


def test_a_completed_copy_whose_clock_fails_completes_unmeasured_and_is_logged(cuda_engine, monkeypatch, caplog):
    """The interval is telemetry: a clock that raises costs the copy's duration (and span), never the
    transfer; its blocks and bytes still count, only the duration histogram leaves it out."""
    from connector.telemetry import failures

    monkeypatch.setattr(failures, "_logged", set())
    engine, _, _ = cuda_engine
    engine._clock = _FailingClock()
    worker = _worker_on(engine)
    with caplog.at_level("ERROR", logger="connector.telemetry.failures"):
        worker.wait_for_save(_a_store(1))
        meta = worker.build_worker_meta()
    assert meta is not None and meta.completed_jobs == {1: 1} and not meta.failed_jobs
    assert "device-event interval" in caplog.text and "the device-event clock failed" in caplog.text
    stats = worker.take_stats().data
    assert stats["copy_bytes"] == {"0|full_attention|store": engine._group_block_bytes[0]}
    assert stats["store_bytes"] == {"0|full_attention": engine._group_block_bytes[0]}
    assert "copy_duration_s" not in stats


def test_a_copy_whose_clock_is_made_and_works_is_timed(cuda_engine):
    engine, _, _ = cuda_engine
    worker = _worker_on(engine)
    worker.wait_for_save(_a_store(1))
    assert worker.build_worker_meta().completed_jobs == {1: 1}
    assert list(worker.take_stats().data["copy_duration_s"]) == ["0|full_attention|store"]


# --- found by the mutation campaign of the worker side --------------------------------------------


def test_a_device_error_polling_a_copy_waits_for_the_copy_streams_before_the_job_fails(cuda_engine, monkeypatch):
    """A failed job releases its host slots and device blocks: when asking after its copy raised, the
    copy may still be running, so the worker waits for the copy streams before reporting it."""
    engine, _, log = cuda_engine
    worker = _worker_on(engine)

    def broken(copy):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine, "poll", broken)
    log.clear()
    worker.wait_for_save(_a_store(1))
    assert ("store", "synchronized") in log and ("load", "synchronized") in log
    assert worker.build_worker_meta().failed_jobs == {1: 1}


def test_a_traced_copy_whose_clock_fails_records_no_span_and_loses_none(cuda_engine, monkeypatch):
    """An unmeasured copy (its device-event clock failed) has no interval to put a span on: it records
    none, rather than a span that fails to record and is counted as a lost record."""
    from connector.telemetry import failures
    from connector.telemetry.testing import in_memory_tracing

    monkeypatch.setattr(failures, "_logged", set())
    engine, _, _ = cuda_engine
    engine._clock = _FailingClock()
    tracing, exporter = in_memory_tracing()
    worker = _worker_on(engine)
    worker.tracing = tracing
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(1, "r", STORE, [GroupTransfer(0, [3], [1], [0])],
                                                             trace_carrier=(0xABC, 0xDEF, None))]))
    assert worker.build_worker_meta().completed_jobs == {1: 1}
    assert exporter.get_finished_spans() == ()
    assert "dropped_trace_records" not in worker.take_stats().data


class _SlowCopies:
    """A CUDA engine stand-in whose copies finish only once `done` is set."""

    is_cuda, num_blocks, done = True, 16, False

    def load(self, group, slots, subs, block_ids, waits_for_stores=True):
        from connector.copy_engine import CopyResult

        return CopyResult(0, len(block_ids), 0, 0, pending_events=object())

    def poll(self, copy):
        return self.done


def test_a_load_still_copying_at_its_step_is_reported_once_vllm_asks_after_it_is_done():
    """On CUDA a load is often still copying when `start_load_kv` returns; vLLM asks for finished loads
    (`get_finished`) later: the worker looks at the copies in flight again then, or the request's load
    is never reported and it waits for ever."""
    from types import SimpleNamespace

    worker = KVScopeWorker(None, SimpleNamespace(group_factors=[1]), 4, ["full_attention"], 0,
                           KVScopeTracing.disabled())
    worker.engine = _SlowCopies()
    worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(1, "a", LOAD, [GroupTransfer(0, [5], [1], [0])])]))
    assert worker.transfer_results() == (set(), set())
    worker.engine.done = True
    assert worker.transfer_results() == ({"a"}, set())
    assert worker.build_worker_meta().completed_jobs == {1: 1}


class _CopiesDoneByGroup:
    """A CUDA engine stand-in whose copies finish group by group: `done` holds the finished groups."""

    is_cuda, num_blocks = True, 16

    def __init__(self):
        self.done = set()

    def load(self, group, slots, subs, block_ids, waits_for_stores=True):
        from connector.copy_engine import CopyResult

        return CopyResult(0, len(block_ids), 0, 0, pending_events=group)

    def poll(self, copy):
        return copy.pending_events in self.done


def test_a_load_is_reported_only_once_the_copies_of_all_its_groups_are_done():
    """vLLM runs a request whose load is reported: one reported while another group still copies
    would compute with that group's KV half written."""
    from types import SimpleNamespace

    worker = KVScopeWorker(None, SimpleNamespace(group_factors=[1, 1]), 4, ["full_attention", "sliding_window"], 0,
                           KVScopeTracing.disabled())
    worker.engine = _CopiesDoneByGroup()
    worker.start_load_kv(KVScopeMetadata(loads=[TransferJob(1, "a", LOAD, [
        GroupTransfer(0, [5], [1], [0]), GroupTransfer(1, [6], [2], [0])])]))
    worker.engine.done = {0}
    assert worker.transfer_results() == (set(), set())
    assert worker.build_worker_meta() is None
    worker.engine.done = {0, 1}
    assert worker.transfer_results() == ({"a"}, set())
    assert worker.build_worker_meta().completed_jobs == {1: 1}


def test_the_engines_store_stream_is_neither_the_compute_stream_nor_its_load_stream(monkeypatch):
    """torch's pool hands a stream out again (round robin): a store stream that is the load stream
    queues stores behind large loads, and fencing the stores makes the next forward wait for loads."""
    from types import SimpleNamespace

    log: list = []
    compute, first, second = _Stream("compute", log), _Stream("first", log), _Stream("second", log)
    pool = iter([compute, first, first, second])  # the compute stream, then the load stream, come again
    fake_cuda = type("FakeCuda", (), {"Stream": staticmethod(lambda device=None: next(pool)),
                                      "current_stream": staticmethod(lambda device=None: compute)})
    monkeypatch.setattr(copy_engine_module.torch, "cuda", fake_cuda)
    monkeypatch.setattr(copy_engine_module, "HostBuffer", lambda num_slots, slot_bytes, pin: SimpleNamespace(
        tensor=torch.zeros((num_slots, slot_bytes), dtype=torch.int8)))
    monkeypatch.setattr(copy_engine_module, "_batched_copy_op", lambda: None)
    cache = torch.zeros((4, 64), dtype=torch.int8)
    layout = copy_engine_module.SlotLayout(slot_bytes=64, group_layers=[[("l0", 0, 64)]], group_factors=[1])
    # the first registered cache tells the device: one on CUDA takes the CUDA path
    kv_caches = {"on cuda": SimpleNamespace(device=torch.device("cuda", 0)), "l0": cache}
    engine = copy_engine_module.CopyEngine(kv_caches, SimpleNamespace(num_blocks=4), layout, 2)
    assert engine.is_cuda and (engine.load_stream, engine.store_stream) == (first, second)


def test_the_calibration_stream_is_none_of_the_copy_streams(cuda_engine, monkeypatch):
    """Calibration events wait on their stream: one recorded behind stores would place copy starts
    by the stores' end, and make the worker wait for them."""
    engine, _, log = cuda_engine
    fresh = _Stream("calibration", log)
    pool = iter([engine.store_stream, engine.load_stream, fresh])
    monkeypatch.setattr(copy_engine_module.torch.cuda, "Stream", lambda device=None: next(pool))
    assert engine.poll(engine.store(0, [1], [0], [3]))
    assert engine._clock._stream is fresh


def test_a_copy_is_done_when_its_end_event_is_not_when_its_start_is(cuda_engine):
    """The start event completes as the copy begins: a copy taken for done then releases a load's
    blocks to the next forward, or a store's host slot to a load, before its bytes are there."""
    engine, _, _ = cuda_engine

    class _Pending(_Event):
        def query(self) -> bool:
            return False

    stored = engine.store(0, [1], [0], [3])
    stored.pending_events = (_Event(), _Pending())
    assert not engine.poll(stored) and stored.pending_events is not None


def test_a_copys_start_and_end_are_timing_events_recorded_on_its_own_stream(cuda_engine):
    """A CUDA event never recorded reads as complete: a copy whose end event was not recorded behind it on
    its stream would be taken for done at once, its load's blocks handed to the next forward before its bytes
    are there. Events made without timing would leave every copy unmeasured."""
    engine, _, _ = cuda_engine
    stored = engine.store(0, [1], [0], [3])
    loaded = engine.load(0, [1], [0], [5])
    for copy, stream in ((stored, engine.store_stream), (loaded, engine.load_stream)):
        start, end = copy.pending_events
        assert start.timing and end.timing and start.stream is stream and end.stream is stream
        assert engine.poll(copy) and copy.end_ns >= copy.start_ns > 0


def test_copies_still_in_flight_at_shutdown_are_reported_once_the_device_is_synchronized(monkeypatch):
    """The connector shuts its tracing down right after the worker: the last step's copies, done once
    shutdown synchronizes the device, are collected then, or their copy spans never reach the trace."""
    from types import SimpleNamespace

    from connector import worker as worker_module
    from connector.copy_engine import CopyResult
    from connector.telemetry.testing import in_memory_tracing

    class _Engine:
        is_cuda, num_blocks, device, done, closed = True, 16, "cuda:0", False, False

        def store(self, group, slots, subs, block_ids):
            return CopyResult(64, len(block_ids), None, None, pending_events=object())

        def poll(self, copy):
            if self.done:
                copy.start_ns, copy.end_ns, copy.pending_events = 1_000, 2_000, None
            return self.done

        def fence_compute_stream(self):
            pass

        def close(self):
            self.closed = True

    synchronized = []
    monkeypatch.setattr(worker_module.torch.cuda, "synchronize", synchronized.append)
    tracing, exporter = in_memory_tracing()
    worker = KVScopeWorker(None, SimpleNamespace(group_factors=[1]), 4, ["full_attention"], 0, tracing)
    worker.engine = _Engine()
    worker.wait_for_save(KVScopeMetadata(stores=[TransferJob(1, "r", STORE, [GroupTransfer(0, [5], [1], [0])],
                                                             trace_carrier=(0xABC, 0xDEF, None))]))
    assert worker.build_worker_meta() is None  # still copying
    worker.engine.done = True  # what synchronizing the device makes of every copy
    worker.shutdown()
    tracing.shutdown()  # as the connector does next
    assert synchronized == ["cuda:0"] and worker.engine.closed and worker._in_flight == []
    (span,) = exporter.get_finished_spans()
    assert span.name == "kvscope.group.copy" and span.attributes["kvscope.request.id"] == "r"
