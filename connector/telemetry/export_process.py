"""Span export in a helper process: the engine process only serialises span records.

Encoding a span as OTLP/JSON costs one to two microseconds of CPython (OTLP protobuf far
more), and in the engine process that time is taken under the GIL the engine thread needs,
whichever thread does it: at full sampling it was about as much as the planning it describes.
So the engine process only `marshal`s each batch of records (tuples of ints and strings, well
under a microsecond a record) and writes it to a pipe; a helper process, started on the first
export, builds the real sinks (`sinks.build_exporters`: the trace file, OTLP) and runs them.
A full batch is marshalled and written by the engine thread that filled it, never waiting for
the helper (a non-blocking pipe; what it cannot take now waits in memory for the next write);
the export thread starts the helper, sends the tail and waits out a full pipe.

Robustness: the helper reads until its stdin closes, so it drains and exits when the engine
process shuts down or dies, and it ignores SIGINT, SIGHUP and, while the engine process lives,
SIGTERM (a Ctrl-C to ``vllm serve`` or a service manager's stop reaches the whole process group;
the engine's shutdown still flushes through it). Its warnings (an unwritable trace file, a dead OTLP endpoint) come back over a pipe
of their own and are logged by the engine process, once, as before; its stdout and stderr are the
engine's, so a ``trace_file`` of ``/dev/stdout`` or ``/dev/stderr`` is the engine's. If the helper
cannot start or dies, the export falls back to the same sinks in the engine process, logged once;
what a dead helper had read but not yet written (at most the pipe's 1 MiB) is lost, counted in
`dropped_spans` and said in that log line, and a flush during which spans were lost returns False.
It runs at a lower priority (nice 10) and may use every core, not only the ones vLLM pinned the
engine's threads to.

``KVSCOPE_TRACE_EXPORT=thread`` keeps the export in the engine process (debugging, comparison).
"""

from __future__ import annotations

import logging
import marshal
import mmap
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from itertools import islice
from dataclasses import asdict

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from connector.telemetry.failures import telemetry_failed
from connector.telemetry.sinks import Sinks, build_exporters
from connector.telemetry.trace_file import own_descriptor, write_all

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")  # frame: byte length, then one marshal'd message
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 30.0
# Marshalled batches the helper has not read yet, at most (about 70,000 load records); a helper
# that falls further behind loses spans rather than the engine memory.
_MAX_PENDING_BYTES = 16 << 20
_WRITEV_FRAMES = 64  # frames per writev call
# The batch's bytes go through the pipe itself. Measured and not kept (1g/128, engine CPU, side by side):
# a ring in shared memory with only an 8-byte header in the pipe (1.218 vs 1.204x, 1.226 vs 1.227x the
# uninstrumented planner), and a helper that exports nothing costs the engine as much as one writing
# JSON (1.239 vs 1.214x): what the export costs the engine (1.21-1.23 against 1.14-1.15x with batches
# dropped unsent) is `marshal` and the write call, not the bytes the pipe carries nor the helper's work.
# Version 2: no back-references. Records share few objects, and tracking them all costs more
# than it saves (0.67 vs 0.79 µs a load record, measured).
_MARSHAL_VERSION = 2
_HELPER_EXPORT_RECORDS = 1024  # the helper exports batches that arrived together up to this many records
_PIPE_BYTES = 1 << 20  # Linux's limit for unprivileged processes (/proc/sys/fs/pipe-max-size)
# The records the helper has exported so far, in memory both processes map: what a death of the
# helper loses is counted from it. A reply per export instead woke the engine process's reply
# thread, which then took the GIL from the engine thread: 3 to 4% of the uninstrumented planner's
# time at 1g/128 (engine CPU, tracing on 1.22-1.24 against 1.26-1.28x, measured side by side).
# The second count: the records of those that a sink failed to take (an unreachable OTLP endpoint, an
# unwritable trace file), counted in `dropped_spans` like the ones a death loses.
_COUNTS = struct.Struct("<QQ")


class ExportProcess(SpanExporter):
    """A span exporter that hands record batches to a helper process running the real sinks.

    Two ways in. `export` (the export thread) may block: it starts the helper, waits for a full
    pipe, fails over. `export_nowait` (the engine thread, through `SpanBatcher`) never does: it
    marshals the batch, writes what the pipe takes at once and keeps the rest, in order, for the
    next write; `catch_up` (the export thread again) finishes what it left behind.
    """

    def __init__(self, sinks: Sinks, stop_timeout_s: float = _STOP_TIMEOUT_S):
        self._sinks = sinks
        self._stop_timeout_s = stop_timeout_s
        self._failed = False  # the helper could not start or died: export here from then on
        self._local: list[SpanExporter] | None = None  # the sinks in this process, built when needed
        self._closed = False
        self._init_process_state()
        reinit = weakref.WeakMethod(self._after_fork)
        os.register_at_fork(after_in_child=lambda: (m := reinit()) and m())

    def _init_process_state(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._fd = -1  # the helper's stdin, non-blocking once it runs
        self._replies = None  # the read end of the helper's reply pipe (a raw file)
        self._exported: mmap.mmap | None = None  # the helper's counts of exported and failed records (`_COUNTS`)
        self._helper_failed = 0  # the helper's final count of records a sink failed, once it is unmapped
        self._reader: threading.Thread | None = None
        self._acks: dict[int, threading.Event] = {}
        self._next_ack = 0
        self._lock = threading.Lock()  # one writer at a time
        # Frames written in part or not at all, in order; `_offset` bytes of the first are written.
        self._frames: deque[bytes] = deque()
        self._offset = 0
        self._pending_bytes = 0
        self._deferred: list = []  # batches `export_nowait` left to the export thread
        self._broken: Exception | None = None  # a non-blocking write failed: fail over on the export thread
        self._dropped = 0  # records lost: the helper fell too far behind, or died holding them
        self._sink_failed_here = 0  # records a sink failed in this process (after a fail-over)
        self._fell_behind = False  # some were dropped because the helper fell behind (said once)
        self._drops_logged = False
        self._queued_records = 0  # records of every frame queued for the helper

    def _after_fork(self) -> None:
        # The parent's helper and pipe are not ours: a child starts its own on its first export,
        # and drops its copies of the pipe, or the helper would wait for the child's end too.
        # (Raw file objects: closing them takes no lock the parent's reader thread might hold.)
        proc = self._proc
        if proc is not None:
            for stream in (proc.stdin, self._replies):
                try:
                    stream.close()
                except Exception:
                    pass
        self._init_process_state()

    @property
    def pid(self) -> int | None:
        """The helper's process id while it runs (benchmarks read its CPU time)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def accepts_nowait(self) -> bool:
        """Whether `export_nowait` can send a batch now: the helper runs and nothing has failed."""
        return self._proc is not None and self._broken is None and not self._failed and not self._closed

    @property
    def dropped_spans(self) -> int:
        """Records lost (the helper fell behind, or died holding them) or that a sink failed to take,
        here or in the helper."""
        return sum(self.lost_by_reason().values())

    def lost_by_reason(self) -> dict[str, int]:
        """`dropped_spans` by why (`span_batcher.LOSS_REASONS`)."""
        return {"helper_lost": self._dropped, "sink_failed": self._sink_failed_here + self._sink_failures()}

    def _sink_failures(self) -> int:
        """The helper's count of records a sink failed (any thread): read from the memory it shares
        while that is mapped, then the final count `_release_counter` kept. Never both, never less."""
        counts = self._exported
        if counts is not None:
            try:
                return _COUNTS.unpack_from(counts)[1]
            except ValueError:  # unmapped meanwhile: the final count is kept by then
                pass
        return self._helper_failed

    # ------------------------------------------------------------ the engine thread
    def export_nowait(self, records: list) -> None:
        """Send a batch without blocking: marshal it, write what the pipe takes now, keep the rest.

        Nothing here waits for the helper. A batch it cannot send (the helper not running, a record
        marshal cannot carry) is left to the export thread (`catch_up`); past `_MAX_PENDING_BYTES`
        waiting for a helper that fell behind, batches are dropped and counted (logged once, by
        the export thread)."""
        with self._lock:  # held briefly by anyone but the export thread, which is not exporting now
            if not self.accepts_nowait:  # changed since the batcher asked: the export thread takes it
                self._deferred.append(records)
                return
            try:
                payload = marshal.dumps(("spans", records), _MARSHAL_VERSION)
            except ValueError:  # an attribute value marshal cannot carry (GENERIC spans)
                self._deferred.append(records)
                return
            if self._pending_bytes > _MAX_PENDING_BYTES:
                self._dropped += len(records)
                self._fell_behind = True
                return
            self._queue_frame(payload)
            self._queued_records += len(records)
            try:
                self._write_available()
            except OSError as exc:  # the helper is gone: the export thread fails over
                self._broken = exc

    # ------------------------------------------------------------ the export thread
    def catch_up(self) -> None:
        """Finish what `export_nowait` left: fail over, write a pipe that was full, export deferred batches."""
        with self._lock:
            if not self._closed:
                self._settle()

    def export(self, records: Sequence[tuple]) -> SpanExportResult:
        if not records:
            return SpanExportResult.SUCCESS
        with self._lock:
            if self._closed:  # shut down (maybe giving up on a helper that stopped reading): lost, counted
                self._dropped += len(records)
                return SpanExportResult.FAILURE
            self._settle()
            return self._export_locked(records)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """True once the helper has exported (and flushed) everything sent before this call; False
        after the timeout, or if spans were lost meanwhile (a helper that died: `dropped_spans`)."""
        with self._lock:
            dropped = self.dropped_spans
            if not self._closed:
                self._settle()
            proc = None if self._closed else self._proc
            if proc is not None:
                self._next_ack += 1
                token, done = self._next_ack, threading.Event()
                self._acks[token] = done
                try:
                    self._queue_frame(marshal.dumps(("flush", token)))
                    self._write_pending()
                except Exception as exc:
                    self._acks.pop(token, None)
                    self._fail_over(exc)
                    proc = None
        if proc is not None:
            if not done.wait(timeout_millis / 1000):
                self._acks.pop(token, None)
                return False
            if self._acks.pop(token, None) is not None:  # not answered: the helper died (the reader pops answers)
                with self._lock:
                    if self._closed:  # shutdown gave up on it: what it lost is not counted
                        return False
                    if self._proc is proc:  # (else another thread failed over, and counted the loss)
                        self._fail_over(RuntimeError("the span export helper died during a flush"))
        with self._lock:
            if self._local is not None and not all(e.force_flush(timeout_millis) for e in self._local):
                return False
            return self.dropped_spans == dropped

    def shutdown(self) -> None:
        # The export thread holds the lock while it waits for a full pipe: a helper that stopped
        # reading would hold up the engine's shutdown for ever. Wait a while, then kill it (the
        # blocked write then fails and that batch is exported here).
        locked = self._lock.acquire(timeout=self._stop_timeout_s)
        try:
            if self._closed:
                return
            error = None if locked else TimeoutError("the span export helper stopped reading")
            if locked:  # no helper running: what `export_nowait` left is still exported (here, or by one)
                try:  # what is still waiting for the pipe goes first, within the same deadline
                    deadline = time.monotonic() + self._stop_timeout_s
                    self._settle(deadline)
                    self._write_pending(deadline=deadline)
                except Exception as exc:
                    self._fail_over(exc)  # kills the helper; what it had not read is exported here
            self._closed = True
            proc = self._proc
        finally:
            if locked:
                self._lock.release()
        if proc is not None:
            try:
                if error is not None:
                    raise error
                proc.stdin.close()  # the helper drains, shuts its sinks down and exits
                proc.wait(self._stop_timeout_s)
            except Exception as exc:
                logger.warning("kvscope: stopping the span export helper failed (%r); killed it", exc)
                _kill(proc)
            self._end_replies()
        if locked:  # (else the thread shutdown gave up on fails over when the kill breaks its write, and reads it)
            self._release_counter()
        for exporter in self._local or ():
            exporter.shutdown()

    # ------------------------------------------------------------ under the lock
    def _settle(self, deadline: float | None = None) -> None:
        if self._broken is not None:
            exc, self._broken = self._broken, None
            self._fail_over(exc)
        if self._frames and self._proc is not None:
            try:
                self._write_pending(deadline)  # (none: shutdown passes one, or a stopped helper hangs it)
            except Exception as exc:
                self._fail_over(exc)
        deferred, self._deferred = self._deferred, []
        for batch in deferred:
            self._export_locked(batch)
        if self._fell_behind and not self._drops_logged:
            self._drops_logged = True
            logger.warning("kvscope: the span export process fell behind by %d MiB: spans are dropped "
                           "until it catches up; further drops are not logged", _MAX_PENDING_BYTES >> 20)

    def _export_locked(self, records) -> SpanExportResult:
        if not self._failed:
            try:
                payload = marshal.dumps(("spans", list(records)), _MARSHAL_VERSION)
            except ValueError as exc:  # an attribute value marshal cannot carry (GENERIC spans)
                logger.debug("kvscope: span batch not serialisable (%s); exported in this process", exc)
                return self._export_here(records)
            self._queue_frame(payload)
            self._queued_records += len(records)
            try:
                if self._proc is None:
                    self._start()
                self._write_pending()
                return SpanExportResult.SUCCESS
            except Exception as exc:
                return self._fail_over(exc)  # exports the queued frames, this batch's among them, here
        return self._export_here(records)

    def _queue_frame(self, payload: bytes) -> None:
        frame = _HEADER.pack(len(payload)) + payload
        self._frames.append(frame)
        self._pending_bytes += len(frame)

    def _write_available(self) -> None:
        """Write the queued frames as far as the pipe takes them now (the fd is non-blocking)."""
        frames = self._frames
        while frames:
            buffers = [memoryview(frames[0])[self._offset:], *islice(frames, 1, _WRITEV_FRAMES)]
            try:
                written = os.writev(self._fd, buffers)
            except BlockingIOError:
                return
            self._pending_bytes -= written
            written += self._offset
            while frames and written >= len(frames[0]):
                written -= len(frames.popleft())
            self._offset = written

    def _write_pending(self, deadline: float | None = None) -> None:
        """Write every queued frame, waiting for the helper to read (until ``deadline``)."""
        while True:
            self._write_available()
            if not self._frames:
                return
            timeout = 1.0 if deadline is None else deadline - time.monotonic()
            if timeout <= 0:
                raise TimeoutError("the span export helper stopped reading")
            select.select([], [self._fd], [], min(timeout, 1.0))

    def _start(self) -> None:
        # This very package, whatever the working directory holds: its root first on the path,
        # and (Python 3.11+) no working directory prepended to it.
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []
        # Replies on a pipe of their own: the helper's stdout stays the engine's (a trace file of
        # /dev/stdout is then the engine's stdout, not the reply stream).
        reply_read, reply_write = os.pipe()
        try:
            exported_fd = _shared_counter()
        except BaseException:
            os.close(reply_read)
            os.close(reply_write)
            raise
        try:
            self._exported = mmap.mmap(exported_fd, _COUNTS.size)
            proc = subprocess.Popen(
                [sys.executable, *safe_path, "-m", __name__, str(reply_write), str(exported_fd)],
                env=env,
                stdin=subprocess.PIPE,
                bufsize=0,  # raw pipes: no buffer lock that a fork could leave held (see `_after_fork`)
                close_fds=True,
                pass_fds=(reply_write, exported_fd, *self._trace_file_descriptor()),
            )
        except BaseException:
            os.close(reply_read)
            self._release_counter()
            raise
        finally:
            os.close(reply_write)  # the helper holds it: its end of the stream is the end of the helper
            os.close(exported_fd)  # (the mapping stays)
        self._proc = proc
        self._replies = os.fdopen(reply_read, "rb", buffering=0)
        config = marshal.dumps(asdict(self._sinks))
        write_all(proc.stdin.fileno(), _HEADER.pack(len(config)) + config)
        self._await_ready(self._replies)
        self._fd = proc.stdin.fileno()
        os.set_blocking(self._fd, False)  # the engine thread's writes must never wait for the helper
        _enlarge_pipe(self._fd)
        self._reader = threading.Thread(target=self._read_replies, args=(self._replies,),
                                        name="kvscope-export-replies", daemon=True)
        self._reader.start()

    def _trace_file_descriptor(self) -> tuple[int, ...]:
        """The engine's descriptor a ``trace_file`` of /dev/fd/N names (N > 2), for the helper to
        keep under its number: without it the helper's N is another file (its shared count, say),
        and the spans would go there. Stdin, stdout and stderr it has already."""
        fd = own_descriptor(self._sinks.trace_file) if self._sinks.trace_file else None
        if fd is None or fd <= 2:
            return ()
        try:
            os.fstat(fd)
        except OSError:  # not open here: the helper's sink fails on it, as this process's would
            return ()
        return (fd,)

    @staticmethod
    def _await_ready(replies) -> None:
        """Wait for the helper's "ready"; warnings it logs while building its sinks (an OTLP setting
        it does not take, say) come first and are logged here, as every later one is."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            message = _read_frame(replies, timeout_s=max(0.0, deadline - time.monotonic()))
            if message == ("ready",):
                return
            if not (isinstance(message, tuple) and message and message[0] == "log"):
                raise RuntimeError(f"span export process did not start (said {message!r})")
            logger.log(message[1], "%s", message[2])

    def _read_replies(self, replies) -> None:
        """Acks of flushes and the helper's warnings, logged here as the engine process's own."""
        while True:
            try:
                message = _read_frame(replies)
            except Exception:
                message = None
            if message is None:
                break
            if message[0] == "ack":
                done = self._acks.pop(message[1], None)  # answered: `force_flush` tells it from a death
                if done is not None:
                    done.set()
            elif message[0] == "log":
                logger.log(message[1], "%s", message[2])
        for done in list(self._acks.values()):  # nobody will answer these any more
            done.set()

    def _fail_over(self, exc: Exception) -> SpanExportResult:
        """From now on export here, starting with every batch the helper may not have read whole.
        What the helper had read but not exported (at most a pipe's worth) is lost: counted and said."""
        self._failed = True
        proc, self._proc = self._proc, None
        if proc is not None:
            _kill(proc)
            self._end_replies()
        frames, self._frames, self._offset, self._pending_bytes = self._frames, deque(), 0, 0
        messages = [marshal.loads(memoryview(frame)[_HEADER.size:]) for frame in frames]
        here = sum(len(m[1]) for m in messages if m[0] == "spans")
        lost = 0
        if proc is not None:  # dead now: its count is final
            lost = max(0, self._queued_records - here - _COUNTS.unpack_from(self._exported)[0])
        self._release_counter()
        self._dropped += lost
        logger.warning("kvscope: the span export process failed (%r); %d spans it had read but not "
                       "written are lost; spans are exported in this process from now on", exc, lost)
        result = SpanExportResult.SUCCESS
        for message in messages:
            if message[0] == "spans" and self._export_here(message[1]) is not SpanExportResult.SUCCESS:
                result = SpanExportResult.FAILURE
        return result

    def _end_replies(self) -> None:
        """The helper has exited: its reply thread ends with the stream; close our end."""
        if self._reader is not None:
            self._reader.join(timeout=5)
        _close_quietly(self._replies)

    def _release_counter(self) -> None:
        """Unmap the helper's count (the mapping holds a descriptor of its own)."""
        if self._exported is not None:
            # the final count (the helper has exited), kept before the mapping goes: readers see one or the other
            self._helper_failed = _COUNTS.unpack_from(self._exported)[1]
            counts, self._exported = self._exported, None
            try:
                counts.close()
            except BufferError:  # another thread reads it at this very moment: unmapped when collected
                pass

    def _export_here(self, records) -> SpanExportResult:
        if self._local is None:
            self._local = build_exporters(self._sinks)
        results = [self._export_to(exporter, records) for exporter in self._local]
        if all(r is SpanExportResult.SUCCESS for r in results):
            return SpanExportResult.SUCCESS
        self._sink_failed_here += len(records)  # a sink failed them (it logs that, once)
        return SpanExportResult.FAILURE

    @staticmethod
    def _export_to(exporter, records) -> SpanExportResult:
        """One sink's export; one that raises (a bug: sinks report their failures) fails this batch
        only, counted, so the batches after it (a fail-over's, shutdown's deferred ones) still go out."""
        try:
            return exporter.export(records)
        except Exception:
            telemetry_failed("a span sink's export")
            return SpanExportResult.FAILURE


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    try:
        proc.wait(5)
    except Exception:
        pass


def _close_quietly(stream) -> None:
    try:
        if stream is not None:
            stream.close()
    except OSError:
        pass


def _enlarge_pipe(fd: int) -> None:
    """Room for many batches in the pipe (Linux: 64 KiB by default, about four batches of 64 loads):
    a batch the pipe takes only in part waits in the engine process for the next one while the
    helper idles (with batches of 512 at 1g/128, wall clock 1.57x -> 1.33x with 1 MiB)."""
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except (ImportError, AttributeError, OSError):  # not Linux, or above /proc/sys/fs/pipe-max-size
        pass


def _shared_counter() -> int:
    """A descriptor of `_COUNTS.size` zero bytes in memory (no file on disk where the system has
    memfd), for the engine process and its helper to map."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("kvscope-exported", os.MFD_CLOEXEC)
    else:
        with tempfile.TemporaryFile() as file:  # unlinked already: gone with the last descriptor
            fd = os.dup(file.fileno())
    try:
        os.ftruncate(fd, _COUNTS.size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_exactly(stream, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(stream, timeout_s: float | None = None):
    """The next message, or None at end of stream (or after ``timeout_s`` without one)."""
    if timeout_s is not None:
        ready, _, _ = select.select([stream], [], [], timeout_s)
        if not ready:
            return None
    header = _read_exactly(stream, _HEADER.size)
    if header is None:
        return None
    body = _read_exactly(stream, _HEADER.unpack(header)[0])
    return None if body is None else marshal.loads(body)


# ---------------------------------------------------------------- the helper's side
class _ForwardToParent(logging.Handler):
    """The helper's warnings go to the engine process, which logs them."""

    def __init__(self, send):
        super().__init__(logging.WARNING)
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._send(("log", record.levelno, record.getMessage()))
        except Exception:
            pass


def _yield_to_the_engine() -> None:
    """Run below the engine's priority and off its pinned cores: vLLM's CPU backend pins the
    engine's threads (the one that started this process among them) to cores its compute uses."""
    try:
        os.nice(10)
    except OSError:
        pass
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # the kernel keeps it inside any cpuset
    except (AttributeError, OSError, ValueError):
        pass


def _serve(reply_fd: int, exported_fd: int | None = None) -> int:
    # A signal to the whole process group (Ctrl-C, systemd's stop, `timeout`) must not end the
    # helper before the engine's shutdown has drained through it: it ends when its stdin closes
    # (the engine process exits or dies), and a helper that hangs is killed by the engine process.
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    # SIGTERM too, while the engine process lives; once it is gone (an orphan blocked on a sink that
    # takes nothing, say), SIGTERM ends the helper: nothing is left to drain for
    engine_pid = os.getppid()
    signal.signal(signal.SIGTERM, lambda signum, frame: os.getppid() != engine_pid and os._exit(1))
    _yield_to_the_engine()
    # Unbuffered: a buffer could hold frames that `select` (`_readable`) does not see.
    requests = sys.stdin.buffer.raw
    reply_lock = threading.Lock()
    engine_gone = False

    def reply(message) -> None:
        nonlocal engine_gone
        if engine_gone:
            return
        payload = marshal.dumps(message)
        with reply_lock:
            try:
                write_all(reply_fd, _HEADER.pack(len(payload)) + payload)
            except OSError:  # the engine process died: nobody reads replies, the spans still get written
                engine_gone = True

    logging.getLogger().addHandler(_ForwardToParent(reply))
    # what a death of ours would lose is counted from this (`ExportProcess._fail_over`)
    exported_count = mmap.mmap(exported_fd, _COUNTS.size) if exported_fd is not None else None
    exported_total = failed_total = 0
    config = _read_frame(requests)
    if config is None:
        return 0
    exporters = build_exporters(Sinks(**config))
    reply(("ready",))

    def export(records) -> None:
        nonlocal exported_total, failed_total
        failed = False
        for exporter in exporters:
            try:
                failed = exporter.export(records) is not SpanExportResult.SUCCESS or failed
            except Exception:
                logging.getLogger(__name__).exception("kvscope: span exporter %r raised", exporter)
                failed = True
        exported_total += len(records)
        if failed:  # (the sink logs why, once)
            failed_total += len(records)
        if exported_count is not None:
            _COUNTS.pack_into(exported_count, 0, exported_total, failed_total)

    records: list = []  # batches that arrived together, exported as one (one write, one OTLP request)
    while True:
        if records and (len(records) >= _HELPER_EXPORT_RECORDS or not _readable(requests)):
            export(records)
            records = []
        message = _read_frame(requests)
        if message is None:  # the engine process closed the pipe (shutdown) or is gone
            break
        if message[0] == "spans":
            records += message[1]
        elif message[0] == "flush":
            if records:
                export(records)
                records = []
            for exporter in exporters:
                exporter.force_flush()
            reply(("ack", message[1]))
    if records:
        export(records)
    for exporter in exporters:
        exporter.shutdown()
    return 0


def _readable(stream) -> bool:
    """Whether more of the engine's frames are waiting in the pipe (``stream`` is unbuffered)."""
    return bool(select.select([stream], [], [], 0)[0])


if __name__ == "__main__":
    # the reply pipe's descriptor and the exported count's, from `ExportProcess._start`
    raise SystemExit(_serve(*map(int, sys.argv[1:3])))
