"""What this peer knows of its links to the peers it talks to, from its own traffic.

Three figures per peer, each from traffic the swarm sends anyway:

- **round-trip time**, smoothed as TCP does (RFC 6298: ``srtt`` and ``rttvar`` with gains 1/8 and
  1/4), from the failure detector's pings to its pipeline neighbours. A ping that answers late still
  gives a sample: that is how the estimate learns a congested link's queue.
  :meth:`LinkMeter.retransmit_timeout` (``srtt + 4 rttvar``) is the time after which a ping's
  silence starts to mean something.
- **goodput**, the median of the last few large transfers received from that peer: forward requests
  (activations), counting only the bytes this peer waited for, from the first read that waited
  (``dht.wire.ArrivalClock``: bytes already buffered when the handler ran read as a burst, which
  made a 10 Mbit/s path read 3-6 MB/s), and a state pull's measured per-donor rate (its probes
  give round-trip samples too). A median, not a mean.
- **last heard**: when any request or answer of that peer last arrived. A peer whose activations or
  answers keep arriving is alive, whatever its pings say (a ping waits behind the same bytes).
- **sending**: whether a bulk send of this peer's to that peer (a gradient or state push) was under
  way at some moment since a given time: a ping to it queues behind those bytes on the same
  connection and the same home uplink (CI 2026-11-28, 20 Mbit/s + 40 ms: a stage-0 peer pushing its
  first batch's gradients to its co-replica, whose downlink carried a 5 MB backup pull, declared
  it down with two late pings).

Memory is bounded (:data:`MAX_PEERS`, the least recently heard forgotten first), and
:meth:`LinkMeter.summary` gives the few figures a peer publishes in its record (``dht.link_figures.LinkFigure``),
rounded and capped. The clock is injected.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dht.clock import SYSTEM_CLOCK
from dht.link_figures import MAX_LINK_FIGURES, LinkFigure

MAX_PEERS = 256
GOODPUT_SAMPLES = 8
MIN_TRANSFER_BYTES = 64 * 1024  # smaller payloads measure the round trip, not the rate
MIN_RTT_SAMPLES = 4  # round trips seen before the least of them stands for the path
MAX_RTO = 30.0  # seconds: a figure beyond that is a dead link, not a slow one


@dataclass
class _Link:
    srtt: float | None = None
    rttvar: float = 0.0
    min_rtt: float | None = None
    rtt_samples: int = 0
    last_heard: float = float("-inf")
    sends: int = 0  # bulk sends to the peer under way
    last_sent: float = float("-inf")  # when the last of them ended
    goodput: collections.deque = field(default_factory=lambda: collections.deque(maxlen=GOODPUT_SAMPLES))


class LinkMeter:
    """Per-peer round-trip time, goodput and last-heard time; see the module docstring."""

    def __init__(self, *, clock: Callable[[], float] = SYSTEM_CLOCK, max_peers: int = MAX_PEERS) -> None:
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
        link.min_rtt = seconds if link.min_rtt is None else min(link.min_rtt, seconds)
        link.rtt_samples += 1
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

    def min_rtt(self, peer_id: str) -> float | None:
        """The shortest round trip seen: the path's own delay, without the queues and the busy event
        loops that a smoothed figure carries (what ``dht.striping`` sizes a call's streams by); None
        before MIN_RTT_SAMPLES (a new connection's first pings are slow: on loopback they striped a
        stage-0 peer's first calls)."""
        link = self._links.get(peer_id)
        return None if link is None or link.rtt_samples < MIN_RTT_SAMPLES else link.min_rtt

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

    @contextlib.contextmanager
    def sending(self, peer_id: str) -> Iterator[None]:
        """The ``with`` block is a bulk send to ``peer_id`` (see :meth:`sent_since`)."""
        self._link(peer_id).sends += 1
        try:
            yield
        finally:
            link = self._link(peer_id)
            link.sends, link.last_sent = max(0, link.sends - 1), self.clock()

    def sent_since(self, peer_id: str, since: float) -> bool:
        """Whether a bulk send to ``peer_id`` was under way at some moment since ``since``."""
        link = self._links.get(peer_id)
        return link is not None and (link.sends > 0 or link.last_sent >= since)

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
