"""Seed 002 (SpanTrain) §3.2–3.3: two-level device grouping, cost model Eq. 1, beam search.

Two-level grouping (§3.2.2). First level, by network: every device starts alone; the pair of
groups with the highest mean bandwidth between them (the top of the max-heap) merges while that
bandwidth is within ``network_ratio`` of the fastest link, so groups grow inside fast regions and
stop at slow cross-region links. Second level, by compute, inside each first-level group: devices
sorted by FLOP/s join the previous sub-group while within ``compute_ratio`` of its slowest member.

Cost (Eq. 1), stages s in pipeline order, B micro-batches::

    T = max_s ( sum_{i<s} t_i^f  +  B t_s^c  +  sum_{i<s} t_i^l  +  AL_s )

with ``t_s^c`` the stage's compute per micro-batch (FLOPs over the group's total FLOP/s),
``t_i^f`` compute plus transfer of stage i (the fill), ``t_i^l = max(0, transfer_i - t_i^c)`` the
transfer the compute does not hide, and ``AL_s = 2 W_s / min bandwidth`` in the group (DP).

Beam search (Alg. 1): ``beam_width`` candidates, each a random order of the first-level groups
(from ``rng``) with a compute-proportional layer split; each iteration expands every candidate by
swapping two stages (global) and by moving one boundary one layer (local), scores all with Eq. 1
and keeps the best ``beam_width``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.assembly import assemble_plan
from planner.plan import Plan
from planner.replanning import split_by_capacity
from planner.snapshot import SwarmSnapshot


@dataclass(frozen=True, kw_only=True)
class SpanTrainConfig:
    """Knobs of the SpanTrain planner.

    Attributes:
        network_ratio: first-level groups merge while their link is at least this fraction of
            the fastest link's bandwidth.
        compute_ratio: second-level sub-groups hold devices within this FLOP/s ratio.
        beam_width: candidates kept per iteration (``l`` in Alg. 1).
        num_iterations: refinement iterations (``max_iter``).
    """

    network_ratio: float = 0.2
    compute_ratio: float = 0.8
    beam_width: int = 4
    num_iterations: int = 20

    def __post_init__(self) -> None:
        if not (0 < self.network_ratio <= 1 and 0 < self.compute_ratio <= 1):
            raise ValueError("network_ratio and compute_ratio must lie in (0, 1]")
        if self.beam_width < 1 or self.num_iterations < 0:
            raise ValueError("beam_width must be >= 1 and num_iterations >= 0")


def group_by_network(snapshot: SwarmSnapshot, ratio: float) -> list[list[int]]:
    """First-level groups (§3.2.2), each sorted, ordered by their first device."""
    bandwidth = np.array(snapshot.links.bandwidth, dtype=np.float64)
    symmetric = (bandwidth + bandwidth.T) / 2
    np.fill_diagonal(symmetric, 0.0)
    threshold = ratio * symmetric.max() if snapshot.num_devices > 1 else 0.0
    groups = [[i] for i in range(snapshot.num_devices)]
    while len(groups) > 1:
        best, pair = -1.0, (0, 1)
        for a in range(len(groups)):
            for b in range(a + 1, len(groups)):
                mean = float(symmetric[np.ix_(groups[a], groups[b])].mean())
                if mean > best:
                    best, pair = mean, (a, b)
        if best < threshold:
            break
        a, b = pair
        groups = [g for k, g in enumerate(groups) if k not in pair] + [sorted(groups[a] + groups[b])]
    return sorted(groups)


def group_by_compute(snapshot: SwarmSnapshot, members: list[int], ratio: float) -> list[list[int]]:
    """Second-level sub-groups of ``members`` by FLOP/s (§3.2.2)."""
    ordered = sorted(members, key=lambda i: (-snapshot.flops[i], i))
    groups: list[list[int]] = []
    for i in ordered:
        if groups and snapshot.flops[i] >= ratio * snapshot.flops[groups[-1][-1]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def estimate_cost(snapshot: SwarmSnapshot, groups: list[list[int]], bounds: tuple[int, ...]) -> float:
    """Seed 002 Eq. 1 for ``groups`` in pipeline order with layer ``bounds``."""
    model = snapshot.model
    latency, bandwidth = snapshot.links.latency_delay, snapshot.links.bandwidth
    starts = (0,) + tuple(bounds[:-1])
    worst, fill, residual = 0.0, 0.0, 0.0
    for s, (group, start, end) in enumerate(zip(groups, starts, bounds)):
        compute = model.microbatch_size * sum(model.layer_flops[start:end]) / snapshot.flops[group].sum()
        reduce = 0.0
        if len(group) > 1:
            reduce = 2.0 * sum(model.layer_param_bytes[start:end]) / bandwidth[np.ix_(group, group)].min()
        worst = max(worst, fill + model.num_microbatches * compute + residual + reduce)
        if s + 1 < len(groups):
            pairs = np.ix_(group, groups[s + 1])
            num_bytes = model.microbatch_size * model.layer_activation_bytes[end - 1]
            transfer = float(latency[pairs].mean() + num_bytes / bandwidth[pairs].mean())
            fill += compute + transfer
            residual += max(0.0, transfer - compute)
    return worst


def _even_bounds(snapshot: SwarmSnapshot, groups: list[list[int]]) -> tuple[int, ...]:
    capacities = np.array([snapshot.flops[g].sum() for g in groups])
    return split_by_capacity(snapshot.model.layer_flops, capacities)


def _expand(candidate: tuple[tuple[int, ...], tuple[int, ...]]) -> list:
    order, bounds = candidate
    expanded = []
    for i in range(len(order)):
        for j in range(i + 1, len(order)):
            swapped = list(order)
            swapped[i], swapped[j] = swapped[j], swapped[i]
            expanded.append((tuple(swapped), bounds))
    for k in range(len(bounds) - 1):
        for step in (-1, 1):
            moved = list(bounds)
            moved[k] += step
            previous = moved[k - 1] if k > 0 else 0
            if previous < moved[k] < moved[k + 1]:
                expanded.append((order, tuple(moved)))
    return expanded


def plan_spantrain(
    snapshot: SwarmSnapshot, config: SpanTrainConfig | None = None, *, rng: np.random.Generator
) -> Plan:
    """SpanTrain plan: one stage per first-level group that has a reliable device (module doc).

    Groups without a reliable device join the group of best bandwidth as clients; stages beyond
    the layer count merge with their neighbour.
    """
    config = config or SpanTrainConfig()
    reliable = set(snapshot.reliable_indices())
    groups = group_by_network(snapshot, config.network_ratio)
    served = [g for g in groups if reliable & set(g)]
    if not served:
        raise ValueError("a plan needs at least one reliable device")
    for g in (g for g in groups if not reliable & set(g)):
        best = max(range(len(served)), key=lambda k: (snapshot.links.bandwidth[np.ix_(g, served[k])].mean(), -k))
        served[best] = sorted(served[best] + g)
    while len(served) > snapshot.model.num_layers:
        served = [sorted(served[0] + served[1])] + served[2:]
    beam = []
    for _ in range(config.beam_width):
        order = tuple(int(k) for k in rng.permutation(len(served)))
        beam.append((order, _even_bounds(snapshot, [served[k] for k in order])))
    for _ in range(config.num_iterations):
        pool = list(dict.fromkeys(beam + [c for b in beam for c in _expand(b)]))
        pool.sort(key=lambda c: (estimate_cost(snapshot, [served[k] for k in c[0]], c[1]), c))
        beam = pool[: config.beam_width]
    order, bounds = beam[0]
    arranged = []
    for k in order:
        members = np.array(served[k], dtype=np.int64)
        is_server = np.array([i in reliable for i in served[k]])
        arranged.append((members[is_server], members[~is_server]))
    return assemble_plan(snapshot, arranged, bounds)
