"""Stage order as an open travelling-salesman path, solved by simulated annealing (seed 000 §3.3.3).

The coarse graph H has one node per cluster and the mean edge delay between two clusters as the
edge weight. The path visits every cluster once; its cost is ``num_nodes * max_hop + sum_hops``:
seed 000 Eq. 2 takes a maximum over stages, so the longest hop dominates and the total breaks
ties. Moves reverse a sub-path (2-opt); acceptance is Metropolis with a geometric temperature
schedule. Paths with at most ``exact_limit`` nodes are enumerated instead, which is exact and,
at that size, cheaper than annealing.
"""

from __future__ import annotations

import itertools
import math

import numpy as np


def build_coarse_graph(edges: np.ndarray, clusters: list[np.ndarray]) -> np.ndarray:
    """Mean edge delay between every pair of clusters (graph H of seed 000 §3.3.3)."""
    num_clusters = len(clusters)
    coarse = np.zeros((num_clusters, num_clusters))
    for i in range(num_clusters):
        for j in range(i + 1, num_clusters):
            coarse[i, j] = coarse[j, i] = float(edges[np.ix_(clusters[i], clusters[j])].mean())
    return coarse


def measure_path(coarse: np.ndarray, path: list[int]) -> float:
    """Path cost ``n * max_hop + sum_hops``."""
    if len(path) < 2:
        return 0.0
    hops = coarse[path[:-1], path[1:]]
    return float(len(path) * hops.max() + hops.sum())


def order_clusters(
    coarse: np.ndarray, rng: np.random.Generator, *, num_iterations: int = 4000, exact_limit: int = 7
) -> list[int]:
    """Returns a visiting order of the clusters minimising ``measure_path``."""
    num_nodes = coarse.shape[0]
    if num_nodes <= 2:
        return list(range(num_nodes))
    if num_nodes <= exact_limit:
        return list(min(itertools.permutations(range(num_nodes)), key=lambda p: measure_path(coarse, list(p))))
    path = _nearest_neighbour_path(coarse)
    cost = measure_path(coarse, path)
    best_path, best_cost = list(path), cost
    temperature = max(float(coarse.mean()), 1e-9)
    cooling = (1e-3) ** (1.0 / max(num_iterations, 1))
    for _ in range(num_iterations):
        i, j = sorted(rng.choice(num_nodes, size=2, replace=False).tolist())
        candidate = path[:i] + path[i:j + 1][::-1] + path[j + 1:]
        candidate_cost = measure_path(coarse, candidate)
        delta = candidate_cost - cost
        if delta <= 0 or rng.random() < math.exp(-delta / temperature):
            path, cost = candidate, candidate_cost
            if cost < best_cost:
                best_path, best_cost = list(path), cost
        temperature *= cooling
    return best_path


def _nearest_neighbour_path(coarse: np.ndarray) -> list[int]:
    """Greedy start: from the node with the largest total delay, always go to the nearest node."""
    num_nodes = coarse.shape[0]
    path = [int(np.argmax(coarse.sum(axis=1)))]
    remaining = set(range(num_nodes)) - {path[0]}
    while remaining:
        last = path[-1]
        nearest = min(remaining, key=lambda j: (coarse[last, j], j))
        path.append(nearest)
        remaining.remove(nearest)
    return path
