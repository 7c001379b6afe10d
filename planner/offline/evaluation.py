"""Scores arrangements (ordered server groups with their clients) under seed 000 Eq. 2.

An arrangement fixes which devices serve and work for each stage, in pipeline order; its cost is
the bottleneck stage term of the best layer split (``layer_split``). Search procedures score
thousands of arrangements that share most groups, so the stage delay matrix of each distinct
``(servers, clients, in-flight count)`` and the link terms of each distinct server pair are
computed once and memoised.
"""

from __future__ import annotations

import numpy as np

from planner.assembly import assemble_plan, build_edge_delays, typical_transfer_bytes
from planner.costs import count_inflight, profile_group
from planner.layer_split import (
    build_cost_matrix, build_floor_matrix, build_link_terms, compute_range_delays, split_by_matrices,
)
from planner.plan import Plan
from planner.snapshot import SwarmSnapshot

Arrangement = list[tuple[tuple[int, ...], tuple[int, ...]]]


class ArrangementScorer:
    """Memoising scorer of arrangements for one snapshot."""

    def __init__(self, snapshot: SwarmSnapshot) -> None:
        self.snapshot = snapshot
        self.num_evaluations = 0
        self._delays: dict[tuple, np.ndarray] = {}
        self._links: dict[tuple, np.ndarray] = {}
        self._ranges: dict[tuple, float] = {}
        self._floors: dict[tuple, np.ndarray] = {}
        self._edges: np.ndarray | None = None
        model = snapshot.model
        self._out_bytes = model.microbatch_size * np.asarray((0.0,) + model.layer_activation_bytes)

    @property
    def edges(self) -> np.ndarray:
        """Edge delays of seed 000 §3.3.3 for a typical transfer, built once per scorer."""
        if self._edges is None:
            self._edges = build_edge_delays(self.snapshot, typical_transfer_bytes(self.snapshot))
        return self._edges

    def stage_matrix(self, servers: tuple[int, ...], clients: tuple[int, ...], inflight: int) -> np.ndarray:
        """Stage delay ``DT[a, b]`` of the group for every layer range (inf where a >= b)."""
        key = (servers, clients, inflight)
        matrix = self._delays.get(key)
        if matrix is None:
            group = profile_group(
                self.snapshot, np.array(servers, dtype=np.int64), np.array(clients, dtype=np.int64)
            )
            matrix = build_cost_matrix(self.snapshot.model, group, num_inflight=inflight, link_terms=None)
            self._delays[key] = matrix
        return matrix

    def floor_matrix(self, servers: tuple[int, ...], clients: tuple[int, ...]) -> np.ndarray:
        """Averaging floor ``AT[a, b] / d`` of the group (``costs`` module doc)."""
        key = (servers, clients)
        floor = self._floors.get(key)
        if floor is None:
            group = profile_group(
                self.snapshot, np.array(servers, dtype=np.int64), np.array(clients, dtype=np.int64)
            )
            floor = build_floor_matrix(self.snapshot.model, group)
            self._floors[key] = floor
        return floor

    def link_terms(self, senders: tuple[int, ...], receivers: tuple[int, ...]) -> tuple[float, float]:
        """``(alpha_f + alpha_b, per-byte seconds)`` of the link between two server groups."""
        return build_link_terms(
            self.snapshot, np.array(senders, dtype=np.int64), np.array(receivers, dtype=np.int64)
        )

    def link_row(self, senders: tuple[int, ...], receivers: tuple[int, ...]) -> np.ndarray:
        """Link delay to the next stage for every stage end ``b`` (broadcast over ``a``)."""
        key = (senders, receivers)
        row = self._links.get(key)
        if row is None:
            fixed, per_byte = build_link_terms(
                self.snapshot, np.array(senders, dtype=np.int64), np.array(receivers, dtype=np.int64)
            )
            row = (fixed + per_byte * self._out_bytes)[None, :]
            self._links[key] = row
        return row

    def range_delay(
        self, servers: tuple[int, ...], clients: tuple[int, ...], inflight: int, start: int, end: int
    ) -> float:
        """Stage delay of one layer range, without building the whole matrix."""
        matrix = self._delays.get((servers, clients, inflight))
        if matrix is not None:
            return float(matrix[start, end])
        key = (servers, clients, inflight, start, end)
        delay = self._ranges.get(key)
        if delay is None:
            group = profile_group(
                self.snapshot, np.array(servers, dtype=np.int64), np.array(clients, dtype=np.int64)
            )
            delay = float(compute_range_delays(
                self.snapshot.model, group, np.array([start]), np.array([end]), num_inflight=inflight
            )[0])
            self._ranges[key] = delay
        return delay

    def stage_cost(self, arrangement: Arrangement, bounds: tuple[int, ...], k: int) -> float:
        """Cost of stage k (delay plus outgoing link) with the layer boundaries held fixed."""
        num_stages = len(arrangement)
        servers, clients = arrangement[k]
        inflight = count_inflight(k, num_stages, self.snapshot.model.num_microbatches)
        start = bounds[k - 1] if k > 0 else 0
        cost = self.range_delay(servers, clients, inflight, start, bounds[k])
        if k + 1 < num_stages:
            cost += float(self.link_row(servers, arrangement[k + 1][0])[0, bounds[k]])
        return max(cost, float(self.floor_matrix(servers, clients)[start, bounds[k]]))

    def score_with_bounds(
        self, arrangement: Arrangement, bounds: tuple[int, ...], *,
        base: tuple[Arrangement, np.ndarray] | None = None,
    ) -> float:
        """Bottleneck seconds with the layer boundaries held fixed.

        ``base`` is an arrangement of the same length with its per-stage costs: only the stages
        whose members, or whose successor's servers, differ from it are recomputed.
        """
        num_stages = len(arrangement)
        if base is None or len(base[0]) != num_stages:
            return max(self.stage_cost(arrangement, bounds, k) for k in range(num_stages))
        previous, costs = base
        worst = 0.0
        for k in range(num_stages):
            changed = arrangement[k] != previous[k]
            changed |= k + 1 < num_stages and arrangement[k + 1][0] != previous[k + 1][0]
            worst = max(worst, self.stage_cost(arrangement, bounds, k) if changed else float(costs[k]))
        return worst

    def stage_matrices(self, arrangement: Arrangement) -> list[np.ndarray]:
        """Per-stage cost matrices (stage delay plus outgoing link) of ``arrangement``."""
        num_stages = len(arrangement)
        matrices = []
        for k, (servers, clients) in enumerate(arrangement):
            inflight = count_inflight(k, num_stages, self.snapshot.model.num_microbatches)
            matrix = self.stage_matrix(servers, clients, inflight)
            if k + 1 < num_stages:
                matrix = matrix + self.link_row(servers, arrangement[k + 1][0])
            matrices.append(np.maximum(matrix, self.floor_matrix(servers, clients)))
        return matrices

    def score(self, arrangement: Arrangement) -> tuple[tuple[int, ...], float]:
        """(layer boundaries, bottleneck seconds) of the best layer split; inf when infeasible."""
        self.num_evaluations += 1
        if len(arrangement) > self.snapshot.model.num_layers:
            return (), float("inf")
        return split_by_matrices(self.stage_matrices(arrangement))

    def stage_costs(self, arrangement: Arrangement, bounds: tuple[int, ...]) -> np.ndarray:
        """Per-stage cost for fixed layer boundaries."""
        starts = (0,) + tuple(bounds[:-1])
        matrices = self.stage_matrices(arrangement)
        return np.array([m[a, b] for m, a, b in zip(matrices, starts, bounds)])

    def to_plan(self, arrangement: Arrangement, bounds: tuple[int, ...]) -> Plan:
        """The Plan of an arrangement and its boundaries."""
        groups = [(np.array(s, dtype=np.int64), np.array(c, dtype=np.int64)) for s, c in arrangement]
        return assemble_plan(self.snapshot, groups, bounds, edges=self.edges)
