"""The live global plan rule in the swarm-lifetime simulator: mode ``"live_global"`` of
``planner.offline.lifetime`` (issue #18).

What the real peers do (``peer.plan_watch``, ``peer.plan_adoption``, ``peer.standby``), and how it
is modelled here:

* **Every** ``global_plan_period`` **seconds** (the first after one period) the swarm takes the
  planner's snapshot of its members (serving or pulling state) and of the peers standing by, runs
  ``planner.global_plan.plan_global`` on it and asks ``planner.adoption.decide`` (``min_gain`` 0.2,
  horizon 1,800 s) whether to move. The live peers take turns to propose; every peer computes the
  same plan from the same records, so here the swarm computes it once per period.
* **Only swarms of up to** ``max_planned_peers`` (the live ``MAX_PLANNED_PEERS``, 256) are planned:
  above it the period is counted in ``plans_skipped_too_large`` and nothing else happens, so the
  mode is then "even" exactly. Raising the field shows what planning would do above the cap.
* **It proposes only** when every stage has a holder and no earlier plan's move is still pulling
  state (the live "a change is under way"); such a period counts in ``plans_deferred`` and is not
  planned at all (the live peer plans and then declines to propose: the decision is the same, the
  time is not counted here).
* **Adopted**: the layout becomes the plan's (its stages and layer ranges), each planned peer takes
  the stage the plan names, and the peers it leaves idle stand by (online, serving nothing, in the
  next snapshots). A peer with a move in ``decide``'s verdict contributes nothing until that move's
  pulls are done, a peer whose new layers it already holds serves at once. The pulls are costed as
  ``planner.adoption.plan_moves`` costs them (from the best current holder of each old stage it
  needs, one after another) but in the receiving direction: ``plan_moves`` reads
  ``bandwidth[puller, holder]``, and the internet model's matrix is directed (``[p, q]`` is
  ``min(up_p, down_q)``), so read as is it would cost a pull at the puller's own uplink, 5x below
  its downlink. The live link view is symmetric, where the two agree. The verdict itself is
  ``decide``'s on the snapshot as is (its payback counts the slower, upload-direction pulls: a
  conservative verdict).
* Between plans arrivals join by the live join rule on the current layout; a peer standing by that
  leaves just leaves; a stage left with no holder is taken, after ``failure_detect_s``, by the
  lowest-numbered peer standing by (one each, stages in order; it serves at once, as the lifetime
  simulator's first peer of an empty stage does: the live peer loads a backup or checkpoint), and
  only stages still unheld after that go to the re-planning rule.

**Gaps, stated.** The simulator scores layouts with per-stage sums (``lifetime.fleet_throughput``):
every member is a server (``volunteer_snapshot`` makes every volunteer reliable, so plans have no
clients), a link runs at the sender's uplink (the snapshot's ``min(up, down)`` differs only where a
receiver's downlink is below the sender's uplink), and **averaging is not counted** in the
simulator's throughput, while the planner plans with the runtime's averaging
(``plan_averaging_period``: 0 by default, the live default ``replica_sync`` "gradients", the cost
model's blocking averaging every step). So the planner optimises a swarm that averages and the
simulator scores one that does not; the result keeps the planner's own figures of the last verdict
(``last_plan_current``, ``last_plan_planned``) beside the simulator's. Setting
``plan_averaging_period`` very large plans without averaging, as the simulator scores. Memory: a
plan's layout is sized by the planner against each planned peer's memory, so after the first
adoption the simulator stops checking that a stage fits the smallest device; a joiner placed by the
join rule on a planned layout is not checked against its memory either. The live turn guard, view
reads and judging by followers are not modelled (every peer follows at once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from planner.adoption import Adoption, AdoptionConfig, decide, plan_moves
from planner.global_plan import plan_global
from planner.offline.internet import ChurnTrace, volunteer_snapshot
from planner.runtime import RuntimeSettings
from planner.snapshot import LinkMatrix, ModelProfile, SwarmSnapshot


class PlannedSwarm(Protocol):
    """What the rule reads and changes of the simulated swarm (``lifetime._Swarm``, which imports
    this module: a protocol rather than an import cycle)."""

    trace: ChurnTrace
    model: ModelProfile
    config: Any  # lifetime.LifetimeConfig
    layers: tuple[tuple[int, int], ...]
    serving: dict[int, int]
    syncing: dict[int, tuple[int, float]]
    standby: set[int]
    holders: np.ndarray
    check_memory: bool

    def _all_stages(self) -> dict[int, int]: ...

    def _shape(self) -> None: ...

    def num_held(self) -> int: ...

    def place(self, peer: int, stage: int, now: float) -> float | None: ...


@dataclass(frozen=True)
class PlanStep:
    """What one period of the rule did: ``outcome`` is "too_large" (above ``max_planned_peers``: no
    plan), "deferred" (a stage unheld, a move under way, or no plan fits), "stays" or "adopted";
    ``seconds`` the plan and verdict took (by the clock given, else 0), ``current`` / ``planned`` the
    verdict's samples/s, ``readies`` (peer, ready at) of the peers that now pull state."""

    outcome: str
    seconds: float = 0.0
    current: float = 0.0
    planned: float = 0.0
    readies: tuple[tuple[int, float], ...] = ()


def peer_id(peer: int) -> str:
    """The planner's id of volunteer ``peer`` (the one ``_Swarm.members`` gives)."""
    return f"{peer:06d}"


def planning_snapshot(swarm: PlannedSwarm) -> tuple[SwarmSnapshot, dict[str, int]]:
    """The snapshot the live peer plans on (members and peers standing by, by volunteer number) and
    the stage of each member (serving or pulling state; not of those standing by)."""
    config = swarm.config
    stage_of = {peer_id(p): stage for p, stage in sorted(swarm._all_stages().items())}
    peers = sorted([*swarm.serving, *swarm.syncing, *swarm.standby])
    runtime = RuntimeSettings(max_in_flight_per_peer=config.max_in_flight,
                              boundary_compression_ratio=config.compression_ratio,
                              averaging_period=config.plan_averaging_period, is_flushing=config.is_flushing)
    snapshot = volunteer_snapshot(swarm.trace.volunteers, swarm.model, runtime=runtime,
                                  peers=np.array(peers, dtype=np.int64), peer_ids=[peer_id(p) for p in peers])
    return snapshot, stage_of


def global_plan_step(swarm: PlannedSwarm, now: float, movers: set[int], clock: Callable[[], float] | None) -> PlanStep:
    """One period of the live rule (module docstring) at time ``now``. ``movers``: the peers of the
    last adopted plan's moves (updated when a plan is adopted)."""
    config = swarm.config
    if len(swarm.serving) + len(swarm.syncing) + len(swarm.standby) > config.max_planned_peers:
        return PlanStep("too_large")
    if swarm.num_held() < len(swarm.layers) or any(p in swarm.syncing for p in movers):
        return PlanStep("deferred")
    snapshot, stage_of = planning_snapshot(swarm)
    started = clock() if clock is not None else 0.0
    try:
        plan = plan_global(snapshot, config.global_plan)
    except ValueError:  # no plan fits the members' memory: the live peer logs it and waits a period
        return PlanStep("deferred")
    adoption = decide(snapshot, swarm.layers, stage_of, plan,
                      AdoptionConfig(min_gain=config.plan_min_gain, horizon=config.plan_horizon_s))
    seconds = clock() - started if clock is not None else 0.0
    if not adoption.adopt:
        return PlanStep("stays", seconds, adoption.current, adoption.planned)
    receiving = SwarmSnapshot(devices=snapshot.devices, model=snapshot.model, runtime=snapshot.runtime,
                              links=LinkMatrix(latency_delay=snapshot.links.latency_delay.T,
                                               bandwidth=snapshot.links.bandwidth.T))
    pulls = {move.peer_id: move.seconds for move in plan_moves(swarm.layers, stage_of, plan, receiving)}
    readies = adopt(swarm, adoption, pulls, now)
    movers.clear()
    movers.update(peer for peer, _ in readies)
    return PlanStep("adopted", seconds, adoption.current, adoption.planned, tuple(readies))


def adopt(swarm: PlannedSwarm, adoption: Adoption, move_seconds: dict[str, float], now: float) -> list[tuple[int, float]]:
    """Carry out ``adoption``'s plan on ``swarm`` at ``now``: the plan's layout, each planned peer on
    its stage (pulling for ``move_seconds[peer id]``, else serving at once), the others standing by."""
    plan = adoption.plan
    idle = set(swarm.serving) | set(swarm.syncing) | swarm.standby
    swarm.layers = tuple((stage.layer_start, stage.layer_end) for stage in plan.stages)
    swarm.serving, swarm.syncing = {}, {}
    readies = []
    for k, stage in enumerate(plan.stages):
        for planned in stage.peer_ids:
            peer = int(planned)
            idle.discard(peer)
            seconds = move_seconds.get(planned, 0.0)
            if seconds > 0:
                swarm.syncing[peer] = (k, now + seconds)
                readies.append((peer, now + seconds))
            else:
                swarm.serving[peer] = k
    swarm.standby = idle
    swarm.check_memory = False  # the planner sized the stages to its peers' memory (module docstring)
    swarm._shape()
    return sorted(readies)


def standby_takes_unheld(swarm: PlannedSwarm, now: float) -> int:
    """Each stage nobody holds is taken by the lowest-numbered peer standing by (one each, stages in
    order; served at once); returns how many were taken."""
    taken = 0
    for stage in range(len(swarm.layers)):
        if swarm.holders[stage] == 0 and swarm.standby:
            peer = min(swarm.standby)
            swarm.standby.discard(peer)
            swarm.place(peer, stage, now)
            taken += 1
    return taken
