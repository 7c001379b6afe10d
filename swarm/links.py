"""What this peer knows of its links to the peers it talks to, from its own traffic.

Three figures per peer, each from traffic the swarm sends anyway:

- **round-trip time**, smoothed as TCP does (RFC 6298: ``srtt`` and ``rttvar`` with gains 1/8 and
  1/4), from the failure detector's pings to its pipeline neighbours. A ping that answers late still
  gives a sample: that is how the estimate learns a congested link's queue.
  :meth:`LinkMeter.retransmit_timeout` (``srtt + 4 rttvar``) is the time after which a ping's
  silence starts to mean something.
- **goodput**, the median of the last few large transfers received from that peer: forward requests
  (activations) timed from their header to their last payload byte, and a state pull's measured
  per-donor rate (its probes give round-trip samples too). A median, not a mean: a payload already buffered when its handler ran reads as a burst.
- **last heard**: when any request or answer of that peer last arrived. A peer whose activations or
  answers keep arriving is alive, whatever its pings say (a ping waits behind the same bytes).

Memory is bounded (:data:`MAX_PEERS`, the least recently heard forgotten first), and
:meth:`LinkMeter.summary` gives the few figures a peer publishes in its record (``dht.link_figures.LinkFigure``),
rounded and capped. The clock is injected.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dht.link_figures import MAX_LINK_FIGURES, LinkFigure

MAX_PEERS = 256
GOODPUT_SAMPLES = 8
MIN_TRANSFER_BYTES = 64 * 1024  # smaller payloads measure the round trip, not the rate
MAX_RTO = 30.0  # seconds: a figure beyond that is a dead link, not a slow one


@dataclass
class _Link:
    srtt: float | None = None
    rttvar: float = 0.0
    last_heard: float = float("-inf")
    goodput: collections.deque = field(default_factory=lambda: collections.deque(maxlen=GOODPUT_SAMPLES))


class LinkMeter:
    """Per-peer round-trip time, goodput and last-heard time; see the module docstring."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, max_peers: int = MAX_PEERS) -> None:
        self.clock, self.max_peers = clock, max_peers
        self._links: collections.OrderedDict[str, _Link] = collections.OrderedDict()

    def heard(self, peer_id: str) -> None:
        """A request or answer of ``peer_id`` arrived just now."""
        self._link(peer_id).last_heard = self.clock()

    def round_trip(self, peer_id: str, seconds: float) -> None:
        """A request/answer exchange with ``peer_id`` took ``seconds`` (RFC 6298 smoothing)."""
        if not 0 <= seconds < MAX_RTO:
            return
        link = self._link(peer_id)
        link.last_heard = self.clock()
        if link.srtt is None:
            link.srtt, link.rttvar = seconds, seconds / 2
        else:
            link.rttvar = 0.75 * link.rttvar + 0.25 * abs(link.srtt - seconds)
            link.srtt = 0.875 * link.srtt + 0.125 * seconds

    def transfer(self, peer_id: str, num_bytes: int, seconds: float) -> None:
        """``num_bytes`` from ``peer_id`` arrived over ``seconds`` (ignored below MIN_TRANSFER_BYTES)."""
        if num_bytes < MIN_TRANSFER_BYTES or seconds <= 0:
            return
        link = self._link(peer_id)
        link.last_heard = self.clock()
        link.goodput.append(num_bytes / seconds)

    def rate(self, peer_id: str, bytes_per_s: float) -> None:
        """A goodput measured elsewhere (a state pull's per-donor rate), as one transfer sample."""
        if bytes_per_s > 0:
            self._link(peer_id).goodput.append(bytes_per_s)

    def rtt(self, peer_id: str) -> float | None:
        link = self._links.get(peer_id)
        return None if link is None else link.srtt

    def retransmit_timeout(self, peer_id: str) -> float | None:
        """``srtt + 4 rttvar`` (capped at MAX_RTO), None before the first sample."""
        link = self._links.get(peer_id)
        if link is None or link.srtt is None:
            return None
        return min(MAX_RTO, link.srtt + 4 * link.rttvar)

    def goodput(self, peer_id: str) -> float | None:
        """Bytes/s: the median of the last GOODPUT_SAMPLES transfers, None before the first."""
        link = self._links.get(peer_id)
        return None if link is None or not link.goodput else statistics.median(link.goodput)

    def heard_since(self, peer_id: str, since: float) -> bool:
        link = self._links.get(peer_id)
        return link is not None and link.last_heard >= since

    def forget(self, peer_id: str) -> None:
        self._links.pop(peer_id, None)

    def summary(self, limit: int = MAX_LINK_FIGURES) -> tuple[LinkFigure, ...]:
        """The most recently heard peers with a round-trip time, as published in a record."""
        figures = []
        for peer_id, link in reversed(self._links.items()):
            if link.srtt is None:
                continue
            goodput = self.goodput(peer_id)
            figures.append(LinkFigure.capped(peer_id, rtt_ms=link.srtt * 1000,
                                             mbit_per_s=None if goodput is None else goodput * 8 / 1e6))
            if len(figures) == limit:
                break
        return tuple(sorted(figures, key=lambda f: f.peer_id))

    def _link(self, peer_id: str) -> _Link:
        link = self._links.pop(peer_id, None) or _Link()
        self._links[peer_id] = link  # most recently used last
        while len(self._links) > self.max_peers:
            self._links.popitem(last=False)
        return link
