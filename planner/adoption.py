"""Whether a running swarm moves to a global plan: only for a clear gain that pays back its moves (issue #18).

The swarm as it runs is a plan too (:func:`layout_plan`): its layer ranges, each stage's reliable
members its servers and its unreliable ones its clients. A proposed plan (from
``planner.global_plan.plan_global`` on the same snapshot) is adopted when, under the one cost model
(``planner.costs.estimate_throughput``):

1. it is more than ``min_gain`` faster than the swarm as it runs, and
2. what its moves cost is paid back within ``horizon`` seconds. A peer whose new layers are not all
   layers it holds now pulls the state of the others (parameters and two AdamW moments:
   ``STATE_BYTES_PER_PARAM_BYTE`` times their parameter bytes) from the current holders of each old
   stage they come from, one old stage after another (as ``peer.relayout.gather_pieces`` pulls), each
   over the fastest link from it to one of that stage's holders. The pulls of different peers run at
   once, and the swarm is counted as stopped until the slowest ends (``move_seconds``: an
   over-estimate, since peers that keep their layers keep training). The samples lost,
   ``current × move_seconds``, must be made up by the gain: ``lost <= (planned - current) × horizon``.

A swarm the cost model cannot score as it runs (a stage with no reliable member) scores 0: any plan
that runs pays back at once. A plan with layers nobody holds now is never adopted (their state
would be lost; a stage without holders is for the rescue and re-planning rules, ``planner.backup_plan``
and ``planner.replanning``). Everything here is a pure function of its arguments, so peers
holding the same snapshot reach the same verdict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from planner.costs import estimate_throughput
from planner.plan import Plan, Stage
from planner.snapshot import SwarmSnapshot

STATE_BYTES_PER_PARAM_BYTE = 3.0  # parameters and AdamW's two moments travel; gradients do not


@dataclass(frozen=True, kw_only=True)
class AdoptionConfig:
    """Attributes:
        min_gain: the plan must be more than ``1 + min_gain`` times as fast as the swarm as it runs.
        horizon: seconds within which the gain must make up the samples the moves cost.
    """

    min_gain: float = 0.2
    horizon: float = 1800.0

    def __post_init__(self) -> None:
        if not (self.min_gain >= 0 and math.isfinite(self.min_gain)) or not self.horizon > 0:
            raise ValueError(f"min_gain must be finite and >= 0 and horizon > 0, got {self.min_gain}, {self.horizon}")


@dataclass(frozen=True, kw_only=True)
class Move:
    """One peer's new layers and what fetching their state costs.

    Attributes:
        peer_id: the peer.
        layers: its layer range in the plan.
        held: the layer range it holds now (None: it holds none).
        num_bytes: state bytes it must pull (its new layers outside ``held``).
        seconds: how long the pulls take over the links of the snapshot.
    """

    peer_id: str
    layers: tuple[int, int]
    held: tuple[int, int] | None
    num_bytes: float
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Adoption:
    """The verdict on one proposed plan.

    Attributes:
        plan: the proposed plan.
        current: samples/s of the swarm as it runs (0 when it cannot be scored).
        planned: samples/s of ``plan``.
        moves: the peers that pull state to follow the plan.
        move_seconds: the slowest move (0 without moves).
        payback_seconds: seconds of the gain that make up the samples lost while moving (inf without a gain).
        adopt: whether the swarm moves to the plan.
        reason: one sentence saying why (or why not).
    """

    plan: Plan
    current: float
    planned: float
    moves: tuple[Move, ...]
    move_seconds: float
    payback_seconds: float
    adopt: bool
    reason: str

    @property
    def gain(self) -> float:
        """``planned / current`` (inf when the swarm as it runs scores 0)."""
        return self.planned / self.current if self.current > 0 else math.inf


def layout_plan(stage_layers: Sequence[tuple[int, int]], stage_of: Mapping[str, int],
                snapshot: SwarmSnapshot) -> Plan | None:
    """The swarm as it runs: ``stage_of`` maps each member to its stage of ``stage_layers``; None when
    a stage has no reliable member (the cost model needs a server per stage)."""
    stages = []
    for k, (start, end) in enumerate(stage_layers):
        members = sorted(p for p, s in stage_of.items() if s == k and p in snapshot.index_by_peer_id)
        reliable = [p for p in members if snapshot.devices[snapshot.index_by_peer_id[p]].is_reliable]
        if not reliable:
            return None
        stages.append(Stage(layer_start=start, layer_end=end, server_ids=tuple(reliable),
                            client_ids=tuple(p for p in members if p not in reliable)))
    return Plan(stages=tuple(stages))


def plan_moves(stage_layers: Sequence[tuple[int, int]], stage_of: Mapping[str, int], proposed: Plan,
               snapshot: SwarmSnapshot) -> tuple[Move, ...]:
    """The moves that take the swarm as it runs (``stage_layers``, ``stage_of``) to ``proposed``
    (the module docstring says how they are costed), in peer-id order."""
    layer_bytes = np.asarray(snapshot.model.layer_param_bytes, dtype=np.float64) * STATE_BYTES_PER_PARAM_BYTE
    holders = [[snapshot.index_by_peer_id[p] for p, s in stage_of.items() if s == k and p in snapshot.index_by_peer_id]
               for k in range(len(stage_layers))]
    moves = []
    for stage in proposed.stages:
        for peer_id in stage.peer_ids:
            own = stage_of.get(peer_id, -1)
            held = tuple(stage_layers[own]) if 0 <= own < len(stage_layers) else None
            me = snapshot.index_by_peer_id[peer_id]
            num_bytes = seconds = 0.0
            for k, (start, end) in enumerate(stage_layers):
                if k == own:
                    continue
                lo, hi = max(start, stage.layer_start), min(end, stage.layer_end)
                if lo >= hi:
                    continue
                piece = float(layer_bytes[lo:hi].sum())
                num_bytes += piece
                seconds += _pull_seconds(snapshot, me, holders[k], piece)
            if num_bytes > 0:
                moves.append(Move(peer_id=peer_id, layers=(stage.layer_start, stage.layer_end), held=held,
                                  num_bytes=num_bytes, seconds=seconds))
    return tuple(sorted(moves, key=lambda m: m.peer_id))


def _pull_seconds(snapshot: SwarmSnapshot, me: int, sources: Sequence[int], num_bytes: float) -> float:
    """Seconds to pull ``num_bytes`` from the best of ``sources`` (inf if there is none)."""
    links = snapshot.links
    times = [num_bytes / links.bandwidth[me, j] + 2 * links.latency_delay[me, j] for j in sources if j != me]
    return min(times, default=math.inf)


def decide(snapshot: SwarmSnapshot, stage_layers: Sequence[tuple[int, int]], stage_of: Mapping[str, int],
           proposed: Plan, config: AdoptionConfig | None = None) -> Adoption:
    """The verdict on ``proposed`` for the swarm as it runs (the module docstring)."""
    config = config or AdoptionConfig()
    running = layout_plan(stage_layers, stage_of, snapshot)
    current = estimate_throughput(snapshot, running) if running is not None else 0.0
    planned = estimate_throughput(snapshot, proposed)
    moves = plan_moves(stage_layers, stage_of, proposed, snapshot)
    move_seconds = max((m.seconds for m in moves), default=0.0)
    gain_rate = planned - current
    lost = current * move_seconds if current > 0 else 0.0
    payback = lost / gain_rate if gain_rate > 0 else math.inf

    def verdict(adopt: bool, reason: str) -> Adoption:
        return Adoption(plan=proposed, current=current, planned=planned, moves=moves, move_seconds=move_seconds,
                        payback_seconds=payback, adopt=adopt, reason=reason)

    if planned <= current * (1 + config.min_gain) or planned <= 0:
        return verdict(False, f"the plan's {planned:.3g} samples/s is not more than {1 + config.min_gain:.2f}x "
                              f"the {current:.3g} of the swarm as it runs")
    if not math.isfinite(move_seconds):
        return verdict(False, "a peer of the plan could pull its new layers from nobody")
    if payback > config.horizon:
        return verdict(False, f"its moves ({move_seconds:.0f} s) cost samples that its gain makes up in {payback:.0f} s, "
                              f"more than the {config.horizon:.0f} s horizon")
    return verdict(True, f"{planned / current if current > 0 else math.inf:.2f}x the swarm as it runs; its moves "
                         f"({move_seconds:.0f} s) pay back in {payback:.0f} s")
