"""Seed 000 §3.3.3: the global plan from a swarm snapshot.

1. Divisive hierarchical clustering of the reliable devices on the edge-delay graph with the
   Eq. 2/3 stop rule (``clustering``); each cluster becomes one stage's parameter servers.
2. Stage order: open TSP over the coarse cluster graph by simulated annealing (``ordering``).
3. Each unreliable device joins the partition of least mean delay
   ``(1/|tau_k|) sum_{j in tau_k} alpha_uj + t / beta_uj``.
   Each candidate is also scored with the devices that cannot hold an even share of the layers
   left idle (``drop_small_memory``).
4. Layers by compute: the exact bottleneck split of ``layer_split`` (seed 000 splits in proportion
   to stage compute; the DP also sees links and memory).
5. FS/BS roles (``assembly``).

Two additions, both scored with the cost model (``costs``): the levels next
to the one the stop rule picks, and both directions of the path, are scored in full and the best
kept; then a bounded local search (``refinement``) moves single devices onto the bottleneck stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from planner.assembly import build_edge_delays, typical_transfer_bytes
from planner.clustering import cluster_devices
from planner.evaluation import Arrangement, ArrangementScorer
from planner.ordering import build_coarse_graph, order_clusters
from planner.refinement import RefinementConfig, refine_arrangement
from planner.plan import Plan
from planner.snapshot import SwarmSnapshot


@dataclass(frozen=True, kw_only=True)
class PartitionConfig:
    """Knobs of the seed 000 planner.

    Attributes:
        clustering_patience: clustering levels past a rise of the Eq. 2/3 estimate before stopping.
        num_scored_levels: clustering levels scored in full, nearest the stop rule's level first.
        num_anneal_iterations: simulated-annealing steps of the stage-order search.
        num_refined: best candidates handed to the local search.
        small_swarm_size: swarms of at most this many devices refine every candidate (cheap
            there, and the restarts escape local minima).
        reference_swarm_size: past this many devices the scored levels and the local-search
            budget shrink in proportion, so a plan's time grows about linearly, not quadratically.
        refinement: budget of the local search.
    """

    clustering_patience: int = 3
    num_scored_levels: int = 5
    num_anneal_iterations: int = 3000
    num_refined: int = 1
    small_swarm_size: int = 12
    reference_swarm_size: int = 128
    refinement: RefinementConfig = field(default_factory=RefinementConfig)

    def __post_init__(self) -> None:
        if self.clustering_patience < 1 or self.num_scored_levels < 1 or self.num_refined < 0:
            raise ValueError("clustering_patience and num_scored_levels must be >= 1, num_refined >= 0")
        if self.num_anneal_iterations < 0:
            raise ValueError("num_anneal_iterations must be >= 0")


def assign_unreliable(
    snapshot: SwarmSnapshot, clusters: list[np.ndarray], num_bytes: float
) -> list[list[int]]:
    """Seed 000 §3.3.3: each unreliable device to the cluster of least mean delay."""
    unreliable = np.array(snapshot.unreliable_indices(), dtype=np.int64)
    members: list[list[int]] = [[] for _ in clusters]
    if unreliable.size == 0:
        return members
    latency, bandwidth = snapshot.links.latency_delay[unreliable], snapshot.links.bandwidth[unreliable]
    delay = latency + num_bytes / bandwidth
    means = np.stack([delay[:, c].mean(axis=1) for c in clusters], axis=1)
    for u, k in zip(unreliable.tolist(), np.argmin(means, axis=1).tolist()):
        members[k].append(u)
    return members


def drop_small_memory(snapshot: SwarmSnapshot, arrangement: Arrangement) -> Arrangement:
    """Idles the members that cannot hold an even share of the layers (at least one server stays).

    An even share is ``ceil(L / K)`` consecutive layers with their optimizer state; a server that
    cannot hold it would make every balanced split infeasible (seed 001 §3.3 memory budget).
    """
    model = snapshot.model
    window = -(-model.num_layers // len(arrangement))
    params = np.convolve(model.layer_param_bytes, np.ones(window), mode="valid")
    needed = float(params.max()) * (1.0 + model.optimizer_bytes_per_param_byte)
    memory = snapshot.memory_bytes
    filtered = []
    for servers, clients in arrangement:
        kept = tuple(s for s in servers if memory[s] >= needed)
        if not kept:
            kept = (max(servers, key=lambda s: (memory[s], -s)),)
        filtered.append((kept, tuple(c for c in clients if memory[c] >= needed)))
    return filtered


def pick_levels(num_levels: int, chosen: int, count: int) -> list[int]:
    """Up to ``count`` level indices, nearest to ``chosen`` first (ties: fewer clusters first)."""
    return sorted(range(num_levels), key=lambda i: (abs(i - chosen), i))[:count]


def build_candidates(
    snapshot: SwarmSnapshot, config: PartitionConfig, rng: np.random.Generator, *,
    edges: np.ndarray | None = None,
) -> list[Arrangement]:
    """Steps 1–3 for each scored clustering level, in both path directions."""
    reliable = np.array(snapshot.reliable_indices(), dtype=np.int64)
    if reliable.size == 0:
        raise ValueError("a plan needs at least one reliable device to serve as parameter server")
    num_bytes = typical_transfer_bytes(snapshot)
    if edges is None:
        edges = build_edge_delays(snapshot, num_bytes)
    model = snapshot.model
    weight_bytes = sum(model.layer_param_bytes) * (1.0 + model.optimizer_bytes_per_param_byte)
    typical_memory = float(np.median(snapshot.memory_bytes[reliable]))
    max_clusters = min(model.num_layers, reliable.size)
    levels, chosen = cluster_devices(
        edges, snapshot.flops, model, devices=reliable, max_clusters=max_clusters,
        min_clusters=min(max_clusters, int(np.ceil(weight_bytes / max(typical_memory, 1.0)))),
        patience=config.clustering_patience,
    )
    candidates = []
    effort = min(1.0, config.reference_swarm_size / snapshot.num_devices)
    num_levels = max(2, round(config.num_scored_levels * effort))
    for level in pick_levels(len(levels), chosen, num_levels):
        clusters = levels[level]
        order = order_clusters(
            build_coarse_graph(edges, clusters), rng, num_iterations=config.num_anneal_iterations
        )
        clients = assign_unreliable(snapshot, clusters, num_bytes)
        arrangement = [(tuple(clusters[k].tolist()), tuple(clients[k])) for k in order]
        for variant in (arrangement, drop_small_memory(snapshot, arrangement)):
            candidates.append(variant)
            if len(variant) > 1:
                candidates.append(variant[::-1])
    unique = []
    for candidate in candidates:
        if candidate not in unique:
            unique.append(candidate)
    return unique


def plan_partition(
    snapshot: SwarmSnapshot, config: PartitionConfig | None = None, *, rng: np.random.Generator
) -> Plan:
    """The seed 000 plan of ``snapshot`` (see module docstring); deterministic given ``rng``'s seed."""
    config = config or PartitionConfig()
    scorer = ArrangementScorer(snapshot)
    scored = []
    for index, arrangement in enumerate(build_candidates(snapshot, config, rng, edges=scorer.edges)):
        bounds, cost = scorer.score(arrangement)
        scored.append((cost, index, arrangement, bounds))
    scored.sort(key=lambda item: (item[0], item[1]))
    best_cost, _, best_arrangement, best_bounds = scored[0]
    num_refined = len(scored) if snapshot.num_devices <= config.small_swarm_size else config.num_refined
    effort = min(1.0, config.reference_swarm_size / snapshot.num_devices)
    refinement = replace(
        config.refinement, max_screened_moves=round(config.refinement.max_screened_moves * effort)
    )
    for cost, _, arrangement, bounds in scored[:num_refined]:
        refined, refined_bounds, refined_cost = refine_arrangement(scorer, arrangement, refinement, rng=rng)
        if refined_cost < best_cost:
            best_cost, best_arrangement, best_bounds = refined_cost, refined, refined_bounds
    if not np.isfinite(best_cost):
        raise ValueError("no feasible plan: the reliable devices cannot hold the model in memory")
    return scorer.to_plan(best_arrangement, best_bounds)
