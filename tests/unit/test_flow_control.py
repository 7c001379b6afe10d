"""The in-flight window (swarm/flow_control.py) on a simulated path, with a fake clock.

The path is a FIFO bottleneck that serves one microbatch every ``service`` seconds (a link's
transfer time of one microbatch, or a stage's compute) between two fixed delays: a microbatch sent at
``t`` reaches the bottleneck at ``t + delay / 2``, waits for it, and is back ``delay / 2`` after its
service. Its bandwidth-delay product is ``(delay + service) / service`` microbatches. The simulated
stage-0 peer keeps ``window`` microbatches out and tells the controller every round trip.
"""

from __future__ import annotations

import heapq
import math

import pytest

from swarm.flow_control import ALPHA, BETA, INITIAL_WINDOW, MIN_RTT_PERIOD, QUEUE_LIMIT, FlowWindow
from tests.unit.fake_clock import FakeClock


class Path:
    """A bottleneck between two delays, driven by a :class:`FlowWindow` (see the module docstring)."""

    def __init__(self, *, delay: float, service: float, max_window: int = 64) -> None:
        self.delay, self.service = delay, service
        self.clock = FakeClock()
        self.flow = FlowWindow(max_window=max_window, clock=self.clock)
        self.free_at = 0.0  # when the bottleneck finishes its last microbatch
        self.out: list[tuple[float, float]] = []  # heap of (back at, sent at)
        self.windows: list[int] = []  # the window after every round trip
        self.rtts: list[float] = []
        self.delivered = 0
        self.queue: int | None = None  # what the "next stage" reports in its replies

    def bdp(self) -> float:
        return (self.delay + self.service) / self.service

    def _send(self) -> None:
        now = self.clock.now
        start = max(now + self.delay / 2, self.free_at)
        self.free_at = start + self.service
        heapq.heappush(self.out, (self.free_at + self.delay / 2, now))

    def run(self, seconds: float) -> float:
        """Run for ``seconds``; returns the microbatches delivered per second."""
        end, before = self.clock.now + seconds, self.delivered
        while True:
            while len(self.out) < self.flow.window:
                self._send()
            back, sent = heapq.heappop(self.out)
            if back > end:
                heapq.heappush(self.out, (back, sent))
                self.clock.advance(end - self.clock.now)
                return (self.delivered - before) / seconds
            self.clock.advance(back - self.clock.now)
            self.delivered += 1
            self.rtts.append(back - sent)
            self.windows.append(self.flow.on_round_trip(back - sent, in_flight=len(self.out) + 1, queue=self.queue))


def test_the_window_grows_to_the_bandwidth_delay_product_of_a_long_delay_link():
    path = Path(delay=1.0, service=0.1)  # 10 microbatches/s over a 1 s round trip: 11 in flight fill it
    assert path.flow.window == INITIAL_WINDOW
    path.run(30)
    rate = path.run(30)
    window = path.flow.window
    assert path.bdp() <= window <= path.bdp() + BETA + 1, (window, path.bdp())
    assert rate > 0.9 / path.service, rate


def test_on_a_short_link_the_window_stays_small_and_the_round_trip_near_its_minimum():
    path = Path(delay=0.05, service=0.1)  # 1.5 microbatches fill it
    rate = path.run(60)
    assert path.flow.window <= math.ceil(path.bdp() + BETA + 1), path.flow.window
    assert rate > 0.95 / path.service
    assert max(path.rtts[-50:]) < (BETA + 2) * min(path.rtts)  # a bounded queue


def test_a_bandwidth_dip_shrinks_the_window_and_it_recovers_after():
    path = Path(delay=1.0, service=0.1)
    path.run(60)
    grown = path.flow.window
    path.service = 0.5  # the link's bandwidth falls to a fifth: 3 in flight fill it now
    path.run(60)
    dipped = path.flow.window
    assert dipped <= path.bdp() + BETA + 1 < grown, (grown, dipped, path.bdp())
    assert max(path.rtts[-10:]) < 2 * (path.delay + path.service), "the queue was drained"
    path.service = 0.1
    path.run(30)
    rate = path.run(30)
    assert path.flow.window >= path.bdp() - 1 > dipped, (dipped, path.flow.window)
    assert rate > 0.8 / path.service


def test_the_window_never_exceeds_the_memory_bound():
    path = Path(delay=1.0, service=0.05, max_window=6)  # 21 would fill it
    path.run(60)
    assert max(path.windows) == 6 and all(w <= 6 for w in path.windows)


def test_a_loss_halves_the_window_once_per_round_and_holds_growth_for_a_round():
    path = Path(delay=1.0, service=0.1)
    path.run(60)
    before = path.flow.window
    assert path.flow.on_loss() == before // 2
    assert path.flow.on_loss() == before // 2, "two re-sends of one round halve once"
    path.run(path.flow.srtt * 0.9)
    assert path.flow.window == before // 2, "no growth within the loss's round"
    path.run(60)
    assert path.flow.window >= path.bdp(), "and it grows back"


def test_a_busy_next_stage_holds_growth():
    path = Path(delay=1.0, service=0.1)
    path.queue = QUEUE_LIMIT
    path.run(60)
    assert path.flow.window == 2
    path.queue = QUEUE_LIMIT - 1
    path.run(60)
    assert path.flow.window >= path.bdp()


def test_an_unfilled_window_does_not_grow():
    """Under the flush schedule a batch's last microbatches leave the window unfilled: no growth on that."""
    clock = FakeClock()
    flow = FlowWindow(max_window=16, clock=clock)
    for _ in range(100):
        clock.advance(1.0)
        flow.on_round_trip(1.0, in_flight=1)
    assert flow.window == 2
    for _ in range(10):
        clock.advance(1.0)
        flow.on_round_trip(1.0, in_flight=2)
    assert flow.window > 2


def test_a_longer_path_is_relearnt_after_the_minimum_expires():
    """The path gets longer for good (another replica, a rerouted link): round trips first read as a
    queue and the window shrinks; once the minimum is ``MIN_RTT_PERIOD`` old it is relearnt and the
    window grows to the new path's bandwidth-delay product."""
    path = Path(delay=0.2, service=0.1)
    path.run(30)
    path.delay = 2.0  # 21 fill it now
    path.run(MIN_RTT_PERIOD + 60)
    assert path.flow.window >= path.bdp() - 1, (path.flow.window, path.bdp())
    assert path.flow.min_rtt >= 2.0


def test_a_standing_queue_is_not_mistaken_for_the_path_when_the_minimum_expires():
    """Over several expiries of the minimum the window stays near the product instead of creeping up."""
    path = Path(delay=1.0, service=0.1)
    path.run(8 * MIN_RTT_PERIOD)
    assert path.flow.window <= path.bdp() + BETA + 1
    assert path.flow.min_rtt < (path.delay + path.service) * 1.5


def test_the_estimate_reads_littles_law():
    path = Path(delay=1.0, service=0.1)
    path.run(60)
    estimate = path.flow.estimate()
    assert estimate.window == path.flow.window
    assert estimate.min_rtt == pytest.approx(path.delay + path.service, rel=0.05)
    assert ALPHA - 1 <= estimate.queued <= BETA + 1
    assert estimate.bdp == pytest.approx(path.bdp(), abs=BETA + 1)


def test_nonsense_round_trips_are_ignored_and_bounds_are_checked():
    clock = FakeClock()
    flow = FlowWindow(max_window=4, clock=clock)
    for bad in (0.0, -1.0, math.nan, math.inf):
        assert flow.on_round_trip(bad, in_flight=2) == 2
    assert flow.min_rtt is None
    with pytest.raises(ValueError):
        FlowWindow(max_window=0)
    assert FlowWindow(max_window=1).window == 1
