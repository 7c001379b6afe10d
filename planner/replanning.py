"""Layer-wise lightweight re-planning after a failure (seed 001 §3.4).

Instead of re-running the global planner, the failed peers leave their stages; a stage that still
has a server keeps its layers, and only when a stage loses every server are the partition points
moved: the layers are re-split over the surviving stages in proportion to their computing capacity
(seed 001: "reallocated among the remaining stages based on their computing capacity ... a minor
adjustment to the layer partitioning points"). With prefix FLOPs ``P_l`` and capacities ``C_k``,
boundary ``b_k`` is the layer whose prefix is closest to ``P_L * sum_{j<=k} C_j / sum_j C_j``
(each stage keeps at least one layer). If that split breaks a memory budget, the exact split of
``layer_split`` (which respects memory) is used instead. The clients of a vanished stage are
released to join again (the live peer places them with ``stage_choice``; the offline bench with
``offline.rebalance.choose_join_stage``).

The result lists, per layer that changes hands, where its weights come from: the old stage that
held it, or None when that stage vanished and the weights come from its backup (the next stage,
seed 001 "topology-driven model replication").
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from planner.assembly import assemble_plan
from planner.costs import estimate_stage_costs, profile_group
from planner.layer_split import split_by_matrices, split_layers
from planner.plan import Plan
from planner.plan import Stage as PlanStage
from planner.snapshot import Device, LinkMatrix, ModelProfile, SwarmSnapshot
from planner.stage_choice import StageMember


@dataclass(frozen=True, kw_only=True)
class LayerMigration:
    """One layer changing stage.

    Attributes:
        layer: the layer index.
        from_stage: old stage index that holds it, or None when only a backup holds it.
        to_stage: new stage index.
    """

    layer: int
    from_stage: int | None
    to_stage: int


@dataclass(frozen=True, kw_only=True)
class ReplanDecision:
    """Outcome of ``replan_after_failure``.

    Attributes:
        plan: the new plan.
        migrations: layers that change stage, by layer index.
        released_peer_ids: surviving clients of vanished stages, to re-join elsewhere.
    """

    plan: Plan
    migrations: tuple[LayerMigration, ...]
    released_peer_ids: tuple[str, ...]


def split_by_capacity(layer_flops: tuple[float, ...], capacities: np.ndarray) -> tuple[int, ...]:
    """Boundaries putting ``sum(layer_flops)`` in proportion to ``capacities``, >= 1 layer each."""
    num_layers, num_stages = len(layer_flops), capacities.size
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} stages cannot split {num_layers} layers")
    prefix = np.concatenate([[0.0], np.cumsum(layer_flops)])
    targets = prefix[-1] * np.cumsum(capacities) / capacities.sum()
    bounds = []
    for k in range(num_stages - 1):
        low = (bounds[-1] if bounds else 0) + 1
        high = num_layers - (num_stages - 1 - k)
        candidates = np.arange(low, high + 1)
        bounds.append(int(candidates[np.argmin(np.abs(prefix[candidates] - targets[k]))]))
    return tuple(bounds) + (num_layers,)


def replan_after_failure(snapshot: SwarmSnapshot, plan: Plan, failed_peer_ids: set[str]) -> ReplanDecision:
    """Seed 001 §3.4 re-planning; ``snapshot`` may or may not still list the failed peers."""
    survivors, released = [], []
    for k, stage in enumerate(plan.stages):
        servers = tuple(p for p in stage.server_ids if p not in failed_peer_ids)
        clients = tuple(p for p in stage.client_ids if p not in failed_peer_ids)
        if servers:
            survivors.append((k, servers, clients))
        else:
            released.extend(clients)
    if not survivors:
        raise ValueError("every stage lost all its servers; the global planner must start over")
    groups = [(np.sort(snapshot.indices_of(s)), np.sort(snapshot.indices_of(c))) for _, s, c in survivors]
    old_bounds = tuple(plan.stages[k].layer_end for k, _, _ in survivors)
    if len(survivors) == plan.num_stages:
        bounds = old_bounds
    else:
        capacities = np.array([snapshot.flops[np.concatenate(g)].sum() for g in groups])
        bounds = split_by_capacity(snapshot.model.layer_flops, capacities)
        candidate = assemble_plan(snapshot, groups, bounds)
        if not np.all(np.isfinite(estimate_stage_costs(snapshot, candidate))):
            bounds, _ = split_layers(snapshot, [profile_group(snapshot, s, c) for s, c in groups])
    new_plan = assemble_plan(snapshot, groups, bounds)
    migrations = layer_migrations([(s.layer_start, s.layer_end) for s in plan.stages], [k for k, _, _ in survivors],
                                  [(s.layer_start, s.layer_end) for s in new_plan.stages])
    return ReplanDecision(plan=new_plan, migrations=migrations, released_peer_ids=tuple(sorted(released)))


class MemoryBudgetError(ValueError):
    """No split of the layers over the surviving stages fits every member's memory budget."""


@dataclass(frozen=True, kw_only=True)
class LayoutReplan:
    """A running swarm's re-planned stage layout (:func:`replan_layout`).

    Attributes:
        stage_layers: the new block ranges, one per surviving stage.
        stage_map: per old stage, its index in the new layout, or None when it vanished.
        migrations: the layers that change stage (``from_stage``/``to_stage`` are old/new indices).
    """

    stage_layers: tuple[tuple[int, int], ...]
    stage_map: tuple[int | None, ...]
    migrations: tuple[LayerMigration, ...]


@dataclass(frozen=True, kw_only=True, order=True)
class Layout:
    """A stage layout as peers advertise it: its version and block ranges (version 0 is the run's own)."""

    version: int
    stage_layers: tuple[tuple[int, int], ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)


VANISHED = "~vanished-"  # placeholder server id of a stage nobody holds (never a real peer id)


def replan_layout(
    stage_layers: tuple[tuple[int, int], ...], layer_flops: tuple[float, ...], members: Sequence[StageMember],
    *, layer_bytes: tuple[float, ...] | None = None, overhead_bytes: float = 0.0,
) -> LayoutReplan | None:
    """Seed 001 §3.4 for a running swarm: the stages no member holds vanish and their layers are
    re-split over the surviving stages by :func:`replan_after_failure` (by the stages' computing
    capacity: the sum of their members' FLOP/s). None when every stage is held.

    Memory: with ``layer_bytes`` (what training each layer takes on one peer: weights, gradients,
    optimizer state, activations in flight; the embedding counted with the first layer and the head
    with the last), every member of a new stage must hold its layers' sum plus ``overhead_bytes``
    within its ``memory_bytes`` (members that did not say are not limited). If the capacity split
    breaks a budget, the split minimising the largest FLOPs-per-capacity among the splits that fit
    is taken instead (a bottleneck DP, as in ``layer_split``). Links are not in the records, so
    they are taken as uniform. Deterministic: the same layout and members, in any order, give the
    same answer.

    Raises:
        ValueError: no stage is held, a member is outside the stages, or ``layer_flops`` (or
            ``layer_bytes``) does not match the layout.
        MemoryBudgetError: no split of the layers over the surviving stages fits the budgets.
    """
    num_layers = stage_layers[-1][1]
    if len(layer_flops) != num_layers:
        raise ValueError(f"{len(layer_flops)} layer costs for a layout of {num_layers} layers")
    if layer_bytes is not None and len(layer_bytes) != num_layers:
        raise ValueError(f"{len(layer_bytes)} layer sizes for a layout of {num_layers} layers")
    holders: list[list[StageMember]] = [[] for _ in stage_layers]
    for member in members:
        if not 0 <= member.stage < len(stage_layers):
            raise ValueError(f"peer {member.peer_id} claims stage {member.stage} of {len(stage_layers)}")
        holders[member.stage].append(member)
    vanished = [k for k, held in enumerate(holders) if not held]
    if not vanished:
        return None
    if len(vanished) == len(stage_layers):
        raise ValueError("no stage is held: there is nothing to re-plan onto")
    decision = _capacity_replan(stage_layers, layer_flops, holders)
    survivors = [k for k in range(len(stage_layers)) if k not in vanished]
    new_layers = tuple((s.layer_start, s.layer_end) for s in decision.plan.stages)
    migrations = decision.migrations
    if layer_bytes is not None:
        budgets = [stage_budget(holders[k], overhead_bytes) for k in survivors]
        if not fits_budgets(new_layers, layer_bytes, budgets):
            capacities = [sum(max(m.flops, 1.0) for m in holders[k]) for k in survivors]
            new_layers = split_within_budgets(layer_flops, layer_bytes, capacities, budgets)
            migrations = layer_migrations(stage_layers, survivors, new_layers)
    stage_map = tuple(survivors.index(k) if k in survivors else None for k in range(len(stage_layers)))
    return LayoutReplan(stage_layers=new_layers, stage_map=stage_map, migrations=migrations)


def _capacity_replan(stage_layers: tuple[tuple[int, int], ...], layer_flops: tuple[float, ...],
                     holders: Sequence[Sequence[StageMember]]) -> ReplanDecision:
    """:func:`replan_after_failure` on the running swarm's layout: each stage served by its
    ``holders`` (a stage with none by one stand-in that fails), links uniform, memory unlimited."""
    num_layers = len(layer_flops)
    devices = tuple(Device(peer_id=m.peer_id, flops=max(m.flops, 1.0), memory_bytes=1 << 60, is_reliable=True)
                    for held in holders for m in held)
    size = len(devices)
    links = LinkMatrix(latency_delay=np.zeros((size, size)), bandwidth=np.full((size, size), 1e9))
    profile = ModelProfile(layer_flops=layer_flops, layer_param_bytes=(0.0,) * num_layers,
                           layer_activation_bytes=(0.0,) * num_layers)
    snapshot = SwarmSnapshot(devices=devices, links=links, model=profile)
    plan = Plan(stages=tuple(
        PlanStage(layer_start=start, layer_end=end,
                  server_ids=tuple(sorted(m.peer_id for m in holders[k])) or (f"{VANISHED}{k}",))
        for k, (start, end) in enumerate(stage_layers)))
    vanished = {f"{VANISHED}{k}" for k, held in enumerate(holders) if not held}
    return replan_after_failure(snapshot, plan, vanished)


def stage_budget(members: Sequence[StageMember], overhead_bytes: float) -> float:
    """The bytes every one of ``members`` can give a stage's layers: the smallest stated budget less
    ``overhead_bytes`` (infinite when no member stated one)."""
    stated = [m.memory_bytes for m in members if m.memory_bytes > 0]
    return min(stated) - overhead_bytes if stated else math.inf


def fits_budgets(stage_layers: Sequence[tuple[int, int]], layer_bytes: Sequence[float], budgets: Sequence[float]) -> bool:
    """Whether every stage's layers fit its budget."""
    return all(sum(layer_bytes[start:end]) <= budget for (start, end), budget in zip(stage_layers, budgets, strict=True))


def split_within_budgets(layer_flops: Sequence[float], layer_bytes: Sequence[float], capacities: Sequence[float],
                         budgets: Sequence[float]) -> tuple[tuple[int, int], ...]:
    """Contiguous ranges, one per stage in order, minimising the largest ``FLOPs / capacity`` among the
    splits whose every stage fits its budget.

    Raises:
        MemoryBudgetError: no such split exists.
    """
    num_layers = len(layer_flops)
    prefix_flops = np.concatenate([[0.0], np.cumsum(layer_flops)])
    prefix_bytes = np.concatenate([[0.0], np.cumsum(layer_bytes)])
    a, b = np.meshgrid(np.arange(num_layers + 1), np.arange(num_layers + 1), indexing="ij")
    costs = []
    for capacity, budget in zip(capacities, budgets, strict=True):
        cost = (prefix_flops[b] - prefix_flops[a]) / capacity
        fits = (b > a) & (prefix_bytes[b] - prefix_bytes[a] <= budget)
        costs.append(np.where(fits, cost, np.inf))
    bounds, bottleneck = split_by_matrices(costs)
    if not math.isfinite(bottleneck):
        need = max(layer_bytes) if layer_bytes else 0.0
        raise MemoryBudgetError(f"no split of {num_layers} layers over {len(capacities)} stages fits their members' "
                                f"memory (the largest layer alone needs {need / 2**20:.0f} MiB)")
    starts = (0,) + tuple(bounds[:-1])
    return tuple(zip(starts, bounds))


def layer_migrations(old_layers: Sequence[tuple[int, int]], survivors: Sequence[int],
                     new_layers: Sequence[tuple[int, int]]) -> tuple[LayerMigration, ...]:
    """The layers that change stage going from ``old_layers`` to ``new_layers`` (new stage ``i`` is
    old stage ``survivors[i]``); ``from_stage`` is None where the old stage vanished."""
    old_owner = [k for k, (start, end) in enumerate(old_layers) for _ in range(start, end)]
    migrations = []
    for new_index, (start, end) in enumerate(new_layers):
        for layer in range(start, end):
            old = old_owner[layer]
            if old != survivors[new_index]:
                migrations.append(LayerMigration(layer=layer, from_stage=old if old in survivors else None,
                                                 to_stage=new_index))
    return tuple(migrations)


def choose_layout(current: Layout, seen: Sequence[Layout], *, num_unheld: int, alone: bool,
                  planned: Collection[Layout] = ()) -> Layout | None:
    """The layout a peer under ``current`` moves to, given the layouts other peers train under; None: stay.

    Every peer applies the same order, so concurrent re-plans converge on one layout: a higher version
    first, then, between two re-plans of one version (peers whose views differed), the one that kept
    more stages (its proposer saw more of them held: the other dropped a stage that was not lost),
    then the smaller block ranges (lexicographic). A layout is only taken from a peer when it could
    follow from this peer's view: the next version, dropping between 1 and ``num_unheld`` stages (the
    stages this peer sees nobody hold), or a competing layout of this peer's own version that ranks
    before it. A peer ``alone`` under its layout (everyone else moved on while it was cut off) takes
    the best layout of any newer version, as it has no pipeline left where it is. A layout of
    ``planned`` (a global plan this peer judged worth following, ``peer.plan_adoption``) follows
    when it is the next version, whatever stages it keeps or adds.
    """
    def rank(layout: Layout) -> tuple:
        return -layout.num_stages, layout.stage_layers

    def follows(layout: Layout) -> bool:
        if layout.version == current.version:
            return rank(layout) < rank(current)
        if layout.version < current.version:
            return False
        if alone or (layout in planned and layout.version == current.version + 1):
            return True
        dropped = current.num_stages - layout.num_stages
        return layout.version == current.version + 1 and 1 <= dropped <= num_unheld

    candidates = [layout for layout in seen if layout != current and follows(layout)]
    if not candidates:
        return None
    return min(candidates, key=lambda layout: (-layout.version, *rank(layout)))
