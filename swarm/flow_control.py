"""How many microbatches a stage-0 peer keeps in the pipeline: a window sized from bandwidth × delay.

Seed 002 §3.4 (SpanTrain's dynamic environment adapter) watches how long a microbatch takes to cross
a link and, when the link slows, changes what is sent so that the next stage does not wait. Here the
knob is the number of microbatches in flight, and the law is TCP's (Vegas, with BBR's filters).

**Cost model (Little's law).** A stage-0 peer with ``w`` microbatches in flight, each back after a
round trip ``R``, delivers ``X = w / R`` microbatches per second. The path behind it (every link,
every stage's compute) has a bottleneck that serves at most ``C`` microbatches/s, and an empty path
answers after ``R0`` (propagation both ways, one microbatch's transfer at each hop, its compute). Up
to ``w = C · R0``, the *bandwidth-delay product* in microbatches, nothing waits: ``R = R0`` and
``X`` grows with ``w``. Beyond it ``X`` stays at ``C`` and each extra microbatch only waits in a
queue (a router's buffer, a stage's compute queue), so ``R = w / C``. The window to keep is the BDP
plus a margin that keeps the bottleneck busy while answers travel back. From the peer's own
traffic, whatever the bottleneck is (the slowest hop's link, the slowest stage, a link whose
bandwidth dipped):

    BDP    = X · R0 = n · R0 / R      (n microbatches in flight, R measured)
    queued = n − BDP = n · (1 − R0 / R)

``R0`` is the least round trip, trusted for :data:`MIN_RTT_PERIOD` seconds after a round trip came
close to it (BBR's RTprop filter), ``R``
the least of the last round (one smoothed round trip; its minimum, not its mean, so compute jitter
on a shared CPU does not read as a queue: Linux's tcp_vegas does the same).

**The law**, decided once per round (a change shows in the round trips only a round later):

- ``queued > BETA`` (the round trip grew well above its minimum: a queue, congestion, not a dead
  peer): back to ``ceil(BDP) + ALPHA``. This is how a bandwidth dip shrinks the window: the
  bottleneck's rate falls, round trips grow, the BDP measured at the new rate is smaller.
- ``queued < ALPHA``, the window was full (``n == w``: under the ``flush`` schedule a batch's last
  microbatches cannot fill it) and the next stage's compute queue is short (below
  :data:`QUEUE_LIMIT` jobs waiting ahead of our microbatch, as it said in its reply): ``w + 1``.
- a loss (a microbatch re-sent: a call timed out or no peer took it): ``w // 2`` at once, at most
  once per round, and no growth for a round.
- always ``1 <= w <= max_window``: ``--max-in-flight``, the number the memory check sized the stage
  for (every microbatch in flight holds its graph at each stage it crossed).

A queue that stands for long would hide in ``R0`` once the filter forgets the last empty round trip
(the window would then creep up). So when ``R0`` is :data:`MIN_RTT_PERIOD` old, the window is halved
for :data:`PROBE_ROUNDS` round trips (BBR's ProbeRTT): the queue drains, and the microbatches sent
meanwhile give ``R0`` again. It costs about a quarter of a round's throughput every 30 s.

Pure: the clock is injected; no asyncio, no torch. :class:`swarm.trainer.Trainer` consults it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from dht.clock import SYSTEM_CLOCK

INITIAL_WINDOW = 2  # microbatches in flight before any round trip was measured
ALPHA = 1.0  # microbatches allowed to queue on the path before the window stops growing
BETA = 3.0  # ...and beyond which it shrinks back to the bandwidth-delay product plus ALPHA
QUEUE_LIMIT = 2  # jobs waiting ahead of a microbatch at the next stage's compute that hold growth
MIN_RTT_PERIOD = 30.0  # seconds a minimum round trip is trusted (then a round at half the window relearns it)
PROBE_ROUNDS = 2.0  # round trips a probe for R0 lasts (the first drains the queue, the second measures)
MIN_RTT_TOLERANCE = 1.1  # a round trip this close to R0 shows the path still empty (no probe needed)
SRTT_GAIN = 0.25  # weight of the newest round trip in the smoothed one (the length of a round)


@dataclass(frozen=True)
class WindowEstimate:
    """What the controller believes of the path (all ``nan`` before the first round trip)."""

    window: int
    min_rtt: float  # R0, seconds
    srtt: float  # smoothed round trip, seconds
    bdp: float  # microbatches the path holds without a queue, at the last round
    queued: float  # microbatches waiting in queues, at the last round


class FlowWindow:
    """The in-flight window of one stage-0 peer; see the module docstring for the law."""

    def __init__(self, *, max_window: int, clock: Callable[[], float] = SYSTEM_CLOCK,
                 initial_window: int = INITIAL_WINDOW, min_rtt_period: float = MIN_RTT_PERIOD) -> None:
        if max_window < 1 or initial_window < 1:
            raise ValueError("max_window and initial_window must be >= 1")
        self.max_window, self.clock, self.min_rtt_period = max_window, clock, min_rtt_period
        self._window = min(initial_window, max_window)
        self._min_rtt: tuple[float, float] | None = None  # (when last seen, R0)
        self.srtt: float | None = None
        self._round_start = clock()
        self._round_min = math.inf
        self._round_in_flight = 0  # most microbatches in flight at a completion this round
        self._round_queue: int | None = None  # least compute queue the next stage reported this round
        self._hold_until = -math.inf  # no decision before this (a loss's round)
        self._probing = False  # a round at half the window, to relearn R0
        self._probe_start = self._probe_until = self._probe_min = math.inf
        self._last = WindowEstimate(self._window, math.nan, math.nan, math.nan, math.nan)
        self.num_losses = 0

    @property
    def window(self) -> int:
        """Microbatches to keep in flight now."""
        return max(1, self._window // 2) if self._probing else self._window

    @property
    def min_rtt(self) -> float | None:
        return None if self._min_rtt is None else self._min_rtt[1]

    def estimate(self) -> WindowEstimate:
        return self._last

    def on_round_trip(self, seconds: float, *, in_flight: int, queue: int | None = None) -> int:
        """A microbatch came back after ``seconds``; ``in_flight`` were out when it did (itself
        included); ``queue``: jobs the next stages' busiest compute had waiting ahead of it, if it
        said. Returns the window."""
        if not (math.isfinite(seconds) and seconds > 0):
            return self.window
        now = self.clock()
        if self._min_rtt is None or seconds <= MIN_RTT_TOLERANCE * self._min_rtt[1]:  # (about) seen again:
            self._min_rtt = (now, min(seconds, self._min_rtt[1] if self._min_rtt else seconds))  # trusted anew
        self.srtt = seconds if self.srtt is None else (1 - SRTT_GAIN) * self.srtt + SRTT_GAIN * seconds
        self._round_min = min(self._round_min, seconds)
        self._round_in_flight = max(self._round_in_flight, in_flight)
        if queue is not None:
            self._round_queue = queue if self._round_queue is None else min(self._round_queue, queue)
        if self._probing:
            self._probe(now, seconds)
        elif now - self._round_start >= self.srtt and now >= self._hold_until:
            self._end_round(now)
        return self.window

    def on_loss(self) -> int:
        """A microbatch had to be re-sent (a timeout, no peer took it): halve, once per round."""
        now = self.clock()
        self.num_losses += 1
        if now < self._hold_until:
            return self.window
        self._window = max(1, self._window // 2)
        self._hold_until = now + (self.srtt or 0.0)
        self._new_round(now)
        return self.window

    def _end_round(self, now: float) -> None:
        if self._min_rtt[0] < now - self.min_rtt_period:  # R0 is stale: drain the queue and measure it again
            self._probing, self._probe_start, self._probe_min = True, now, math.inf
            self._probe_until = now + PROBE_ROUNDS * (self.srtt or 0.0)
        else:
            self._decide()
        self._new_round(now)

    def _probe(self, now: float, seconds: float) -> None:
        """A round trip during the probe: only microbatches sent after it began (at half the window,
        behind no queue of ours) measure R0; it ends :data:`PROBE_ROUNDS` round trips later."""
        if now - seconds >= self._probe_start:
            self._probe_min = min(self._probe_min, seconds)
        if now >= self._probe_until and self._probe_min < math.inf:
            self._probing = False
            self._min_rtt = (now, self._probe_min)
            self._new_round(now)

    def _decide(self) -> None:
        n, r0, r = self._round_in_flight, self._min_rtt[1], self._round_min
        bdp = n * r0 / r
        queued = n - bdp
        window = self._window
        if queued > BETA:
            window = max(1, min(window - 1, math.ceil(bdp + ALPHA)))
        elif queued < ALPHA and n >= window and (self._round_queue or 0) < QUEUE_LIMIT:
            window = window + 1
        self._window = max(1, min(self.max_window, window))
        self._last = WindowEstimate(self._window, r0, self.srtt or math.nan, bdp, queued)

    def _new_round(self, now: float) -> None:
        self._round_start, self._round_min = now, math.inf
        self._round_in_flight, self._round_queue = 0, None
