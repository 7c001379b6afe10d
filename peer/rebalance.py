"""Rebalancing (DESIGN §1 step 8): when this peer is the one to move to the swarm's bottleneck stage.

Every ``--rebalance-period`` seconds each peer applies ``planner.stage_choice.choose_move`` to the
same records; only the peer it names moves, and only if the move raises the swarm's bottleneck
throughput by ``--rebalance-min-gain``. A peer that just arrived waits two periods (its rate is not
known yet), and nobody moves while peers are joining (they fill deficits themselves).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from dht.records import RunSpec
from peer.errors import UserError
from planner.reachability import RELAY_DELAY
from planner.stage_choice import StageMember, StageMove, choose_move
from swarm.model import stage_flops_per_sample
from swarm.view import SwarmView

logger = logging.getLogger(__name__)


class RebalanceWatch:
    """Names the move of this peer, once it is the one to move.

    Args:
        view: the peer's swarm view.
        spec: the run spec under the layout the peer trains under.
        peer_id: this peer's.
        period: seconds between looks (``--rebalance-period``).
        min_gain: the least gain of the bottleneck throughput that justifies a move.
        clock: monotonic seconds (the settling time after arriving).
        on_check: called with the swarm's move (or None) after each check that counted (settled, no
            joiner in view): the ``rebalance_checked`` event tests wait on instead of seconds.
    """

    def __init__(self, view: SwarmView, spec: RunSpec, *, peer_id: str, period: float, min_gain: float,
                 clock: Callable[[], float] = time.monotonic,
                 on_check: Callable[[StageMove | None], None] = lambda move: None) -> None:
        self.view, self.spec, self.peer_id = view, spec, peer_id
        self.period, self.min_gain, self.clock, self.on_check = period, min_gain, clock, on_check
        self.arrived = clock()
        self._costs = [stage_flops_per_sample(spec, k) for k in range(spec.num_stages)]

    def check(self, *, is_training: bool) -> StageMove | None:
        """This peer's move now, or None (not it, not yet, or no move gains enough)."""
        if not is_training or self.clock() - self.arrived < 2 * self.period:
            return None  # settle first: a peer that just arrived must not be moved on stale rates
        if any(r.state == "joining" for r in self.view.records):
            return None  # joiners are filling deficits themselves; decide once they have
        members = [StageMember(peer_id=r.peer_id, stage=r.stage, flops=r.flops, reachability=r.reachability)
                   for k in range(self.spec.num_stages) for r in self.view.members(k, states=("training", "syncing"))]
        move = choose_move(self._costs, members, min_gain=self.min_gain, microbatch_size=self.spec.microbatch_size,
                           relay_delay=RELAY_DELAY, pinned={r.peer_id for r in self.view.records if r.pinned})
        self.on_check(move)
        return move if move is not None and move.peer_id == self.peer_id else None

    async def wait(self, is_training: Callable[[], bool], check_memory: Callable[[int], None]) -> StageMove:
        """Returns once this peer is the one to move and the stage fits it (never otherwise)."""
        while True:
            await asyncio.sleep(self.period)
            move = self.check(is_training=is_training())
            if move is None:
                continue
            try:
                check_memory(move.to_stage)
            except UserError as e:  # the bottleneck stage does not fit this peer
                logger.info(f"not moving to stage {move.to_stage}: {e}")
                continue
            return move
