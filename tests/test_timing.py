"""A call's time by phase (resilient_ckpt.timing): what the restore's breakdown is made of."""

from __future__ import annotations

import threading
import time

import pytest

from resilient_ckpt.timing import OTHER, PhaseClock, current, phase


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_phases_count_self_time_and_the_rest_is_other():
    with PhaseClock() as clock:
        with phase("reads"):
            _spin(0.02)
            with phase("collectives"):  # inside reads: taken out of it
                _spin(0.03)
        with phase("reads"):  # a second visit adds up
            _spin(0.01)
        _spin(0.02)  # no phase
    b = clock.breakdown()
    assert b["collectives"] == pytest.approx(0.03, abs=0.01)
    assert b["reads"] == pytest.approx(0.03, abs=0.01)
    assert b[OTHER] == pytest.approx(0.02, abs=0.01)
    assert sum(b.values()) == pytest.approx(clock.wall_s, rel=1e-6)


def test_a_phase_raising_is_still_counted_and_the_clock_closes():
    with pytest.raises(RuntimeError):
        with PhaseClock() as clock:
            with phase("decode"):
                _spin(0.01)
                raise RuntimeError("bad header")
    assert clock.breakdown()["decode"] >= 0.009
    assert current() is None


def test_without_an_open_clock_marks_do_nothing_and_other_threads_see_no_clock():
    with phase("reads"):  # no clock: no error, nothing recorded anywhere
        pass
    seen = []
    with PhaseClock() as clock:
        t = threading.Thread(target=lambda: seen.append(current()))
        t.start()
        t.join()
        assert current() is clock
    assert seen == [None] and clock.seconds == {}


def test_helper_threads_add_their_busy_seconds_to_the_clock_they_are_handed():
    with PhaseClock() as clock:
        threads = [threading.Thread(target=clock.add_busy, args=("pread", 0.25)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert clock.busy == {"pread": pytest.approx(2.0)}
    assert "pread" not in clock.breakdown()  # helper time is not the calling thread's
