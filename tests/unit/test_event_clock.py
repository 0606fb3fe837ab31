"""Wall-clock times of device copies from CUDA timing events (`event_clock`).

CUDA events need a GPU; these stand-ins keep a device time and answer `elapsed_time` as CUDA does,
a float32 of milliseconds, which is what loses precision far from the calibration."""

from __future__ import annotations

import numpy as np

from connector.event_clock import EventClock

WALL_AT_DEVICE_ZERO_NS = 1_764_500_000_000_000_000


class _Device:
    def __init__(self):
        self.ms = 0.0  # device time
        self.events = 0

    def now_ns(self) -> int:  # the host's wall clock, in step with the device
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
        self.ms = self.device.ms

    def synchronize(self) -> None:
        pass

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
