"""Choosing the next hop of a microbatch and sending it there, directly stage to stage.

Stochastic wiring (SWARM, but decided by the sender, not a central trainer): among the training
peers of the next stage, pick peer ``p`` with probability proportional to

    w_p = throughput_p / (1 + in_flight_p)

where ``throughput_p`` is what ``p`` advertises (measured samples/s once it trains, its profiled
FLOP/s over the stage cost before that), capped at ``MAX_CLAIM_RATIO`` times the candidates' median
(``planner.claims``) and ``in_flight_p`` the microbatches this peer has sent
to ``p`` and not yet heard back about (a queue-length signal it observes locally, at no cost).
A peer that failed a call is avoided for ``failure_cooldown`` seconds. If a hop fails, the same
microbatch goes to another peer of that stage (the upstream still holds its inputs), so a
vanished peer costs a retry, not the microbatch.

With the ``replay`` recovery (:mod:`swarm.task_pool`) stage 0 draws the whole path at once
(:meth:`Router.plan_path`, the same weights, with its own microbatches out at each peer as the queue
signal, and each hop after the first weighted by the link between its two peers as their records
tell it, ``planner.link_view``: topology-aware, where the first hop's link is measured here); each
hop sends to the planned peer and, if it is gone, to the first live stand-in in
:func:`substitute_order`, so replays of one microbatch meet the replicas that already counted it.
When the failure detector or a leave notice says a peer is gone, :meth:`Router.peer_down` stops
sending it new work; a call to a peer that hangs fails at an adaptive deadline
(:meth:`Router.call_timeout`: a multiple of the measured round trips, longer for a peer whose own
answers come slowly, e.g. over a slow link).

With a :class:`~swarm.spot_check.SpotChecker`, every request asks for a fingerprint of the outputs,
and a fraction of the answers is recomputed by another replica of the next stage and compared.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from hivemind.p2p import P2P

from dht.clock import SYSTEM_CLOCK
from dht.records import PeerRecord
from dht.reputation import Reputation
from dht.rpc import (
    Declined,
    PeerUnavailableError,
    RemoteError,
    call_peer,
    forward_handler,
)
from dht.striping import stripe_count
from dht.wire import ProtocolError
from planner.claims import cap_to_median
from planner.link_view import LinkView
from swarm.boundary_codec import BoundaryCodec, boundary_codec
from swarm.links import LinkMeter
from swarm.spot_check import SpotChecker
from swarm.admission import NOT_MEMBER, RATE_LIMITED
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
MIN_CALL_TIMEOUT = 5.0  # seconds: the adaptive deadline of a forward call never goes below this
OWN_CALLS = 20  # answered calls per peer that set its own deadline (a peer on a slow link)
OWN_MARGIN = 2.0  # a peer's own deadline: this many times its slowest recent answered call
PROBE_FACTOR = 2.0  # after a timeout, the next call to that peer waits this many times the common deadline
MAX_TRACKED = 1024  # peers whose own call durations are kept
LATENCY_EMA = 0.3  # weight of the newest call in a peer's smoothed call duration
LATENCY_TOLERANCE = 2.0  # a peer up to this many times slower than the fastest candidate keeps its full weight
MIN_LATENCY_FACTOR = 0.02  # the least share a slow candidate's weight is cut to (it is still measured)
TURNED_AWAY_COOLDOWN = 1.0  # seconds a peer that refused this one admission (swarm.admission) is routed around
SLOW_PEER_RATIO = 8.0  # a candidate this many times slower than the fastest gets one call at a time


class NoPeerAvailableError(Declined):
    """No peer of the next stage could take the microbatch (answered upstream with code "unrouted")."""

    code = "unrouted"


def hop_weights(candidates: Sequence[PeerRecord], in_flight: Counter, stage_flops: float,
                latency: dict[str, float] | None = None) -> list[float]:
    """Selection weight of each candidate: advertised throughput, capped at ``MAX_CLAIM_RATIO`` times
    the candidates' median (``planner.claims``: one liar cannot draw all the traffic), over (1 + our
    in-flight to it), times :func:`latency_factors` of the measured call durations (``latency``:
    peer id -> smoothed seconds; a peer on a slow link advertises its compute, not its link). A
    candidate over :data:`SLOW_PEER_RATIO` times slower than the fastest that already has a call
    from us gets 0, unless every candidate is such a one."""
    throughputs = cap_to_median([r.samples_per_s if r.samples_per_s > 0 else r.flops / stage_flops
                                 for r in candidates])
    factors = latency_factors([(latency or {}).get(r.peer_id) for r in candidates])
    weights = [max(throughput, 1e-9) / (1 + in_flight[r.peer_id]) * factor
               for r, throughput, factor in zip(candidates, throughputs, factors, strict=True)]
    # a peer behind a slow link shares it between its calls: a second call makes both late (and time
    # out, and be struck); it waits for its one call to come back, unless every candidate is as busy
    busy = [factor < LATENCY_TOLERANCE / SLOW_PEER_RATIO and in_flight[r.peer_id] > 0
            for r, factor in zip(candidates, factors, strict=True)]
    if not all(busy):
        weights = [0.0 if is_busy else weight for weight, is_busy in zip(weights, busy, strict=True)]
    return weights


def latency_factors(latencies: Sequence[float | None]) -> list[float]:
    """Each candidate's weight factor from its measured call duration: 1 up to
    :data:`LATENCY_TOLERANCE` times the fastest measured candidate, beyond it that bound over the
    duration (a peer 40x slower than the fastest gets 1/20 of its share), never below
    :data:`MIN_LATENCY_FACTOR`, so a slow peer is still called and measured again. Unmeasured
    candidates get 1. A claim cannot raise a share here, only answering fast (and a fast wrong
    answer is what spot checks catch)."""
    measured = [t for t in latencies if t is not None and t > 0]
    if not measured:
        return [1.0] * len(latencies)
    bound = LATENCY_TOLERANCE * min(measured)
    return [1.0 if t is None or t <= bound else max(MIN_LATENCY_FACTOR, bound / t) for t in latencies]


def link_factors(links: LinkView, sender: str, candidates: Sequence[str], num_bytes: float) -> list[float]:
    """Each candidate's weight factor by the link from ``sender``: :func:`latency_factors` of the time
    to send it ``num_bytes`` and hear back (``planner.link_view``: both ends' published figures, the
    worse of them; one end's, bounded by the swarm's; the typical link where none is known)."""
    return latency_factors([links.transfer_seconds(sender, peer_id, num_bytes) for peer_id in candidates])


def substitute_order(mb_id: str, peer_ids: Sequence[str]) -> list[str]:
    """The order in which a hop tries stand-ins for a microbatch's planned peer: rendezvous hashing of
    (microbatch id, peer id). Every peer that knows the same replicas derives the same order, so a
    replay of the microbatch, whoever sends it, reaches the stand-in that may already have counted it."""
    def score(peer_id: str) -> bytes:
        return hashlib.blake2b(f"{mb_id}|{peer_id}".encode(), digest_size=8).digest()
    return sorted(peer_ids, key=score, reverse=True)


class Router:
    """Sends microbatches from this stage to the next one, retrying on another replica on failure.

    ``sticky`` (the ``replay`` recovery): the request's planned peer goes first, then stand-ins in
    :func:`substitute_order`; otherwise (the ``restart`` baseline) a weighted random choice per attempt.

    Deadlines (``failed_until``, a call's duration) are read from ``clock`` (seconds, monotonic), so a
    test can move time forward without waiting.
    """

    def __init__(
        self,
        p2p: P2P,
        view: SwarmView,
        *,
        run_id: str,
        next_stage: int,
        next_stage_flops: float,
        request_timeout: float,
        max_payload_bytes: int,
        rng: random.Random,
        max_attempts: int = 3,
        failure_cooldown: float = 10.0,
        sticky: bool = True,
        reputation: Reputation | None = None,
        spot_checker: SpotChecker | None = None,
        clock: Callable[[], float] = SYSTEM_CLOCK,
        links: LinkMeter | None = None,
        codec: BoundaryCodec | None = None,
        striped: bool = True,
    ) -> None:
        self.p2p, self.view, self.run_id = p2p, view, run_id
        self.striped = striped  # a long round trip's calls go over several streams (dht.striping)
        self.codec = codec if codec is not None else boundary_codec("none")  # the run's (swarm.subspace.stage_boundary_codec)
        self.clock = clock
        self.links = links if links is not None else LinkMeter()  # its answers say the next hop is alive
        self.spot_checker = spot_checker
        self.next_stage, self.next_stage_flops = next_stage, next_stage_flops
        self.request_timeout, self.max_payload_bytes = request_timeout, max_payload_bytes
        self.rng, self.max_attempts, self.failure_cooldown = rng, max_attempts, failure_cooldown
        self.sticky = sticky
        self.reputation = reputation
        self.in_flight: Counter = Counter()
        self.path_in_flight: Counter = Counter()  # stage 0: its microbatches out at each peer of any stage
        self.failed_until: dict[str, float] = {}  # peer -> the clock reading until which it is avoided
        self.num_failures = 0
        self.num_striped = 0  # calls sent over several streams at once (dht.striping)
        self.num_timeouts = 0  # calls that got no answer in time (a queue that long is a loss to flow control)
        self._durations: collections.deque[float] = collections.deque(maxlen=200)  # answered calls, seconds
        self._own_durations: dict[str, collections.deque[float]] = {}  # per peer, its answered calls
        self._probe: dict[str, float] = {}  # peer -> the longer deadline of its next call, after a timeout
        self.latency: dict[str, float] = {}  # peer -> smoothed duration of its calls (a timeout counts its deadline)
        self.payload_bytes = 0  # the last forward request's tensors as sent: what a planned hop carries

    def _available(self, peer_id: str, now: float) -> bool:
        return (self.failed_until.get(peer_id, 0.0) <= now and not self.view.is_gone(peer_id)
                and not (self.reputation is not None and self.reputation.is_banned(peer_id)))

    def choose(self, exclude: set[str]) -> PeerRecord | None:
        now = self.clock()
        candidates = [r for r in self.view.members(self.next_stage) if r.peer_id not in exclude and self._available(r.peer_id, now)]
        if not candidates:
            return None
        weights = hop_weights(candidates, self.in_flight, self.next_stage_flops, self.latency)
        return self.rng.choices(candidates, weights=weights, k=1)[0]

    def plan_path(self, stage_flops: Sequence[float]) -> list[str]:
        """Stage 0: a planned peer for each stage after the first (``stage_flops[s]``: FLOP per sample of
        stage s), weighted like :meth:`choose` with this peer's microbatches out at each, and each hop
        after the first by the link from the peer planned before it (:func:`link_factors`: a stage-1
        replica far from a stage-2 replica sends to a near one); "" where a stage has no known peer
        (the hop then picks a stand-in)."""
        now = self.clock()
        path = []
        links = self.view.links()
        for stage in range(1, len(stage_flops)):
            candidates = [r for r in self.view.members(stage) if self._available(r.peer_id, now)]
            if not candidates:
                path.append("")
                continue
            weights = hop_weights(candidates, self.path_in_flight, stage_flops[stage], self.latency)
            sender = path[-1] if path else ""
            if sender:  # the first hop's own calls are measured here (``latency``); later ones only by records
                factors = link_factors(links, sender, [r.peer_id for r in candidates], self.payload_bytes)
                weights = [weight * factor for weight, factor in zip(weights, factors, strict=True)]
            path.append(self.rng.choices(candidates, weights=weights, k=1)[0].peer_id)
        return path

    def _next_target(self, mb_id: str, planned: str, tried: set[str]) -> str | None:
        now = self.clock()
        if not self.sticky:
            record = self.choose(tried)
            return None if record is None else record.peer_id
        if planned and planned not in tried and self._available(planned, now):
            return planned
        live = [r.peer_id for r in self.view.members(self.next_stage) if r.peer_id not in tried and self._available(r.peer_id, now)]
        order = substitute_order(mb_id, live)
        return order[0] if order else None

    def _answered(self, target: str, header: dict[str, Any], tensors: Sequence[torch.Tensor],
                  answer: tuple[dict[str, Any], list[torch.Tensor]]) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The answer without its fingerprint, after drawing whether to spot-check it."""
        reply, reply_tensors = answer
        checker = self.spot_checker
        if checker is None or not checker.is_enabled or header.get("kind") == "eval":  # held-out loss: nothing to check
            return answer
        fingerprint = reply_tensors[1] if len(reply_tensors) == 2 else None
        if checker.should_check():
            now = self.clock()
            others = [r.peer_id for r in self.view.members(self.next_stage) if r.peer_id != target and self._available(r.peer_id, now)]
            checker.start_check(header, tensors, peer_id=target, reply=reply, fingerprint=fingerprint, candidates=others)
        return reply, reply_tensors[:1]

    def _decoded(self, target: str, header: dict[str, Any], activations: torch.Tensor,
                 answer: tuple[dict[str, Any], list[torch.Tensor]]) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The answer with its gradient decoded (``[gradient]`` or ``[gradient, fingerprint]``); a
        held-out answer carries none. An undecodable gradient strikes ``target`` and ends the call:
        it was computed and counted there, so it is not sent to another replica."""
        reply, reply_tensors = answer
        if header.get("kind") == "eval":
            return answer
        n = self.codec.num_wire_tensors
        try:
            if len(reply_tensors) not in (n, n + 1):
                raise ProtocolError(f"a forward answer carries {n} or {n + 1} tensors, got {len(reply_tensors)}")
            grad = self.codec.decode(reply_tensors[:n], shape=tuple(activations.shape), dtype=activations.dtype,
                                     name="gradient")
        except ProtocolError as e:
            self.num_failures += 1
            if self.reputation is not None:
                self.reputation.strike(target, f"answered a forward call with a malformed gradient: {e}")
            raise NoPeerAvailableError(f"{target} answered microbatch {header.get('mb_id')} with a malformed gradient: {e}") from e
        return reply, [grad, *reply_tensors[n:]]

    def peer_down(self, peer_id: str) -> None:
        """``peer_id`` is gone (a leave notice or the failure detector said so): send it nothing new.

        Calls already waiting on it are left alone: a leaving peer drains them, a crashed one's
        connections are reset so they fail at once, and abandoning a call to a peer that is only
        suspected (a busy host stalls) would get its microbatch counted by two replicas."""
        self.link_down(peer_id)

    def link_down(self, peer_id: str) -> None:
        """``peer_id`` missed pings or declined: route around it for ``failure_cooldown`` seconds,
        without declaring it gone (seed 003 §IV disconnect-link)."""
        self.failed_until[peer_id] = self.clock() + self.failure_cooldown

    def link_up(self, peer_id: str) -> None:
        """``peer_id`` answers again, or came back to work: route to it again (connect-link, scale-out)."""
        self.failed_until.pop(peer_id, None)

    @contextlib.contextmanager
    def reserved_path(self, path: Sequence[str]) -> Iterator[None]:
        """Count a stage-0 microbatch as out at every peer of ``path`` while inside (the path planner
        spreads the next microbatches by these counts)."""
        for peer_id in path:
            self.path_in_flight[peer_id] += 1
        try:
            yield
        finally:
            for peer_id in path:
                self.path_in_flight[peer_id] -= 1
                if self.path_in_flight[peer_id] <= 0:
                    del self.path_in_flight[peer_id]

    def call_timeout(self, target: str | None = None) -> float:
        """Deadline of one forward call: 8x the 95th percentile of the last answered calls (which
        include the whole rest of the pipeline), at least ``MIN_CALL_TIMEOUT``, at most
        ``request_timeout``; ``request_timeout`` until 20 calls were measured.

        A peer on a slow link (1 Mbit/s: 4 s per activation each way) answers after that deadline,
        so every call to it timed out, was struck, and the peer was banned without ever being
        measured. So ``target``'s deadline is also at least :data:`OWN_MARGIN` times its slowest
        of its last :data:`OWN_CALLS` answered calls, and after a timeout its next call waits
        :data:`PROBE_FACTOR` times as long. Calls that took longer than the common deadline are kept
        out of the common percentile: one slow peer does not slow the detection of a hung fast one.
        A peer that never answers still times out at twice the common deadline and is struck each time.
        """
        if len(self._durations) < 20:
            common = self.request_timeout
        else:
            p95 = sorted(self._durations)[int(0.95 * (len(self._durations) - 1))]
            common = min(self.request_timeout, max(MIN_CALL_TIMEOUT, 8 * p95))
        if target is None:
            return common
        own = self._own_durations.get(target)
        own_deadline = OWN_MARGIN * max(own) if own else 0.0
        return min(self.request_timeout, max(common, own_deadline, self._probe.get(target, 0.0)))

    def _smooth_latency(self, target: str, seconds: float) -> None:
        if target not in self.latency and len(self.latency) > MAX_TRACKED:
            self.latency.clear()
        before = self.latency.get(target)
        self.latency[target] = seconds if before is None else (1 - LATENCY_EMA) * before + LATENCY_EMA * seconds

    def _record_answer(self, target: str, duration: float) -> None:
        self.links.heard(target)
        self._probe.pop(target, None)
        self._smooth_latency(target, duration)
        if duration <= self.call_timeout():
            self._durations.append(duration)
        if target not in self._own_durations and len(self._own_durations) > MAX_TRACKED:
            self._own_durations.clear()  # peers come and go: forget them all rather than grow
        self._own_durations.setdefault(target, collections.deque(maxlen=OWN_CALLS)).append(duration)

    def _stripes(self, target: str) -> int:
        """Streams for a forward call to ``target`` (dht.striping: several on a long round trip)."""
        stripes = stripe_count(self.payload_bytes, self.links.min_rtt(target)) if self.striped else 1
        self.num_striped += stripes > 1
        return stripes

    def _record_timeout(self, target: str, deadline: float) -> None:
        self.num_timeouts += 1
        self._smooth_latency(target, deadline)  # it took at least that long
        if len(self._probe) > MAX_TRACKED:
            self._probe.clear()
        self._probe[target] = min(self.request_timeout, PROBE_FACTOR * self.call_timeout())

    async def forward(
        self, header: dict[str, Any], tensors: Sequence[torch.Tensor]
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """Send a forward request to a peer of the next stage; on failure try another one.

        ``tensors`` are ``[activations, targets]`` (a subspace run's: the whole window,
        ``swarm.subspace.request_ids``); the activations travel encoded by the run's boundary codec,
        and the gradient of the answer comes back decoded to their shape and dtype.

        Raises:
            NoPeerAvailableError: every attempt failed or nobody serves the next stage, or the peer
                that answered sent a gradient that does not decode (it is struck).
        """
        mb_id = str(header.get("mb_id"))
        ids = tensors[1] if len(tensors) > 1 else None  # what a subspace run rebuilds its activations from
        wire = [*self.codec.encode_activations(tensors[0], ids), *tensors[1:]]  # once: re-sends and checks send these bytes
        self.payload_bytes = sum(t.numel() * t.element_size() for t in wire)
        checker = self.spot_checker
        if checker is not None and checker.is_enabled and header.get("kind") != "eval":
            header = {**header, "fp": True}  # on every request, so a replica cannot tell which are checked
        path = header.get("path")
        planned = path[self.next_stage - 1] if isinstance(path, list) and len(path) >= self.next_stage else ""
        tried: set[str] = set()
        errors = []
        for _ in range(self.max_attempts):
            target = self._next_target(mb_id, planned, tried)
            if target is None:
                break
            tried.add(target)
            self.in_flight[target] += 1
            started, deadline = self.clock(), self.call_timeout(target)
            try:
                answer = await call_peer(
                    self.p2p, target, forward_handler(self.run_id), header, wire,
                    timeout=deadline, max_payload_bytes=self.max_payload_bytes, stripes=self._stripes(target),
                )
                self._record_answer(target, self.clock() - started)
                return self._answered(target, header, wire, self._decoded(target, header, tensors[0], answer))
            except (PeerUnavailableError, RemoteError) as e:
                self.num_failures += 1
                if isinstance(e.__cause__, TimeoutError):
                    self._record_timeout(target, deadline)
                code = getattr(e, "code", "")
                if code in (NOT_MEMBER, RATE_LIMITED):  # turned away (its view lacks this peer yet, or this
                    # peer sent too much): no misdeed of its, and it takes work again in a moment
                    self.failed_until[target] = self.clock() + TURNED_AWAY_COOLDOWN
                elif code != "unrouted":  # it answered: only the stage after it failed
                    self.failed_until[target] = self.clock() + self.failure_cooldown
                    if self.reputation is not None:
                        self.reputation.strike(target, f"a forward call failed after {self.clock() - started:.1f}s "
                                                       f"(deadline {deadline:.1f}s): {e}")
                errors.append(str(e))
                logger.debug(f"microbatch {mb_id} failed at {target[-6:]}: {e}")
            finally:
                self.in_flight[target] -= 1
                if self.in_flight[target] <= 0:
                    del self.in_flight[target]
        raise NoPeerAvailableError(
            f"no peer of stage {self.next_stage} took microbatch {mb_id}: {'; '.join(errors) or 'none known'}"
        )
