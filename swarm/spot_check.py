"""Spot checks: a small fraction of microbatches is recomputed by a second replica and compared.

Issue #7 ("Hostile peers"). The peer that sends a microbatch to stage k (a peer of stage k - 1, the
router's owner) picks it for a check with probability ``fraction``. Every forward request such a
peer sends asks for a *fingerprint* of the outputs (``"fp": true`` in the header, on all requests
alike, so a replica cannot tell a checked microbatch from another), and every replica answers with
it: the outputs of its stage (the logits on the last stage) projected on ``FINGERPRINT_DIMS`` fixed
pseudo-random directions, one small vector per (sample, position), and the tag of the weights it
used (:attr:`swarm.stage.Stage.weights_tag`). That fingerprint is the replica's answer actually
used: it is computed from the very outputs it sent on.

For a checked microbatch, the sender asks another replica of stage k for a *check*: the same inputs,
``"kind": "check"``; the replica runs the forward alone (no graph kept, nothing sent downstream,
nothing counted, no ledger entry: a gradient is never counted twice) and answers its fingerprint.
The check request names the tag of the weights the first replica used; the second computes on the
same weights when it can (its current ones, or the snapshot of that averaging round if it stepped
since). The two are compared by their relative distance ``|a - b| / max(|a|, |b|)``:

* if both used weights with the same non-empty tag (the same averaging round and no local step
  since, or both still at the seed's initialisation), they computed with bit-identical weights, and
  the tolerance is ``STRICT_TOLERANCE`` (float reassociation only);
* otherwise their weights differ legitimately (replicas step on their own between averaging
  rounds). With ``tolerance`` 0 (the default) such answers are not compared (the check is
  skipped); a positive ``tolerance`` compares them loosely. Measured, two honest replicas a few
  local steps apart early in training differ by 0.1-1.5 on this scale (docs/spot-checks.md), as
  much as garbage outputs (1.0), so no loose tolerance is both safe and useful by default.

A mismatch is suspicion of both: each gets a strike (``dht.reputation``), not a ban, and at most one
per ``SUSPICION_PERIOD`` so that suspicion alone never adds up to a ban. When the stage has a third
replica, it arbitrates: if it sides with one answer, the other replica is blamed and struck every
time, and the one it sided with is cleared. So a single faulty replica collects a strike from every
check it takes part in while honest ones collect none, and it is banned after ``--ban-strikes``
checks in the window.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.p2p import P2P

from dht.clock import SYSTEM_CLOCK
from dht.reputation import Reputation
from dht.rpc import PeerUnavailableError, RemoteError, call_peer, forward_handler

logger = logging.getLogger(__name__)

FINGERPRINT_DIMS = 2  # directions per (sample, position): 2 / d_model of the activations' bytes
FINGERPRINT_SEED = 0x5F07C4EC  # every replica projects on the same directions
STRICT_TOLERANCE = 1e-3  # same weights: float32 reassociation (threads, kernels) stays far below this
MAX_CONCURRENT_CHECKS = 4  # checks in flight at once; a microbatch drawn beyond that is not checked
# An unarbitrated mismatch strikes a peer at most once per this many seconds: with the default
# 8 strikes in 30 s, suspicion alone (at most 3 strikes per window) never bans, so a faulty replica
# cannot get its one honest partner banned; blame from an arbiter strikes every time.
SUSPICION_PERIOD = 10.0
OUTCOMES = ("match", "mismatch", "skipped")

_directions: dict[tuple[int, str], torch.Tensor] = {}


def output_fingerprint(outputs: torch.Tensor) -> torch.Tensor:
    """``outputs`` (…, width) projected on ``FINGERPRINT_DIMS`` fixed unit-variance directions: a
    float32 CPU tensor of shape (…, FINGERPRINT_DIMS). Deterministic on every replica."""
    width = outputs.shape[-1]
    key = (width, str(outputs.device))
    directions = _directions.get(key)
    if directions is None:
        generator = torch.Generator().manual_seed(FINGERPRINT_SEED)
        directions = torch.randn(width, FINGERPRINT_DIMS, generator=generator) / math.sqrt(width)
        directions = _directions[key] = directions.to(outputs.device)
    return (outputs.detach().float() @ directions).cpu()


def fingerprint_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / max(|a|, |b|)`` (L2 over all entries); inf if the shapes differ or any is not finite."""
    if a.shape != b.shape or not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    scale = max(float(a.double().norm()), float(b.double().norm()), 1e-12)
    return float((a.double() - b.double()).norm()) / scale


@dataclass(frozen=True)
class Answer:
    """One replica's answer to a microbatch, as far as a check is concerned."""

    peer_id: str
    fingerprint: torch.Tensor
    weights_tag: str


class SpotChecker:
    """Draws microbatches for spot checks, runs them in the background, and judges the replicas.

    ``on_event("spot_check", **fields)`` reports every check drawn, with its ``outcome`` (one of
    ``OUTCOMES``); ``num_checks`` counts them by outcome (for /metrics).
    """

    def __init__(
        self, p2p: P2P, *, run_id: str, fraction: float, tolerance: float, rng: random.Random,
        timeout: float, max_payload_bytes: int, reputation: Reputation | None = None,
        on_event: Callable[..., None] = lambda event, **fields: None, clock: Callable[[], float] = SYSTEM_CLOCK,
        seq_len: int | None = None,
    ) -> None:
        if not 0.0 <= fraction <= 1.0 or not 0.0 <= tolerance < math.inf:
            raise ValueError("need 0 <= fraction <= 1 and a finite tolerance >= 0")
        self.p2p, self.run_id, self.fraction, self.tolerance, self.rng = p2p, run_id, fraction, tolerance, rng
        self.timeout, self.max_payload_bytes = timeout, max_payload_bytes
        self.reputation, self.on_event = reputation, on_event
        self.num_checks: Counter[str] = Counter()
        self.clock, self.seq_len = clock, seq_len  # seq_len: of the fingerprints (None: the targets')
        self._suspected_at: dict[str, float] = {}  # peer -> when an unarbitrated mismatch last struck it
        self._tasks: set[asyncio.Task] = set()

    @property
    def is_enabled(self) -> bool:
        return self.fraction > 0

    def should_check(self) -> bool:
        return self.fraction > 0 and self.rng.random() < self.fraction

    def start_check(
        self, header: dict[str, Any], tensors: Sequence[torch.Tensor], *, peer_id: str,
        reply: dict[str, Any], fingerprint: torch.Tensor | None, candidates: Sequence[str],
    ) -> None:
        """Check in the background the answer ``peer_id`` gave to the request ``header``/``tensors``
        (its ``fingerprint`` and ``reply["weights"]``) against other replicas among ``candidates``."""
        mb_id = str(header.get("mb_id"))
        if len(self._tasks) >= MAX_CONCURRENT_CHECKS:
            self._report(mb_id, "skipped", [peer_id], reason="too many checks in flight")
            return
        tag = reply.get("weights")
        if fingerprint is None or not isinstance(tag, str) or len(tag) > 128:
            self._report(mb_id, "skipped", [peer_id], reason="the replica sent no fingerprint")
            return
        others = [p for p in candidates if p != peer_id]
        if not others:
            self._report(mb_id, "skipped", [peer_id], reason="no other replica to recompute it")
            return
        first = Answer(peer_id, fingerprint, tag)
        request = {"kind": "check", "mb_id": mb_id, "route": header.get("route"), "batch_size": header.get("batch_size"),
                   "weights": tag}
        self.rng.shuffle(others)
        task = asyncio.create_task(self._check(request, list(tensors), first, others), name=f"spot-check {mb_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait_checks_done(self) -> None:
        """Until every check started so far has been judged (tests, and a clean leave)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def shutdown(self) -> None:
        """Cancel the checks in flight (idempotent)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _check(self, request: dict, tensors: list[torch.Tensor], first: Answer, others: list[str]) -> None:
        mb_id = request["mb_id"]
        # the targets (batch, seq) come last, after the encoded activations (a subspace run's: seq + 1)
        shape = (tensors[-1].shape[0], self.seq_len or tensors[-1].shape[1], FINGERPRINT_DIMS)
        second = await self._recompute(request, tensors, others, shape)
        if second is None:
            self._report(mb_id, "skipped", [first.peer_id], reason="no other replica answered a check")
            return
        peers = [first.peer_id, second.peer_id]
        distance, tolerance, strict = self._compare(first, second)
        if tolerance is None:  # the distance is still reported: it shows how far honest replicas drift
            self._report(mb_id, "skipped", peers, distance=distance, reason=f"the replicas used different weights "
                         f"({first.weights_tag or 'own'} and {second.weights_tag or 'own'})")
            return
        if distance <= tolerance:
            self._report(mb_id, "match", peers, distance=distance, tolerance=tolerance, strict=strict)
            return
        blamed, arbitrated = list(peers), False  # suspicion of both, unless a third replica tells them apart
        third = await self._recompute(request, tensors, others, shape)
        if third is not None:
            peers.append(third.peer_id)
            verdicts = {a.peer_id: self._agrees(a, third) for a in (first, second)}
            disagreeing = [peer_id for peer_id, agrees in verdicts.items() if agrees is False]
            if len(disagreeing) == 1 and True in verdicts.values():  # it sides with one: the other is the odd one
                blamed, arbitrated = disagreeing, True
        reason = (f"spot check of microbatch {mb_id}: outputs {distance:.3g} apart (tolerance {tolerance:.3g}, "
                  f"{'same' if strict else 'different'} weights), computed by {', '.join(p[-6:] for p in peers)}")
        logger.warning(f"{reason}; {'blaming' if arbitrated else 'suspecting'} {', '.join(p[-6:] for p in blamed)}")
        struck = blamed if arbitrated else self._suspect(blamed)
        if self.reputation is not None:
            for peer_id in struck:
                self.reputation.strike(peer_id, reason)
        self._report(mb_id, "mismatch", peers, distance=distance, tolerance=tolerance, strict=strict, blamed=blamed,
                     arbitrated=arbitrated, struck=struck)

    def _suspect(self, peer_ids: list[str]) -> list[str]:
        """Those of ``peer_ids`` an unarbitrated mismatch strikes now (see ``SUSPICION_PERIOD``)."""
        now = self.clock()
        if len(self._suspected_at) > 4096:
            self._suspected_at = {p: t for p, t in self._suspected_at.items() if now - t < SUSPICION_PERIOD}
        struck = [p for p in peer_ids if now - self._suspected_at.get(p, -math.inf) >= SUSPICION_PERIOD]
        self._suspected_at.update((p, now) for p in struck)
        return struck

    def _compare(self, a: Answer, b: Answer) -> tuple[float, float | None, bool]:
        """(distance, tolerance, whether both used the same weights); the tolerance is None when the
        two answers are not comparable (different weights and no loose tolerance configured)."""
        strict = a.weights_tag == b.weights_tag != ""
        tolerance = STRICT_TOLERANCE if strict else self.tolerance or None
        return fingerprint_distance(a.fingerprint, b.fingerprint), tolerance, strict

    def _agrees(self, a: Answer, b: Answer) -> bool | None:
        """Whether ``a`` and ``b`` match; None if they are not comparable."""
        distance, tolerance, _ = self._compare(a, b)
        return None if tolerance is None else distance <= tolerance

    async def _recompute(self, request: dict, tensors: list[torch.Tensor], others: list[str],
                         shape: tuple[int, ...]) -> Answer | None:
        """The first replica in ``others`` (consumed) that answers the check request well, or None."""
        while others:
            peer_id = others.pop(0)
            try:
                reply, reply_tensors = await call_peer(self.p2p, peer_id, forward_handler(self.run_id), request, tensors,
                                                       timeout=self.timeout, max_payload_bytes=self.max_payload_bytes)
            except (PeerUnavailableError, RemoteError) as e:
                logger.debug(f"spot check of {request['mb_id']}: {peer_id[-6:]} did not recompute it: {e}")
                continue
            tag = reply.get("weights")
            if (len(reply_tensors) != 1 or reply_tensors[0].dtype != torch.float32
                    or tuple(reply_tensors[0].shape) != shape or not isinstance(tag, str) or len(tag) > 128):
                if self.reputation is not None:
                    self.reputation.strike(peer_id, "answered a spot check with a malformed fingerprint")
                continue
            return Answer(peer_id, reply_tensors[0], tag)
        return None

    def _report(self, mb_id: str, outcome: str, peers: list[str], **fields: Any) -> None:
        self.num_checks[outcome] += 1
        if outcome == "skipped":
            logger.debug(f"spot check of {mb_id} skipped: {fields.get('reason')}")
        self.on_event("spot_check", mb_id=mb_id, outcome=outcome, peers=peers, **fields)
