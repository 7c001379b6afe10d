"""hivemind's butterfly all-reduce with a robust reducer: each part's reducer applies :mod:`swarm.robust`.

In hivemind's all-reduce every member reduces one part of the flattened tensors: all members send it
their copy of that part, it sums them as they arrive (``TensorPartReducer``) and sends each sender
``average - its copy``, which the sender adds to its tensors. :class:`RobustPartReducer` keeps every
sender's copy instead of a running sum and, once all live senders delivered, combines them with
:func:`swarm.robust.aggregate`, rows in sender order. A sender whose part has a NaN or an infinity is
refused for that part, in every method (a NaN in a sum would reach every replica).

Every member still ends with the same bytes. One peer reduces each part and sends the same result to
all, and the result is rounded to float32 before it goes out: the replicas' float64 copies of float32
tensors then compute ``local + (result - local)`` exactly, as with hivemind's own float32 accumulator
(see :mod:`swarm.averaging`).

Sender weights are ignored: a peer's claimed weight is remote input, and a Byzantine one could claim
a huge one. Each sender counts once. (Murmuration never sets weights.)

A part left short: when a round began with three or more senders but fewer than three of them
delivered a part (a sender timed out or failed), the two copies that remain cannot out-vote each
other, and their mean would hand a Byzantine one half the say. (A copy that *arrived* with a NaN is
different: that sender is the faulty one, and the finite copies left are averaged.) The reducer's own copy is then the
result (each peer trusts its own state; a Byzantine reducer could send anything anyway), so every
member still gets the same bytes; a reducer with no copy of its own (an aux peer) fails the part,
and every sender keeps its own copy of it.

What this does not defend against: a Byzantine *reducer*, which can send any result for the part it
reduces. BTARD (Gorbunov et al. 2022) adds verification of reducers for that; docs/robust-averaging.md.

Reports: when a round refused or out-voted anyone, the reducer puts one summary on a queue the main
process drains (:class:`RobustAverager`), because the averager runs in a child process.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing as mp
import queue
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.utils.asyncio import as_aiter, azip

from dht.clock import SYSTEM_CLOCK
from swarm.robust import AGGREGATIONS, MIN_ROBUST_ROWS, RobustConfig, aggregate

logger = logging.getLogger(__name__)
Report = dict[str, Any]


class RobustPartReducer(TensorPartReducer):
    """``TensorPartReducer`` that keeps every sender's part and reduces with a robust aggregate."""

    def __init__(
        self, part_shapes: Sequence[torch.Size], num_senders: int, *, method: str, sender_ids: Sequence[str],
        on_report: Callable[[Report], None], config: RobustConfig = RobustConfig(), own_index: int | None = None,
    ) -> None:
        if method not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {method!r}")
        self.method, self.config, self.sender_ids, self.on_report = method, config, tuple(sender_ids), on_report
        self.own_index = own_index  # this reducer's own row among the senders, if it sends too
        self.num_short = 0  # parts of a round of 3+ senders that fewer than 3 delivered (module docstring)
        self.num_refused = [0] * num_senders
        self.num_outvoted = [0] * num_senders
        self.max_spreads = [0.0] * num_senders  # the farthest each sender was from a result, in median distances
        self._parts: dict[int, torch.Tensor] = {}
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        self.accumulator = None  # the base class's running sum is not used: the parts are kept whole
        self._parts = {}

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """Keep ``tensor_part``, wait for every other live sender's copy, return the aggregate.

        Raises:
            AllreduceException: a part of the wrong shape or dtype (the runner then bans the sender),
                or a part nobody sent a finite copy of.
        """
        if not (0 <= sender_index < self.num_senders and 0 <= part_index < self.num_parts):
            raise AllreduceException(f"part {part_index} of sender {sender_index} is out of range")
        expected = self.part_shapes[part_index]
        if tensor_part.shape != expected or not tensor_part.is_floating_point():
            raise AllreduceException(f"sender {self.sender_ids[sender_index]} sent a {tensor_part.dtype} part of "
                                     f"shape {list(tensor_part.shape)}, expected {list(expected)}")
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # earlier parts are still being reduced
            finished = asyncio.create_task(self.finished.wait())
            try:
                await asyncio.wait({self.current_part_future, finished}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                finished.cancel()
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != math.inf:
            raise BannedException(f"sender {sender_index} was banned in background")
        future = self.current_part_future
        self._parts[sender_index] = tensor_part.detach().reshape(-1).to(torch.float64)
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        return await future

    def check_current_part_finished(self) -> None:
        if self.current_part_accumulated_from < self.num_current_senders:
            return
        future = self.current_part_future
        if not self._parts:
            future.cancel()  # every sender of this part failed before sending it: nobody waits for it
        else:
            try:
                future.set_result(self._reduce())
            except ValueError as e:  # not one finite copy: the round fails for everyone, nothing changes
                future.set_exception(AllreduceException(f"part {self.current_part_index}: {e}"))
        self.reset_accumulators()

    def _reduce(self) -> torch.Tensor:
        senders = sorted(self._parts)
        rows = torch.stack([self._parts[i] for i in senders])
        if self.method != "mean" and self.num_senders >= MIN_ROBUST_ROWS > len(senders):
            return self._short_part(senders, torch.isfinite(rows).all(dim=1))
        result = aggregate(rows, self.method, self.config)
        for row in result.refused:
            self.num_refused[senders[row]] += 1
        for row in result.outliers:
            self.num_outvoted[senders[row]] += 1
        for row, spread in enumerate(result.spreads):
            if math.isfinite(spread):
                self.max_spreads[senders[row]] = max(self.max_spreads[senders[row]], spread)
        # float32 rounding: every replica then reconstructs the result exactly (module docstring)
        rounded = result.value.to(torch.float32).to(torch.float64)
        return rounded.reshape(self.part_shapes[self.current_part_index])

    def _short_part(self, senders: list[int], finite: torch.Tensor) -> torch.Tensor:
        """A part of a robust round that fewer than three senders delivered: this reducer's own copy."""
        self.num_short += 1
        for row, ok in enumerate(finite.tolist()):
            if not ok:
                self.num_refused[senders[row]] += 1
        if self.own_index not in self._parts or not bool(torch.isfinite(self._parts[self.own_index]).all()):
            raise ValueError(f"only {len(senders)} of {self.num_senders} senders delivered, and this reducer has no "
                             "finite copy of its own to keep")
        own = self._parts[self.own_index].to(torch.float32).to(torch.float64)  # float32-exact, as in _reduce
        return own.reshape(self.part_shapes[self.current_part_index])

    def finalize(self) -> None:
        if not self.finished.is_set() and (any(self.num_refused) or any(self.num_outvoted) or self.num_short):
            self.on_report({
                "aggregation": self.method, "num_parts": self.num_parts, "short_parts": self.num_short,
                "refused": {p: n for p, n in zip(self.sender_ids, self.num_refused) if n},
                "outvoted": {p: n for p, n in zip(self.sender_ids, self.num_outvoted) if n},
                "max_spread": {p: round(x, 2) for p, x in zip(self.sender_ids, self.max_spreads)},
            })
        super().finalize()


class RobustAllReduceRunner(AllReduceRunner):
    """``AllReduceRunner`` whose local part is reduced by a :class:`RobustPartReducer`."""

    def __init__(self, *, aggregation: str, on_report: Callable[[Report], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # the base class built a plain reducer; mark it finished so that dropping it logs nothing
        self.tensor_part_reducer.finished.set()
        self.tensor_part_reducer = RobustPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging), len(self.sender_peer_ids),
            method=aggregation, sender_ids=[str(p) for p in self.sender_peer_ids], on_report=on_report,
            own_index=self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None,
        )


class RobustAverager(DecentralizedAverager):
    """``DecentralizedAverager`` that runs :class:`RobustAllReduceRunner`; reports come out of :meth:`reports`.

    It speaks under hivemind's own RPC names, so it still averages with a plain ``DecentralizedAverager``
    (whose parts are then reduced by the plain mean).
    """

    def __init__(self, averaged_tensors: Sequence[torch.Tensor], dht: Any, *, aggregation: str, **kwargs: Any) -> None:
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {', '.join(AGGREGATIONS)}")
        # set before the base class starts the averager's process (start=True), which inherits them
        self.aggregation = aggregation
        self._reports: mp.Queue = mp.Queue()
        super().__init__(averaged_tensors, dht, **kwargs)

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return DecentralizedAverager._get_handle_name(namespace, method_name)

    def reports(self) -> list[Report]:
        """The reports of rounds that refused or out-voted a sender, since the last call (main process)."""
        found = []
        while True:
            try:
                found.append(self._reports.get_nowait())
            except queue.Empty:
                return found

    def _report(self, report: Report) -> None:  # in the averager's process
        logger.debug(f"robust averaging report: {report}")
        self._reports.put(report)

    async def _shutdown(self, timeout: float | None) -> None:
        """hivemind 1.1.12's ``_shutdown`` calls ``finalize`` on ``_running_groups``' values, which are
        futures of runners: whenever a round ran at shutdown, its thread died on an AttributeError
        (a traceback in every such peer's log). Here the runner is finalized, or its future cancelled."""
        if not self.client_mode:
            await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        for future in list(self._running_groups.values()):
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().finalize(cancel=True)
            else:
                future.cancel()

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs) -> None:
        """hivemind 1.1.12's method with :class:`RobustAllReduceRunner` in place of ``AllReduceRunner``."""
        group_id = group_info.group_id if group_id is None else group_id
        runner = RobustAllReduceRunner(
            aggregation=self.aggregation, on_report=self._report, p2p=self._p2p, servicer_type=type(self),
            prefix=self.prefix, tensors=tensors, group_id=group_id, ordered_peer_ids=group_info.peer_ids, **kwargs,
        )
        if group_id not in self._running_groups:
            raise AllreduceException(f"group {group_id!r} was not registered")
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
            return
        async for tensor, update in azip(as_aiter(*tensors), runner):
            tensor.add_(update, alpha=self._averaging_alpha)
            self.last_updated = SYSTEM_CLOCK.dht_time()  # hivemind's field, on hivemind's clock (the machine's)
            self._state_updated.set()
        parts = runner.tensor_part_container
        if parts.failed_size:
            # a reducer failed this member (a stream cut or timed out, e.g. on a loaded host): hivemind
            # then keeps this member's own values for that reducer's parts, so its copy differs from
            # every other member's, and it would serve other bytes under the round's version. The round
            # fails here instead (StageAverager keeps the pre-round state and publishes nothing).
            raise AllreduceException(f"a reducer failed: {parts.failed_size} of {parts.total_size} averaged values "
                                     "did not arrive")
