"""Wall-clock times of device copies from CUDA timing events (`event_clock`).

CUDA events need a GPU; these stand-ins keep a device time and answer `elapsed_time` as CUDA does,
a float32 of milliseconds, which is what loses precision far from the calibration."""

from __future__ import annotations

import numpy as np

from connector.event_clock import CALIBRATION_WAIT_NS, EventClock

WALL_AT_DEVICE_ZERO_NS = 1_764_500_000_000_000_000


class _Device:
    def __init__(self):
        self.ms = 0.0  # device time
        self.events = 0
        self.queued_until_ms = 0.0  # the calibration stream's queue is busy until then
        self.tick_ms = 0.0  # host time each wall-clock read takes (a polling loop moves time on)

    def now_ns(self) -> int:  # the host's wall clock, in step with the device
        self.ms += self.tick_ms
        return WALL_AT_DEVICE_ZERO_NS + round(self.ms * 1e6)

    def event(self, at_ms: float | None = None) -> "_Event":
        self.events += 1
        event = _Event(self)
        if at_ms is not None:
            event.ms = at_ms
        return event


class _Event:
    def __init__(self, device: _Device):
        self.device, self.ms = device, None

    def record(self, stream=None) -> None:
        self.ms = max(self.device.ms, self.device.queued_until_ms)  # stamped once the queue reaches it

    def query(self) -> bool:
        return self.device.ms >= self.ms

    def synchronize(self) -> None:
        self.device.ms = max(self.device.ms, self.ms)

    def elapsed_time(self, end: "_Event") -> float:
        return float(np.float32(end.ms - self.ms))  # cudaEventElapsedTime: float32 milliseconds


def _clock(device: _Device, **kw) -> EventClock:
    return EventClock(device.event, stream=None, now_ns=device.now_ns, **kw)


def test_a_short_copy_an_hour_after_start_keeps_its_microseconds():
    device = _Device()
    clock = _clock(device)
    clock.interval(device.event(0.0), device.event(0.01))  # calibrated at start-up
    device.ms = 3_600_000.0  # an hour later
    start, end = device.event(3_600_000.0), device.event(3_600_000.020)  # a 20 µs copy
    start_ns, end_ns = clock.interval(start, end)
    assert abs((end_ns - start_ns) - 20_000) <= 100
    assert abs(start_ns - (WALL_AT_DEVICE_ZERO_NS + 3_600_000_000_000)) <= 1_000
    # one calibration made then, from this far away, would place it in steps of 250 µs
    assert float(np.float32(3_600_000.0 + 0.020)) - 3_600_000.0 != 0.020


def test_the_duration_is_measured_between_the_copys_own_events():
    device = _Device()
    clock = _clock(device, recalibrate_s=1e9)  # never recalibrated
    clock.interval(device.event(0.0), device.event(0.0))
    device.ms = 86_400_000.0  # a day later: the start is placed in 8 ms steps
    start_ns, end_ns = clock.interval(device.event(86_400_000.0), device.event(86_400_000.035))
    assert abs((end_ns - start_ns) - 35_000) <= 100


def test_calibrates_once_per_interval_not_per_copy():
    device = _Device()
    clock = _clock(device, recalibrate_s=5.0)
    for i in range(100):
        device.ms = i * 10.0  # one second of copies
        clock.interval(device.event(device.ms), device.event(device.ms + 0.05))
    assert device.events == 100 * 2 + 1
    device.ms += 6_000.0
    clock.interval(device.event(device.ms), device.event(device.ms + 0.05))
    assert device.events == 101 * 2 + 2


def test_a_recalibration_queued_behind_a_forward_is_given_up_within_its_wait_and_retried():
    """A calibration event that waits behind other work (streams sharing a hardware queue) would stall
    the worker and place starts by the middle of that wait: the clock keeps its calibration instead."""
    device = _Device()
    clock = _clock(device, recalibrate_s=5.0)
    clock.interval(device.event(0.0), device.event(0.01))  # calibrated at start-up, idle stream
    device.ms = 6_000.0  # due for recalibration, but the stream's queue is busy for 30 ms
    device.queued_until_ms = 6_030.0
    device.tick_ms = 0.002  # each poll of the event takes 2 µs
    start_ns, end_ns = clock.interval(device.event(6_000.0), device.event(6_000.02))
    assert device.ms - 6_000.0 <= CALIBRATION_WAIT_NS / 1e6 + 0.01  # waited ~0.2 ms, not 30 ms
    assert clock.late_calibrations == 1
    # placed by the old calibration: right to within float32 steps at 6 s, not off by 15 ms
    assert abs(start_ns - (WALL_AT_DEVICE_ZERO_NS + 6_000_000_000)) <= 1_000
    assert abs((end_ns - start_ns) - 20_000) <= 100
    # not tried again at once (every copy would wait): one second later, on an idle queue, it succeeds
    events = device.events
    device.ms = 6_500.0
    clock.interval(device.event(6_500.0), device.event(6_500.01))
    assert device.events == events + 2 and clock.late_calibrations == 1
    device.ms = 7_300.0
    clock.interval(device.event(7_300.0), device.event(7_300.01))
    assert device.events == events + 5  # a new calibration event
    assert clock.late_calibrations == 1


def test_the_first_calibration_waits_for_its_event_and_is_soon_made_again_when_it_waited_long():
    device = _Device()
    device.queued_until_ms = 30.0  # behind a 30 ms forward at start-up: nothing to fall back on
    clock = _clock(device)
    start_ns, _ = clock.interval(device.event(0.0), device.event(0.01))
    assert device.ms == 30.0  # it waited
    assert abs(start_ns - WALL_AT_DEVICE_ZERO_NS) <= 15_000_000  # within half the wait
    events = device.events
    device.ms = 1_100.0  # a second later (not five): made again, on an idle queue
    start_ns, _ = clock.interval(device.event(1_100.0), device.event(1_100.01))
    assert device.events == events + 3
    assert abs(start_ns - (WALL_AT_DEVICE_ZERO_NS + 1_100_000_000)) <= 1_000


def test_a_recalibration_seen_done_only_after_a_host_stall_is_given_up_too():
    """The event completed at once, but the worker thread first saw it 8 ms later (GIL, preemption): its
    stamp is known only within those 8 ms, so it is not taken."""
    device = _Device()
    clock = _clock(device, recalibrate_s=5.0)
    clock.interval(device.event(0.0), device.event(0.01))
    device.ms = 6_000.0
    device.tick_ms = 8.0  # every read of the wall clock comes 8 ms after the last
    start_ns, _ = clock.interval(device.event(6_000.0), device.event(6_000.02))
    assert clock.late_calibrations == 1
    assert abs(start_ns - (WALL_AT_DEVICE_ZERO_NS + 6_000_000_000)) <= 1_000  # the old calibration's placing


def test_a_wall_clock_stepped_back_during_a_recalibration_gives_it_up_at_once():
    device = _Device()
    clock = _clock(device, recalibrate_s=5.0)
    clock.interval(device.event(0.0), device.event(0.01))
    device.ms, device.queued_until_ms, device.tick_ms = 6_000.0, 6_030.0, 0.002
    reads = []
    real_now = device.now_ns

    def stepping_back() -> int:  # NTP steps the clock back 1 s right after the event is recorded
        reads.append(None)
        return real_now() - (1_000_000_000 if len(reads) > 2 else 0)

    clock._now_ns = stepping_back
    clock.interval(device.event(6_000.0), device.event(6_000.02))
    assert clock.late_calibrations == 1 and len(reads) == 3  # due?, before, one poll: no wait for the queue


def test_a_calibration_a_minute_old_is_made_again_waiting_if_the_queue_stays_busy():
    """Every recalibration waits behind a forward: the clock keeps its calibration a minute at most, then
    waits for one (float32 steps grow with its age: 8 ms after a day)."""
    device = _Device()
    clock = _clock(device, recalibrate_s=5.0)
    clock.interval(device.event(0.0), device.event(0.01))
    waited = []
    for second in range(7, 200, 7):  # a copy every 7 s, the calibration queue always 30 ms behind
        device.ms = second * 1_000.0
        device.queued_until_ms = device.ms + 30.0
        device.tick_ms = 0.002
        before = device.ms
        start_ns, _ = clock.interval(device.event(device.ms), device.event(device.ms + 0.02))
        device.tick_ms = 0.0
        waited.append(device.ms - before >= 30.0)
        assert abs(start_ns - (WALL_AT_DEVICE_ZERO_NS + second * 1_000_000_000)) <= 15_100_000
    # waits only once the accepted calibration is past a minute old: at 63 s, 126 s, 189 s
    assert [7 * (i + 1) for i, w in enumerate(waited) if w] == [63, 126, 189]
    assert clock.late_calibrations == len(waited) - 3


# --- found by the mutation campaign of the worker side --------------------------------------------


def test_a_recalibration_taken_in_time_holds_for_its_whole_interval():
    """Only a calibration that waited too long is retried a second later; one taken in time lasts
    `recalibrate_s`, or every second's copies would wait for a calibration event."""
    device = _Device()
    clock = _clock(device, recalibrate_s=5.0)
    clock.interval(device.event(0.0), device.event(0.01))
    device.ms = 6_000.0
    clock.interval(device.event(6_000.0), device.event(6_000.01))  # recalibrated, in time
    events = device.events
    assert events == 2 + 1 + 2 + 1 and clock.late_calibrations == 0
    device.ms = 8_000.0  # two seconds on: not due
    clock.interval(device.event(8_000.0), device.event(8_000.01))
    assert device.events == events + 2
    device.ms = 11_100.0
    clock.interval(device.event(11_100.0), device.event(11_100.01))
    assert device.events == events + 5


def test_a_first_calibration_across_a_wall_clock_stepped_back_is_made_again_a_second_later():
    """A wall clock stepped back while the first calibration waited leaves its stamp known only within
    an unknown wait: it is treated as one that waited long, made again a second later, not five."""
    device = _Device()
    reads = []

    def stepping_back() -> int:  # NTP steps the clock back 1 s between the calibration's two reads
        reads.append(None)
        return device.now_ns() - (1_000_000_000 if len(reads) > 1 else 0)

    clock = EventClock(device.event, stream=None, now_ns=stepping_back)
    clock.interval(device.event(0.0), device.event(0.01))
    events = device.events
    device.ms = 1_100.0
    clock.interval(device.event(1_100.0), device.event(1_100.01))
    assert device.events == events + 3  # a new calibration event


def test_a_recalibration_seen_done_exactly_at_the_end_of_its_wait_is_taken():
    """`CALIBRATION_WAIT_NS` is the longest wait accepted, itself included."""
    device = _Device()
    clock = _clock(device, recalibrate_s=5.0)
    clock.interval(device.event(0.0), device.event(0.01))
    device.ms = 6_000.0
    device.tick_ms = CALIBRATION_WAIT_NS / 1e6  # each wall-clock read comes exactly one wait after the last
    clock.interval(device.event(6_000.0), device.event(6_000.02))
    assert clock.late_calibrations == 0


def test_a_copy_never_ends_before_it_starts():
    """A negative elapsed time between a copy's events (not in order on the device) gives a span of no
    length, never one ending before its start."""
    device = _Device()
    clock = _clock(device)
    start_ns, end_ns = clock.interval(device.event(1.0), device.event(0.5))
    assert end_ns == start_ns


# --- found by the mutation campaign of the worker side (event clock) -------------------------------


def test_a_first_calibration_is_placed_in_the_middle_of_the_reads_around_it():
    """The device stamps the calibration event somewhere between the wall-clock reads before and after
    it: their middle places copy starts within half that wait, either read alone within all of it."""
    device = _Device()
    device.tick_ms = 10.0  # each wall-clock read takes 10 ms
    device.queued_until_ms = 20.0  # stamped at 20 ms: 10 ms after the read before it, 10 ms before the one after
    clock = _clock(device)
    start_ns, _ = clock.interval(device.event(25.0), device.event(25.5))
    assert abs(start_ns - (WALL_AT_DEVICE_ZERO_NS + 25_000_000)) <= 1_000


def test_a_recalibration_is_placed_in_the_middle_of_the_reads_around_it():
    """As at start-up: a recalibration taken in time places starts by the middle of its short wait."""
    device = _Device()
    clock = _clock(device, recalibrate_s=5.0)
    clock.interval(device.event(0.0), device.event(0.01))
    device.ms = 6_000.0
    device.tick_ms = 0.0625  # 62.5 µs a wall-clock read: read before at 6000.125 ms, seen done at 6000.25 ms
    device.queued_until_ms = 6_000.1875  # stamped in the middle
    start_ns, _ = clock.interval(device.event(6_000.5), device.event(6_000.52))
    assert clock.late_calibrations == 0
    assert abs(start_ns - (WALL_AT_DEVICE_ZERO_NS + 6_000_500_000)) <= 1_000


def test_a_first_calibration_seen_done_exactly_at_the_end_of_its_wait_holds_for_its_whole_interval():
    """`CALIBRATION_WAIT_NS` itself included, as for recalibrations: such a first calibration is not
    made again a second later."""
    device = _Device()
    device.tick_ms = CALIBRATION_WAIT_NS / 1e6  # the read after comes exactly one wait after the read before
    clock = _clock(device, recalibrate_s=5.0)
    clock.interval(device.event(0.0), device.event(0.01))
    device.tick_ms = 0.0
    events = device.events
    device.ms = 1_100.0
    clock.interval(device.event(1_100.0), device.event(1_100.01))
    assert device.events == events + 2  # no new calibration event
