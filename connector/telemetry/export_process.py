"""Span export in a helper process: the engine process only serialises span records.

Encoding a span as OTLP/JSON costs one to two microseconds of CPython (OTLP protobuf far
more), and in the engine process that time is taken under the GIL the engine thread needs,
whichever thread does it: at full sampling it was about as much as the planning it describes.
So the engine's export thread only `marshal`s each batch of records (tuples of ints and
strings, about 0.3 µs a span) and writes it to a pipe; a helper process, started on the first
export, builds the real sinks (`sinks.build_exporters`: the trace file, OTLP) and runs them.

Robustness: the helper reads until its stdin closes, so it drains and exits when the engine
process shuts down or dies, and it ignores SIGINT (a Ctrl-C to ``vllm serve`` reaches the whole
process group; the engine's shutdown still flushes through it). Its warnings (an unwritable
trace file, a dead OTLP endpoint) come back over its stdout and are logged by the engine
process, once, as before. If the helper cannot start or dies, the export falls back to the
same sinks in the engine process, logged once: spans are never silently lost. It runs at a lower priority (nice 10) and
may use every core, not only the ones vLLM pinned the engine's threads to.

``KVSCOPE_TRACE_EXPORT=thread`` keeps the export in the engine process (debugging, comparison).
"""

from __future__ import annotations

import logging
import marshal
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Sequence
from dataclasses import asdict

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from connector.telemetry.sinks import Sinks, build_exporters
from connector.telemetry.trace_file import write_all

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")  # frame: byte length, then one marshal'd message
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 30.0


class ExportProcess(SpanExporter):
    """A span exporter that hands record batches to a helper process running the real sinks."""

    def __init__(self, sinks: Sinks, stop_timeout_s: float = _STOP_TIMEOUT_S):
        self._sinks = sinks
        self._stop_timeout_s = stop_timeout_s
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._acks: dict[int, threading.Event] = {}
        self._next_ack = 0
        self._failed = False  # the helper could not start or died: export here from then on
        self._local: list[SpanExporter] | None = None  # the sinks in this process, built when needed
        self._closed = False
        self._lock = threading.Lock()  # one writer at a time: the batcher thread, or shutdown
        reinit = weakref.WeakMethod(self._after_fork)
        os.register_at_fork(after_in_child=lambda: (m := reinit()) and m())

    def _after_fork(self) -> None:
        # The parent's helper and pipe are not ours: a child starts its own on its first export,
        # and drops its copies of the pipe, or the helper would wait for the child's end too.
        # (Raw file objects: closing them takes no lock the parent's reader thread might hold.)
        proc = self._proc
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except Exception:
                    pass
        self._proc, self._reader, self._acks = None, None, {}
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The helper's process id while it runs (benchmarks read its CPU time)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    # ------------------------------------------------------------ SpanExporter
    def export(self, records: Sequence[tuple]) -> SpanExportResult:
        if not records:
            return SpanExportResult.SUCCESS
        with self._lock:
            if self._closed:
                return SpanExportResult.FAILURE
            if not self._failed:
                try:
                    payload = marshal.dumps(("spans", list(records)))
                except ValueError as exc:  # an attribute value marshal cannot carry (GENERIC spans)
                    logger.debug("kvscope: span batch not serialisable (%s); exported in this process", exc)
                    return self._export_here(records)
                try:
                    self._send(payload)
                    return SpanExportResult.SUCCESS
                except Exception as exc:
                    self._fail_over(exc)
            return self._export_here(records)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """True once the helper has exported (and flushed) everything sent before this call."""
        with self._lock:
            if self._local is not None and not all(e.force_flush(timeout_millis) for e in self._local):
                return False
            if self._proc is None or self._closed:
                return True
            self._next_ack += 1
            token, done = self._next_ack, threading.Event()
            self._acks[token] = done
            try:
                self._send(marshal.dumps(("flush", token)))
            except Exception as exc:
                self._acks.pop(token, None)
                self._fail_over(exc)
                return True
        ok = done.wait(timeout_millis / 1000)
        self._acks.pop(token, None)
        return ok

    def shutdown(self) -> None:
        # The batcher thread holds the lock while it writes to the pipe: a helper that stopped
        # reading would hold up the engine's shutdown for ever. Wait a while, then kill it (the
        # blocked write then fails and that batch is exported here).
        locked = self._lock.acquire(timeout=self._stop_timeout_s)
        try:
            if self._closed:
                return
            self._closed = True
            proc = self._proc
        finally:
            if locked:
                self._lock.release()
        if proc is not None:
            try:
                if not locked:
                    raise TimeoutError("the span export helper stopped reading")
                proc.stdin.close()  # the helper drains, shuts its sinks down and exits
                proc.wait(self._stop_timeout_s)
            except Exception as exc:
                logger.warning("kvscope: stopping the span export helper failed (%r); killed it", exc)
                proc.kill()
                try:
                    proc.wait(5)
                except Exception:
                    pass
            if self._reader is not None:
                self._reader.join(timeout=5)
        for exporter in self._local or ():
            exporter.shutdown()

    # ------------------------------------------------------------ the helper
    def _send(self, payload: bytes) -> None:
        if self._proc is None:
            self._start()
        write_all(self._proc.stdin.fileno(), _HEADER.pack(len(payload)) + payload)

    def _start(self) -> None:
        # This very package, whatever the working directory holds: its root first on the path,
        # and (Python 3.11+) no working directory prepended to it.
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []
        proc = subprocess.Popen(
            [sys.executable, *safe_path, "-m", __name__],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # raw pipes: no buffer lock that a fork could leave held (see `_after_fork`)
            close_fds=True,
        )
        self._proc = proc
        config = marshal.dumps(asdict(self._sinks))
        write_all(proc.stdin.fileno(), _HEADER.pack(len(config)) + config)
        ready = _read_frame(proc.stdout, timeout_s=_START_TIMEOUT_S)
        if ready != ("ready",):
            raise RuntimeError(f"span export process did not start (said {ready!r})")
        self._reader = threading.Thread(target=self._read_replies, args=(proc,), name="kvscope-export-replies",
                                        daemon=True)
        self._reader.start()

    def _read_replies(self, proc: subprocess.Popen) -> None:
        """Acks of flushes and the helper's warnings, logged here as the engine process's own."""
        while True:
            try:
                message = _read_frame(proc.stdout)
            except Exception:
                message = None
            if message is None:
                break
            if message[0] == "ack":
                done = self._acks.get(message[1])
                if done is not None:
                    done.set()
            elif message[0] == "log":
                logger.log(message[1], "%s", message[2])
        for done in list(self._acks.values()):  # nobody will answer these any more
            done.set()

    def _fail_over(self, exc: Exception) -> None:
        logger.warning("kvscope: the span export process failed (%r); spans are exported in this "
                       "process from now on", exc)
        self._failed = True
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()

    def _export_here(self, records) -> SpanExportResult:
        if self._local is None:
            self._local = build_exporters(self._sinks)
        results = [e.export(records) for e in self._local]
        ok = all(r is SpanExportResult.SUCCESS for r in results)
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE


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


def _serve() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _yield_to_the_engine()
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the reply stream
    reply_lock = threading.Lock()

    def reply(message) -> None:
        payload = marshal.dumps(message)
        with reply_lock:
            replies.write(_HEADER.pack(len(payload)) + payload)
            replies.flush()

    logging.getLogger().addHandler(_ForwardToParent(reply))
    config = _read_frame(requests)
    if config is None:
        return 0
    exporters = build_exporters(Sinks(**config))
    reply(("ready",))
    while True:
        message = _read_frame(requests)
        if message is None:  # the engine process closed the pipe (shutdown) or is gone
            break
        if message[0] == "spans":
            for exporter in exporters:
                try:
                    exporter.export(message[1])
                except Exception:
                    logging.getLogger(__name__).exception("kvscope: span exporter %r raised", exporter)
        elif message[0] == "flush":
            for exporter in exporters:
                exporter.force_flush()
            reply(("ack", message[1]))
    for exporter in exporters:
        exporter.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(_serve())
