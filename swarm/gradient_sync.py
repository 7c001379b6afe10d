"""A swarm-wide batch: the replicas of a stage add up their gradients of every batch before they step.

Under the run spec's ``replica_sync = "gradients"`` (the default) one optimizer step is one batch of
``target_batch_size`` samples *for the whole swarm*, as in one process: the stage-0 replicas split
each batch's microbatches among themselves (:func:`batch_slots`; each draws the samples of its
positions, :meth:`swarm.data.TokenSampler.sample_slot`), and when a replica closes batch
``b`` it sends the sum of its gradients of that batch (and how many microbatches it holds) to each of
its co-replicas and waits for theirs. Every replica adds the contributions in the same order (sorted
peer ids), divides by the total number of microbatches and steps; so replicas that held the same
weights hold the same weights after the step, bit for bit. This is hivemind's collaborative
optimizer's semantics (a global target batch, gradients averaged every step) on our own RPC: the
batch numbers come from stage 0 (every microbatch carries its ``batch``), so no matchmaking, no
clock and no DHT round is involved, and a step costs one message per co-replica.

When a batch closes (see :class:`swarm.stage.Stage`): stage 0 closes its batch when its share came
back; a later stage closes batch ``b`` when a microbatch of ``b + 1`` arrives, when all of ``b``
came through it, when a co-replica's contribution for ``b`` arrives (that replica closed it, so
stage 0 finished ``b``: no microbatch of ``b`` is still on its way here), or when every replica of
the stage before said it closes ``b`` (a ``"closing"`` notice: each replica sends one to the next
stage's replicas as it starts its exchange). A replica closes ``b`` only once every microbatch of
``b`` it handled came back through it, and that microbatch had come through the next stage before;
so the next stage can close at once. Without the notice it would wait for the first microbatch of
``b + 1``, i.e. for this stage's whole exchange and step: on a 20 Mbit/s + 40 ms link the two
exchanges (about 1.5 s each) ran one after the other in every step; now they overlap.

Who is waited for: the stage's members in the view. A member that answers with a newer batch than
``b`` (it is ahead: this replica joined late or missed batches), that is gone, or whose contribution
has not come after ``WAIT_FACTOR`` times the smoothed duration of recent whole exchanges (at least
``MIN_WAIT``, at most ``timeout``) is not waited for: one replica behind a slow link must not set the
pace of the swarm. One that missed a deadline is *late*: it is waited for only a short while
(``LATE_FACTOR`` times the smoothed exchange time) until a contribution of it comes in time again. A
co-replica behind a slow link then costs each batch that short while, and one that only hiccuped is
back in the sum at its next punctual contribution. Contributions are pushed in the background, at
most one at a time per co-replica (a co-replica still receiving the last one gets no newer one); a
replica that hears of a newer batch than its own jumps to it (:meth:`swarm.stage.Stage.note_batch`).

Replicas that hold different weights (a joiner's pulled state is a few steps old; one stepped
without the other's contribution; an averaging round fell between their steps of one batch) would
stay apart: the same summed gradient applied to different weights keeps them different, and each
replica's microbatches then run on its own weights. So every contribution carries the digest of the
weights it was computed on and the replica's optimizer step count, and when the contributors to a
batch differ, after the step they all take one replica's whole state (parameters, AdamW moments and
step counts): the weights most contributors hold, else the replica with the most steps
(:func:`choose_source`, :meth:`GradientSync.reconcile`). The others wait for it as for a
contribution; one that does not come in time is tried again at the next batch.

Robustness: a contribution with NaN/Inf or the wrong shape is refused, and only members of the
stage in the view may send one. Under a robust ``aggregation`` (``--aggregation``, default
``centered_clip``; swarm/robust.py), a batch with three or more contributions is combined as the
robust aggregate of the contributors' per-microbatch mean gradients (times the batch's microbatch
count), so one replica sending garbage is out-voted, as in the periodic rounds (BTARD applies
CenteredClip to gradients the same way). Two contributions cannot out-vote each other: they are
added as they are. The robust aggregate weighs every contributor alike, which differs a little from
one process's mean when the shares are uneven (e.g. 2, 1, 1 microbatches).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.p2p import P2P

from dht.clock import SYSTEM_CLOCK, Clock
from dht.rpc import Declined, PeerUnavailableError, RemoteError, call_peer, serve_request
from dht.striping import stripe_count
from dht.wire import ProtocolError, require_tensor
from swarm.boundary_codec import boundary_codec
from swarm.links import LinkMeter
from swarm.robust import MIN_ROBUST_ROWS, aggregate
from swarm.stage import Stage
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
WAIT_SLICE = 0.5  # seconds between checks of the view while waiting for contributions
LATE_FACTOR = 2.0  # a late co-replica is waited for this many times the smoothed exchange time...
MIN_LATE_WAIT = 0.2  # ...but at least this many seconds
MIN_WAIT = 5.0  # seconds a replica always waits for its co-replicas' contributions (within ``timeout``)
WAIT_FACTOR = 4.0  # ...and this many times the smoothed time a whole exchange took lately
WAIT_SMOOTHING = 0.2  # weight of the newest whole exchange in that average
KEEP_BATCHES = 4  # contributions of batches this far behind the stage's are dropped
MAX_BATCHES_AHEAD = 1 << 20  # a contribution further ahead than this is refused (hostile numbering)


def gradients_handler(namespace: str, stage: int) -> str:
    return f"{namespace}.grads{stage}"


def batch_slots(num_microbatches: int, members: Sequence[str], peer_id: str) -> list[int]:
    """The positions in one batch whose microbatches ``peer_id`` injects: position ``j`` goes to the
    member at index ``j mod n`` of the sorted ``members`` (``peer_id`` counts even if the view lacks it)."""
    ordered = sorted(set(members) | {peer_id})
    index, count = ordered.index(peer_id), len(ordered)
    return list(range(index, num_microbatches, count))


def wait_limit(typical_wait: float | None, timeout: float) -> float:
    """Seconds to wait for co-replicas' contributions: ``WAIT_FACTOR`` times the smoothed duration of
    recent whole exchanges, at least ``MIN_WAIT``, at most ``timeout`` (``timeout`` before any)."""
    if typical_wait is None:
        return timeout
    return min(timeout, max(MIN_WAIT, WAIT_FACTOR * typical_wait))


def add_in_order(contributions: dict[str, tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, int]:
    """The sum of the contributions' gradients and microbatch counts, added in sorted peer-id order:
    every replica adds the same floats in the same order, so all get the same bits."""
    names = sorted(contributions)
    total = contributions[names[0]][0].clone()
    for name in names[1:]:
        total.add_(contributions[name][0])
    return total, sum(count for _, count in contributions.values())


def combine_contributions(contributions: dict[str, tuple[torch.Tensor, int]], aggregation: str,
                          ) -> tuple[torch.Tensor, int, list[str]]:
    """The batch's gradient sum and microbatch count from every replica's contribution, and the
    contributors out-voted: the plain sum (:func:`add_in_order`) under ``mean`` or with fewer than
    three contributors; else the robust aggregate of their per-microbatch means, times the count."""
    active = sorted(p for p, (_, count) in contributions.items() if count > 0)
    if aggregation == "mean" or len(active) < MIN_ROBUST_ROWS:
        return (*add_in_order(contributions), [])
    rows = torch.stack([contributions[p][0].to(torch.float64) / contributions[p][1] for p in active])
    result = aggregate(rows, aggregation)
    total = sum(count for _, count in contributions.values())
    return (result.value * total).to(torch.float32), total, [active[i] for i in result.outliers]


def choose_source(weights: dict[str, tuple[str, int]]) -> str | None:
    """Whose state the contributors to a batch take after the step, given each one's ``(digest of
    the weights it computed the batch on, optimizer steps)``; None when all computed on the same
    weights. The digest most contributors hold wins (its lowest peer id sends it), so a minority
    cannot impose its state; without a majority (two replicas that differ), the replica with the most
    optimizer steps (then the lowest peer id): a joiner's pulled state is older than its holder's."""
    if len({digest for digest, _ in weights.values()}) <= 1:
        return None
    groups: dict[str, list[str]] = {}
    for peer_id, (digest, _) in weights.items():
        groups.setdefault(digest, []).append(peer_id)
    majority = [peers for peers in groups.values() if 2 * len(peers) > len(weights)]
    if majority:
        return min(majority[0])
    return min(weights, key=lambda p: (-weights[p][1], p))


class GradientSync:
    """Exchanges one stage replica's gradient sums with its co-replicas, batch by batch."""

    def __init__(self, p2p: P2P, view: SwarmView, stage: Stage, *, peer_id: str, timeout: float,
                 max_payload_bytes: int, aggregation: str = "mean",
                 on_event: Callable[..., None] = lambda event, **fields: None,
                 links: LinkMeter | None = None, striped: bool = True, clock: Clock = SYSTEM_CLOCK) -> None:
        self.p2p, self.view, self.stage, self.peer_id, self.clock = p2p, view, stage, peer_id, clock
        # the links to co-replicas: their pushes count as heard and this peer's as sent (the failure
        # detector's); a long round trip stripes a push when ``striped`` (dht.striping)
        self.links, self.striped = links, striped
        self.aggregation = aggregation
        self.timeout, self.max_payload_bytes, self.on_event = timeout, max_payload_bytes, on_event
        self.handler = gradients_handler(stage.spec.namespace, stage.index)
        self.num_params = sum(p.numel() for p in stage.model.parameters())
        self.codec = boundary_codec(stage.spec.gradient_codec)  # how contributions travel
        self._residual: torch.Tensor | None = None  # error feedback: what the codec rounded off, added next batch
        self.state_size = sum(t.numel() for t in stage.averaged_tensors())
        self._received: dict[int, dict[str, tuple[torch.Tensor, int]]] = {}
        self._weights: dict[int, dict[str, tuple[str, int]]] = {}  # per batch: contributors' weights digest, steps
        self._states: dict[int, dict[str, torch.Tensor]] = {}  # per batch: states sent to reconcile with
        self._reconcile: dict[int, tuple[str, list[str]]] = {}  # per batch: the source, and who takes its state
        self._state_pushes: set[asyncio.Task] = set()
        self._ahead: dict[int, set[str]] = {}  # per batch: co-replicas that said they are past it
        self._arrived = asyncio.Event()
        self._pushes: dict[str, asyncio.Task] = {}  # co-replica -> the push to it in flight
        self._queued: dict[str, tuple[int, dict, list[torch.Tensor]]] = {}  # co-replica -> the newest push waiting for it
        self._late: set[str] = set()  # co-replicas that missed their last deadline: waited for briefly
        self._closing: dict[int, set[str]] = {}  # per batch: replicas of the stage before that said they close it
        self._notices: set[asyncio.Task] = set()  # "closing" notices to the next stage on their way
        self.typical_wait: float | None = None  # smoothed seconds a whole exchange took
        # batches closed; of them, closed without some co-replica's contribution; with no co-replica known
        self.num_exchanges = self.num_partial = self.num_alone = self.num_outvoted = 0
        self.num_reconciled = 0  # batches after which this replica took a co-replica's state

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler, self.rpc_gradients)
        self.stage.combine, self.stage.reconcile = self.combine, self.reconcile

    async def stop(self) -> None:
        self.stage.combine = self.stage.reconcile = None
        self._queued.clear()
        for push in [*self._pushes.values(), *self._state_pushes, *self._notices]:
            push.cancel()
        self._pushes.clear()
        try:
            await self.p2p.remove_binary_stream_handler(self.handler)
        except Exception as e:  # the daemon may already be gone
            logger.debug(f"could not remove the gradients handler: {e!r}")

    def co_replicas(self) -> list[str]:
        return sorted(r.peer_id for r in self.view.members(self.stage.index) if r.peer_id != self.peer_id)

    def slots(self, num_microbatches: int) -> list[int]:
        """This replica's positions in a stage-0 batch (see :func:`batch_slots`)."""
        return batch_slots(num_microbatches, self.co_replicas(), self.peer_id)

    async def combine(self, batch: int, gradients: torch.Tensor, count: int, weights: str = "") -> tuple[torch.Tensor, int]:
        """Send this replica's contribution to batch ``batch`` to every co-replica, wait for theirs
        (or until each is past the batch, gone, or silent for ``timeout``), and return the sum.
        ``weights``: the digest of the weights the contribution was computed on; contributions
        computed on other weights than this replica's are reconciled after the step (:meth:`reconcile`)."""
        self._announce_closing(batch)
        members = self.co_replicas()
        if members:
            gradients, wire = self.encode(gradients)
        contributions = {self.peer_id: (gradients, count)}
        header = {"batch": batch, "count": count, "weights": weights, "steps": self.stage.optimizer_steps}
        started = self.clock()
        if members:
            for peer_id in members:  # theirs may come first: they still need this one
                self._push_soon(peer_id, batch, header, wire)
            await self._wait_contributions(batch, members)
            contributions.update({p: c for p, c in self._received.get(batch, {}).items() if p in members})
            self._plan_reconcile(batch, {self.peer_id: (weights, header["steps"])} | {
                p: w for p, w in self._weights.get(batch, {}).items() if p in contributions})
            ahead = self._ahead.get(batch, set())
            self._late = {p for p in members if p not in contributions and p not in ahead and not self.view.is_gone(p)}
        missing = [p[-6:] for p in members if p not in contributions]
        self.on_event("gradients_exchanged", batch=batch, co_replicas=len(members), missing=len(missing),
                      seconds=round(self.clock() - started, 4))  # what a step waits on its co-replicas
        self.num_exchanges += 1
        self.num_alone += not members
        if missing:
            self.num_partial += 1
            logger.info(f"batch {batch} of stage {self.stage.index}: stepped without {', '.join(missing)}")
        self._forget_before(batch)
        total, count, outvoted = combine_contributions(contributions, self.aggregation)
        if outvoted:
            self.num_outvoted += len(outvoted)
            logger.warning(f"batch {batch} of stage {self.stage.index}: out-voted the gradients of "
                           f"{', '.join(p[-6:] for p in outvoted)} ({self.aggregation})")
            self.on_event("gradients_outvoted", batch=batch, peers=outvoted)
        return total, count

    def encode(self, gradients: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This replica's contribution as its co-replicas will decode it, and its wire tensors.
        Every replica adds the *decoded* contributions, its own too, so all of them step on the same
        sum, bit for bit, whatever the codec rounds. A lossy codec's rounding error is kept and added
        to the next batch's sum (error feedback, as in 1-bit SGD and EF-SGD): nothing is lost, only
        late by a batch."""
        if self.codec.name == "none":
            return gradients, [gradients]
        target = gradients if self._residual is None else gradients + self._residual
        wire = self.codec.encode(target)
        decoded = self.codec.decode(wire, shape=(self.num_params,), dtype=torch.float32, name="gradients")
        self._residual = target - decoded
        return decoded, wire

    def _push_soon(self, peer_id: str, batch: int, header: dict[str, Any], gradients: list[torch.Tensor]) -> None:
        """Push now, or, while the last push to ``peer_id`` is still under way (a slow link), right after
        it; only the newest waits (an older batch than that is of no use to the co-replica any more)."""
        if peer_id in self._pushes:
            self._queued[peer_id] = (batch, header, gradients)
            return
        push = asyncio.create_task(self._push(peer_id, batch, header, gradients), name=f"push-gradients-{batch}")
        self._pushes[peer_id] = push

        def pushed(done: asyncio.Task) -> None:
            if self._pushes.get(peer_id) is done:
                del self._pushes[peer_id]
                if peer_id in self._queued:
                    self._push_soon(peer_id, *self._queued.pop(peer_id))

        push.add_done_callback(pushed)

    async def _push(self, peer_id: str, batch: int, header: dict[str, Any], gradients: list[torch.Tensor]) -> None:
        try:
            payload = sum(t.numel() * t.element_size() for t in gradients)
            stripes = stripe_count(payload, self.links.min_rtt(peer_id)) if self.links and self.striped else 1
            with self._sending(peer_id):
                reply, _ = await call_peer(self.p2p, peer_id, self.handler, header, gradients, stripes=stripes,
                                           timeout=self.timeout, max_payload_bytes=self.max_payload_bytes)
        except (PeerUnavailableError, RemoteError) as e:
            logger.debug(f"gradients of batch {batch} not delivered to {peer_id[-6:]}: {e}")
            self._ahead.setdefault(batch, set()).add(peer_id)  # do not wait for it
            self._arrived.set()
            return
        version = reply.get("version")
        if isinstance(version, int) and version > batch:  # it already stepped past this batch
            self._ahead.setdefault(batch, set()).add(peer_id)
            self.stage.note_batch(version, from_replica=False)
            self._arrived.set()

    def _announce_closing(self, batch: int) -> None:
        """Tell every replica of the next stage that this one closes ``batch`` (see the module docstring)."""
        if self.stage.is_last:
            return
        handler = gradients_handler(self.stage.spec.namespace, self.stage.index + 1)
        for record in self.view.members(self.stage.index + 1):
            notice = asyncio.create_task(self._notify_closing(record.peer_id, handler, batch), name=f"closing-{batch}")
            self._notices.add(notice)
            notice.add_done_callback(self._notices.discard)

    async def _notify_closing(self, peer_id: str, handler: str, batch: int) -> None:
        try:
            await call_peer(self.p2p, peer_id, handler, {"batch": batch, "kind": "closing"},
                            timeout=self.timeout, max_payload_bytes=self.max_payload_bytes)
        except (PeerUnavailableError, RemoteError) as e:  # it closes on the next batch's first microbatch then
            logger.debug(f"closing notice of batch {batch} not delivered to {peer_id[-6:]}: {e}")

    def _receive_closing(self, sender: str, batch: int) -> dict[str, Any]:
        """A replica of the stage before closes ``batch``: once all of them did, so does this replica."""
        if self.stage.is_first:
            raise Declined("stage 0 has no stage before it")
        before = {r.peer_id for r in self.view.members(self.stage.index - 1)}
        if sender not in before:
            raise Declined(f"{sender[-6:]} is not a replica of stage {self.stage.index - 1} here")
        if not self.stage.version <= batch <= self.stage.version + 1:
            return {"ok": True}  # a batch closed here already, or not begun: nothing to do (and nothing kept)
        closing = self._closing.setdefault(batch, set())
        closing.add(sender)
        if batch == self.stage.version and before <= closing:
            self.stage.request_close()
        return {"ok": True}

    # --- reconciling replicas whose weights differ ------------------------------------------

    def _plan_reconcile(self, batch: int, weights: dict[str, tuple[str, int]]) -> None:
        """Contributions to ``batch`` computed on different weights (a joiner's pulled state is a few
        steps old; an averaging round fell between two replicas' steps; a replica stepped without the
        other): after the step every contributor takes one replica's state (:func:`choose_source`)."""
        source = choose_source(weights)
        if source is not None:
            self._reconcile[batch] = (source, sorted(p for p, (digest, _) in weights.items()
                                                     if digest != weights[source][0]))

    async def reconcile(self, batch: int) -> None:
        """After the step of ``batch``: the source sends its state to the replicas that computed on
        other weights, and those load it (waiting as for contributions), so all hold the same state
        again. A state that does not come in time is not waited for: the next batch tries again."""
        plan = self._reconcile.pop(batch, None)
        if plan is None:
            return
        source, behind = plan
        if source == self.peer_id:
            state = await self.stage.run(self.stage.flat_state)
            for peer_id in behind:
                push = asyncio.create_task(self._push_state(peer_id, batch, state), name=f"push-state-{batch}")
                self._state_pushes.add(push)
                push.add_done_callback(self._state_pushes.discard)
            return
        if self.peer_id not in behind:
            return
        state = await self._wait_state(batch, source)
        if state is None:
            logger.info(f"batch {batch} of stage {self.stage.index}: {source[-6:]}'s state did not come; "
                        "the weights still differ")
            return
        async with self.stage.paused():
            await self.stage.run(self.stage.load_flat_state, state)
        self.num_reconciled += 1
        logger.info(f"batch {batch} of stage {self.stage.index}: computed on other weights than {source[-6:]}; "
                    "took its state")
        self.on_event("replica_reconciled", batch=batch, source=source)

    def _sending(self, peer_id: str) -> contextlib.AbstractContextManager:
        """A bulk push to ``peer_id``: its pings queue behind it (``LinkMeter.sent_since``)."""
        return contextlib.nullcontext() if self.links is None else self.links.sending(peer_id)

    async def _push_state(self, peer_id: str, batch: int, state: torch.Tensor) -> None:
        try:
            with self._sending(peer_id):
                await call_peer(self.p2p, peer_id, self.handler, {"batch": batch, "kind": "state"}, [state],
                                timeout=self.timeout, max_payload_bytes=self.max_payload_bytes)
        except (PeerUnavailableError, RemoteError) as e:
            logger.debug(f"state after batch {batch} not delivered to {peer_id[-6:]}: {e}")

    async def _wait_state(self, batch: int, source: str) -> torch.Tensor | None:
        deadline = self.clock() + self.wait_limit()
        while source not in self._states.get(batch, {}) and not self.view.is_gone(source):
            remaining = deadline - self.clock()
            if remaining <= 0:
                return None
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=min(WAIT_SLICE, remaining))
            except asyncio.TimeoutError:
                pass
        return self._states.get(batch, {}).pop(source, None)

    def wait_limit(self) -> float:
        return wait_limit(self.typical_wait, self.timeout)

    def late_wait_limit(self) -> float:
        """How long a late co-replica is waited for (see the module docstring)."""
        return min(self.wait_limit(), max(MIN_LATE_WAIT, LATE_FACTOR * (self.typical_wait or 0.0)))

    async def _wait_contributions(self, batch: int, members: list[str]) -> None:
        started = self.clock()
        deadline, late_deadline = started + self.wait_limit(), started + self.late_wait_limit()
        while True:
            received, ahead, now = self._received.get(batch, {}), self._ahead.get(batch, set()), self.clock()
            waiting = [p for p in members if p not in received and p not in ahead and not self.view.is_gone(p)
                       and (p not in self._late or now < late_deadline)]
            remaining = (deadline if any(p not in self._late for p in waiting) else late_deadline) - now
            if not waiting and all(p in received or p in ahead for p in members if p not in self._late):
                took = self.clock() - started
                self.typical_wait = took if self.typical_wait is None else (
                    (1 - WAIT_SMOOTHING) * self.typical_wait + WAIT_SMOOTHING * took)
                return
            if not waiting or remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=min(WAIT_SLICE, remaining))
            except asyncio.TimeoutError:
                pass

    async def rpc_gradients(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = info.peer_id.to_base58()

        async def process(header: dict[str, Any], tensors: list[torch.Tensor]) -> tuple[dict, list]:
            return self._receive(sender, header, tensors), []

        await serve_request(reader, writer, process, max_payload_bytes=self.max_payload_bytes, timeout=self.timeout,
                            what="gradients")

    def _receive(self, sender: str, header: dict[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
        batch = header.get("batch")
        if type(batch) is not int or batch < 0:
            raise ProtocolError("batch must be a non-negative integer")
        if header.get("kind") == "closing":  # from the stage before, not a co-replica
            return self._receive_closing(sender, batch)
        if sender not in {r.peer_id for r in self.view.members(self.stage.index)}:
            raise Declined(f"{sender[-6:]} is not a replica of stage {self.stage.index} here")
        if self.links is not None:
            self.links.heard(sender)  # a co-replica whose pushes arrive is alive, whatever its pings say
        version = self.stage.version
        if batch > version + MAX_BATCHES_AHEAD:
            raise ProtocolError(f"batch {batch} is implausibly far ahead of this replica's {version}")
        if header.get("kind") == "state":
            return self._receive_state(sender, batch, tensors)
        count, weights, steps = header.get("count"), header.get("weights", ""), header.get("steps", 0)
        if type(count) is not int or not 0 <= count <= 1 << 20:
            raise ProtocolError("count must be a non-negative integer")
        if type(weights) is not str or len(weights) > 64 or type(steps) is not int or steps < 0:
            raise ProtocolError("weights must be a digest and steps a non-negative integer")
        gradients = self.codec.decode(tensors, shape=(self.num_params,), dtype=torch.float32, name="gradients")
        if batch < version and not self.stage.is_closing(batch):
            return {"ok": True, "version": version}  # this replica is past it: the sender must not wait
        self._received.setdefault(batch, {})[sender] = (gradients, count)
        self._weights.setdefault(batch, {})[sender] = (weights, steps)
        self._arrived.set()
        self.stage.note_batch(batch, from_replica=True)
        return {"ok": True, "version": self.stage.version}

    def _receive_state(self, sender: str, batch: int, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """A co-replica's whole state after ``batch``, kept for :meth:`reconcile`, which loads it only if
        this replica chose that co-replica as the batch's source (it may arrive before the choice)."""
        if not self.stage.version - KEEP_BATCHES <= batch <= self.stage.version + 1:
            raise Declined(f"no state is expected after batch {batch}")
        state = require_tensor(tensors, 0, dtype=torch.float32, shape=(self.state_size,), name="state")
        if not torch.isfinite(state).all():
            raise ProtocolError("state holds NaN or Inf")
        self._states.setdefault(batch, {})[sender] = state
        self._arrived.set()
        return {"ok": True}

    def _forget_before(self, batch: int) -> None:
        for table in (self._received, self._ahead, self._weights, self._states, self._reconcile, self._closing):
            for old in [b for b in table if b < batch - KEEP_BATCHES]:
                del table[old]
