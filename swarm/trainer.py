"""Stage 0's training loop: draw microbatches from the data and push them through the pipeline.

Keeps several microbatches in the pipeline at once, so that while stage k works on one microbatch,
stage k+1 works on another (pipelining by concurrency rather than a global schedule). How many: with a
:class:`~swarm.flow_control.FlowWindow`, as many as the path's measured bandwidth × delay asks for
(between 1 and ``max_in_flight``, the memory bound; every microbatch that comes back, with the next
stage's compute queue from its reply, and every re-send tell it); without one, ``max_in_flight``.
The run spec's ``pipeline_schedule`` says what happens at a step: under ``flush`` (the
default) the microbatches of one batch are in flight together and the next batch is drawn only after
the stage stepped on this one, so no gradient is stale; under ``delayed`` microbatches keep flowing
across steps on the previous weight version (see :mod:`swarm.stage` and docs/convergence.md).

Every ``eval_every`` samples the trainer sends the fixed held-out set through the pipeline
(forward only) and reports the held-out loss as an ``eval`` event.

Every microbatch is a :class:`~swarm.task_pool.Task`: drawn once, kept until its gradient came back.
One whose route broke goes back to the :class:`~swarm.task_pool.TaskPool` and is replayed (same id,
same data, same planned path) before anything new is drawn; nothing is counted until its gradient
came back. With the ``restart`` baseline the replay starts over on a new path and nobody
de-duplicates (what SWARM does).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dht.clock import SYSTEM_CLOCK, Clock
from swarm.data import TokenSampler
from swarm.flow_control import FlowWindow
from swarm.router import NoPeerAvailableError, Router
from swarm.stage import Stage
from swarm.subspace import request_ids
from swarm.task_pool import Task, TaskPool

logger = logging.getLogger(__name__)
PAUSE_POLL_PERIOD = 0.2  # how soon a paused trainer notices it was resumed, seconds
MAX_REPORTED_QUEUE = 1 << 16  # a next stage's compute queue beyond this is nonsense (remote input): ignored


class Trainer:
    """Injects microbatches at stage 0, replays the broken ones and applies the gradients that come back."""

    def __init__(
        self,
        stage: Stage,
        sampler: TokenSampler,
        router: Router | None,
        *,
        peer_id: str,
        max_in_flight: int,
        on_microbatch: Callable[[dict[str, Any]], None] = lambda event: None,
        on_event: Callable[..., None] = lambda event, **fields: None,
        stage_flops: Sequence[float] = (),
        sticky: bool = True,
        heldout: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
        eval_every: int = 0,
        batch_slots: Callable[[int], Sequence[int]] | None = None,
        flow: FlowWindow | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not stage.is_first:
            raise ValueError("only stage 0 owns data and injects microbatches")
        if (router is None) != stage.is_last:
            raise ValueError("a multi-stage pipeline needs a router to stage 1")
        self.stage, self.sampler, self.router = stage, sampler, router
        self.peer_id, self.max_in_flight, self.on_microbatch = peer_id, max_in_flight, on_microbatch
        self.on_event = on_event
        self.stage_flops = list(stage_flops) or [1.0] * stage.spec.num_stages  # FLOP per sample of each stage
        self.sticky = sticky  # replay recovery: plan the path up front and keep it across replays
        self.clock = clock
        self.pool = TaskPool(clock=clock)
        self.in_flight: dict[str, Task] = {}
        self.num_unrouted = 0
        self.is_paused = False  # injects no new microbatch while set; in-flight ones finish
        self._ids = itertools.count()
        self._slots: collections.deque[int] | None = None  # flush: positions of the current batch not drawn yet
        self._batch = 0  # flush: the batch being drawn (the stage's weight version when it began)
        self._per_batch = 1  # flush: microbatches in that batch (its positions are 0 .. this - 1)
        self.heldout, self.eval_every = list(heldout), eval_every  # held-out microbatches, samples between evaluations
        self._next_eval, self._num_evals = 0, 0
        # replica_sync "gradients": this replica's positions in a swarm batch of that many microbatches
        # (swarm.gradient_sync.GradientSync.slots); None: the whole batch
        self.batch_slots = batch_slots
        self.last_val_loss = math.nan
        self.flow = flow  # None: always max_in_flight in flight
        self._window_changed = asyncio.Event()  # lanes beyond the window wait on it
        self._timeouts_seen = self._failures_seen = 0  # the router's timed-out and failed calls already told to it

    async def run(self, stop: asyncio.Event) -> None:
        """Train until ``stop`` is set; then let in-flight microbatches finish."""
        try:
            if self.stage.spec.pipeline_schedule == "flush":
                await self._run_flushed(stop)
            else:
                async with asyncio.TaskGroup() as group:
                    for lane in range(self.max_in_flight):
                        group.create_task(self._lane(stop, lane))
        finally:  # drawn, never completed (waiting for a replay, or cut off by a hard stop): reported, so a
            # run's accounting can tell them from lost ones
            pending = self.pool.pending() + list(self.in_flight.values())
            if pending:
                self.on_event("unfinished", mb_ids=[t.mb_id for t in pending], samples=sum(t.batch_size for t in pending))

    async def _run_flushed(self, stop: asyncio.Event) -> None:
        """The ``flush`` schedule: one batch at a time. Its microbatches run concurrently (up to the
        window, replays included) and the next batch starts only after the stage stepped on this
        one, so every gradient is computed on the current weights. Each batch ends with a
        ``batch_done`` event: how long its microbatches took (``pipeline_s``) and the step after
        them (``close_s``: the gradient exchange with co-replicas, or waiting for the step)."""
        stage = self.stage
        per_batch = -(-stage.spec.target_batch_size // stage.spec.microbatch_size)
        while not stop.is_set():
            await self.maybe_evaluate()
            share, batch, began = self.begin_batch(per_batch), self._batch, self.clock()
            async with asyncio.TaskGroup() as group:
                for lane in range(min(self.max_in_flight, share)):
                    group.create_task(self._lane(stop, lane))
            if stop.is_set() and self._slots:
                break  # stopped mid-batch: the co-replicas finish this batch without this replica
            drained = self.clock()
            if stage.exchanges_gradients:
                await stage.close_batch()
            else:
                await stage.wait_step_done()
            self.on_event("batch_done", batch=batch, microbatches=share, pipeline_s=round(drained - began, 4),
                          close_s=round(self.clock() - drained, 4))

    @property
    def window(self) -> int:
        """Microbatches to keep in flight now: lanes at or beyond it wait."""
        return self.max_in_flight if self.flow is None else min(self.max_in_flight, self.flow.window)

    def begin_batch(self, per_batch: int) -> int:
        """Start drawing the next batch (``flush``) of ``per_batch`` microbatches: this replica's
        positions in it (all of them unless the stage exchanges gradients with co-replicas), drawn by
        :meth:`next_task` from now on; returns how many."""
        stage = self.stage
        slots = self.batch_slots(per_batch) if stage.exchanges_gradients and self.batch_slots else range(per_batch)
        self._slots, self._batch, self._per_batch = collections.deque(slots), stage.version, per_batch
        return len(self._slots)

    async def _lane(self, stop: asyncio.Event, lane: int) -> None:
        await self.clock.sleep(0.05 * lane)  # stagger lanes so they do not hit the pipeline in lockstep
        while not stop.is_set():
            if self.is_paused:
                await self.clock.sleep(PAUSE_POLL_PERIOD)
                continue
            if self._slots is not None and not self._slots and not len(self.pool) and not self.in_flight:
                # flush: this batch is drawn and nothing of it waits for a replay, nor may come back as
                # one (a lane that left while another's call was out left that one's replay to lanes
                # beyond a window shrunk to 1: the batch waited until the peer left, ci33 2026-11-27)
                return
            if lane >= self.window:  # beyond the flow window: wait until it grows (or the batch ends)
                await self._wait_window_change()
                continue
            task = self.next_task()
            if task is None:  # only replays wait, not ready yet
                await self.clock.sleep(min(self.pool.next_ready_in(), PAUSE_POLL_PERIOD))
                continue
            try:
                await self.run_task(task)
            except NoPeerAvailableError as e:
                self.num_unrouted += 1
                logger.debug(str(e))
            if lane == 0 and self._slots is None:  # delayed: evaluate between this lane's microbatches
                await self.maybe_evaluate()

    async def _wait_window_change(self) -> None:
        self._window_changed.clear()
        try:
            await asyncio.wait_for(self._window_changed.wait(), timeout=PAUSE_POLL_PERIOD)
        except asyncio.TimeoutError:
            pass  # (a batch drained meanwhile, a pause: checked by the caller)

    def _tell_flow(self, seconds: float | None, reply: dict[str, Any] | None = None) -> None:
        """A microbatch came back after ``seconds`` (None: it has to be re-sent). A loss: a call to the
        next stage that timed out (a queue so long that answers came too late), or a re-send after a
        failed call; not a microbatch that found no peer to call at all (the next stage is not known yet)."""
        flow, router = self.flow, self.router
        if flow is None or router is None:
            return
        before = flow.window
        if router.num_timeouts > self._timeouts_seen or (seconds is None and router.num_failures > self._failures_seen):
            flow.on_loss()
        self._timeouts_seen, self._failures_seen = router.num_timeouts, router.num_failures
        if seconds is not None:
            queue = (reply or {}).get("queue")
            valid = type(queue) is int and 0 <= queue <= MAX_REPORTED_QUEUE
            flow.on_round_trip(seconds, in_flight=len(self.in_flight), queue=queue if valid else None)
        if flow.window != before:
            self._window_changed.set()
            estimate = flow.estimate()
            self.on_event("flow_window", window=flow.window, before=before, min_rtt=estimate.min_rtt,
                          srtt=estimate.srtt, bdp=estimate.bdp, queued=estimate.queued, losses=flow.num_losses)

    async def maybe_evaluate(self) -> None:
        """Evaluate the held-out loss if ``eval_every`` samples passed since the last evaluation."""
        if not self.eval_every or not self.heldout or self.stage.counters.num_samples < self._next_eval:
            return
        samples = self.stage.counters.num_samples
        try:
            val_loss = await self.evaluate()
        except NoPeerAvailableError as e:
            logger.debug(f"held-out evaluation failed, retried after the next microbatches: {e}")
            return
        self._next_eval = samples + self.eval_every
        self.last_val_loss = val_loss
        self.on_event("eval", samples=samples, val_loss=val_loss, num_sequences=sum(len(x) for x, _ in self.heldout))

    async def evaluate(self) -> float:
        """The held-out loss of the pipeline's current weights: the token-weighted mean over
        ``heldout``, each microbatch sent through every stage as ``"kind": "eval"`` (forward only)."""
        self._num_evals += 1
        losses = await asyncio.gather(*(self._evaluate_microbatch(f"{self.peer_id[-8:]}:eval{self._num_evals}.{i}", x, y)
                                        for i, (x, y) in enumerate(self.heldout)))
        tokens = [x.numel() for x, _ in self.heldout]
        return sum(loss * n for loss, n in zip(losses, tokens)) / sum(tokens)

    async def _evaluate_microbatch(self, mb_id: str, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        if self.router is None:
            return await self.stage.evaluate(inputs, targets)
        outputs = await self.stage.evaluate(inputs)
        header = {"mb_id": mb_id, "route": [[self.peer_id, 0, self.stage.version]], "batch_size": len(inputs), "kind": "eval"}
        reply, _ = await self.router.forward(header, [outputs, request_ids(self.stage.spec, inputs, targets)])
        loss = reply.get("loss")
        if not isinstance(loss, float) or not math.isfinite(loss):
            raise NoPeerAvailableError(f"stage 1 answered the held-out microbatch {mb_id} with no usable loss: {loss!r:.50}")
        return loss

    def next_task(self) -> Task | None:
        """A replay whose backoff passed, else a new microbatch; None while replays wait their backoff
        and the pool holds as many as there are lanes (the pipeline is broken: draw nothing new)."""
        task = self.pool.take_ready()
        if task is not None:
            self.on_event("replayed", mb_id=task.mb_id, attempt=task.attempt, reason=task.last_error[:200])
            if not self.sticky:
                task.path = None  # the baseline starts over on a new route
            return task
        if len(self.pool) >= self.max_in_flight or (self._slots is not None and not self._slots):
            return None
        return self.new_task(None if self._slots is None else self._slots.popleft())

    def new_task(self, slot: int | None = None) -> Task:
        """A new microbatch. Under ``replica_sync = "gradients"`` the one at position ``slot`` of the
        batch being drawn, the same in every process (:meth:`TokenSampler.sample_slot`); otherwise
        (or without a ``slot``) the next of this peer's own draws."""
        spec = self.stage.spec
        if slot is not None and self.stage.syncs_gradients:
            inputs, targets = self.sampler.sample_slot(spec.microbatch_size, seed=spec.seed, batch=self._batch, slot=slot,
                                                       slots=self._per_batch)
        else:
            inputs, targets = self.sampler.sample(spec.microbatch_size)
        task = Task(f"{self.peer_id[-8:]}:{next(self._ids)}", inputs, targets)
        self.on_event("injected", mb_id=task.mb_id, samples=task.batch_size,
                      **({"batch": self._batch, "slot": slot} if slot is not None else {}))
        return task

    async def run_microbatch(self) -> float:
        """One new microbatch through the whole pipeline and back; returns its loss."""
        return await self.run_task(self.new_task())

    async def run_task(self, task: Task) -> float:
        """``task`` through the whole pipeline and back; returns its loss. If no peer of stage 1 took
        it, it goes back to the pool and :class:`NoPeerAvailableError` is raised."""
        stage, batch_size = self.stage, task.batch_size
        started = self.clock()
        self.in_flight[task.mb_id] = task
        try:
            if self.router is None:  # a single-stage run: stage 0 is also the last
                loss, _ = await stage.forward_loss_backward(task.inputs, task.targets)
                route = [[self.peer_id, 0, stage.version]]
            else:
                reply = await self._through_pipeline(task)
                loss, route = float(reply.get("loss", float("nan"))), reply["route"]
                self._tell_flow(self.clock() - started, reply)
        finally:
            del self.in_flight[task.mb_id]
        stage.record_microbatch(batch_size, loss)
        self.on_event("accumulated", mb_id=task.mb_id, samples=batch_size)
        self.on_microbatch({"mb_id": task.mb_id, "loss": loss, "route": route, "samples": batch_size,
                            "tokens": batch_size * stage.spec.model.seq_len, "attempts": task.attempt + 1,
                            "seconds": self.clock() - started, "window": self.window})
        return loss

    async def _through_pipeline(self, task: Task) -> dict[str, Any]:
        """``task`` to the next stage and its gradient back through this stage; the next stage's reply."""
        stage, router = self.stage, self.router
        if self.sticky and task.path is None:
            task.path = router.plan_path(self.stage_flops)
        path = task.path or []
        outputs = await stage.forward(task.mb_id, task.inputs)
        route = [[self.peer_id, 0, stage.version]]
        header = {"mb_id": task.mb_id, "route": route, "batch_size": task.batch_size, "batch": stage.version,
                  **({"path": path} if path else {})}
        try:
            with router.reserved_path(path):
                reply, grads = await router.forward(header, [outputs, request_ids(stage.spec, task.inputs, task.targets)])
            if len(grads) != 1 or grads[0].shape != outputs.shape:
                raise NoPeerAvailableError(f"stage 1 returned a malformed gradient for {task.mb_id}")
        except NoPeerAvailableError as e:
            await stage.drop(task.mb_id)
            self.pool.put_back(task, str(e))
            self._tell_flow(None)
            raise
        except BaseException:
            await stage.drop(task.mb_id)
            raise
        try:
            await stage.backward(task.mb_id, grads[0])
        except ValueError as e:  # a gradient that would poison the stage: replay the microbatch
            logger.warning(f"microbatch {task.mb_id} came back with an unusable gradient: {e}")
            self.pool.put_back(task, str(e))
            raise NoPeerAvailableError(f"microbatch {task.mb_id} came back with an unusable gradient") from e
        return reply if "route" in reply else {**reply, "route": route}
