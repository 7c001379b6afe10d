"""Knowing within a second that a neighbour crashed, with no timeout constant to guess.

Each peer pings its pipeline neighbours (its own stage and the stages before and after it) every
``ping_period`` over the membership protocol, and keeps, per neighbour, the intervals between
answered pings. A :class:`PhiAccrual` model of them (Hayashibara et al., 2004; what Cassandra and
Akka use) gives the suspicion level

    phi(t) = -log10(P(next answer comes later than t)),

with the intervals modelled as a normal distribution of their measured mean and deviation. A ping's
deadline is the time at which phi reaches ``threshold`` (8: a one-in-10^8 chance that a live peer is
this late), so it follows what the link and the host actually do: tight on an idle loopback, looser
on a busy one; and never shorter than the link's retransmission timeout (``srtt + 4 rttvar`` of the
pings' own round trips, ``swarm.links``), so a link whose queue fills with activations stretches the
deadline instead of failing it. A ping that misses its deadline is a strike but keeps waiting, up to
twice the deadline (the first ping to a peer, which may have to open the connection, at least
``FIRST_PING_DEADLINE``), and at least ``acceptable_pause`` past the deadline (Akka's name for it;
3 s, its cluster default): an answer clears the strike and teaches the estimate the new round trip; no
answer by then is a second strike. The pause is for the queues of home links: when a stage's
replicas average, their uplinks carry megabytes at once, and a ping waits behind them for seconds
(20 Mbit/s with 40 ms, tests/e2e/test_internet.py: pings 2-4 s late at the round times, and peers
declared each other down there and "back" a second later, CI 2026-11-27). The first strike already
routes around the silent peer (``on_link``); only the verdict waits. ``max_failed_pings`` (2)
strikes in a row, missed or refused outright (the peer's daemon is gone), declare the neighbour down.
No strike counts while this peer itself stalled (its own ticks came late: a busy host), so an
overloaded observer does not declare all its neighbours dead, nor while anything else of the
neighbour arrived (activations, answers, ``LinkMeter.heard``): on a congested link a ping queues behind those bytes, and a peer whose bytes
keep coming is alive. Nor while this peer's own averaging round ran (``busy_since``): every stage's
replicas average at the same clock times, and a round's megabytes fill this peer's link and its
partners' (CI 2026-11-27, 20 Mbit/s + 40 ms: a ping to an averaging partner waited behind the round
on their shared connection for over 4 s, past the acceptable pause).

A dial that reached the neighbour's port but failed in libp2p's handshake is no strike: a live daemon
answered. Two peers that dial each other within a round trip from their listening ports (as peers
behind NATs do, ``dht.node``) meet in one TCP connection and both handshakes fail; libp2p then answers
every dial to that address with "dial backoff" for 5 s, which repeats the last real dial's verdict
(:func:`refusal_kind`). Two new neighbours declared each other down that way (CI 2026-11-28).

A peer that declares a neighbour down tells the peers in its view (gossip, :mod:`swarm.membership`);
a receiver does not take the word of a stranger for it but pings the named peer once itself, so a
liar cannot talk the swarm out of a live peer. Together: a crash is known in well under a second on
loopback, not at the DHT record's expiry.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import Callable

from hivemind.p2p import P2P

from dht.clock import SYSTEM_CLOCK, Clock
from dht.node import first_line
from dht.rpc import PeerUnavailableError, RemoteError, call_peer
from swarm.links import LinkMeter
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
RECHECK_PERIOD = 2.0  # seconds between pings to a peer declared down whose record is still fresh
STALL_FACTOR = 3  # a tick this many ping periods late means this peer stalled, not its neighbours
VOUCH_WINDOW = 5.0  # seconds after its last answered ping that a neighbour counts as answering (vouches_for)
# the first ping to a peer may open the connection (TCP, multistream, noise, yamux: 5-6 round trips,
# over a second at a home link's 150-300 ms): until a round trip is measured, it gets this long
FIRST_PING_DEADLINE = 2.0
ACCEPTABLE_PAUSE = 3.0  # seconds past its deadline that an unanswered ping still waits before the second strike


# go-libp2p's words for a dial that reached a listener whose handshake then failed, and for a dial it
# did not try because the last one to that address failed moments ago
HANDSHAKE_FAILED = ("failed to negotiate",)
DIAL_BACKOFF = "dial backoff"


def dial_reasons(error: str) -> list[str]:
    """The per-address lines of a go-libp2p dial error ("* [/ip4/…] why"), none for other errors."""
    return [line.strip() for line in error.splitlines() if line.strip().startswith("* [")]


def is_backoff(error: str) -> bool:
    """Whether libp2p skipped every address of this dial for its backoff (no real dial was made)."""
    reasons = dial_reasons(error)
    return bool(reasons) and all(DIAL_BACKOFF in reason for reason in reasons)


def refusal_kind(error: str, last: str | None) -> str:
    """How a ping that could not reach its peer counts: "refused" (a strike: nothing answered at its
    address) or "inconclusive" (a daemon answered there; no strike). A dial libp2p skipped for its
    backoff counts as the last real dial did (``last``, None: none seen, a strike). Pure."""
    if is_backoff(error):
        return last or "refused"
    if any(word in error for word in HANDSHAKE_FAILED):
        return "inconclusive"
    return "refused"


class PhiAccrual:
    """Suspicion level of one monitored peer from the intervals between its heartbeats (pure)."""

    def __init__(self, *, window: int = 100, min_std: float = 0.1, first_interval: float = 1.0) -> None:
        self.min_std = min_std
        self._intervals: collections.deque[float] = collections.deque(maxlen=window)
        self._intervals.append(first_interval)  # a prior until real intervals arrive
        self.last: float | None = None

    def heartbeat(self, now: float) -> None:
        if self.last is not None:
            self._intervals.append(max(0.0, now - self.last))
        self.last = now

    @property
    def mean(self) -> float:
        return sum(self._intervals) / len(self._intervals)

    @property
    def std(self) -> float:
        mean = self.mean
        variance = sum((x - mean) ** 2 for x in self._intervals) / len(self._intervals)
        return max(math.sqrt(variance), self.min_std)

    def phi(self, now: float) -> float:
        """-log10 of the chance that a live peer's next heartbeat comes this late or later."""
        return 0.0 if self.last is None else self._phi_after(now - self.last)

    def timeout(self, threshold: float) -> float:
        """How long after the last heartbeat phi reaches ``threshold`` (for the ping deadline)."""
        low, high = 0.0, self.mean + 40 * self.std
        for _ in range(50):
            mid = (low + high) / 2
            low, high = (mid, high) if self._phi_after(mid) < threshold else (low, mid)
        return high

    def _phi_after(self, elapsed: float) -> float:
        tail = 0.5 * math.erfc((elapsed - self.mean) / self.std / math.sqrt(2))
        return -math.log10(max(tail, 1e-300))


class FailureDetector:
    """Pings the pipeline neighbours; calls ``on_down(peer_id, how)`` once for each one that went down."""

    def __init__(
        self,
        p2p: P2P,
        view: SwarmView,
        *,
        peer_id: str,
        stage: int,
        handler: str,
        on_down: Callable[[str, str], None],
        ping_period: float = 0.3,
        threshold: float = 8.0,
        max_failed_pings: int = 2,
        min_std: float = 0.1,
        on_link: Callable[[str, str], None] = lambda kind, peer_id: None,
        links: LinkMeter | None = None,
        acceptable_pause: float = ACCEPTABLE_PAUSE,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.clock = clock
        self.p2p, self.view, self.peer_id, self.stage, self.handler = p2p, view, peer_id, stage, handler
        self.on_down, self.ping_period, self.threshold = on_down, ping_period, threshold
        self.max_failed_pings, self.min_std, self.on_link = max_failed_pings, min_std, on_link
        self.links = links if links is not None else LinkMeter(clock=clock)
        self.acceptable_pause = acceptable_pause
        # whether this peer's link was busy with a bulk exchange of its own at some moment since the
        # given monotonic time (the session points it at its averager's ``exchanged_since``)
        self.busy_since: Callable[[float], bool] = lambda since: False
        self.monitors: dict[str, PhiAccrual] = {}
        self._failed: collections.Counter = collections.Counter()
        self._strikes: collections.defaultdict = collections.defaultdict(list)  # the last strikes' reasons, for the log
        self._refusals: dict[str, str] = {}  # the last refused ping's error per peer, for the log
        self._dial_kinds: dict[str, str] = {}  # the last real dial's refusal_kind per peer (dial backoff repeats it)
        self._pinging: dict[str, asyncio.Task] = {}
        self.down: set[str] = set()
        self._recheck_at: dict[str, float] = {}
        self._last_tick = self.clock()
        self._stalled_at = -math.inf
        self.num_pings = 0

    def neighbours(self) -> set[str]:
        """The training peers of this stage and the two next to it that this peer can dial. A failed
        ping says nothing of the others; their records' TTL tells instead:
        - a peer whose record says it is unreachable (a client behind a NAT) answers only over a
          connection it opened itself;
        - between two peers behind NATs, a ping goes through a relay until a hole is punched (it
          needs 4 public peers), and a relayed connection is cut after 128 KiB or 2 minutes: on
          emulated 50 Mbit/s links two such peers declared each other down every 15-20 s, each time
          "back" a second later (bench/wan.py --nat, 2026-11-27)."""
        stages = {self.stage - 1, self.stage, self.stage + 1}
        behind_nat = any(r.peer_id == self.peer_id and r.reachability != "direct" for r in self.view.records)
        return {r.peer_id for r in self.view.records
                if r.stage in stages and r.state == "training" and r.peer_id != self.peer_id
                and r.reachability != "unreachable" and not (behind_nat and r.reachability == "relayed")
                and not self.view.is_gone(r.peer_id)}

    def vouches_for(self, peer_id: str, now: float | None = None) -> bool:
        """Whether ``peer_id`` answered one of this detector's pings within :data:`VOUCH_WINDOW`
        seconds (``now``: monotonic, default the current time) and is not declared down."""
        monitor = self.monitors.get(peer_id)
        if peer_id in self.down or monitor is None or monitor.last is None:
            return False
        return (self.clock() if now is None else now) - monitor.last <= VOUCH_WINDOW

    def declare_down(self, peer_id: str, how: str) -> bool:
        """Mark ``peer_id`` down (once); returns whether this was news."""
        if peer_id in self.down:
            return False
        self.down.add(peer_id)
        self.monitors.pop(peer_id, None)
        task = self._pinging.pop(peer_id, None)
        if task is not None:
            task.cancel()
        self.view.mark_departed(peer_id)
        self.on_down(peer_id, how)
        return True

    async def check(self, peer_id: str, *, timeout: float = 1.0) -> bool:
        """Is ``peer_id`` answering? (one ping, used to verify a rumour); it waits at least twice the
        link's retransmission timeout (the first ping to a peer, FIRST_PING_DEADLINE), so a slow link
        does not confirm a false rumour."""
        rto = self.links.retransmit_timeout(peer_id)
        timeout = max(timeout, FIRST_PING_DEADLINE if rto is None else 2 * rto)
        started = self.clock()
        answered = await self._ping_once(peer_id, timeout) == "answered"
        if answered:
            self.links.round_trip(peer_id, self.clock() - started)
        return answered

    async def _ping_once(self, peer_id: str, timeout: float) -> str:
        """"answered", "late" (no answer by ``timeout``), "refused" (could not reach it) or
        "inconclusive" (:func:`refusal_kind`)."""
        try:
            await call_peer(self.p2p, peer_id, self.handler, {"kind": "ping"}, timeout=timeout, max_payload_bytes=0)
            return "answered"
        except PeerUnavailableError as e:
            if isinstance(e.__cause__, asyncio.TimeoutError):
                return "late"
            error = str(e)
            kind = refusal_kind(error, self._dial_kinds.get(peer_id))
            if not is_backoff(error):
                self._dial_kinds[peer_id] = kind
            reasons = "; ".join(dial_reasons(error))
            self._refusals[peer_id] = first_line(e) + (f": {reasons[:300]}" if reasons else "")
            return kind
        except RemoteError as e:
            self._refusals[peer_id] = f"remote error: {first_line(e)}"
            return "refused"

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                self.tick(self.clock())
                try:
                    await asyncio.wait_for(stop.wait(), timeout=self.ping_period)
                except asyncio.TimeoutError:
                    pass
        finally:
            for task in self._pinging.values():
                task.cancel()

    def tick(self, now: float) -> None:
        if now - self._last_tick > STALL_FACTOR * self.ping_period:
            # this peer itself stalled (a busy host): whatever timed out meanwhile is not their fault
            self._stalled_at = now
            logger.debug(f"failure detector stalled for {now - self._last_tick:.2f}s: no verdict on pings in flight")
        self._last_tick = now
        current = self.neighbours()
        for peer_id in list(self.monitors):
            if peer_id not in current:  # no longer a neighbour (moved, left, expired)
                del self.monitors[peer_id]
        for peer_id in self.down & {r.peer_id for r in self.view.records}:
            if peer_id not in self._pinging and now >= self._recheck_at.get(peer_id, 0.0):
                self._recheck_at[peer_id] = now + RECHECK_PERIOD  # declared down, but its record lives on
                self._pinging[peer_id] = asyncio.create_task(self._recheck(peer_id))
        for peer_id in current:
            if peer_id in self.down:
                continue
            monitor = self.monitors.setdefault(peer_id, PhiAccrual(min_std=self.min_std, first_interval=self.ping_period))
            if peer_id not in self._pinging:
                rto = self.links.retransmit_timeout(peer_id)
                deadline = max(self.ping_period, monitor.timeout(self.threshold), FIRST_PING_DEADLINE if rto is None else rto)
                self._pinging[peer_id] = asyncio.create_task(self._ping(peer_id, deadline))

    async def _recheck(self, peer_id: str) -> None:
        """A peer declared down whose record is still fresh: if it answers, it was a false alarm."""
        try:
            answered = await self.check(peer_id)
        finally:
            self._pinging.pop(peer_id, None)
        if answered and peer_id in self.down:
            logger.info(f"{peer_id[-6:]} answers again: back in the view")
            self.down.discard(peer_id)
            self._failed[peer_id] = 0
            self.view.restore(peer_id)

    async def _ping(self, peer_id: str, deadline: float) -> None:
        """One ping. Past ``deadline`` it is a strike (unless this peer stalled or heard from the other
        meanwhile) but goes on waiting, up to twice that and at least ``acceptable_pause`` more, with a
        second ping beside it: an answer to either clears the strike and teaches the link's round-trip
        estimate its queue; no answer by then is a second strike (down)."""
        started = self.clock()
        self.num_pings += 1
        wait = deadline + max(deadline, self.acceptable_pause)
        pings = [asyncio.ensure_future(self._ping_once(peer_id, wait))]
        try:
            done, _ = await asyncio.wait(pings, timeout=deadline)
            if not done:
                if self._counts_as_silence(peer_id, started) and self._strike(peer_id, f"no answer in {deadline:.2f}s"):
                    return  # declared down
                # a second ping on a stream of its own: the first may be stuck on a connection that two
                # peers dialling each other at once opened twice and then closed (two stage-0 peers,
                # seconds old, declared each other down while others heard both: CI rehearsal 2026-11-27)
                self.num_pings += 1
                pings.append(asyncio.ensure_future(self._ping_once(peer_id, wait - deadline)))
            outcome = await _first_answer(pings)
        finally:
            for ping in pings:
                ping.cancel()
            if self._pinging.get(peer_id) is asyncio.current_task():
                del self._pinging[peer_id]
        monitor = self.monitors.get(peer_id)
        if monitor is None:
            return
        if outcome == "answered":
            now = self.clock()
            self.links.round_trip(peer_id, now - started)
            monitor.heartbeat(now)
            if self._failed[peer_id]:
                self.on_link("connect_link", peer_id)  # the link is back before the peer was declared down
            self._failed[peer_id] = 0
        elif outcome == "inconclusive":
            logger.debug(f"{peer_id[-6:]}: a ping reached its daemon but not its handler: {self._refusals.get(peer_id)}")
        elif outcome == "refused" or self._counts_as_silence(peer_id, started):
            how = f"refused ({self._refusals.get(peer_id)})" if outcome == "refused" else outcome
            self._strike(peer_id, f"{how} after {self.clock() - started:.2f}s (deadline {deadline:.2f}s)")

    def _counts_as_silence(self, peer_id: str, since: float) -> bool:
        """A ping unanswered since ``since`` says something only if this peer did not stall meanwhile
        (its own ticks came on time), nothing else of the other peer arrived (activations, answers:
        a ping waits behind the same bytes on a congested link), this peer sent it no bulk push
        meanwhile (the ping waits behind that), and this peer's link carried no bulk exchange of its
        own (an averaging round)."""
        stalled = self._stalled_at >= since or self.clock() - self._last_tick > STALL_FACTOR * self.ping_period
        return (not stalled and not self.links.heard_since(peer_id, since) and not self.links.sent_since(peer_id, since)
                and not self.busy_since(since))

    def _strike(self, peer_id: str, why: str = "refused") -> bool:
        """Count a missed or refused ping (``why``: how, for the log); True if that made ``peer_id`` down."""
        self._failed[peer_id] += 1
        previous = self._strikes[peer_id] if self._failed[peer_id] > 1 else []
        self._strikes[peer_id] = [*previous, why][-self.max_failed_pings:]
        if self._failed[peer_id] == 1:
            self.on_link("disconnect_link", peer_id)
        if self._failed[peer_id] < self.max_failed_pings:
            return False
        if self._pinging.get(peer_id) is asyncio.current_task():
            del self._pinging[peer_id]  # declare_down cancels the ping in flight: not this one
        logger.info(f"{peer_id[-6:]} missed or refused {self._failed[peer_id]} pings in a row ({'; '.join(self._strikes[peer_id])}): down")
        self.declare_down(peer_id, "detector")
        return True


async def _first_answer(pings: list[asyncio.Future]) -> str:
    """"answered" as soon as one of ``pings`` is answered; else, once all ended, "refused" if one was,
    else "inconclusive" if one was, else "late"."""
    outcomes: list[str] = []
    pending = set(pings)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        outcomes += [task.result() for task in done]
        if "answered" in outcomes:
            return "answered"
    return next((kind for kind in ("refused", "inconclusive") if kind in outcomes), "late")
