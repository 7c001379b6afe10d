"""Nothing lost, nothing counted twice: stage 0's task pool and every replica's microbatch ledger.

A microbatch is a *task* (seed 000 "Task pool"). Stage 0 draws it from the data once, gives it an id
and a planned path (one peer per later stage), and keeps it until its gradient came back. If its route
breaks anywhere, the task goes back to the :class:`TaskPool` and is sent again later with the same
id, the same data and the same path: it is *replayed*, never dropped and never re-drawn.

Each hop holds its inputs until the downstream hop answered (its graph is still alive), so a failed
hop is re-dispatched right there to another replica of the next stage (:mod:`swarm.router`). What
makes re-delivery safe is the :class:`MicrobatchLedger` every stage replica keeps: by microbatch id,
what it is computing now, the replies it sent recently, and which ids it already *counted* (added the
weight gradient to its batch). A request for an id

- in progress here waits for that computation and gets its answer (nothing computed twice);
- answered recently gets the cached answer (nothing computed or counted twice, nothing sent further);
- counted long ago (its answer evicted) is computed again for its input gradient only, and the
  weight gradient is not added again.

Replays follow the task's planned path, and a hop whose planned peer is gone picks its substitute
deterministically from the microbatch id (:func:`swarm.router.substitute_order`), so a replay reaches
the replicas that already counted the microbatch. The invariant this buys, checked end to end by the
tests and ``bench/churn.py`` from the ``accumulated`` events: every completed microbatch is counted
exactly once at every stage, and no microbatch is counted twice by two replicas of one stage.
What a crash still costs is the crashed replica's own accumulated work (its gradients and the local
steps it took since the stage's last averaging round), which is the crashed peer's compute.

The baseline ``restart`` recovery (what SWARM does) turns all of this off: no ledger, no retry at the
failed hop; the microbatch goes back to stage 0 and starts over on a new path.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dht.clock import SYSTEM_CLOCK
from dht.rpc import Declined

CACHE_BYTES = 32 << 20  # answers kept for re-deliveries, per replica
CACHE_TTL = 120.0  # seconds an answer stays cached (a replay comes within a few request deadlines)
MAX_COUNTED_IDS = 1 << 17  # ids remembered as counted (~10 MB): far beyond any replay horizon


@dataclass
class Task:
    """A microbatch stage 0 owns until its gradient is back."""

    mb_id: str
    inputs: torch.Tensor
    targets: torch.Tensor
    path: list[str] | None = None  # planned peer of stages 1..n-1 (replay mode); None: chosen per hop
    attempt: int = 0  # 0 for the first dispatch, then one more per replay
    last_error: str = ""

    @property
    def batch_size(self) -> int:
        return int(self.inputs.shape[0])


class TaskPool:
    """Stage 0's microbatches whose route broke, waiting to be replayed (first in, first out).

    Replays go before new draws, after ``backoff(attempt)`` seconds, so a broken pipeline is retried
    without spinning. Nothing leaves the pool but by being taken for a replay.
    """

    def __init__(self, *, clock: Callable[[], float] = SYSTEM_CLOCK, base_backoff: float = 0.25, max_backoff: float = 4.0) -> None:
        self.clock, self.base_backoff, self.max_backoff = clock, base_backoff, max_backoff
        self._waiting: collections.deque[tuple[float, Task]] = collections.deque()
        self.num_replays = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def backoff(self, attempt: int) -> float:
        return min(self.max_backoff, self.base_backoff * 2 ** max(0, attempt - 1))

    def put_back(self, task: Task, error: str) -> None:
        task.attempt += 1
        task.last_error = error
        self._waiting.append((self.clock() + self.backoff(task.attempt), task))

    def take_ready(self) -> Task | None:
        """The oldest task whose backoff has passed, or None."""
        if self._waiting and self._waiting[0][0] <= self.clock():
            self.num_replays += 1
            return self._waiting.popleft()[1]
        return None

    def next_ready_in(self) -> float:
        return max(0.0, self._waiting[0][0] - self.clock()) if self._waiting else math.inf

    def pending(self) -> list[Task]:
        return [task for _, task in self._waiting]


@dataclass
class _Answer:
    reply: dict[str, Any]  # the reply header, with "route" holding only the hops after this one
    tensors: list[torch.Tensor]
    nbytes: int
    at: float


class MicrobatchLedger:
    """One stage replica's memory of microbatch ids: in progress, answered recently, counted.

    ``begin(mb_id)`` must be followed by ``finish`` or ``fail``. Memory is bounded: answers by
    ``cache_bytes`` and ``cache_ttl``, counted ids by ``max_ids``.
    """

    def __init__(
        self, *, cache_bytes: int = CACHE_BYTES, cache_ttl: float = CACHE_TTL, max_ids: int = MAX_COUNTED_IDS,
        clock: Callable[[], float] = SYSTEM_CLOCK,
    ) -> None:
        self.cache_bytes, self.cache_ttl, self.max_ids, self.clock = cache_bytes, cache_ttl, max_ids, clock
        self._running: dict[str, asyncio.Future] = {}
        self._answers: collections.OrderedDict[str, _Answer] = collections.OrderedDict()
        self._answer_bytes = 0
        self._counted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.num_joined = 0  # re-deliveries that waited for a computation in progress
        self.num_cached = 0  # re-deliveries answered from the cache
        self.num_recomputed = 0  # re-deliveries of a counted id computed again without counting

    def running(self, mb_id: str) -> asyncio.Future | None:
        """The computation of ``mb_id`` in progress here, if any (a re-delivery joins it)."""
        future = self._running.get(mb_id)
        self.num_joined += future is not None
        return future

    def answer(self, mb_id: str) -> _Answer | None:
        self._expire()
        answer = self._answers.get(mb_id)
        if answer is not None:
            self.num_cached += 1
        return answer

    def was_counted(self, mb_id: str) -> bool:
        return mb_id in self._counted

    def begin(self, mb_id: str) -> None:
        if mb_id in self._running:
            raise ValueError(f"microbatch {mb_id} is already in progress here")
        self._running[mb_id] = asyncio.get_running_loop().create_future()

    def count(self, mb_id: str) -> None:
        """The microbatch's weight gradient was added to this replica's batch."""
        self._counted[mb_id] = None
        self._counted.move_to_end(mb_id)
        while len(self._counted) > self.max_ids:
            self._counted.popitem(last=False)

    def finish(self, mb_id: str, reply: dict[str, Any], tensors: Sequence[torch.Tensor]) -> None:
        tensors = list(tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        future = self._running.pop(mb_id)
        if not future.done():
            future.set_result((reply, tensors))
        if nbytes <= self.cache_bytes:
            self._answers.pop(mb_id, None)
            self._answers[mb_id] = _Answer(reply, tensors, nbytes, self.clock())
            self._answer_bytes += nbytes
            while self._answer_bytes > self.cache_bytes:
                self._evict()

    def fail(self, mb_id: str, error: BaseException) -> None:
        future = self._running.pop(mb_id, None)
        if future is not None and not future.done():
            if not isinstance(error, Exception):  # cancelled: those waiting get a refusal, not a cancellation
                error = Declined(f"the first delivery of {mb_id} was abandoned")
            future.set_exception(error)
            future.exception()  # retrieved: no "exception never retrieved" warning when nobody waits

    def _evict(self) -> None:
        _, answer = self._answers.popitem(last=False)
        self._answer_bytes -= answer.nbytes

    def _expire(self) -> None:
        horizon = self.clock() - self.cache_ttl
        while self._answers and next(iter(self._answers.values())).at < horizon:
            self._evict()
