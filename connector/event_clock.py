"""Wall-clock times of device events: when a CUDA copy really ran, for spans and metrics.

`cudaEventElapsedTime` gives a float32 of milliseconds. Measured from one calibration made at
start-up, event times lose precision as the process runs (steps of 62.5 µs after 10 minutes, 8 ms
after a day): copy durations of tens of microseconds would read as 0 or as one step. So a copy's
duration is taken between its own two events, and only its start is placed on the wall clock,
from a calibration event at most `RECALIBRATE_S` old. The calibration event is recorded on a
stream of its own, which holds no copies, so waiting for it does not wait for them.

Not even that is certain: CUDA runs streams on a few hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``,
8 by default) and two streams that share one can serialise, so the calibration event may wait behind
a forward. Its stamp is then known only within that wait, and the worker would have stalled for it. So
a recalibration waits at most `CALIBRATION_WAIT_NS` for its event (a host stall between recording and
seeing it done, or a wall clock stepped back, counts the same); past that it keeps the calibration it
has and tries again `RETRY_S` later. The first one, with nothing to fall back on, and one made when the
last accepted is `MAX_AGE_S` old (float32 steps of 4 µs: starts would drift further), wait for their
event whatever it takes; one that waited long is made again a second later.
"""

from __future__ import annotations

import time
from collections.abc import Callable

RECALIBRATE_S = 5.0  # float32 ms at 5 s: steps of 0.5 µs
# A calibration stamped within this wait places copy starts within half of it; the longest the worker
# thread waits for one (it polls the event: a forward's length would be milliseconds).
CALIBRATION_WAIT_NS = 200_000
RETRY_S = 1.0  # after a calibration that waited too long
MAX_AGE_S = 60.0  # float32 ms at 60 s: steps of 4 µs


class EventClock:
    """Maps pairs of completed timing events to wall-clock nanoseconds.

    ``new_event()`` makes a timing event (``torch.cuda.Event(enable_timing=True)``); ``stream`` is
    where calibration events are recorded; ``now_ns`` reads the wall clock (``time.time_ns``)."""

    def __init__(self, new_event: Callable[[], object], stream, now_ns: Callable[[], int] = time.time_ns,
                 recalibrate_s: float = RECALIBRATE_S):
        self._new_event = new_event
        self._stream = stream
        self._now_ns = now_ns
        self._recalibrate_ns = int(recalibrate_s * 1e9)
        self._retry_ns = min(self._recalibrate_ns, int(RETRY_S * 1e9))
        self._max_age_ns = max(self._recalibrate_ns, int(MAX_AGE_S * 1e9))
        self._event = None
        self._wall_ns = 0  # the wall-clock time of `_event`
        self._next_calibration_ns = 0
        self.late_calibrations = 0  # calibrations given up after `CALIBRATION_WAIT_NS` (tests, logs)

    def interval(self, start, end) -> tuple[int, int]:
        """``(start_ns, end_ns)`` on the wall clock of two completed events, ``end`` after ``start``."""
        if self._event is None:
            self._calibrate_waiting()
        else:
            now = self._now_ns()
            if now >= self._next_calibration_ns:
                if now - self._wall_ns > self._max_age_ns:
                    self._calibrate_waiting()
                else:
                    self._recalibrate()
        start_ns = self._wall_ns + round(self._event.elapsed_time(start) * 1e6)
        return start_ns, start_ns + max(0, round(start.elapsed_time(end) * 1e6))

    def _calibrate_waiting(self) -> None:
        """A calibration that waits for its event whatever it takes: at start-up, or when the last is too old."""
        event = self._new_event()
        before = self._now_ns()
        event.record(self._stream)
        event.synchronize()
        after = self._now_ns()
        # the device stamped the event between the two reads
        self._event, self._wall_ns = event, (before + after) // 2
        wide = not 0 <= after - before <= CALIBRATION_WAIT_NS
        self._next_calibration_ns = after + (self._retry_ns if wide else self._recalibrate_ns)

    def _recalibrate(self) -> None:
        event = self._new_event()
        before = self._now_ns()
        event.record(self._stream)
        while True:
            done = event.query()
            after = self._now_ns()
            in_time = 0 <= after - before <= CALIBRATION_WAIT_NS
            if done and in_time:  # stamped between `before` and this read
                self._event, self._wall_ns = event, (before + after) // 2
                self._next_calibration_ns = after + self._recalibrate_ns
                return
            if not in_time:  # queued behind other work, the host stalled, or the clock stepped: keep the old one
                self.late_calibrations += 1
                self._next_calibration_ns = after + self._retry_ns
                return
