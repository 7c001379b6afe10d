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


def build_coarse_graph(
    edges: np.ndarray, clusters: list[np.ndarray], *, row_sums: list[np.ndarray] | None = None
) -> np.ndarray:
    """Mean edge delay between every pair of clusters (graph H of seed 000 §3.3.3).

    ``row_sums[i]`` may hold ``edges[clusters[i]].sum(axis=0)``; with it the graph costs
    O(p n) instead of O(n^2). The diagonal (delay inside a cluster) is set to 0.
    """
    if row_sums is None:
        row_sums = [edges[c].sum(axis=0) for c in clusters]
    sums = np.stack([np.array([v[c].sum() for c in clusters]) for v in row_sums])
    sizes = np.array([c.size for c in clusters], dtype=np.float64)
    coarse = sums / np.outer(sizes, sizes)
    np.fill_diagonal(coarse, 0.0)
    return coarse


def measure_path(coarse: np.ndarray | list[list[float]], path: list[int]) -> float:
    """Path cost ``n * max_hop + sum_hops`` (plain Python: paths are short, calls are many)."""
    if len(path) < 2:
        return 0.0
    hops = [coarse[a][b] for a, b in zip(path[:-1], path[1:])]
    return float(len(path) * max(hops) + sum(hops))


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
    rows = coarse.tolist()
    cost = measure_path(rows, path)
    best_path, best_cost = list(path), cost
    temperature = max(float(coarse.mean()), 1e-9)
    cooling = (1e-3) ** (1.0 / max(num_iterations, 1))
    firsts = rng.integers(0, num_nodes, size=num_iterations).tolist()
    offsets = rng.integers(1, num_nodes, size=num_iterations).tolist()
    draws = rng.random(num_iterations).tolist()
    for first, offset, draw in zip(firsts, offsets, draws):
        i, j = sorted((first, (first + offset) % num_nodes))
        candidate = path[:i] + path[i:j + 1][::-1] + path[j + 1:]
        candidate_cost = measure_path(rows, candidate)
        delta = candidate_cost - cost
        if delta <= 0 or draw < math.exp(-delta / temperature):
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
