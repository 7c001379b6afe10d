"""Baselines the planner is measured against, expressed as Plans of the same form.

* ``plan_even`` — GPipe-style even partition: equal layer counts, devices dealt round-robin in
  peer-id order, blind to compute and links. For fairness the number of stages is the best one
  under our own cost model.
* ``plan_petals`` — Petals' block selection: the fewest even stages that fit a typical device;
  peers join one at a time (peer-id order, reliable first) and each takes the stage whose summed
  throughput is lowest ("weakest block"), blind to links.
* ``plan_swarm`` — SWARM-style queue rebalancing: from the even plan, repeatedly move one peer
  from the stage with the most spare throughput to the stage with the least, while that raises
  the slowest stage's throughput; throughput here is compute only, as SWARM sees queues, not links.

"Peer-id order" is the canonical order of ``planner.canonical`` (issue #18): each baseline runs on
the canonical snapshot and its plan is mapped back, so renaming peers renames the plan and
nothing else, and every planner compares against the same baseline whatever the names.
"""

from __future__ import annotations

import numpy as np

from planner.assembly import assemble_plan
from planner.canonical import plan_canonically
from planner.costs import estimate_throughput
from planner.plan import Plan
from planner.snapshot import SwarmSnapshot

Groups = list[tuple[list[int], list[int]]]


def _even_bounds(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Equal layer counts, the remainder spread over the first stages."""
    sizes = [num_layers // num_stages + (1 if k < num_layers % num_stages else 0) for k in range(num_stages)]
    return tuple(int(b) for b in np.cumsum(sizes))


def _to_plan(snapshot: SwarmSnapshot, groups: Groups, bounds: tuple[int, ...]) -> Plan:
    arrays = [(np.array(sorted(s), dtype=np.int64), np.array(sorted(c), dtype=np.int64)) for s, c in groups]
    return assemble_plan(snapshot, arrays, bounds)


def _deal(snapshot: SwarmSnapshot, num_stages: int) -> Groups:
    """Round-robin in peer-id order: reliable devices as servers, unreliable as clients."""
    groups: Groups = [([], []) for _ in range(num_stages)]
    for position, index in enumerate(snapshot.reliable_indices()):
        groups[position % num_stages][0].append(index)
    for position, index in enumerate(snapshot.unreliable_indices()):
        groups[position % num_stages][1].append(index)
    return groups


def plan_even(snapshot: SwarmSnapshot) -> Plan:
    """GPipe even partition with the best stage count (see module docstring)."""
    return plan_canonically(snapshot, _plan_even)


def _plan_even(snapshot: SwarmSnapshot) -> Plan:
    num_reliable = len(snapshot.reliable_indices())
    if num_reliable == 0:
        raise ValueError("a plan needs at least one reliable device")
    best_plan, best_throughput = None, -1.0
    for num_stages in range(1, min(snapshot.model.num_layers, num_reliable) + 1):
        plan = _to_plan(snapshot, _deal(snapshot, num_stages), _even_bounds(snapshot.model.num_layers, num_stages))
        throughput = estimate_throughput(snapshot, plan)
        if throughput > best_throughput:
            best_plan, best_throughput = plan, throughput
    return best_plan


def count_min_stages(snapshot: SwarmSnapshot) -> int:
    """Fewest even stages whose weights and optimizer state fit the median reliable device."""
    model = snapshot.model
    memory = float(np.median(snapshot.memory_bytes[snapshot.reliable_indices()]))
    factor = 1.0 + model.optimizer_bytes_per_param_byte
    for num_stages in range(1, model.num_layers + 1):
        bounds = (0,) + _even_bounds(model.num_layers, num_stages)
        largest = max(sum(model.layer_param_bytes[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
        if largest * factor <= memory:
            return num_stages
    return model.num_layers


def plan_petals(snapshot: SwarmSnapshot) -> Plan:
    """Petals' weakest-block choice over even stages (see module docstring)."""
    return plan_canonically(snapshot, _plan_petals)


def _plan_petals(snapshot: SwarmSnapshot) -> Plan:
    reliable = snapshot.reliable_indices()
    if not reliable:
        raise ValueError("a plan needs at least one reliable device")
    num_stages = min(count_min_stages(snapshot), len(reliable))
    groups: Groups = [([], []) for _ in range(num_stages)]
    totals = np.zeros(num_stages)
    for index in reliable + snapshot.unreliable_indices():
        if index in reliable and any(not servers for servers, _ in groups):
            stage = next(k for k, (servers, _) in enumerate(groups) if not servers)
        else:
            stage = int(np.argmin(totals))
        groups[stage][0 if index in reliable else 1].append(index)
        totals[stage] += snapshot.flops[index]
    return _to_plan(snapshot, groups, _even_bounds(snapshot.model.num_layers, num_stages))


def plan_swarm(snapshot: SwarmSnapshot, *, max_moves: int = 1000) -> Plan:
    """SWARM-style rebalancing from the even partition (see module docstring)."""
    return plan_canonically(snapshot, lambda canonical: _plan_swarm(canonical, max_moves=max_moves))


def _plan_swarm(snapshot: SwarmSnapshot, *, max_moves: int) -> Plan:
    reliable = snapshot.reliable_indices()
    if not reliable:
        raise ValueError("a plan needs at least one reliable device")
    model = snapshot.model
    num_stages = min(count_min_stages(snapshot), len(reliable))
    bounds = _even_bounds(model.num_layers, num_stages)
    starts = (0,) + bounds[:-1]
    stage_flops = np.array([sum(model.layer_flops[a:b]) for a, b in zip(starts, bounds)])
    groups = _deal(snapshot, num_stages)
    for _ in range(max_moves):
        rates = np.array([snapshot.flops[s + c].sum() for s, c in groups]) / stage_flops
        slow, fast = int(np.argmin(rates)), int(np.argmax(rates))
        servers, clients = groups[fast]
        movable = clients if clients else (servers if len(servers) > 1 else [])
        if not movable:
            break
        device = min(movable, key=lambda i: (snapshot.flops[i], i))
        gain = snapshot.flops[device]
        if min(rates[slow] + gain / stage_flops[slow], rates[fast] - gain / stage_flops[fast]) <= rates[slow]:
            break
        movable.remove(device)
        groups[slow][0 if movable is servers else 1].append(device)
    return _to_plan(snapshot, groups, bounds)
