"""Brute-force optimum over all plans of a small swarm: the oracle of tests and benchmarks.

The search space is the one every planner here draws from: any subset of the reliable devices
split into an ordered sequence of ``K <= L`` non-empty server groups, each unreliable device idle
or a client of any stage, and the optimal layer split for that arrangement (``layer_split``, an
exact DP; a test checks it against enumerating all splits). The objective is seed 000 Eq. 2
(``costs``). Cost grows like ``sum_K K! S(r, K) (K + 1)^u``; keep ``r + u <= 8``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from planner.evaluation import ArrangementScorer
from planner.plan import Plan
from planner.snapshot import SwarmSnapshot


def iterate_set_partitions(items: list[int]) -> Iterator[list[list[int]]]:
    """Yields every partition of ``items`` into non-empty blocks, each exactly once."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in iterate_set_partitions(rest):
        for i in range(len(partition)):
            yield partition[:i] + [[first] + partition[i]] + partition[i + 1:]
        yield [[first]] + partition


def iterate_server_sequences(reliable: list[int], max_stages: int) -> Iterator[list[list[int]]]:
    """Yields every ordered sequence of disjoint non-empty groups of reliable devices."""
    for size in range(1, len(reliable) + 1):
        for subset in itertools.combinations(reliable, size):
            for partition in iterate_set_partitions(list(subset)):
                if len(partition) > max_stages:
                    continue
                for ordered in itertools.permutations(partition):
                    yield [sorted(block) for block in ordered]


def find_optimal_plan(snapshot: SwarmSnapshot) -> tuple[Plan | None, float]:
    """Returns (best plan, its throughput in samples/s); (None, 0.0) when nothing is feasible."""
    model = snapshot.model
    reliable = snapshot.reliable_indices()
    unreliable = snapshot.unreliable_indices()
    scorer = ArrangementScorer(snapshot)
    best_cost, best = np.inf, None
    for servers in iterate_server_sequences(reliable, model.num_layers):
        num_stages = len(servers)
        for placement in itertools.product(range(-1, num_stages), repeat=len(unreliable)):
            arrangement = [
                (tuple(servers[s]), tuple(u for u, k in zip(unreliable, placement) if k == s))
                for s in range(num_stages)
            ]
            bounds, cost = scorer.score(arrangement)
            if cost < best_cost:
                best_cost, best = cost, (arrangement, bounds)
    if best is None:
        return None, 0.0
    return scorer.to_plan(*best), model.microbatch_size / best_cost
