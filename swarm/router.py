"""Choosing the next hop of a microbatch and sending it there, directly stage to stage.

Stochastic wiring (SWARM, but decided by the sender, not a central trainer): among the training
peers of the next stage, pick peer ``p`` with probability proportional to

    w_p = throughput_p / (1 + in_flight_p)

where ``throughput_p`` is what ``p`` advertises (measured samples/s once it trains, its profiled
FLOP/s over the stage cost before that) and ``in_flight_p`` the microbatches this peer has sent
to ``p`` and not yet heard back about (a queue-length signal it observes locally, at no cost).
A peer that failed a call is avoided for ``failure_cooldown`` seconds. If a hop fails, the same
microbatch goes to another peer of that stage (the upstream still holds its inputs), so a
vanished peer costs a retry, not the microbatch.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from hivemind.p2p import P2P

from dht.records import PeerRecord
from dht.rpc import Declined, PeerUnavailableError, RemoteError, call_peer, forward_handler
from swarm.view import SwarmView

logger = logging.getLogger(__name__)


class NoPeerAvailableError(Declined):
    """No peer of the next stage could take the microbatch."""


def hop_weights(candidates: Sequence[PeerRecord], in_flight: Counter, stage_flops: float) -> list[float]:
    """Selection weight of each candidate: advertised throughput over (1 + our in-flight to it)."""
    weights = []
    for record in candidates:
        throughput = record.samples_per_s if record.samples_per_s > 0 else record.flops / stage_flops
        weights.append(max(throughput, 1e-9) / (1 + in_flight[record.peer_id]))
    return weights


class Router:
    """Sends microbatches from this stage to the next one, retrying on another replica on failure."""

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
    ) -> None:
        self.p2p, self.view, self.run_id = p2p, view, run_id
        self.next_stage, self.next_stage_flops = next_stage, next_stage_flops
        self.request_timeout, self.max_payload_bytes = request_timeout, max_payload_bytes
        self.rng, self.max_attempts, self.failure_cooldown = rng, max_attempts, failure_cooldown
        self.in_flight: Counter = Counter()
        self.failed_until: dict[str, float] = {}
        self.num_failures = 0

    def choose(self, exclude: set[str]) -> PeerRecord | None:
        now = time.monotonic()
        candidates = [
            r for r in self.view.members(self.next_stage)
            if r.peer_id not in exclude and self.failed_until.get(r.peer_id, 0.0) <= now
        ]
        if not candidates:
            return None
        weights = hop_weights(candidates, self.in_flight, self.next_stage_flops)
        return self.rng.choices(candidates, weights=weights, k=1)[0]

    async def forward(
        self, header: dict[str, Any], tensors: Sequence[torch.Tensor]
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """Send a forward request to a peer of the next stage; on failure try another one.

        Raises:
            NoPeerAvailableError: every attempt failed or nobody serves the next stage.
        """
        tried: set[str] = set()
        errors = []
        for _ in range(self.max_attempts):
            target = self.choose(tried)
            if target is None:
                break
            tried.add(target.peer_id)
            self.in_flight[target.peer_id] += 1
            try:
                return await call_peer(
                    self.p2p, target.peer_id, forward_handler(self.run_id), header, tensors,
                    timeout=self.request_timeout, max_payload_bytes=self.max_payload_bytes,
                )
            except (PeerUnavailableError, RemoteError) as e:
                self.num_failures += 1
                self.failed_until[target.peer_id] = time.monotonic() + self.failure_cooldown
                errors.append(str(e))
                logger.debug(f"microbatch {header.get('mb_id')} failed at {target.peer_id[-6:]}: {e}")
            finally:
                self.in_flight[target.peer_id] -= 1
                if self.in_flight[target.peer_id] <= 0:
                    del self.in_flight[target.peer_id]
        raise NoPeerAvailableError(
            f"no peer of stage {self.next_stage} took microbatch {header.get('mb_id')}: {'; '.join(errors) or 'none known'}"
        )
