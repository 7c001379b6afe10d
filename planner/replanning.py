"""Layer-wise lightweight re-planning after a failure (seed 001 §3.4).

Instead of re-running the global planner, the failed peers leave their stages; a stage that still
has a server keeps its layers, and only when a stage loses every server are the partition points
moved: the layers are re-split over the surviving stages in proportion to their computing capacity
(seed 001: "reallocated among the remaining stages based on their computing capacity ... a minor
adjustment to the layer partitioning points"). With prefix FLOPs ``P_l`` and capacities ``C_k``,
boundary ``b_k`` is the layer whose prefix is closest to ``P_L * sum_{j<=k} C_j / sum_j C_j``
(each stage keeps at least one layer). If that split breaks a memory budget, the exact split of
``layer_split`` (which respects memory) is used instead. The clients of a vanished stage are
released to re-join through ``rebalance.choose_join_stage``.

The result lists, per layer that changes hands, where its weights come from: the old stage that
held it, or None when that stage vanished and the weights come from its backup (the next stage,
seed 001 "topology-driven model replication").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.assembly import assemble_plan
from planner.costs import estimate_stage_costs, profile_group
from planner.layer_split import split_layers
from planner.plan import Plan
from planner.snapshot import SwarmSnapshot


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
    old_owner = [plan.stage_of_layer(layer) for layer in range(plan.num_layers)]
    alive = {k for k, _, _ in survivors}
    migrations = []
    for new_index, stage in enumerate(new_plan.stages):
        for layer in range(stage.layer_start, stage.layer_end):
            old = old_owner[layer]
            if old != survivors[new_index][0]:
                migrations.append(LayerMigration(layer=layer, from_stage=old if old in alive else None, to_stage=new_index))
    return ReplanDecision(plan=new_plan, migrations=tuple(migrations), released_peer_ids=tuple(sorted(released)))
