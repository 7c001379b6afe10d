"""Scores arrangements (ordered server groups with their clients) under the cost model (``costs``).

An arrangement fixes which devices serve and work for each stage, in pipeline order; its cost is
seconds per micro-batch of the best layer split (``layer_split``, exact for the bottleneck term),
with the window bound ``R / W`` of that split applied on top, exactly as ``estimate_throughput``
scores the resulting plan. Search procedures score thousands of arrangements that share most
groups, so the profile (``costs.StageGroup``) and stage delay matrix of each distinct
``(servers, clients)`` group and the link terms of each distinct server pair are computed once and
memoised: a local search at 1,000 devices asked for about five profiles per distinct group.
"""

from __future__ import annotations

import numpy as np

from planner.assembly import assemble_plan, build_edge_delays, typical_transfer_bytes
from planner.costs import (
    LinkTerms, StageGroup, count_flushed, count_inflight, estimate_averaging_share, estimate_exchange,
    estimate_link_terms, profile_group, seconds_per_microbatch,
)
from planner.layer_split import (
    build_cost_matrix, build_floor_matrix, build_link_matrix, compute_range_delays, split_by_matrices,
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
        self._groups: dict[tuple, StageGroup] = {}
        self._link_terms: dict[tuple, LinkTerms] = {}
        self._edges: np.ndarray | None = None

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
            matrix = build_cost_matrix(
                self.snapshot.model, self._group(servers, clients), num_inflight=inflight, link_per_byte=None,
                runtime=self.snapshot.runtime,
            )
            self._delays[key] = matrix
        return matrix

    def _group(self, servers: tuple[int, ...], clients: tuple[int, ...]) -> StageGroup:
        """The group's profile, memoised: the screening, link, floor and round-trip terms of one
        candidate stage all read it."""
        key = (servers, clients)
        group = self._groups.get(key)
        if group is None:
            group = profile_group(self.snapshot, np.array(servers, dtype=np.int64), np.array(clients, dtype=np.int64))
            self._groups[key] = group
        return group

    def floor_matrix(self, servers: tuple[int, ...], clients: tuple[int, ...]) -> np.ndarray:
        """Blocking averaging floor ``AT[a, b] / d`` of the group (``costs`` module doc)."""
        key = (servers, clients)
        floor = self._floors.get(key)
        if floor is None:
            floor = build_floor_matrix(self.snapshot.model, self._group(servers, clients), runtime=self.snapshot.runtime)
            self._floors[key] = floor
        return floor

    def link_terms(self, senders: tuple[int, ...], receivers: tuple[int, ...]) -> LinkTerms:
        """``LinkTerms`` of the link between two server groups, memoised."""
        key = (senders, receivers)
        terms = self._link_terms.get(key)
        if terms is None:
            terms = estimate_link_terms(
                self.snapshot, np.array(senders, dtype=np.int64), np.array(receivers, dtype=np.int64)
            )
            self._link_terms[key] = terms
        return terms

    def link_matrix(self, group: tuple[tuple[int, ...], tuple[int, ...]], receivers: tuple[int, ...]) -> np.ndarray:
        """``L_k[a, b]``: the outgoing link of stage ``group`` (servers, clients) for every range."""
        key = (group, receivers)
        matrix = self._links.get(key)
        if matrix is None:
            per_byte = self.link_terms(group[0], receivers).bottleneck_per_byte
            matrix = build_link_matrix(
                self.snapshot.model, self._group(*group), per_byte, runtime=self.snapshot.runtime
            )
            self._links[key] = matrix
        return matrix

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
            delay = float(compute_range_delays(
                self.snapshot.model, self._group(servers, clients), np.array([start]), np.array([end]),
                num_inflight=inflight,
            )[0])
            self._ranges[key] = delay
        return delay

    def window(self, arrangement: Arrangement) -> int:
        """``W`` of the arrangement: the runtime's window times its stage-0 servers."""
        return count_inflight(self.snapshot.runtime, len(arrangement[0][0]))

    def stage_cost(self, arrangement: Arrangement, bounds: tuple[int, ...], k: int) -> float:
        """``term_k`` (delay, outgoing link, floor) with the layer boundaries held fixed."""
        servers, clients = arrangement[k]
        start = bounds[k - 1] if k > 0 else 0
        cost = self.range_delay(servers, clients, self.window(arrangement), start, bounds[k])
        if k + 1 < len(arrangement):
            cost = max(cost, float(self.link_matrix(arrangement[k], arrangement[k + 1][0])[start, bounds[k]]))
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
        if base is None or len(base[0]) != num_stages or len(base[0][0][0]) != len(arrangement[0][0]):
            return max(self.stage_cost(arrangement, bounds, k) for k in range(num_stages))
        previous, costs = base
        worst = 0.0
        for k in range(num_stages):
            changed = arrangement[k] != previous[k]
            changed |= k + 1 < num_stages and arrangement[k + 1][0] != previous[k + 1][0]
            worst = max(worst, self.stage_cost(arrangement, bounds, k) if changed else float(costs[k]))
        return worst

    def stage_matrices(self, arrangement: Arrangement) -> list[np.ndarray]:
        """Per-stage ``term_k`` matrices (delay, outgoing link, floor) of ``arrangement``."""
        num_stages = len(arrangement)
        inflight = self.window(arrangement)
        matrices = []
        for k, (servers, clients) in enumerate(arrangement):
            matrix = self.stage_matrix(servers, clients, inflight)
            if k + 1 < num_stages:
                matrix = np.maximum(matrix, self.link_matrix(arrangement[k], arrangement[k + 1][0]))
            matrices.append(np.maximum(matrix, self.floor_matrix(servers, clients)))
        return matrices

    def score(self, arrangement: Arrangement) -> tuple[tuple[int, ...], float]:
        """(layer boundaries, seconds per micro-batch) of the best layer split; inf when infeasible.

        The split minimises the bottleneck term; the window bound ``R / W`` of that split is then
        applied (under the flush schedule, the step's fill, drain and round:
        ``costs.seconds_per_microbatch``), so the cost is what ``estimate_throughput`` gives the plan.
        """
        self.num_evaluations += 1
        if len(arrangement) > self.snapshot.model.num_layers:
            return (), float("inf")
        bounds, cost = split_by_matrices(self.stage_matrices(arrangement))
        if not np.isfinite(cost):
            return bounds, cost
        model, runtime = self.snapshot.model, self.snapshot.runtime
        num_flushed = count_flushed(runtime, model)
        starts = (0,) + tuple(bounds[:-1])
        exchange = max(estimate_exchange(model, self._group(*stage), start, end, runtime=runtime)
                       for stage, start, end in zip(arrangement, starts, bounds)) if num_flushed else 0.0
        return bounds, seconds_per_microbatch(cost, self.round_trip(arrangement, bounds), self.window(arrangement),
                                              exchange=exchange, num_flushed=num_flushed)

    def round_trip(self, arrangement: Arrangement, bounds: tuple[int, ...]) -> float:
        """``R`` of the cost model for fixed boundaries (``costs`` module doc)."""
        model, flops = self.snapshot.model, self.snapshot.flops
        seconds, start = 0.0, 0
        for k, (servers, clients) in enumerate(arrangement):
            end = bounds[k]
            seconds += model.microbatch_size * sum(model.layer_flops[start:end]) / float(flops[list(servers)].mean())
            if k + 1 < len(arrangement):
                link = self.link_terms(servers, arrangement[k + 1][0])
                share = estimate_averaging_share(
                    model, self._group(servers, clients), start, end, runtime=self.snapshot.runtime
                )
                num_bytes = model.microbatch_size * model.layer_activation_bytes[end - 1] / (1.0 - share)
                seconds += link.round_trip_latency + link.round_trip_per_byte * num_bytes
            start = end
        return seconds

    def stage_costs(self, arrangement: Arrangement, bounds: tuple[int, ...]) -> np.ndarray:
        """Per-stage cost for fixed layer boundaries."""
        starts = (0,) + tuple(bounds[:-1])
        matrices = self.stage_matrices(arrangement)
        return np.array([m[a, b] for m, a, b in zip(matrices, starts, bounds)])

    def to_plan(self, arrangement: Arrangement, bounds: tuple[int, ...]) -> Plan:
        """The Plan of an arrangement and its boundaries.

        A client that cannot hold its stage's weights gets no work in the cost model (its cap is
        0) and would make the plan unfit (``costs.is_within_memory``), so it is left idle here.
        """
        model, memory = self.snapshot.model, self.snapshot.memory_bytes
        factor = 1.0 + model.optimizer_bytes_per_param_byte
        starts = (0,) + tuple(bounds[:-1])
        groups = [
            (np.array(s, dtype=np.int64),
             np.array([c for c in clients if memory[c] >= sum(model.layer_param_bytes[a:b]) * factor], dtype=np.int64))
            for (s, clients), a, b in zip(arrangement, starts, bounds)
        ]
        return assemble_plan(self.snapshot, groups, bounds, edges=self.edges)
