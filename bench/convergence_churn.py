"""The ``swarm_churn`` mode of bench/convergence.py: the demo's 2 × 2 swarm under bench/churn.py's trace.

While the swarm trains, a seeded trace (:func:`bench.churn_metrics.make_trace`, the churn
benchmark's) applies one event every ``period`` seconds: a crash (SIGKILL of a training peer's
process group), a graceful leave (SIGINT) or a rejoin (a new run_peer.py, which negotiates its
stage), keeping between ``num_peers - 1`` and ``num_peers + 1`` peers planned, and never emptying a
stage (:func:`bench.churn_metrics.choose_victim`). Samples and held-out evaluations are counted as
in every process mode, over every peer that ever ran (a crashed peer's events up to its crash).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from bench.churn import LEAVE_KILL_AFTER, TrackedPeer, apply_event, kill_group
from bench.churn_metrics import make_trace

PERIOD = 30.0  # seconds between churn events (bench/churn.py's default)


class ChurnDriver:
    """Applies the trace to a running swarm as the bench polls it.

    Args:
        peers: the swarm's peer processes so far (``LocalSwarm.peers``).
        start_peer: starts one more peer process (a rejoin) and returns it.
        seed, period, duration: the trace's (the same seed gives the same trace).
    """

    def __init__(self, peers: Sequence, start_peer: Callable[[], object], *, seed: int, period: float = PERIOD,
                 duration: float) -> None:
        self.tracked = [TrackedPeer(p) for p in peers]
        self._start = start_peer
        self.trace = make_trace(seed, duration=duration, period=period, num_peers=len(peers),
                                min_peers=len(peers) - 1, max_peers=len(peers) + 1)
        self.applied: list[dict] = []
        self.started_at = time.time()

    def poll(self) -> list[str]:
        """Apply the events that are due; returns the names of peers that died without being told to."""
        now = time.time()
        for peer in self.tracked:
            peer.poll()
            if peer.left and peer.proc.is_alive() and now - peer.gone_at > LEAVE_KILL_AFTER:
                kill_group(peer)  # a leave that hangs
        while len(self.applied) < len(self.trace) and now >= self.started_at + self.trace[len(self.applied)].at:
            event = self.trace[len(self.applied)]
            self.applied.append({"at": event.at, **apply_event(event, self.tracked, self._start_tracked)})
        return [p.name for p in self.tracked if p.gone_at is None and not p.proc.is_alive()]

    def summary(self) -> str:
        kinds = [e["kind"] + ("(skipped)" if "skipped" in e else "") for e in self.applied]
        return f"{len(self.applied)} churn events: {', '.join(kinds) or 'none'}"

    def _start_tracked(self) -> TrackedPeer:
        peer = TrackedPeer(self._start())
        self.tracked.append(peer)
        return peer
