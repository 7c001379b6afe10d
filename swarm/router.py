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
signal); each hop sends to the planned peer and, if it is gone, to the first live stand-in in
:func:`substitute_order`, so replays of one microbatch meet the replicas that already counted it.
When the failure detector or a leave notice says a peer is gone, :meth:`Router.peer_down` stops
sending it new work; a call to a peer that hangs fails at an adaptive deadline
(:meth:`Router.call_timeout`: a multiple of the measured round trips).

With a :class:`~swarm.spot_check.SpotChecker`, every request asks for a fingerprint of the outputs,
and a fraction of the answers is recomputed by another replica of the next stage and compared.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import random
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from hivemind.p2p import P2P

from dht.records import PeerRecord
from dht.reputation import Reputation
from dht.rpc import (
    Declined,
    PeerUnavailableError,
    RemoteError,
    call_peer,
    forward_handler,
)
from planner.claims import cap_to_median
from swarm.spot_check import SpotChecker
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
MIN_CALL_TIMEOUT = 5.0  # seconds: the adaptive deadline of a forward call never goes below this


class NoPeerAvailableError(Declined):
    """No peer of the next stage could take the microbatch (answered upstream with code "unrouted")."""

    code = "unrouted"


def hop_weights(candidates: Sequence[PeerRecord], in_flight: Counter, stage_flops: float) -> list[float]:
    """Selection weight of each candidate: advertised throughput, capped at ``MAX_CLAIM_RATIO`` times
    the candidates' median (``planner.claims``: one liar cannot draw all the traffic), over (1 + our
    in-flight to it)."""
    throughputs = cap_to_median([r.samples_per_s if r.samples_per_s > 0 else r.flops / stage_flops
                                 for r in candidates])
    return [max(throughput, 1e-9) / (1 + in_flight[r.peer_id]) for r, throughput in zip(candidates, throughputs, strict=True)]


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
    ) -> None:
        self.p2p, self.view, self.run_id = p2p, view, run_id
        self.spot_checker = spot_checker
        self.next_stage, self.next_stage_flops = next_stage, next_stage_flops
        self.request_timeout, self.max_payload_bytes = request_timeout, max_payload_bytes
        self.rng, self.max_attempts, self.failure_cooldown = rng, max_attempts, failure_cooldown
        self.sticky = sticky
        self.reputation = reputation
        self.in_flight: Counter = Counter()
        self.path_in_flight: Counter = Counter()  # stage 0: its microbatches out at each peer of any stage
        self.failed_until: dict[str, float] = {}
        self.num_failures = 0
        self._durations: collections.deque[float] = collections.deque(maxlen=200)  # answered calls, seconds

    def _available(self, peer_id: str, now: float) -> bool:
        return (self.failed_until.get(peer_id, 0.0) <= now and not self.view.is_gone(peer_id)
                and not (self.reputation is not None and self.reputation.is_banned(peer_id)))

    def choose(self, exclude: set[str]) -> PeerRecord | None:
        now = time.monotonic()
        candidates = [r for r in self.view.members(self.next_stage) if r.peer_id not in exclude and self._available(r.peer_id, now)]
        if not candidates:
            return None
        weights = hop_weights(candidates, self.in_flight, self.next_stage_flops)
        return self.rng.choices(candidates, weights=weights, k=1)[0]

    def plan_path(self, stage_flops: Sequence[float]) -> list[str]:
        """Stage 0: a planned peer for each stage after the first (``stage_flops[s]``: FLOP per sample of
        stage s), weighted like :meth:`choose` with this peer's microbatches out at each; "" where a
        stage has no known peer (the hop then picks a stand-in)."""
        now = time.monotonic()
        path = []
        for stage in range(1, len(stage_flops)):
            candidates = [r for r in self.view.members(stage) if self._available(r.peer_id, now)]
            if not candidates:
                path.append("")
                continue
            weights = hop_weights(candidates, self.path_in_flight, stage_flops[stage])
            path.append(self.rng.choices(candidates, weights=weights, k=1)[0].peer_id)
        return path

    def _next_target(self, mb_id: str, planned: str, tried: set[str]) -> str | None:
        now = time.monotonic()
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
        if checker is None or not checker.is_enabled:
            return answer
        fingerprint = reply_tensors[1] if len(reply_tensors) == 2 else None
        if checker.should_check():
            now = time.monotonic()
            others = [r.peer_id for r in self.view.members(self.next_stage) if r.peer_id != target and self._available(r.peer_id, now)]
            checker.start_check(header, tensors, peer_id=target, reply=reply, fingerprint=fingerprint, candidates=others)
        return reply, reply_tensors[:1]

    def peer_down(self, peer_id: str) -> None:
        """``peer_id`` is gone (a leave notice or the failure detector said so): send it nothing new.

        Calls already waiting on it are left alone: a leaving peer drains them, a crashed one's
        connections are reset so they fail at once, and abandoning a call to a peer that is only
        suspected (a busy host stalls) would get its microbatch counted by two replicas."""
        self.failed_until[peer_id] = time.monotonic() + self.failure_cooldown

    def call_timeout(self) -> float:
        """Deadline of one forward call: 8x the 95th percentile of the last answered calls (which
        include the whole rest of the pipeline), at least ``MIN_CALL_TIMEOUT``, at most
        ``request_timeout``; ``request_timeout`` until 20 calls were measured."""
        if len(self._durations) < 20:
            return self.request_timeout
        p95 = sorted(self._durations)[int(0.95 * (len(self._durations) - 1))]
        return min(self.request_timeout, max(MIN_CALL_TIMEOUT, 8 * p95))

    async def forward(
        self, header: dict[str, Any], tensors: Sequence[torch.Tensor]
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """Send a forward request to a peer of the next stage; on failure try another one.

        Raises:
            NoPeerAvailableError: every attempt failed or nobody serves the next stage.
        """
        mb_id = str(header.get("mb_id"))
        checker = self.spot_checker
        if checker is not None and checker.is_enabled:
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
            started = time.monotonic()
            try:
                answer = await call_peer(
                    self.p2p, target, forward_handler(self.run_id), header, tensors,
                    timeout=self.call_timeout(), max_payload_bytes=self.max_payload_bytes,
                )
                self._durations.append(time.monotonic() - started)
                return self._answered(target, header, tensors, answer)
            except (PeerUnavailableError, RemoteError) as e:
                self.num_failures += 1
                if getattr(e, "code", "") != "unrouted":  # it answered: only the stage after it failed
                    self.failed_until[target] = time.monotonic() + self.failure_cooldown
                    if self.reputation is not None:
                        self.reputation.strike(target, f"a forward call failed: {e}")
                errors.append(str(e))
                logger.debug(f"microbatch {mb_id} failed at {target[-6:]}: {e}")
            finally:
                self.in_flight[target] -= 1
                if self.in_flight[target] <= 0:
                    del self.in_flight[target]
        raise NoPeerAvailableError(
            f"no peer of stage {self.next_stage} took microbatch {mb_id}: {'; '.join(errors) or 'none known'}"
        )
