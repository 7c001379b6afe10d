"""Divisive hierarchical clustering of reliable devices with seed 000's stop rule (§3.3.3).

Graph G: one node per reliable device, edge ``e_ij = alpha_ij + alpha_ji + t/beta_ij + t/beta_ji``.
Top-down, each level splits the cluster of largest diameter in two: the two devices farthest apart
seed the halves and every other member joins the seed with the smaller mean delay to the half's
members so far (two refinement passes). After each level the pipeline time is approximated by
seed 000 Eq. 2 with Eq. 3's ``DT ~ B|H| / (d p sum C)``; the inter-stage term is the largest
nearest-neighbour delay among clusters (every stage needs at least one hop that long). The
levels stop once that estimate has risen for ``patience`` levels in a row, or at ``max_clusters``.
The paper keeps only the level before the first rise; we return every level visited so that the
caller can score the neighbours of that level with the full cost model.
"""

from __future__ import annotations

import numpy as np

from planner.costs import approximate_pipeline_delay
from planner.ordering import build_coarse_graph
from planner.snapshot import ModelProfile


def split_cluster(edges: np.ndarray, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Splits ``members`` in two around its two farthest devices (both halves non-empty)."""
    sub = edges[np.ix_(members, members)]
    flat = int(np.argmax(sub))
    first, second = divmod(flat, members.size)
    if first == second:
        first, second = 0, members.size - 1
    in_first = sub[:, first] <= sub[:, second]
    in_first[first], in_first[second] = True, False
    for _ in range(2):
        to_first = sub[:, in_first].mean(axis=1)
        to_second = sub[:, ~in_first].mean(axis=1)
        updated = to_first <= to_second
        updated[first], updated[second] = True, False
        if np.array_equal(updated, in_first):
            break
        in_first = updated
    return members[in_first], members[~in_first]


def diameter(edges: np.ndarray, members: np.ndarray) -> float:
    """Largest edge delay inside a cluster (0 for a singleton)."""
    if members.size < 2:
        return 0.0
    return float(edges[np.ix_(members, members)].max())


def nearest_cluster_delay(coarse: np.ndarray) -> float:
    """Largest, over clusters, of the mean delay to the nearest other cluster (0 for one cluster)."""
    if coarse.shape[0] < 2:
        return 0.0
    others = coarse + np.diag(np.full(coarse.shape[0], np.inf))
    return float(others.min(axis=1).max())


def cluster_devices(
    edges: np.ndarray, flops: np.ndarray, model: ModelProfile, *, devices: np.ndarray,
    max_clusters: int, min_clusters: int = 1, patience: int = 2,
) -> tuple[list[list[np.ndarray]], int]:
    """Divisive clustering levels of ``devices`` (indices into ``edges`` and ``flops``).

    Returns:
        (levels, chosen): ``levels[p - 1]`` holds the p clusters of level p, each sorted;
        ``levels[chosen]`` is the level seed 000's stop rule picks. Levels with fewer than
        ``min_clusters`` clusters (too few stages to hold the model) score as infinite and do not
        count towards ``patience``.
    """
    devices = np.sort(np.asarray(devices, dtype=np.int64))
    if devices.size == 0:
        raise ValueError("cannot cluster an empty device set")
    total_flops = float(flops[devices].sum())
    clusters = [devices]
    widths = [diameter(edges, devices)]
    row_sums = [edges[devices].sum(axis=0)]
    levels = [list(clusters)]
    best_delay = approximate_pipeline_delay(model, total_flops, num_clusters=1, max_link_delay=0.0)
    if min_clusters > 1:
        best_delay = float("inf")
    chosen, rises = 0, 0
    while len(clusters) < min(max_clusters, devices.size) and rises < patience:
        widest = max(range(len(clusters)), key=lambda i: (widths[i], -i))
        if clusters[widest].size < 2:
            break
        halves = split_cluster(edges, clusters[widest])
        clusters = clusters[:widest] + list(halves) + clusters[widest + 1:]
        widths = widths[:widest] + [diameter(edges, h) for h in halves] + widths[widest + 1:]
        row_sums = row_sums[:widest] + [edges[h].sum(axis=0) for h in halves] + row_sums[widest + 1:]
        order = sorted(range(len(clusters)), key=lambda i: int(clusters[i][0]))
        clusters, widths, row_sums = ([x[i] for i in order] for x in (clusters, widths, row_sums))
        levels.append(list(clusters))
        coarse = build_coarse_graph(edges, clusters, row_sums=row_sums)
        delay = approximate_pipeline_delay(
            model, total_flops, num_clusters=len(clusters), max_link_delay=nearest_cluster_delay(coarse)
        )
        if len(clusters) < min_clusters:
            continue
        if delay < best_delay:
            best_delay, chosen, rises = delay, len(levels) - 1, 0
        else:
            rises += 1
    return levels, chosen
