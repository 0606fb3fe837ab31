"""Wall-clock times of device events: when a CUDA copy really ran, for spans and metrics.

`cudaEventElapsedTime` gives a float32 of milliseconds. Measured from one calibration made at
start-up, event times lose precision as the process runs (steps of 62.5 µs after 10 minutes, 8 ms
after a day): copy durations of tens of microseconds would read as 0 or as one step. So a copy's
duration is taken between its own two events, and only its start is placed on the wall clock,
from a calibration event at most `RECALIBRATE_S` old. The calibration event is recorded on a
stream of its own, which holds no copies, so waiting for it does not wait for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

RECALIBRATE_S = 5.0  # float32 ms at 5 s: steps of 0.5 µs


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
        self._event = None
        self._wall_ns = 0

    def interval(self, start, end) -> tuple[int, int]:
        """``(start_ns, end_ns)`` on the wall clock of two completed events, ``end`` after ``start``."""
        if self._event is None or self._now_ns() - self._wall_ns > self._recalibrate_ns:
            self._calibrate()
        start_ns = self._wall_ns + round(self._event.elapsed_time(start) * 1e6)
        return start_ns, start_ns + max(0, round(start.elapsed_time(end) * 1e6))

    def _calibrate(self) -> None:
        event = self._new_event()
        before = self._now_ns()
        event.record(self._stream)
        event.synchronize()  # the stream is otherwise idle: this waits for the event alone
        # the device stamped the event between the two reads
        self._event, self._wall_ns = event, (before + self._now_ns()) // 2
