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
from planner.costs import estimate_group_costs, profile_group, throughput_of
from planner.plan import Plan
from planner.snapshot import SwarmSnapshot

Groups = list[tuple[list[int], list[int]]]


def _even_bounds(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Equal layer counts, the remainder spread over the first stages."""
    sizes = [num_layers // num_stages + (1 if k < num_layers % num_stages else 0) for k in range(num_stages)]
    return tuple(int(b) for b in np.cumsum(sizes))


def _to_plan(snapshot: SwarmSnapshot, groups: Groups, bounds: tuple[int, ...], *,
             edges: np.ndarray | None = None) -> Plan:
    arrays = [(np.array(sorted(s), dtype=np.int64), np.array(sorted(c), dtype=np.int64)) for s, c in groups]
    return assemble_plan(snapshot, arrays, bounds, edges=edges)


def _deal(snapshot: SwarmSnapshot, num_stages: int) -> Groups:
    """Round-robin in peer-id order: reliable devices as servers, unreliable as clients."""
    groups: Groups = [([], []) for _ in range(num_stages)]
    for position, index in enumerate(snapshot.reliable_indices()):
        groups[position % num_stages][0].append(index)
    for position, index in enumerate(snapshot.unreliable_indices()):
        groups[position % num_stages][1].append(index)
    return groups


def plan_even(snapshot: SwarmSnapshot, *, is_canonical: bool = False) -> Plan:
    """GPipe even partition with the best stage count (see module docstring).

    ``is_canonical``: ``snapshot`` is already canonical (``canonical.plan_canonically``).
    """
    return plan_canonically(snapshot, _plan_even, is_canonical=is_canonical)


def _plan_even(snapshot: SwarmSnapshot) -> Plan:
    """Scores every stage count's dealt groups with the cost model (``costs.estimate_group_costs``:
    the plan's figures without building the Plan, whose server roles do not change them) and
    assembles the best only. A count where a member cannot hold its stage's weights and optimizer
    state is worth 0 under the model (``costs.is_within_memory``) and is not profiled: those are
    the fewest stages, the largest groups."""
    num_reliable = len(snapshot.reliable_indices())
    if num_reliable == 0:
        raise ValueError("a plan needs at least one reliable device")
    best, best_throughput = None, -1.0
    for num_stages in range(1, min(snapshot.model.num_layers, num_reliable) + 1):
        groups, bounds = _deal(snapshot, num_stages), _even_bounds(snapshot.model.num_layers, num_stages)
        if _fits(snapshot, groups, bounds):
            profiles = [
                profile_group(snapshot, np.array(s, dtype=np.int64), np.array(c, dtype=np.int64)) for s, c in groups
            ]
            throughput = throughput_of(snapshot, estimate_group_costs(snapshot, profiles, (0,) + bounds))
        else:
            throughput = 0.0
        if throughput > best_throughput:
            best, best_throughput = (groups, bounds), throughput
    return _to_plan(snapshot, *best)


def _fits(snapshot: SwarmSnapshot, groups: Groups, bounds: tuple[int, ...]) -> bool:
    """True when every member holds its stage's weights and optimizer state: the memory test of
    ``costs.estimate_group_costs``, summed the same way, without the profiles."""
    model = snapshot.model
    factor = 1.0 + model.optimizer_bytes_per_param_byte
    for (servers, clients), start, end in zip(groups, (0,) + bounds[:-1], bounds):
        members = np.array(servers + clients, dtype=np.int64)
        if not np.all(snapshot.memory_bytes[members] >= sum(model.layer_param_bytes[start:end]) * factor):
            return False
    return True


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


def plan_petals(snapshot: SwarmSnapshot, *, is_canonical: bool = False) -> Plan:
    """Petals' weakest-block choice over even stages (see module docstring); ``is_canonical`` as
    in ``plan_even``."""
    return plan_canonically(snapshot, _plan_petals, is_canonical=is_canonical)


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


def plan_swarm(snapshot: SwarmSnapshot, *, max_moves: int = 1000, is_canonical: bool = False) -> Plan:
    """SWARM-style rebalancing from the even partition (see module docstring); ``is_canonical`` as
    in ``plan_even``."""
    return plan_canonically(
        snapshot, lambda canonical: _plan_swarm(canonical, max_moves=max_moves), is_canonical=is_canonical
    )


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
