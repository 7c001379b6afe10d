"""Stage 0's training loop: draw microbatches from the data and push them through the pipeline.

Keeps up to ``max_in_flight`` microbatches in the pipeline at once, so that while stage k works on
one microbatch, stage k+1 works on another (pipelining by concurrency rather than a global
schedule; every stage drains before it steps, see :mod:`swarm.stage`). A microbatch that no peer
of the next stage could take releases its graph and is drawn again later; nothing is counted until
its gradient came back.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from swarm.data import TokenSampler
from swarm.router import NoPeerAvailableError, Router
from swarm.stage import Stage

logger = logging.getLogger(__name__)
NO_PEER_BACKOFF = 0.5
PAUSE_POLL_PERIOD = 0.2  # how soon a paused trainer notices it was resumed, seconds


class Trainer:
    """Injects microbatches at stage 0 and applies the gradients that come back."""

    def __init__(
        self,
        stage: Stage,
        sampler: TokenSampler,
        router: Router | None,
        *,
        peer_id: str,
        max_in_flight: int,
        on_microbatch: Callable[[dict[str, Any]], None] = lambda event: None,
    ) -> None:
        if not stage.is_first:
            raise ValueError("only stage 0 owns data and injects microbatches")
        if (router is None) != stage.is_last:
            raise ValueError("a multi-stage pipeline needs a router to stage 1")
        self.stage, self.sampler, self.router = stage, sampler, router
        self.peer_id, self.max_in_flight, self.on_microbatch = peer_id, max_in_flight, on_microbatch
        self.num_unrouted = 0
        self.is_paused = False  # injects no new microbatch while set; in-flight ones finish
        self._ids = itertools.count()

    async def run(self, stop: asyncio.Event) -> None:
        """Train until ``stop`` is set; then let in-flight microbatches finish."""
        async with asyncio.TaskGroup() as group:
            for lane in range(self.max_in_flight):
                group.create_task(self._lane(stop, lane))

    async def _lane(self, stop: asyncio.Event, lane: int) -> None:
        await asyncio.sleep(0.05 * lane)  # stagger lanes so they do not hit the pipeline in lockstep
        while not stop.is_set():
            if self.is_paused:
                await asyncio.sleep(PAUSE_POLL_PERIOD)
                continue
            try:
                await self.run_microbatch()
            except NoPeerAvailableError as e:
                self.num_unrouted += 1
                logger.debug(str(e))
                await asyncio.sleep(NO_PEER_BACKOFF)

    async def run_microbatch(self) -> float:
        """One microbatch through the whole pipeline and back; returns its loss."""
        stage, batch_size = self.stage, self.stage.spec.microbatch_size
        inputs, targets = self.sampler.sample(batch_size)
        mb_id = f"{self.peer_id[-8:]}:{next(self._ids)}"
        started = time.monotonic()
        if self.router is None:  # a single-stage run: stage 0 is also the last
            loss, _ = await stage.forward_loss_backward(inputs, targets)
            route = [[self.peer_id, 0, stage.version]]
        else:
            outputs = await stage.forward(mb_id, inputs)
            route = [[self.peer_id, 0, stage.version]]
            try:
                reply, grads = await self.router.forward({"mb_id": mb_id, "route": route, "batch_size": batch_size}, [outputs, targets])
                if len(grads) != 1 or grads[0].shape != outputs.shape:
                    raise NoPeerAvailableError(f"stage 1 returned a malformed gradient for {mb_id}")
            except BaseException:
                await stage.drop(mb_id)
                raise
            await stage.backward(mb_id, grads[0])
            loss, route = float(reply.get("loss", float("nan"))), reply.get("route", route)
        stage.record_microbatch(batch_size, loss)
        self.on_microbatch({"mb_id": mb_id, "loss": loss, "route": route, "samples": batch_size,
                            "tokens": batch_size * stage.spec.model.seq_len,
                            "seconds": time.monotonic() - started})
        return loss
