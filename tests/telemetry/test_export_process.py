"""ExportProcess: span records are encoded and exported by a helper process, never lost."""

from __future__ import annotations

import contextlib
import json
import logging
import marshal
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import pytest
from opentelemetry.sdk.trace.export import SpanExportResult

from connector.telemetry.export_process import _HEADER, _MARSHAL_VERSION, ExportProcess, _enlarge_pipe, _read_frame
from connector.telemetry.sinks import Sinks, build_exporters
from connector.telemetry.span_records import LOAD_SPAN, LOOKUP_SPAN, SCAN_SPAN
from connector.telemetry.tracing import KVScopeTracing

from .descriptors import descriptors_open_on


class _Keep:
    def __init__(self):
        self.records = []

    def on_end(self, record):
        self.records.append(record)


def _records(requests: int = 3) -> list[tuple]:
    """Records of `requests` traced requests (lookup, load, scan) plus one general span."""
    keep = _Keep()
    tracing = KVScopeTracing(keep, None)
    for i in range(requests):
        lookup = tracing.record(LOOKUP_SPAN, None, 10, 20, (f"req-{i}", 64, 32, "evicted", 16))
        load = tracing.open_span(lookup, 30)
        tracing.record(SCAN_SPAN, load, 31, 32, (0, "sliding_window", 8, 3, 2, 5))
        tracing.end_span(LOAD_SPAN, load, 40, (f"req-{i}", 16, 32, 1))
    span = tracing.start_span("custom", start_time=50)
    span.set_attributes({"flag": True, "ratio": 0.5, "ids": [1, 2]})
    span.end(60)
    return keep.records


def _spans(path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                out.extend(ss["spans"])
    return out


def _sinks(path) -> Sinks:
    return Sinks(str(path), {}, {"service.name": "kvscope-test"})


# How long a test waits for a signal to take effect on the helper: far past any scheduling delay.
SIGNAL_DEADLINE_S = 30.0


def _wait_until_dead(pid: int) -> None:
    """Until the killed helper (our child) has exited: its end of the pipe is closed then. Not
    reaped (``WNOWAIT``): the `ExportProcess` still reaps it through its own `Popen`."""
    deadline = time.monotonic() + SIGNAL_DEADLINE_S
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        assert time.monotonic() < deadline, f"the helper (pid {pid}) still runs {SIGNAL_DEADLINE_S:.0f} s after SIGKILL"
        time.sleep(0.01)


def _wait_until_stopped(pid: int) -> None:
    """Until the helper is really stopped (SIGSTOP takes effect asynchronously)."""
    deadline = time.monotonic() + SIGNAL_DEADLINE_S
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        assert time.monotonic() < deadline, f"the helper (pid {pid}) still runs {SIGNAL_DEADLINE_S:.0f} s after SIGSTOP"
        time.sleep(0.01)


def test_the_helper_writes_exactly_what_the_engine_process_would(tmp_path):
    records = _records()
    helper = ExportProcess(_sinks(tmp_path / "helper.jsonl"))
    try:
        helper.export(records)
        assert helper.force_flush(10_000)  # a flush ends a line: batches that arrive together share one
        helper.export(records[:2])
        assert helper.force_flush(10_000)
        assert helper.pid is not None and helper.pid != os.getpid()
    finally:
        helper.shutdown()
    (here,) = build_exporters(_sinks(tmp_path / "here.jsonl"))
    here.export(records)
    here.export(records[:2])
    here.shutdown()
    assert (tmp_path / "helper.jsonl").read_text() == (tmp_path / "here.jsonl").read_text()
    assert len(_spans(tmp_path / "helper.jsonl")) == len(records) + 2


def test_batches_that_arrive_together_are_exported_together(tmp_path):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    with _stopped(helper):
        for b in range(4):
            helper.export_nowait(_numbered(1 + 10 * b, 10))
    assert helper.force_flush(10_000)
    helper.shutdown()
    assert _request_ids(path) == list(range(41))
    assert len(path.read_text().splitlines()) == 2  # the first request's line, then one for all four batches


def test_shutdown_drains_the_helper_and_it_exits(tmp_path):
    helper = ExportProcess(_sinks(tmp_path / "t.jsonl"))
    helper.export(_records(50))
    pid = helper.pid
    helper.shutdown()  # no flush before: closing the pipe must still write everything
    assert len(_spans(tmp_path / "t.jsonl")) == 50 * 3 + 1
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped: gone


def test_the_helpers_warnings_are_logged_here_once(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = blocker / "traces.jsonl"  # a path under a regular file: cannot be created
    helper = ExportProcess(_sinks(bad))
    with caplog.at_level(logging.WARNING):
        try:
            for _ in range(3):
                helper.export(_records(1))
            helper.force_flush(10_000)
        finally:
            helper.shutdown()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(bad) in warnings[0], warnings
    assert helper.dropped_spans == 3 * len(_records(1))  # every record its sink failed, counted here
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # word for word what the sink says in this process
        for exporter in build_exporters(_sinks(bad)):
            exporter.export(_records(1))
            exporter.shutdown()
    assert warnings == [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_warning_the_helper_logs_while_it_starts_is_logged_here_and_the_helper_still_runs(tmp_path, caplog):
    # "500ms" is not a number of milliseconds the OTLP exporter takes: it warns while the helper
    # builds its sinks, before the helper says it is ready.
    otel = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces", "OTEL_EXPORTER_OTLP_TIMEOUT": "500ms"}
    path = tmp_path / "t.jsonl"
    helper = ExportProcess(Sinks(str(path), otel, {"service.name": "kvscope-test"}), stop_timeout_s=5)
    with caplog.at_level(logging.WARNING):
        try:
            helper.export(_records(1))
            assert helper.pid is not None, "the helper did not start"
            helper.force_flush(10_000)  # (False: the OTLP sink, at a port that refuses, failed the records)
        finally:
            helper._sinks = _sinks(path)  # (no OTLP retries while it shuts down)
            helper.shutdown()
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in messages if "export process failed" in m], messages
    assert any("OTEL_EXPORTER_OTLP_TIMEOUT" in m or "500ms" in m for m in messages), messages
    assert len(_spans(path)) == 4
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # word for word what building the sinks says in this process
        for exporter in build_exporters(Sinks(str(tmp_path / "here.jsonl"), otel, {"service.name": "kvscope-test"})):
            exporter.shutdown()
    here = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert here and set(here) <= set(messages), (here, messages)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_to_the_process_group_leaves_the_helper_to_drain_at_shutdown(tmp_path, signum):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    with _stopped(helper):  # what it has not read yet is still in the pipe
        helper.export_nowait(_numbered(1, 10))
        os.kill(helper.pid, signum)  # as a service manager's stop or a Ctrl-C reaches every process
    time.sleep(0.2)
    assert helper.pid is not None, "the signal ended the helper"
    helper.shutdown()
    assert _request_ids(path) == list(range(11))


def test_a_dead_helper_fails_over_to_this_process_without_losing_later_spans(tmp_path, caplog):
    path = tmp_path / "t.jsonl"
    helper = ExportProcess(_sinks(path))
    helper.export(_records(1))
    assert helper.force_flush(10_000)
    pid = helper.pid
    os.kill(pid, signal.SIGKILL)
    _wait_until_dead(pid)  # the next write finds the pipe broken
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # the first batch to reach the dead pipe fails over; all three must land
            helper.export(_records(1))
        assert helper.force_flush(10_000)
    helper.shutdown()
    failures = [r.getMessage() for r in caplog.records if "export process failed" in r.getMessage()]
    assert len(failures) == 1
    names = [s["name"] for s in _spans(path)]
    # the one exported before the kill, and all three after it: the first one, which found the
    # pipe broken, is exported here by the fail-over
    assert names.count("kvscope.lookup") == 4


def test_a_forked_child_gets_its_own_helper_and_the_parents_still_exits(tmp_path):
    path = tmp_path / "t.jsonl"
    helper = ExportProcess(_sinks(path))
    helper.export(_records(1))
    assert helper.force_flush(10_000)
    parent_helper = helper.pid
    pid = os.fork()
    if pid == 0:
        try:
            helper.export(_records(2))
            ok = helper.force_flush(10_000) and helper.pid not in (None, parent_helper)
            helper.shutdown()
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    helper.export(_records(1))
    started = time.monotonic()
    helper.shutdown()  # the child dropped its copy of the pipe: the parent's helper sees the end
    assert time.monotonic() - started < 10
    assert [s["name"] for s in _spans(path)].count("kvscope.lookup") == 4


def test_tracing_exports_through_a_helper_unless_told_otherwise(tmp_path):
    for mode, helper_expected in ((None, True), ("thread", False), ("process", True)):
        env = {} if mode is None else {"KVSCOPE_TRACE_EXPORT": mode}
        path = tmp_path / f"{mode}.jsonl"
        tracing = KVScopeTracing.from_config(str(path), 1.0, env=env)
        tracing.record(LOOKUP_SPAN, None, 1, 2, ("r", 1, 0, "new", 0))
        assert tracing.force_flush()
        exporters = tracing._processor._exporters
        assert isinstance(exporters[0], ExportProcess) == helper_expected
        tracing.shutdown()
        assert [s["name"] for s in _spans(path)] == ["kvscope.lookup"]


def test_a_bad_export_mode_names_the_variable_and_the_accepted_values(tmp_path):
    with pytest.raises(ValueError, match=r"KVSCOPE_TRACE_EXPORT='inline'.*'process'.*'thread'"):
        KVScopeTracing.from_config(str(tmp_path / "t.jsonl"), 1.0, env={"KVSCOPE_TRACE_EXPORT": "inline"})


def test_the_helper_yields_to_the_engine_and_ignores_a_decoy_package_in_the_working_directory(
        tmp_path, monkeypatch):
    decoy = tmp_path / "cwd" / "connector"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise RuntimeError('decoy package imported')\n")
    monkeypatch.chdir(decoy.parent)
    monkeypatch.setenv("PYTHONPATH", str(decoy.parent))
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})  # as vLLM's CPU backend pins the thread that starts the helper
    try:
        helper = ExportProcess(_sinks(tmp_path / "t.jsonl"))
        helper.export(_records(1))
        assert helper.force_flush(10_000)
        with open(f"/proc/{helper.pid}/stat") as f:
            nice = int(f.read().rsplit(")", 1)[1].split()[16])
        assert nice == min(os.nice(0) + 10, 19)  # (19: the lowest priority, for a suite run under nice)
        assert os.sched_getaffinity(helper.pid) == allowed
        helper.shutdown()
    finally:
        os.sched_setaffinity(0, allowed)
    assert len(_spans(tmp_path / "t.jsonl")) == 4


def test_shutdown_does_not_hang_on_a_helper_that_stopped_reading(tmp_path, caplog):
    helper = ExportProcess(_sinks(tmp_path / "t.jsonl"), stop_timeout_s=1.0)
    helper.export(_records(1))
    assert helper.force_flush(10_000)
    pid = helper.pid
    os.kill(pid, signal.SIGSTOP)  # alive, never reads again
    _wait_until_stopped(pid)
    errors = []

    def write():
        try:
            for _ in range(100):
                helper.export(_records(200))
        except Exception as exc:  # (the lock shutdown gave up on is still the writer's to release)
            errors.append(exc)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    # Until the pipe (1 MiB) is full and the writer waits for it, holding the exporter's lock.
    deadline = time.monotonic() + SIGNAL_DEADLINE_S
    while not (helper._lock.locked() and helper._pending_bytes > 0 and not _writable(helper._fd)):
        assert writer.is_alive(), "the writer finished: the stopped helper's pipe never filled up"
        assert time.monotonic() < deadline, "the writer did not fill the stopped helper's pipe"
        time.sleep(0.01)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        helper.shutdown()
    assert time.monotonic() - started < 10
    writer.join(10)
    assert not writer.is_alive()  # the kill broke the pipe: the write failed instead of blocking
    assert not errors, errors
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    # Killed and said so, whichever way shutdown found the writer: blocked on the full pipe holding the
    # lock ("stopped reading"), or between two of its writes (the helper then never exits on its own)
    assert any("killed it" in r.getMessage() for r in caplog.records)


def _writable(fd: int) -> bool:
    """Whether the pipe takes a write now (room for at least PIPE_BUF bytes)."""
    return bool(select.select([], [fd], [], 0)[1])


def _numbered(first: int, count: int) -> list[tuple]:
    """`count` lookup records with request ids req-<first>.. (to check order and loss)."""
    keep = _Keep()
    tracing = KVScopeTracing(keep, None)
    for i in range(first, first + count):
        tracing.record(LOOKUP_SPAN, None, 10, 20, (f"req-{i}", 64, 32, "evicted", 16))
    return keep.records


def _request_ids(path) -> list[int]:
    ids = []
    for span in _spans(path):
        for attr in span["attributes"]:
            if attr["key"] == "kvscope.request.id":
                ids.append(int(attr["value"]["stringValue"].split("-")[1]))
    return ids


@contextlib.contextmanager
def _stopped(helper: ExportProcess, settle: bool = False):
    """The helper stopped (SIGSTOP) for the block, alive and reading nothing; ``settle``: wait until
    the stop has taken effect (it does asynchronously)."""
    os.kill(helper.pid, signal.SIGSTOP)
    try:
        if settle:
            _wait_until_stopped(helper.pid)
        yield
    finally:
        os.kill(helper.pid, signal.SIGCONT)


def _fill_the_pipe(helper: ExportProcess, extra: int) -> int:
    """Batches of 200 records through `export_nowait` until the (stopped) helper's pipe is full,
    then ``extra`` more; returns how many."""
    batches = 0
    while helper._pending_bytes == 0 and batches < 10_000:
        helper.export_nowait(_numbered(1 + 200 * batches, 200))
        batches += 1
    for _ in range(extra):
        helper.export_nowait(_numbered(1 + 200 * batches, 200))
        batches += 1
    return batches


def _started(path) -> ExportProcess:
    helper = ExportProcess(_sinks(path))
    helper.export(_numbered(0, 1))
    assert helper.force_flush(10_000) and helper.accepts_nowait
    return helper


def test_the_engine_threads_batches_never_wait_for_a_helper_that_stopped_reading_and_none_is_lost(tmp_path):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    with _stopped(helper):  # alive, reads nothing: the pipe fills up
        started = time.monotonic()
        batches = _fill_the_pipe(helper, extra=20)
        assert time.monotonic() - started < 5  # marshalling only; a blocking write would hang here
        assert helper._pending_bytes > 0  # what the pipe did not take waits, in order
    helper.catch_up()  # the export thread's part: waits for the helper to read the rest
    assert helper._pending_bytes == 0
    assert helper.force_flush(10_000)
    helper.shutdown()
    assert _request_ids(path) == list(range(1 + 200 * batches))


def test_the_engine_threads_batches_fill_a_mebibyte_of_pipe_before_any_waits_here(tmp_path):
    """Found by mutation testing: the helper's pipe is enlarged to 1 MiB (Linux's default 64 KiB holds
    about four batches), so a helper busy for a moment leaves nothing waiting in the engine process."""
    with open("/proc/sys/fs/pipe-max-size") as f:
        if int(f.read()) < 1 << 20:
            pytest.skip("pipes cannot hold 1 MiB here (/proc/sys/fs/pipe-max-size)")
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    with _stopped(helper, settle=True):
        batches = _fill_the_pipe(helper, extra=0)  # until a batch waits here
    batch_bytes = len(marshal.dumps(("spans", _numbered(1, 200)), 2))
    assert (batches - 1) * batch_bytes > 900 << 10, f"the pipe took {batches - 1} batches of {batch_bytes} bytes"
    helper.shutdown()
    assert _request_ids(path) == list(range(1 + 200 * batches))


def test_a_helper_too_far_behind_loses_whole_batches_counted_and_logged_once(tmp_path, caplog, monkeypatch):
    import connector.telemetry.export_process as export_process

    monkeypatch.setattr(export_process, "_MAX_PENDING_BYTES", 100_000)
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    with _stopped(helper):
        batches = _fill_the_pipe(helper, extra=20)  # 20 batches are ~240 KB: over the limit
        dropped = helper.dropped_spans
        assert dropped > 0 and dropped % 200 == 0  # whole batches, the memory held stays bounded
        assert helper._pending_bytes < 100_000 + 20_000
    with caplog.at_level(logging.WARNING):
        helper.catch_up()
        helper.export_nowait(_numbered(9_000_000, 1))
        helper.catch_up()
    assert helper.force_flush(10_000)
    helper.shutdown()
    ids = _request_ids(path)
    assert len(ids) == 1 + 200 * batches + 1 - dropped and ids == sorted(ids) and ids[-1] == 9_000_000
    assert len([r for r in caplog.records if "fell behind" in r.getMessage()]) == 1


def test_a_helper_dying_under_the_engine_threads_batches_fails_over_and_loses_none_it_had_not_read(
        tmp_path, caplog):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    os.kill(helper.pid, signal.SIGSTOP)
    batches = _fill_the_pipe(helper, extra=5)  # part in the pipe, the rest waiting here
    waiting = helper._pending_bytes
    pid = helper.pid
    os.kill(pid, signal.SIGKILL)
    _wait_until_dead(pid)  # the next write finds the pipe broken
    last = 200 * batches
    with caplog.at_level(logging.WARNING):
        helper.export_nowait(_numbered(last + 1, 200))  # the write fails: no waiting, no raising
        assert not helper.accepts_nowait  # the batcher now leaves batches to the export thread
        helper.catch_up()  # fails over: what the helper had not read is exported here
        helper.export(_numbered(last + 201, 1))
    assert helper.force_flush(10_000)
    helper.shutdown()
    ids = _request_ids(path)
    # Lost: only the batches already in the dead helper's pipe. Every batch still waiting here
    # (the one the pipe had taken in part among them) and every later one lands, once, in order.
    assert waiting > 0 and ids[0] == 0
    assert ids[1:] == list(range(ids[1], last + 202)) and (ids[1] - 1) % 200 == 0
    # and those are counted and said, not silently lost
    lost = ids[1] - 1
    assert lost > 0 and helper.dropped_spans == lost
    (failed,) = [r.getMessage() for r in caplog.records if "export process failed" in r.getMessage()]
    assert f"{lost} spans it had read but not written are lost" in failed
    assert not [r for r in caplog.records if "fell behind" in r.getMessage()]  # it died, it did not fall behind


def test_a_helper_that_fell_behind_then_died_counts_both_losses(tmp_path, monkeypatch):
    """Found by mutation testing: what the death loses adds to what falling behind dropped before it.
    Every record sent is either written or counted lost."""
    import connector.telemetry.export_process as export_process

    monkeypatch.setattr(export_process, "_MAX_PENDING_BYTES", 100_000)
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    pid = helper.pid
    os.kill(pid, signal.SIGSTOP)
    _wait_until_stopped(pid)
    batches = _fill_the_pipe(helper, extra=20)
    behind = helper.dropped_spans
    assert behind > 0  # fell behind: whole batches dropped
    os.kill(pid, signal.SIGKILL)
    _wait_until_dead(pid)
    helper.catch_up()  # fails over: the pipe's contents are lost too
    helper.shutdown()
    written = len(_request_ids(path))
    assert helper.dropped_spans > behind
    assert written + helper.dropped_spans == 1 + 200 * batches


def test_spans_of_a_finished_step_survive_the_engine_process_being_killed(tmp_path):
    """vLLM's shutdown can SIGTERM the engine core while it tears down (its handlers already reset),
    right after its last step: what the connector recorded up to the end of a step is in the helper's
    pipe by then, and the helper writes it after the engine process is gone."""
    path = tmp_path / "killed.jsonl"
    script = (
        "import os, signal, time\n"
        "from connector.telemetry.span_records import LOOKUP_SPAN\n"
        "from connector.telemetry.tracing import KVScopeTracing\n"
        f"t = KVScopeTracing.from_config(trace_file={str(path)!r}, sample_ratio=1.0)\n"
        "t.record(LOOKUP_SPAN, None, 1, 2, ('warm-up', 1, 1, 'tail', 0))\n"
        "assert t.force_flush()\n"  # the helper runs (it starts on the first export)
        "t.record(LOOKUP_SPAN, None, 3, 4, ('last-step', 64, 32, 'new', 0))\n"
        "t.end_step()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == -signal.SIGKILL
    deadline = time.time() + 30  # the orphaned helper drains its pipe, writes and exits
    while time.time() < deadline:
        ids = [a["value"]["stringValue"] for span in (_spans(path) if path.exists() else [])
               for a in span["attributes"] if a["key"] == "kvscope.request.id"]
        if "last-step" in ids:
            break
        time.sleep(0.2)
    assert ids == ["warm-up", "last-step"]


def _bare_helper():
    """The helper started as `ExportProcess` starts it, for tests that play the engine's side frame by
    frame: (its `Popen`, stdin unbuffered; the read end of its replies)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    reply_read, reply_write = os.pipe()
    helper = subprocess.Popen([sys.executable, "-P", "-m", "connector.telemetry.export_process", str(reply_write)],
                              env={**os.environ, "PYTHONPATH": root}, stdin=subprocess.PIPE,
                              stderr=subprocess.PIPE, bufsize=0, pass_fds=(reply_write,))
    os.close(reply_write)
    return helper, os.fdopen(reply_read, "rb", buffering=0)


def _frame(message, version: int = marshal.version) -> bytes:
    """One message to the helper as the engine's side frames it (spans at `_MARSHAL_VERSION`)."""
    payload = marshal.dumps(message, version)
    return _HEADER.pack(len(payload)) + payload


def _ready_helper(path):
    """A bare helper sent the sinks writing `path`, once it answered that it is ready."""
    helper, replies = _bare_helper()
    helper.stdin.write(_frame(asdict(_sinks(path))))
    assert _read_frame(replies, 30) == ("ready",)
    return helper, replies


def test_a_helper_whose_engine_died_writes_everything_it_was_sent_and_exits_cleanly(tmp_path):
    """Its replies then go nowhere (a broken pipe): that must not end it before it has written
    every batch waiting in its pipe (a flush among them, whose answer fails to go out)."""
    path = tmp_path / "t.jsonl"
    helper, replies = _ready_helper(path)
    _enlarge_pipe(helper.stdin.fileno())  # as the engine's side does: 600 spans exceed Linux's default 64 KiB
    os.kill(helper.pid, signal.SIGSTOP)  # everything below waits in its pipe
    for first in range(0, 600, 100):
        helper.stdin.write(_frame(("spans", _numbered(first, 100)), _MARSHAL_VERSION))
        if first == 200:
            helper.stdin.write(_frame(("flush", 1)))
    helper.stdin.close()
    replies.close()  # the engine process is gone: both ends closed
    os.kill(helper.pid, signal.SIGCONT)
    assert helper.wait(30) == 0, helper.stderr.read().decode()[-2000:]
    assert _request_ids(path) == list(range(600))


def test_a_helper_whose_engine_died_mid_frame_writes_every_whole_batch_and_exits_cleanly(tmp_path):
    """Found by mutation testing: a frame cut short by the engine's death is the end of the stream,
    not a crash that would lose the batches read before it."""
    path = tmp_path / "t.jsonl"
    helper, replies = _ready_helper(path)
    with replies:
        os.kill(helper.pid, signal.SIGSTOP)  # everything below waits in its pipe
        for first in range(0, 30, 10):
            helper.stdin.write(_frame(("spans", _numbered(first, 10)), _MARSHAL_VERSION))
        frame = _frame(("spans", _numbered(30, 10)), _MARSHAL_VERSION)
        helper.stdin.write(frame[:len(frame) // 2])  # cut short: the header promises the whole payload
        helper.stdin.close()
        os.kill(helper.pid, signal.SIGCONT)
        assert helper.wait(30) == 0, helper.stderr.read().decode()[-2000:]
    assert _request_ids(path) == list(range(30))


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_trace_file_of_dev_stdout_or_stderr_is_the_engine_processs_stream(stream):
    """The helper's replies have a pipe of their own: its stdout and stderr are the engine's, so
    spans written to /dev/stdout reach whatever reads the engine's stdout (a container's log)."""
    script = (
        "import sys\n"
        "from connector.telemetry.span_records import LOOKUP_SPAN\n"
        "from connector.telemetry.tracing import KVScopeTracing\n"
        f"t = KVScopeTracing.from_config(trace_file='/dev/{stream}', sample_ratio=1.0)\n"
        "for i in range(200):\n"
        "    t.record(LOOKUP_SPAN, None, 1, 2, (f'req-{i}', 64, 32, 'new', 0))\n"
        "assert t.force_flush()\n"
        "t.shutdown()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in getattr(proc, stream).splitlines() if line.startswith('{"resourceSpans"')]
    ids = [a["value"]["stringValue"] for line in lines for rs in json.loads(line)["resourceSpans"]
           for ss in rs["scopeSpans"] for span in ss["spans"] for a in span["attributes"]
           if a["key"] == "kvscope.request.id"]
    assert ids == [f"req-{i}" for i in range(200)]


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_spans_to_dev_stdout_redirected_to_a_file_keep_the_engines_own_lines(tmp_path, mode):
    """`vllm serve ... > log`: the trace file is the engine's own stdout, so its lines and the engine's
    share one write offset (a file opened anew at /dev/stdout has its own, and writes over them)."""
    script = (
        "from connector.telemetry.span_records import LOOKUP_SPAN\n"
        "from connector.telemetry.tracing import KVScopeTracing\n"
        "t = KVScopeTracing.from_config(trace_file='/dev/stdout', sample_ratio=1.0)\n"
        "for i in range(50):\n"
        "    print(f'engine line {i:04d} ' + 'x' * 60, flush=True)\n"
        "    t.record(LOOKUP_SPAN, None, 1, 2, (f'req-{i}', 64, 32, 'new', 0))\n"
        "    assert t.force_flush()\n"
        "t.shutdown()\n"
    )
    out = tmp_path / "engine.log"
    with open(out, "w") as stdout:  # `>`: no O_APPEND
        proc = subprocess.run([sys.executable, "-c", script], timeout=120, stdout=stdout, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "KVSCOPE_TRACE_EXPORT": mode},
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = out.read_text().splitlines()
    assert [line for line in lines if line.startswith("engine line")] == [
        f"engine line {i:04d} " + "x" * 60 for i in range(50)]
    spans = [line for line in lines if not line.startswith("engine line")]
    ids = [a["value"]["stringValue"] for line in spans for rs in json.loads(line)["resourceSpans"]
           for ss in rs["scopeSpans"] for span in ss["spans"] for a in span["attributes"]
           if a["key"] == "kvscope.request.id"]
    assert ids == [f"req-{i}" for i in range(50)]


# ------------------------------------------------------------------ pinned by a mutation campaign of export_process.py
@pytest.mark.parametrize("then", ["catch_up", "export", "force_flush"])
def test_a_batch_handed_over_before_the_helper_runs_is_left_to_the_export_thread(tmp_path, then):
    """The engine thread never starts the helper: its batch waits for the export thread's next call,
    which starts the helper and sends that batch first."""
    path = tmp_path / "t.jsonl"
    helper = ExportProcess(_sinks(path))
    assert not helper.accepts_nowait
    helper.export_nowait(_numbered(0, 3))
    assert helper.pid is None and not path.exists()
    if then == "catch_up":
        helper.catch_up()
    elif then == "export":
        helper.export(_numbered(3, 1))
    assert helper.force_flush(10_000)
    assert helper.pid is not None and helper.accepts_nowait
    assert not helper._acks  # an answered flush leaves nothing behind (else one event per flush, for ever)
    assert _request_ids(path) == list(range(4 if then == "export" else 3))  # written once the flush returns
    helper.shutdown()


def _unmarshallable() -> list[tuple]:
    """A general span whose attribute value marshal refuses (a str subclass: an enum member, say)."""
    import enum

    class Direction(str, enum.Enum):
        LOAD = "load"

    keep = _Keep()
    tracing = KVScopeTracing(keep, None)
    span = tracing.start_span("custom", start_time=1)
    span.set_attribute("kvscope.direction", Direction.LOAD)
    span.end(2)
    return keep.records


def test_a_batch_marshal_cannot_carry_is_exported_here_in_its_place(tmp_path):
    """The export thread writes that batch in this process; the helper goes on with the next ones."""
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    helper.export_nowait(_unmarshallable())
    helper.catch_up()
    assert helper.export(_unmarshallable()) is SpanExportResult.SUCCESS
    helper.export_nowait(_numbered(1, 1))
    assert helper.force_flush(10_000) and helper.accepts_nowait
    helper.shutdown()
    names = [s["name"] for s in _spans(path)]
    assert names == ["kvscope.lookup", "custom", "custom", "kvscope.lookup"]


def test_a_batch_sent_by_the_export_thread_leaves_at_once(tmp_path):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    helper.export(_numbered(1, 1))  # no flush: the helper writes it as soon as it has read it
    deadline = time.monotonic() + 10
    waits = set()  # where the helper sleeps meanwhile (the kernel's wchan)
    while _request_ids(path) != [0, 1]:
        assert time.monotonic() < deadline, "the batch did not leave for the helper"
        with open(f"/proc/{helper.pid}/wchan") as f:
            waits.add(f.read())
        time.sleep(0.005)
    helper.shutdown()
    # it looks for more frames without waiting for them (a select with a timeout sleeps in poll)
    assert not [w for w in waits if "poll" in w or "select" in w], waits


def test_a_flush_that_finds_the_helper_dead_fails_over_at_once(tmp_path, caplog):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    pid = helper.pid
    os.kill(pid, signal.SIGKILL)
    _wait_until_dead(pid)
    with caplog.at_level(logging.WARNING):
        started = time.monotonic()
        assert helper.force_flush(10_000)
        assert time.monotonic() - started < 5
    (failed,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]  # (no batch to write)
    assert "export process failed" in failed
    assert not helper._acks and not helper.accepts_nowait
    helper.export(_numbered(1, 1))
    helper.shutdown()
    assert _request_ids(path) == [0, 1]


def test_batches_waiting_here_when_the_helper_dies_are_written_here_by_the_next_catch_up(tmp_path):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    os.kill(helper.pid, signal.SIGSTOP)
    batches = _fill_the_pipe(helper, extra=3)
    pid = helper.pid
    os.kill(pid, signal.SIGKILL)
    _wait_until_dead(pid)
    helper.catch_up()
    assert not helper.accepts_nowait  # failed over
    ids = _request_ids(path)
    assert ids[-1] == 200 * batches  # what waited here was written at once, in order
    assert ids[1:] == list(range(ids[1], 200 * batches + 1)) and helper.dropped_spans == ids[1] - 1
    helper.shutdown()


def test_shutdown_kills_a_helper_that_stopped_reading_and_writes_what_waited_here(tmp_path, caplog):
    path = tmp_path / "t.jsonl"
    helper = ExportProcess(_sinks(path), stop_timeout_s=1.0)
    helper.export(_numbered(0, 1))
    assert helper.force_flush(10_000)
    pid = helper.pid
    os.kill(pid, signal.SIGSTOP)
    _wait_until_stopped(pid)
    batches = _fill_the_pipe(helper, extra=3)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        helper.shutdown()  # must not raise: the pipe never drains within stop_timeout_s
    assert time.monotonic() - started < 10
    (failed,) = [r.getMessage() for r in caplog.records if "export process failed" in r.getMessage()]
    assert "TimeoutError('the span export helper stopped reading')" in failed  # says why
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    ids = _request_ids(path)
    # what the stopped helper's pipe held is lost, counted; what waited here is written here
    assert ids[0] == 0 and ids[1:] == list(range(ids[1], 200 * batches + 1))
    assert helper.dropped_spans == ids[1] - 1 > 0


def test_shutdown_waits_within_its_timeout_for_a_helper_slow_to_read_and_loses_nothing(tmp_path, caplog):
    """Found by mutation testing: the deadline for what waits for a full pipe runs from the shutdown on.
    A helper that reads again well within the stop timeout gets everything, and nothing is killed or lost."""
    path = tmp_path / "t.jsonl"
    helper = _started(path)  # (the default stop timeout: 30 s)
    pid = helper.pid
    os.kill(pid, signal.SIGSTOP)
    _wait_until_stopped(pid)
    batches = _fill_the_pipe(helper, extra=3)
    assert helper._pending_bytes > 0
    resume = threading.Timer(0.5, os.kill, (pid, signal.SIGCONT))  # reads again while shutdown waits
    resume.start()
    with caplog.at_level(logging.WARNING):
        helper.shutdown()
    resume.join()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]  # nothing failed over
    assert helper.dropped_spans == 0
    assert _request_ids(path) == list(range(1 + 200 * batches))


def test_after_shutdown_batches_are_refused_and_no_helper_starts_again(tmp_path, caplog):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    helper.shutdown()
    with caplog.at_level(logging.WARNING):
        assert helper.export(_numbered(1, 1)) is SpanExportResult.FAILURE
        helper.export_nowait(_numbered(2, 1))
        helper.catch_up()
        assert helper.force_flush(1000)
        helper.shutdown()
    assert helper.pid is None
    assert not caplog.records  # nothing tried on the closed pipe (its descriptor may be another file's by now)
    assert _request_ids(path) == [0]


def test_shutdown_alone_sends_what_waits_for_a_full_pipe_and_what_the_export_thread_had_not_taken(tmp_path):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    with _stopped(helper):
        batches = _fill_the_pipe(helper, extra=3)
        assert helper._pending_bytes > 0
    helper.export_nowait(_unmarshallable())  # left to the export thread
    helper.shutdown()  # no catch_up, no flush first
    assert _request_ids(path) == list(range(1 + 200 * batches))
    assert [s["name"] for s in _spans(path)].count("custom") == 1


def test_shutdown_of_a_helper_never_started_is_quiet(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        ExportProcess(_sinks(tmp_path / "t.jsonl")).shutdown()
    assert not caplog.records and not (tmp_path / "t.jsonl").exists()


def test_the_export_thread_waits_for_a_full_pipe_without_spinning(tmp_path):
    """Waiting for the helper to read costs no CPU (a busy loop would take the GIL from the engine)."""
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    with _stopped(helper):
        batches = _fill_the_pipe(helper, extra=3)
        waiter = threading.Thread(target=helper.catch_up, daemon=True)
        cpu = time.process_time()
        waiter.start()
        time.sleep(0.6)
        cpu = time.process_time() - cpu
        assert waiter.is_alive()  # still waiting for the stopped helper
    waiter.join(30)
    assert cpu < 0.15, f"{cpu:.2f} s of CPU in 0.6 s of waiting"
    helper.shutdown()
    assert _request_ids(path) == list(range(1 + 200 * batches))


def test_flushes_from_several_threads_each_wait_for_their_own_answer(tmp_path):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    results = []

    def flush_often(first):
        for i in range(first, first + 20):
            helper.export(_numbered(i, 1))
            results.append(helper.force_flush(10_000))

    threads = [threading.Thread(target=flush_often, args=(1 + 20 * k,)) for k in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    helper.shutdown()
    assert results == [True] * 60
    assert sorted(_request_ids(path)) == list(range(61))


def test_a_helper_failed_over_and_shut_down_leaves_no_descriptor_open(tmp_path):
    before = set(os.listdir("/proc/self/fd"))
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    pid = helper.pid
    os.kill(pid, signal.SIGKILL)
    _wait_until_dead(pid)
    # finds the pipe broken: from now on the file is written here
    assert helper.export(_numbered(1, 1)) is SpanExportResult.SUCCESS
    assert helper.export(_numbered(2, 1)) is SpanExportResult.SUCCESS
    assert helper.pid is None  # and no new helper is started (it could die the same way)
    assert len(descriptors_open_on(path)) == 1  # one file exporter here, built once
    # and nothing of the dead helper's is kept until shutdown (its pipes, its shared count)
    assert len(set(os.listdir("/proc/self/fd")) - before) == 1
    helper.shutdown()
    assert not descriptors_open_on(path)
    assert set(os.listdir("/proc/self/fd")) == before  # nor the pipes to and from the helper
    assert _request_ids(path) == [0, 1, 2]


def test_a_helper_whose_shared_count_cannot_be_made_leaves_the_spans_here_and_no_descriptor_open(
        tmp_path, monkeypatch, caplog):
    """Found by mutation testing: the reply pipe made just before is closed, both ends, and the spans
    are written here (nothing was sent, nothing is lost)."""
    import connector.telemetry.export_process as export_process

    def no_memory():
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(export_process, "_shared_counter", no_memory)
    before = set(os.listdir("/proc/self/fd"))
    path = tmp_path / "t.jsonl"
    helper = ExportProcess(_sinks(path))
    with caplog.at_level(logging.WARNING):
        assert helper.export(_numbered(0, 2)) is SpanExportResult.SUCCESS
    assert helper.pid is None and helper.dropped_spans == 0
    helper.shutdown()
    assert set(os.listdir("/proc/self/fd")) == before
    assert _request_ids(path) == [0, 1]
    (failed,) = [r.getMessage() for r in caplog.records if "export process failed" in r.getMessage()]
    assert "Cannot allocate memory" in failed


def test_an_empty_batch_starts_no_helper(tmp_path):
    helper = ExportProcess(_sinks(tmp_path / "t.jsonl"))
    assert helper.export([]) is SpanExportResult.SUCCESS
    assert helper.pid is None
    helper.shutdown()


def test_a_helper_whose_engine_closed_the_pipe_before_its_config_exits_quietly():
    helper, replies = _bare_helper()
    helper.stdin.close()  # the engine process died before it sent the sinks
    with replies:
        assert helper.wait(30) == 0
        assert helper.stderr.read() == b""


def test_a_flush_the_helper_does_not_answer_gives_up_after_its_timeout(tmp_path):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    with _stopped(helper, settle=True):  # alive, never answers
        results = []
        flusher = threading.Thread(target=lambda: results.append(helper.force_flush(200)), daemon=True)
        flusher.start()
        flusher.join(20)  # 0.2 s, not 200
        assert results == [False]
    assert helper.force_flush(10_000)
    helper.shutdown()


def test_a_helper_that_wrote_everything_before_it_died_loses_nothing(tmp_path, caplog):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    pid = helper.pid
    os.kill(pid, signal.SIGKILL)
    _wait_until_dead(pid)
    with caplog.at_level(logging.WARNING):
        assert helper.export(_numbered(1, 1)) is SpanExportResult.SUCCESS  # fails over
    helper.shutdown()
    assert helper.dropped_spans == 0
    (failed,) = [r.getMessage() for r in caplog.records if "export process failed" in r.getMessage()]
    assert "0 spans it had read but not written are lost" in failed
    assert _request_ids(path) == [0, 1]


@pytest.mark.parametrize("python", ["missing", "true"])
def test_a_helper_that_cannot_start_leaves_the_spans_to_this_process(tmp_path, caplog, monkeypatch, python):
    """No such program, or one that exits at once without a word: the spans are written here, none lost."""
    import shutil

    import connector.telemetry.export_process as export_process

    executable = str(tmp_path / "no-python") if python == "missing" else shutil.which("true")
    monkeypatch.setattr(export_process.sys, "executable", executable)
    path = tmp_path / "t.jsonl"
    replies, closed = [], set()  # the reply pipe it makes for the helper (the first pipe), what is closed
    real_pipe, real_close = os.pipe, os.close

    def pipe():
        fds = real_pipe()
        if not replies:
            replies.extend(fds)
        return fds

    def close(fd):
        closed.add(fd)
        real_close(fd)

    monkeypatch.setattr(os, "pipe", pipe)
    monkeypatch.setattr(os, "close", close)
    helper = ExportProcess(_sinks(path))
    with caplog.at_level(logging.WARNING):
        assert helper.export(_numbered(0, 2)) is SpanExportResult.SUCCESS
        assert helper.export(_numbered(2, 1)) is SpanExportResult.SUCCESS
    assert helper.pid is None and not helper.accepts_nowait
    helper.shutdown()
    assert _request_ids(path) == [0, 1, 2] and helper.dropped_spans == 0
    if python == "missing":  # no helper ever held the reply pipe: both ends are closed here
        assert len(replies) == 2 and set(replies) <= closed
    (failed,) = [r.getMessage() for r in caplog.records if "export process failed" in r.getMessage()]
    assert "0 spans it had read but not written are lost" in failed
    assert python != "missing" or "FileNotFoundError" in failed  # says why ("true" races: a broken pipe, or silence)


def _wait_until_reading(pid: int) -> None:
    """Until the helper waits for the engine's next frame (blocked reading its stdin pipe). Skips where the
    kernel does not say where a process sleeps (wchan reads "0" without kallsyms)."""
    deadline, seen = time.monotonic() + SIGNAL_DEADLINE_S, set()
    while True:
        with open(f"/proc/{pid}/wchan") as f:
            seen.add(where := f.read())
        if where.endswith("pipe_read"):
            return
        if seen == {"0"} and time.monotonic() > deadline - SIGNAL_DEADLINE_S / 2:
            pytest.skip("this kernel does not show where a process sleeps (/proc/<pid>/wchan)")
        assert time.monotonic() < deadline, f"the helper (pid {pid}) does not wait for the engine's frames"
        time.sleep(0.01)


def _otlp_http(receiver) -> dict[str, str]:
    """The OTEL_* variables that send traces to ``receiver`` (the `receiver` fixture's collector)."""
    return {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{receiver.server_port}/v1/traces",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}


def _spans_per_request(receiver) -> list[int]:
    """The spans in each request the `receiver` fixture's collector got."""
    return [sum(len(ss.spans) for rs in r.resource_spans for ss in rs.scope_spans) for r in receiver.requests]


def test_the_helper_sends_an_otlp_collector_no_empty_request(tmp_path, receiver):
    """Every request carries spans: with nothing to export (between batches, after a flush, at the
    end) the helper sends nothing."""
    helper = ExportProcess(Sinks(None, _otlp_http(receiver), {"service.name": "kvscope-test"}))
    helper.export(_numbered(0, 2))
    assert helper.force_flush(10_000)
    _wait_until_reading(helper.pid)  # idle, nothing left to export
    helper.export(_numbered(2, 1))
    assert helper.force_flush(10_000)
    _wait_until_reading(helper.pid)
    helper.shutdown()
    assert _spans_per_request(receiver) == [2, 1]


def test_the_helper_exports_at_most_1024_records_at_once(tmp_path):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    with _stopped(helper):
        for b in range(5):
            helper.export_nowait(_numbered(1 + 256 * b, 256))
    assert helper.force_flush(10_000)
    helper.shutdown()
    assert _request_ids(path) == list(range(1 + 5 * 256))
    lines = [sum(len(ss["spans"]) for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"])
             for line in path.read_text().splitlines()]
    assert lines == [1, 1024, 256]  # the first four batches make 1024: exported as they are


def _unread_bytes(fd: int) -> int:
    import fcntl
    import struct
    import termios

    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]


def test_flushes_waiting_together_each_get_their_own_answer(tmp_path):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    with _stopped(helper, settle=True):
        results = {}
        threads = []
        for k in range(2):
            unread = _unread_bytes(helper._fd)
            threads.append(threading.Thread(target=lambda k=k: results.__setitem__(k, helper.force_flush(2_000))))
            threads[-1].start()
            deadline = time.monotonic() + SIGNAL_DEADLINE_S
            while _unread_bytes(helper._fd) == unread:  # until its flush waits in the pipe
                assert time.monotonic() < deadline, "the flush was not sent"
                time.sleep(0.01)
    for thread in threads:
        thread.join(30)
    helper.shutdown()
    assert results == {0: True, 1: True}


def test_warnings_the_helper_sends_while_it_drains_are_logged_before_shutdown_returns(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = blocker / "traces.jsonl"  # cannot be created: the helper warns on its first write
    logged = []

    class Slow(logging.Handler):
        def emit(self, record):
            time.sleep(1.0)
            logged.append(record.getMessage())

    handler = Slow(logging.WARNING)
    logging.getLogger("connector.telemetry.export_process").addHandler(handler)
    try:
        helper = ExportProcess(_sinks(bad))
        helper.export(_numbered(0, 1))  # written when the pipe closes, at shutdown
        helper.shutdown()
        assert len(logged) == 1 and str(bad) in logged[0]
    finally:
        logging.getLogger("connector.telemetry.export_process").removeHandler(handler)


def test_a_helper_shut_down_leaves_no_descriptor_open(tmp_path):
    before = set(os.listdir("/proc/self/fd"))
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    helper.shutdown()
    assert set(os.listdir("/proc/self/fd")) == before
    assert _request_ids(path) == [0]


def test_what_a_dead_helper_said_it_wrote_is_not_counted_lost(tmp_path):
    """Its last replies may still wait for the reply thread when the helper dies: the fail-over
    reads them all before it counts what was lost."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = blocker / "traces.jsonl"  # the helper warns on its first write, then says what it exported
    replying = threading.Event()

    class Slow(logging.Handler):
        def emit(self, record):
            if threading.current_thread().name == "kvscope-export-replies":
                replying.set()
                time.sleep(1.0)

    handler = Slow(logging.WARNING)
    logger = logging.getLogger("connector.telemetry.export_process")
    logger.addHandler(handler)
    try:
        helper = ExportProcess(_sinks(bad))
        helper.export(_numbered(0, 3))
        assert replying.wait(SIGNAL_DEADLINE_S)  # the reply thread logs the warning (slowly)
        _wait_until_reading(helper.pid)  # and the helper has written the batch, said so, and waits
        pid = helper.pid
        os.kill(pid, signal.SIGKILL)
        _wait_until_dead(pid)
        helper.export(_numbered(3, 1))  # fails over
        helper.shutdown()
    finally:
        logger.removeHandler(handler)
    # The 3 records the helper's sink failed and the 1 the same sink failed here: none lost to the death.
    assert helper.dropped_spans == 4


def test_a_forked_child_still_running_does_not_hold_up_the_parents_helper(tmp_path, caplog):
    """The child drops its copy of the helper's pipe: the parent's shutdown closes the last one."""
    path = tmp_path / "t.jsonl"
    helper = ExportProcess(_sinks(path), stop_timeout_s=5.0)
    helper.export(_numbered(0, 1))
    assert helper.force_flush(10_000)
    parent_helper = helper.pid
    hold_read, hold_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(hold_write)
        os.read(hold_read, 1)  # lives on until the parent's shutdown is over
        os._exit(0)
    os.close(hold_read)
    try:
        with caplog.at_level(logging.WARNING):
            helper.export(_numbered(1, 1))
            helper.shutdown()
    finally:
        os.close(hold_write)
        os.waitpid(pid, 0)
    assert not caplog.records  # the helper saw the end of its pipe and exited: not killed
    with pytest.raises(ChildProcessError):
        os.waitpid(parent_helper, os.WNOHANG)
    assert _request_ids(path) == [0, 1]


def test_a_forked_child_keeps_no_end_of_the_parents_helper_pipes(tmp_path):
    """Found by mutation testing: the child closes both its copies, not only the one its garbage
    collection happens to close. A child holding the reply pipe's read end would keep a helper whose
    engine died blocked on replies nobody reads, once that pipe fills, instead of writing its spans."""
    helper = ExportProcess(_sinks(tmp_path / "t.jsonl"))
    helper.export(_numbered(0, 1))
    assert helper.force_flush(10_000)
    pipes = [f"pipe:[{os.fstat(stream.fileno()).st_ino}]" for stream in (helper._proc.stdin, helper._replies)]
    report_read, report_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(report_read)
            os.write(report_write, repr([bool(descriptors_open_on(pipe)) for pipe in pipes]).encode())
        finally:
            os._exit(0)
    os.close(report_write)
    os.waitpid(pid, 0)
    with os.fdopen(report_read, "rb") as report:
        held = report.read()
    helper.shutdown()
    assert held == b"[False, False]"  # (helper's stdin, its replies)


def test_a_batch_the_failed_over_export_cannot_write_is_a_failure(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    helper = ExportProcess(_sinks(blocker / "traces.jsonl"))  # a path that cannot be created, here or in the helper
    helper.export(_numbered(0, 1))
    helper.force_flush(10_000)
    pid = helper.pid
    os.kill(pid, signal.SIGKILL)
    _wait_until_dead(pid)
    assert helper.export(_numbered(1, 1)) is SpanExportResult.FAILURE  # failed over, then not written
    assert helper.export(_numbered(2, 1)) is SpanExportResult.FAILURE
    # counted: the helper's sink failed the first, this process's sink the two after it
    assert helper.lost_by_reason() == {"helper_lost": 0, "sink_failed": 3} and helper.dropped_spans == 3
    helper.shutdown()
    assert helper.lost_by_reason() == {"helper_lost": 0, "sink_failed": 3}  # (the helper's count kept once unmapped)


def test_after_a_fail_over_every_sink_gets_each_batch_and_one_failing_fails_it(tmp_path, receiver):
    """Found by mutation testing: exported here, a batch goes to the trace file and the OTLP collector
    both, and one of them failing it (an unwritable file) makes it a failure, counted."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    helper = ExportProcess(Sinks(str(blocker / "traces.jsonl"), _otlp_http(receiver), {"service.name": "kvscope-test"}))
    helper.export(_numbered(0, 1))
    helper.force_flush(10_000)
    pid = helper.pid
    os.kill(pid, signal.SIGKILL)
    _wait_until_dead(pid)
    assert helper.export(_numbered(1, 2)) is SpanExportResult.FAILURE  # failed over: the file failed them
    assert helper.lost_by_reason() == {"helper_lost": 0, "sink_failed": 3}
    helper.shutdown()
    assert _spans_per_request(receiver) == [1, 2]  # the collector got them all the same


def test_a_sink_that_raises_fails_its_batch_alone_and_the_deferred_batches_after_it_still_go_out(
        tmp_path, monkeypatch):
    """Sinks report their failures; one that raises instead (a bug) must cost its batch only, counted.
    Exported here after a fail-over, the batches the export thread took over from `export_nowait` go
    out one after another: a raise must not end that loop and drop the rest uncounted."""
    from connector.telemetry import export_process, failures

    monkeypatch.setattr(failures, "_logged", set())
    kept: list[list] = []
    calls = []

    class RaisesAtItsSecondBatch:
        def export(self, records):
            calls.append(len(records))
            if len(calls) == 2:
                raise RuntimeError("a sink bug")
            return SpanExportResult.SUCCESS

        def shutdown(self):
            pass

    class Keeps(RaisesAtItsSecondBatch):
        def export(self, records):
            kept.append(list(records))
            return SpanExportResult.SUCCESS

    monkeypatch.setattr(export_process, "build_exporters", lambda sinks: [RaisesAtItsSecondBatch(), Keeps()])
    helper = ExportProcess(Sinks(str(tmp_path / "t.jsonl"), {}, {"service.name": "kvscope-test"}))
    helper.export(_numbered(0, 1))
    assert helper.force_flush(10_000)
    pid = helper.pid
    os.kill(pid, signal.SIGKILL)
    _wait_until_dead(pid)
    assert helper.export(_numbered(1, 1)) is SpanExportResult.SUCCESS  # fails over: exported here
    helper.export_nowait(_numbered(2, 2))  # no helper: left to the export thread
    helper.export_nowait(_numbered(4, 3))
    helper.catch_up()
    assert [len(batch) for batch in kept] == [1, 2, 3]  # the other sink got every batch
    assert helper.lost_by_reason() == {"helper_lost": 0, "sink_failed": 2}  # the raising sink's batch, counted
    helper.shutdown()


@pytest.mark.parametrize("helper_state", ["not started", "failed over"])
def test_shutdown_alone_writes_a_batch_handed_over_while_no_helper_ran(tmp_path, helper_state):
    path = tmp_path / "t.jsonl"
    helper = ExportProcess(_sinks(path))
    if helper_state == "failed over":
        helper.export(_numbered(0, 1))
        assert helper.force_flush(10_000)
        pid = helper.pid
        os.kill(pid, signal.SIGKILL)
        _wait_until_dead(pid)
        helper.export(_numbered(1, 1))  # fails over
    helper.export_nowait(_numbered(2, 1))  # left to the export thread, which calls no more
    helper.shutdown()
    assert _request_ids(path) == ([2] if helper_state == "not started" else [0, 1, 2])


def test_a_helper_shutdown_gave_up_on_is_killed_and_reaped(tmp_path, caplog):
    """The export thread holds the exporter (a write that never ends): shutdown waits its timeout,
    kills the helper and reaps it (no zombie left behind)."""
    helper = ExportProcess(_sinks(tmp_path / "t.jsonl"), stop_timeout_s=0.2)
    helper.export(_numbered(0, 1))
    assert helper.force_flush(10_000)
    pid = helper.pid
    with helper._lock:  # as the export thread waiting for a full pipe does
        with caplog.at_level(logging.WARNING):
            helper.shutdown()
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    assert any("killed it" in r.getMessage() for r in caplog.records)


def test_a_sink_raising_in_the_helper_is_logged_here_and_the_helper_goes_on(tmp_path, caplog):
    otel = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    helper = ExportProcess(Sinks(None, otel, {"service.name": "kvscope-test"}))
    with caplog.at_level(logging.WARNING):
        helper.export([("not a span record",)])  # the OTLP sink cannot convert it: it raises
        helper.force_flush(10_000)
        running = helper.pid
    helper.shutdown()
    assert running is not None and helper.dropped_spans == 1  # failed by its sink, counted
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "span exporter" in messages[0] and "raised" in messages[0], messages
    assert caplog.records[0].levelno == logging.ERROR  # at the level the helper logged it


def test_a_helper_that_never_says_it_is_ready_is_given_up_on(tmp_path, caplog, monkeypatch):
    import connector.telemetry.export_process as export_process

    silent = tmp_path / "silent-python"
    silent.write_text("#!/bin/sh\nexec sleep 60\n")  # starts, keeps its pipes open, says nothing
    silent.chmod(0o755)
    monkeypatch.setattr(export_process.sys, "executable", str(silent))
    monkeypatch.setattr(export_process, "_START_TIMEOUT_S", 0.5)
    path = tmp_path / "t.jsonl"
    helper = ExportProcess(_sinks(path))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert helper.export(_numbered(0, 1)) is SpanExportResult.SUCCESS  # written here
    assert time.monotonic() - started < 10  # not the 60 s the silent helper would take to exit
    assert helper.pid is None
    helper.shutdown()
    assert _request_ids(path) == [0]
    (failed,) = [r.getMessage() for r in caplog.records if "export process failed" in r.getMessage()]
    assert "did not start" in failed


def test_a_flush_waiting_on_a_helper_that_dies_returns_at_once(tmp_path):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    pid = helper.pid
    os.kill(pid, signal.SIGSTOP)
    _wait_until_stopped(pid)
    flusher = threading.Thread(target=lambda: helper.force_flush(60_000), daemon=True)
    flusher.start()
    deadline = time.monotonic() + SIGNAL_DEADLINE_S
    while not _unread_bytes(helper._fd):  # until its flush waits in the pipe
        assert time.monotonic() < deadline, "the flush was not sent"
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)  # nobody will answer it now
    flusher.join(20)  # (not the 60 s it would wait for an answer)
    assert not flusher.is_alive()
    helper.shutdown()


def _wait_until_the_flush_waits(helper: ExportProcess) -> None:
    """Until a flush is written to the helper's pipe and waits for its answer."""
    deadline = time.monotonic() + SIGNAL_DEADLINE_S
    while not helper._acks:
        assert time.monotonic() < deadline, "the flush was not sent"
        time.sleep(0.01)
    with helper._lock:  # its write is done once the lock is free
        pass


def test_a_flush_the_helper_dies_during_is_false_and_counts_what_it_lost(tmp_path, caplog):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    pid = helper.pid
    os.kill(pid, signal.SIGSTOP)
    _wait_until_stopped(pid)
    helper.export(_numbered(1, 3))  # in the pipe, never read
    results = []
    flusher = threading.Thread(target=lambda: results.append(helper.force_flush(60_000)), daemon=True)
    flusher.start()
    _wait_until_the_flush_waits(helper)
    with caplog.at_level(logging.WARNING):
        os.kill(pid, signal.SIGKILL)
        flusher.join(20)
    assert results == [False]
    assert helper.dropped_spans == 3 and not helper.accepts_nowait and not helper._acks
    (failed,) = [r.getMessage() for r in caplog.records if "export process failed" in r.getMessage()]
    assert "died during a flush" in failed and "3 spans it had read but not written are lost" in failed
    helper.export(_numbered(4, 1))
    assert helper.force_flush(10_000)  # nothing lost since: true again
    helper.shutdown()
    assert _request_ids(path) == [0, 4]


def test_a_flush_that_fails_over_losing_spans_is_false(tmp_path):
    path = tmp_path / "t.jsonl"
    helper = _started(path)
    pid = helper.pid
    os.kill(pid, signal.SIGSTOP)
    _wait_until_stopped(pid)
    helper.export(_numbered(1, 2))  # in the pipe, never read
    os.kill(pid, signal.SIGKILL)
    _wait_until_dead(pid)
    assert helper.force_flush(10_000) is False  # its write finds the helper dead: fails over, 2 lost
    assert helper.dropped_spans == 2
    helper.shutdown()


def test_a_tracing_flush_the_export_helper_dies_during_is_false(tmp_path):
    """Through `KVScopeTracing` and its `SpanBatcher`: a flush that lost spans says so."""
    path = tmp_path / "t.jsonl"
    tracing = KVScopeTracing.from_config(str(path), 1.0, env={})
    tracing.record(LOOKUP_SPAN, None, 1, 2, ("req-0", 1, 0, "new", 0))
    assert tracing.force_flush(30_000)
    (helper,) = tracing._processor._exporters
    pid = helper.pid
    os.kill(pid, signal.SIGSTOP)
    _wait_until_stopped(pid)
    tracing.record(LOOKUP_SPAN, None, 1, 2, ("req-1", 1, 0, "new", 0))
    results = []
    flusher = threading.Thread(target=lambda: results.append(tracing.force_flush(60_000)), daemon=True)
    flusher.start()
    _wait_until_the_flush_waits(helper)
    os.kill(pid, signal.SIGKILL)
    flusher.join(20)
    assert results == [False] and helper.dropped_spans == 1
    tracing.record(LOOKUP_SPAN, None, 1, 2, ("req-2", 1, 0, "new", 0))
    assert tracing.force_flush(30_000)
    tracing.shutdown()
    assert _request_ids(path) == [0, 2]


def test_a_reply_that_cannot_be_read_ends_the_reader_and_frees_the_flush_waiting_on_it(tmp_path, monkeypatch):
    """The reply thread must not die with a flush waiting on it: a reply it cannot read ends it as
    the helper's end would, and the flush fails over (nothing lost: the helper had said it wrote all)."""
    import connector.telemetry.export_process as export_process

    path = tmp_path / "t.jsonl"
    helper = _started(path)  # its reply thread now waits for the next reply
    marshal = export_process.marshal

    class GarbledAcks:  # the reply thread decodes with the module's `marshal`, once a reply's bytes are in
        dumps = staticmethod(marshal.dumps)

        @staticmethod
        def loads(data):
            message = marshal.loads(data)
            if message[0] == "ack":
                raise ValueError("bad marshal data")
            return message

    monkeypatch.setattr(export_process, "marshal", GarbledAcks)
    helper.export(_numbered(1, 1))
    started = time.monotonic()
    assert helper.force_flush(10_000)
    assert time.monotonic() - started < 5  # (not the 10 s a dead reply thread would cost)
    assert not helper.accepts_nowait and helper.dropped_spans == 0  # failed over
    helper.shutdown()
    assert _request_ids(path) == [0, 1]


def test_a_process_that_exits_without_shutting_its_helper_down_exits(tmp_path):
    """The reply thread waits for the helper, which waits for the engine process to close its pipe
    (at exit, after Python joins every non-daemon thread): the thread must not hold the exit up."""
    path = tmp_path / "t.jsonl"
    script = (
        "from connector.telemetry.export_process import ExportProcess\n"
        "from connector.telemetry.sinks import Sinks\n"
        f"helper = ExportProcess(Sinks({str(path)!r}, {{}}, {{'service.name': 'kvscope-test'}}))\n"
        "from connector.telemetry.span_records import LOOKUP_SPAN\n"
        "from connector.telemetry.tracing import KVScopeTracing\n"
        "class Keep:\n"
        "    records = []\n"
        "    def on_end(self, record):\n"
        "        self.records.append(record)\n"
        "KVScopeTracing(Keep(), None).record(LOOKUP_SPAN, None, 10, 20, ('req-0', 64, 32, 'evicted', 16))\n"
        "helper.export(Keep.records)\n"
        "assert helper.force_flush(10_000) and helper.pid is not None\n"  # no shutdown
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, timeout=30,
                          stdin=subprocess.DEVNULL, start_new_session=True)  # (a hung one is killed with its group)
    assert proc.returncode == 0
    assert _request_ids(path) == [0]


def test_a_trace_file_naming_an_engine_descriptor_is_written_by_the_helper_through_that_descriptor(tmp_path):
    """/dev/fd/N (N > 2) names the engine's descriptor: the helper keeps it under the same number. It
    had none of its own there, or another file (its shared count): spans went there, unseen, the flush
    saying True."""
    path = tmp_path / "t.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    fd = os.dup2(fd, 9) if fd < 9 else fd  # a number the helper's own descriptors would not take by chance
    try:
        helper = ExportProcess(Sinks(f"/dev/fd/{fd}", {}, {"service.name": "kvscope-test"}))
        assert helper.export(_numbered(0, 3)) is SpanExportResult.SUCCESS
        assert helper.force_flush(10_000) and helper.pid is not None
        helper.shutdown()
    finally:
        os.close(fd)
    assert _request_ids(path) == [0, 1, 2] and helper.dropped_spans == 0


def test_records_handed_over_after_shutdown_are_counted_as_lost():
    """A shutdown that gave up on a helper that stopped reading closes the exporter; the export
    thread then drains the batcher's queue into it: each record is counted, not dropped unseen."""
    helper = ExportProcess(_sinks("/dev/null"))
    helper.shutdown()
    assert helper.export(_numbered(0, 5)) is SpanExportResult.FAILURE
    assert helper.dropped_spans == 5 and helper.lost_by_reason()["helper_lost"] == 5
