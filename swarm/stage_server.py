"""The RPC handler a stage serves for the pipeline: ``rpc_forward`` (its state is served by replication/).

``rpc_forward`` receives a microbatch's activations (and its targets, which travel with it to the
last stage), runs this stage's forward, and either computes the loss here (last stage) or sends the
result on to a peer of the next stage chosen by the :class:`~swarm.router.Router`. The reply carries
the gradient w.r.t. the activations it received, the loss, and the full route
``[[peer_id, stage, weight_version], ...]``, so the backward retraces exactly the route the forward
took. Every request is validated against the run spec (shapes, dtypes, finiteness, token range,
route consistency) before any compute; a bad one is refused with a logged reason and the server
keeps serving.

A request of ``"kind": "eval"`` carries a held-out microbatch: every stage runs its forward on its
current weights and passes it on, the last stage answers with the loss; nothing is kept, counted or
entered in the ledger, and no gradient flows back (see :meth:`swarm.trainer.Trainer.evaluate`).

A request with ``"fp": true`` (its sender spot-checks) is answered with a fingerprint of this
stage's outputs as a second tensor and the weights' tag in ``"weights"``; a request of ``"kind":
"check"`` is a spot check's recompute: the forward alone, answered with the fingerprint only, no
graph kept, nothing sent on, counted or entered in the ledger (see :mod:`swarm.spot_check`).

With the ``replay`` recovery each request goes through the replica's
:class:`~swarm.task_pool.MicrobatchLedger` first: a microbatch id seen before is answered without
computing or counting it twice (see :mod:`swarm.task_pool`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from hivemind.p2p import P2P

from dht.reputation import Reputation
from dht.rpc import REFUSAL_LOG, REQUEST_OUTCOMES, Declined, forward_handler, send_reply, serve_request
from dht.wire import ProtocolError, require_tensor
from swarm.admission import NOT_MEMBER, Admission
from swarm.subspace import request_ids_layout, scored_targets, stage_boundary_codec
from swarm.links import LinkMeter
from swarm.model import activation_dtype
from swarm.router import Router
from swarm.stage import Stage
from swarm.task_pool import MicrobatchLedger

logger = logging.getLogger(__name__)
MAX_ROUTE_HOPS = 64
# A banned sender's stream is held unread this long before it is closed (a tarpit): a flooder that
# waits for answers sends one request per stream per hold instead of as fast as a close comes back.
# Held streams cost a coroutine and the daemon's window of buffered bytes each, so at most
# MAX_TARPITTED are held at once (all senders together); beyond that they are closed at once.
TARPIT_SECONDS = 5.0
MAX_TARPITTED = 64


class StageServer:
    """Serves one stage's RPCs over hivemind P2P binary streams."""

    def __init__(
        self,
        p2p: P2P,
        stage: Stage,
        *,
        peer_id: str,
        router: Router | None,
        request_timeout: float,
        max_payload_bytes: int,
        on_microbatch: Callable[[dict[str, Any]], None] = lambda event: None,
        on_event: Callable[..., None] = lambda event, **fields: None,
        ledger: MicrobatchLedger | None = None,
        reputation: Reputation | None = None,
        admission: Admission | None = None,
        links: LinkMeter | None = None,
    ) -> None:
        if (router is None) != stage.is_last:
            raise ValueError("every stage but the last needs a router to the next stage")
        self.p2p, self.stage, self.peer_id, self.router = p2p, stage, peer_id, router
        self.request_timeout, self.max_payload_bytes = request_timeout, max_payload_bytes
        self.on_microbatch, self.on_event = on_microbatch, on_event
        self.ledger = ledger  # None: the restart baseline, every delivery is computed and counted
        self.reputation = reputation
        self.admission = admission  # None: anybody not banned may push work (tests of the handler alone)
        self.links = links if links is not None else LinkMeter()  # a sender's activations: alive, and its goodput
        self.codec = stage_boundary_codec(stage.spec)  # how activations arrive and gradients leave
        self.num_refused = 0
        self.num_checks_served = 0  # spot-check recomputes answered (swarm/spot_check.py)
        self._local_ids = itertools.count()
        self._accepting = True
        self.is_paused = False  # declines new microbatches while set (the peer's volunteer paused it)
        self._active: set[asyncio.Task] = set()  # handler tasks serving a request right now
        self.num_tarpitted = 0  # banned senders' streams held unread right now
        self._stopping = asyncio.Event()  # set when the handler is removed: held streams are closed

    @property
    def num_active(self) -> int:
        """Forward requests being served now."""
        return len(self._active)

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(forward_handler(self.stage.spec.namespace), self.rpc_forward)

    def stop_accepting(self) -> None:
        """Refuse new microbatches (leaving): upstream peers re-send them to another replica."""
        self._accepting = False

    async def stop(self, *, timeout: float) -> None:
        """Unregister the handlers and wait up to ``timeout`` for the requests being served."""
        self.stop_accepting()
        self._stopping.set()
        run_id = self.stage.spec.namespace
        try:
            await self.p2p.remove_binary_stream_handler(forward_handler(run_id))
        except Exception as e:  # the daemon may already be gone
            logger.debug(f"could not remove the forward handler: {e!r}")
        if self._active:
            await asyncio.wait(list(self._active), timeout=timeout)

    async def rpc_forward(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = info.peer_id.to_base58()  # authenticated by libp2p
        if self.reputation is not None and self.reputation.is_banned(sender):
            self.num_refused += 1
            await self._tarpit(writer)  # a banned peer gets nothing, not even a reason, and not soon
            return
        if self.admission is not None and (code := await self.admission.check(sender)):
            await self._turn_away(sender, code, reader, writer)
            return
        await self._serve(reader, writer, self._process_forward, max_payload_bytes=self.max_payload_bytes, sender=sender)

    async def _tarpit(self, writer: asyncio.StreamWriter) -> None:
        """Hold a banned sender's stream unread for ``TARPIT_SECONDS`` (fewer if the server stops),
        then close it; closed at once when ``MAX_TARPITTED`` are held already."""
        if self.num_tarpitted < MAX_TARPITTED:
            self.num_tarpitted += 1
            try:
                await asyncio.wait_for(self._stopping.wait(), timeout=TARPIT_SECONDS)
            except asyncio.TimeoutError:
                pass
            finally:
                self.num_tarpitted -= 1
        writer.close()

    async def _turn_away(self, sender: str, code: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Refuse a request from a peer not admitted (``swarm.admission``) before reading it: a reason,
        a count (``murmuration_rpc_requests_total{outcome=code}``) and a bounded log line."""
        self.num_refused += 1
        REQUEST_OUTCOMES["forward", code] += 1
        reason = (f"{sender} is not a peer of stage {self.stage.index - 1} in this peer's view" if code == NOT_MEMBER
                  else f"{sender} sends more than its share of forward requests")
        REFUSAL_LOG.refused("forward", reason)
        await send_reply(reader, writer, {"ok": False, "error": reason, "code": code}, timeout=self.request_timeout)

    async def _serve(self, reader, writer, process, *, max_payload_bytes: int, sender: str) -> None:
        def count(outcome: str) -> None:
            if outcome == "refused":
                self.num_refused += 1
                if self.reputation is not None:
                    self.reputation.strike(sender, "sent a malformed forward request")

        def received(num_bytes: int, seconds: float) -> None:
            self.links.heard(sender)
            self.links.transfer(sender, num_bytes, seconds)

        task = asyncio.current_task()
        self._active.add(task)
        try:
            await serve_request(reader, writer, process, max_payload_bytes=max_payload_bytes,
                                timeout=self.request_timeout, what="forward", on_outcome=count, on_received=received)
        finally:
            self._active.discard(task)

    async def _process_forward(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> tuple[dict, list]:
        if not self._accepting:
            raise Declined("this peer is leaving")
        if self.is_paused:
            raise Declined("this peer is paused")
        stage = self.stage
        mb_id, route, batch_size, path = _check_forward_header(header, stage.spec.microbatch_size, stage.index, stage.spec.num_stages)
        batch = header.get("batch")  # the stage-0 batch it belongs to (swarm/gradient_sync.py)
        if batch is not None and (type(batch) is not int or not 0 <= batch < 2**53):
            raise ProtocolError("batch must be a non-negative integer")
        activations, targets = self._check_forward_tensors(tensors, batch_size)
        if header.get("kind") == "check":  # a spot check: the forward alone, nothing kept, sent on or counted
            wanted = header.get("weights")
            fingerprint, tag = await stage.check_forward(activations, weights_tag=wanted if isinstance(wanted, str) else "")
            self.num_checks_served += 1
            return {"ok": True, "weights": tag}, [fingerprint]
        if header.get("kind") == "eval":  # held-out loss: forward only, nothing kept, counted or entered in the ledger
            return await self._evaluate(mb_id, route, batch_size, activations, targets)
        fingerprint = header.get("fp") is True  # the sender spot-checks: answer every request with a fingerprint
        route = [*route, [self.peer_id, stage.index, stage.version]]
        ledger = self.ledger
        # the reply's "queue": jobs on this stage's compute thread when the microbatch arrived (stage 0's
        # flow control, swarm/flow_control.py, does not grow its window while the next stage is that busy)
        ahead = stage.num_queued
        if ledger is None:
            reply, reply_tensors = await self._compute(mb_id, route, path, batch_size, activations, targets, count=True,
                                                       fingerprint=fingerprint, batch=batch)
            return {**reply, "queue": ahead}, reply_tensors
        running = ledger.running(mb_id)
        if running is not None:  # a re-delivery while the first is still being computed here
            reply, reply_tensors = await asyncio.shield(running)
            return {**reply, "route": route + reply["route"]}, reply_tensors
        answer = ledger.answer(mb_id)
        if answer is not None:  # answered recently: the same answer, nothing computed or counted again
            return {**answer.reply, "route": route + answer.reply["route"]}, answer.tensors
        count = not ledger.was_counted(mb_id)
        ledger.num_recomputed += not count
        ledger.begin(mb_id)
        try:
            reply, reply_tensors = await self._compute(mb_id, route, path, batch_size, activations, targets, count=count,
                                                       fingerprint=fingerprint, batch=batch)
        except BaseException as e:
            ledger.fail(mb_id, e)
            raise
        ledger.finish(mb_id, {**reply, "route": reply["route"][len(route):]}, reply_tensors)
        return {**reply, "queue": ahead}, reply_tensors

    def _check_forward_tensors(self, tensors: list[torch.Tensor], batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec, stage, n = self.stage.spec, self.stage, self.codec.num_wire_tensors
        if len(tensors) != n + 1:
            raise ProtocolError(f"a forward request carries {n + 1} tensors (activations as the run's "
                                f"{self.codec.name} boundary codec sends them, targets), got {len(tensors)}")
        shape, dtype = request_ids_layout(spec, batch_size)  # a subspace run's: the whole window
        targets = require_tensor(tensors, n, dtype=dtype, shape=shape, name="targets")
        if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= spec.model.vocab_size):
            raise ProtocolError("targets hold token ids outside the vocabulary")
        activations = self.codec.decode_activations(tensors[:n], targets, shape=stage.input_shape(batch_size),
                                                    dtype=activation_dtype(spec))
        return activations, targets  # decoded: finite, of the spec's shape and dtype

    async def _compute(
        self, mb_id: str, route: list, path: list[str] | None, batch_size: int,
        activations: torch.Tensor, targets: torch.Tensor, *, count: bool, fingerprint: bool = False,
        batch: int | None = None,
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """This stage's forward and backward of one microbatch (through the rest of the pipeline);
        with ``fingerprint``, the reply also carries the outputs' fingerprint and the weights' tag."""
        stage = self.stage
        if stage.is_last:
            targets = scored_targets(stage.spec, targets)
            loss, grad, prints, tag = await stage.forward_loss_backward_fingerprinted(activations, targets, accumulate=count,
                                                                                      batch=batch)
            if not math.isfinite(loss):
                raise ProtocolError("the activations give a non-finite loss")
            self._counted(mb_id, batch_size, count, loss)
            if count:
                self.on_microbatch({"mb_id": mb_id, "loss": loss, "route": route, "samples": batch_size})
            if fingerprint:
                return {"ok": True, "loss": loss, "route": route, "weights": tag}, [*self.codec.encode(grad), prints]
            return {"ok": True, "loss": loss, "route": route}, self.codec.encode(grad)
        local_id = f"{mb_id}#{next(self._local_ids)}"
        outputs, prints, tag = await stage.forward_fingerprinted(local_id, activations, batch=batch)
        try:
            request = {"mb_id": mb_id, "route": route, "batch_size": batch_size, **({"path": path} if path else {}),
                       **({"batch": batch} if batch is not None else {})}
            reply, reply_tensors = await self.router.forward(request, [outputs, targets])
            grad_outputs = require_tensor(reply_tensors, 0, dtype=activation_dtype(stage.spec), shape=tuple(outputs.shape), name="gradient")
            reply_route = reply.get("route")
            if not isinstance(reply_route, list) or reply_route[:len(route)] != route:
                raise ProtocolError(f"the next stage answered {mb_id} with a route that does not extend ours")
        except BaseException:
            await stage.drop(local_id)
            raise
        grad = await stage.backward(local_id, grad_outputs, accumulate=count)
        self._counted(mb_id, batch_size, count)
        if fingerprint:
            return {"ok": True, "loss": reply.get("loss"), "route": reply_route, "weights": tag}, [*self.codec.encode(grad), prints]
        return {"ok": True, "loss": reply.get("loss"), "route": reply_route}, self.codec.encode(grad)

    async def _evaluate(self, mb_id: str, route: list, batch_size: int, activations: torch.Tensor,
                        targets: torch.Tensor) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """A held-out microbatch: this stage's forward on its current weights, then the rest of the
        pipeline's; the reply carries the last stage's loss and no tensor."""
        stage = self.stage
        if stage.is_last:
            loss = await stage.evaluate(activations, scored_targets(stage.spec, targets))
            if not math.isfinite(loss):
                raise ProtocolError("the activations give a non-finite loss")
            return {"ok": True, "loss": loss}, []
        outputs = await stage.evaluate(activations)
        route = [*route, [self.peer_id, stage.index, stage.version]]
        request = {"mb_id": mb_id, "route": route, "batch_size": batch_size, "kind": "eval"}
        reply, _ = await self.router.forward(request, [outputs, targets])
        return {"ok": True, "loss": reply.get("loss")}, []

    def _counted(self, mb_id: str, batch_size: int, count: bool, loss: float | None = None) -> None:
        if count:
            if self.ledger is not None:
                self.ledger.count(mb_id)
            self.stage.record_microbatch(batch_size, loss)
            self.on_event("accumulated", mb_id=mb_id, samples=batch_size)


def _check_forward_header(header: dict[str, Any], max_batch: int, stage: int, num_stages: int) -> tuple[str, list, int, list[str] | None]:
    mb_id, route, batch_size = header.get("mb_id"), header.get("route"), header.get("batch_size")
    path = header.get("path")
    if path is not None and not (isinstance(path, list) and len(path) == num_stages - 1
                                 and all(isinstance(p, str) and len(p) <= 128 for p in path)):
        raise ProtocolError(f"path must list {num_stages - 1} peer ids (one per stage after the first)")
    if not isinstance(mb_id, str) or not 1 <= len(mb_id) <= 128:
        raise ProtocolError("mb_id must be a string of 1-128 characters")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or not 1 <= batch_size <= max_batch:
        raise ProtocolError(f"batch_size must be an integer in [1, {max_batch}]")
    if not isinstance(route, list) or not 1 <= len(route) <= MAX_ROUTE_HOPS:
        raise ProtocolError("route must be a non-empty list of hops")
    for position, hop in enumerate(route):
        if not (isinstance(hop, list) and len(hop) == 3 and isinstance(hop[0], str) and 1 <= len(hop[0]) <= 128
                and type(hop[1]) is int and hop[1] == position and type(hop[2]) is int and 0 <= hop[2] < 2**53):
            raise ProtocolError(f"route hop {position} must be [peer_id, {position}, version], got {hop!r:.100}")
    if len(route) != stage:
        raise ProtocolError(f"a microbatch for stage {stage} must have visited {stage} stages, its route has {len(route)}")
    return mb_id, route, batch_size, path
