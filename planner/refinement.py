"""Local search on an arrangement: move single devices onto the bottleneck stage.

Not in the seeds: seed 000 §3.3.3 builds the plan in one pass (clusters, order, clients, layers);
its greedy steps can leave a stage that is clearly the bottleneck. We finish with a steepest-
descent search whose moves all target the bottleneck stage b of the current best layer split:

* a client or a spare server (its stage keeps at least one) of another stage moves to b;
* an idle device joins b (as a server if reliable);
* a member of b leaves b for idle (a far server can cost b more in link time than it gives);
* one server (or client) of b swaps with one of a neighbouring stage;
* two adjacent stages merge (fewer hops, more parallel link streams), or a stage is dropped;
* b splits in two (less compute per stage, smaller averaging groups).

Only the ``max_candidates_per_stage`` fastest movers of each stage are tried, which bounds one
round at ``O(K * max_candidates_per_stage)`` scorings whatever the swarm size. A move is accepted
only when it lowers the bottleneck, so the search ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.clustering import split_cluster
from planner.evaluation import Arrangement, ArrangementScorer


@dataclass(frozen=True, kw_only=True)
class RefinementConfig:
    """Budget of the local search.

    Attributes:
        max_rounds: accepted moves at most; raise for higher quality on large swarms.
        max_candidates_per_stage: fastest movers tried per stage and kind per round.
        num_exact: screened moves per round whose layers are re-split exactly.
        max_merge_stages: merges of adjacent stages are tried only up to this many stages
            (each merge changes every stage's in-flight count, so it cannot be screened cheaply).
        num_donor_stages: least-loaded stages that movers are taken from.
        max_screened_moves: moves screened per call at most; bounds the time on large swarms.
        num_kicks: random restarts of the iterated local search.
        kick_size: random moves per restart.
    """

    max_rounds: int = 40
    max_candidates_per_stage: int = 2
    num_exact: int = 6
    max_merge_stages: int = 12
    num_donor_stages: int = 3
    max_screened_moves: int = 1000
    num_kicks: int = 4
    kick_size: int = 2

    def __post_init__(self) -> None:
        if self.max_rounds < 0 or self.max_screened_moves < 0 or self.num_kicks < 0 or self.kick_size < 1:
            raise ValueError("max_rounds, max_screened_moves, num_kicks must be >= 0; kick_size >= 1")
        if min(self.max_candidates_per_stage, self.num_exact, self.num_donor_stages) < 1:
            raise ValueError("max_candidates_per_stage, num_exact and num_donor_stages must be >= 1")


def _fastest(flops: np.ndarray, members: tuple[int, ...], count: int) -> list[int]:
    """The ``count`` fastest members, ties broken by index."""
    return sorted(members, key=lambda i: (-flops[i], i))[:count]


def _replace(arrangement: Arrangement, k: int, servers: tuple, clients: tuple) -> Arrangement:
    """A copy of ``arrangement`` with stage k replaced (members sorted)."""
    return arrangement[:k] + [(tuple(sorted(servers)), tuple(sorted(clients)))] + arrangement[k + 1:]


def _move(arrangement: Arrangement, device: int, source: int | None, target: int | None, *, is_server: bool) -> Arrangement:
    """Moves ``device`` from stage ``source`` to stage ``target`` (None: idle)."""
    if source is not None:
        servers, clients = arrangement[source]
        arrangement = _replace(
            arrangement, source, tuple(x for x in servers if x != device), tuple(x for x in clients if x != device)
        )
    if target is not None:
        servers, clients = arrangement[target]
        if is_server:
            arrangement = _replace(arrangement, target, servers + (device,), clients)
        else:
            arrangement = _replace(arrangement, target, servers, clients + (device,))
    return arrangement


def _list_swaps(
    arrangement: Arrangement, first: int, second: int, *, flops: np.ndarray, count: int
) -> list[Arrangement]:
    """Exchanges of one server (or one client) between stages ``first`` and ``second``."""
    swaps = []
    for position, is_server in ((0, True), (1, False)):
        for x in _fastest(flops, arrangement[first][position], count) + _slowest(flops, arrangement[first][position]):
            for y in _fastest(flops, arrangement[second][position], count) + _slowest(flops, arrangement[second][position]):
                moved = _move(arrangement, x, first, second, is_server=is_server)
                swaps.append(_move(moved, y, second, first, is_server=is_server))
    return swaps


def _slowest(flops: np.ndarray, members: tuple[int, ...]) -> list[int]:
    """The slowest member as a one-element list (empty for no members)."""
    return sorted(members, key=lambda i: (flops[i], i))[:1]


def list_moves(
    arrangement: Arrangement, bottleneck: int, idle: list[int], *, flops: np.ndarray,
    reliable: set[int], count: int, donors: list[int],
) -> list[Arrangement]:
    """Candidate arrangements one device move away, each touching the bottleneck or its link.

    The bottleneck's cost includes its link to the next stage, whose stream count depends on
    both server groups, so stages ``b - 1``, ``b`` and ``b + 1`` are all targets. Movers come
    from the ``donors`` stages (the least loaded) and from the idle devices.
    """
    num_stages = len(arrangement)
    targets = [k for k in (bottleneck, bottleneck + 1, bottleneck - 1) if 0 <= k < num_stages]
    movers: list[tuple[int, int | None, bool]] = []
    for k in donors:
        servers, clients = arrangement[k]
        movers += [(c, k, False) for c in _fastest(flops, clients, count)]
        if len(servers) > 1:
            movers += [(s, k, True) for s in _fastest(flops, servers, count)]
    movers += [(d, None, d in reliable) for d in _fastest(flops, tuple(idle), count)]
    moves = []
    for device, source, is_server in movers:
        for target in targets:
            if target != source:
                moves.append(_move(arrangement, device, source, target, is_server=is_server))
    servers, clients = arrangement[bottleneck]
    leavers = [(c, False) for c in _fastest(flops, clients, count) + _slowest(flops, clients)]
    if len(servers) > 1:
        leavers += [(s, True) for s in _fastest(flops, servers, count) + _slowest(flops, servers)]
    for device, is_server in dict.fromkeys(leavers):
        moves.append(_move(arrangement, device, bottleneck, None, is_server=is_server))
    for other in targets[1:]:
        moves += _list_swaps(arrangement, bottleneck, other, flops=flops, count=count)
    return moves


def list_merges(arrangement: Arrangement, bounds: tuple[int, ...]) -> list[tuple[Arrangement, tuple[int, ...]]]:
    """Every merge of two adjacent stages, and every stage dropped (its devices idle).

    A dropped stage's layers go to the previous stage (the next one for the first stage).
    """
    merges = []
    for k in range(len(arrangement) - 1):
        merged = (arrangement[k][0] + arrangement[k + 1][0], arrangement[k][1] + arrangement[k + 1][1])
        merges.append((_replace(arrangement[: k + 1] + arrangement[k + 2:], k, *merged), bounds[:k] + bounds[k + 1:]))
    if len(arrangement) > 1:
        for k in range(len(arrangement)):
            dropped_bound = k - 1 if k > 0 else 0
            merges.append((arrangement[:k] + arrangement[k + 1:], bounds[:dropped_bound] + bounds[dropped_bound + 1:]))
    return merges


def list_splits(
    arrangement: Arrangement, bounds: tuple[int, ...], bottleneck: int, edges: np.ndarray
) -> list[tuple[Arrangement, tuple[int, ...]]]:
    """The bottleneck stage cut in two along its widest edge (``clustering.split_cluster``).

    Each half keeps the clients nearer to it; the layer range is cut in the middle and both
    orders of the halves are tried. Splitting trades a link hop for less compute per stage and
    a smaller averaging group.
    """
    servers, clients = arrangement[bottleneck]
    start = bounds[bottleneck - 1] if bottleneck > 0 else 0
    if len(servers) < 2 or bounds[bottleneck] - start < 2:
        return []
    first, second = split_cluster(edges, np.array(servers, dtype=np.int64))
    near_first = [c for c in clients if edges[c, first].mean() <= edges[c, second].mean()]
    halves = [
        (tuple(first.tolist()), tuple(near_first)),
        (tuple(second.tolist()), tuple(c for c in clients if c not in near_first)),
    ]
    middle = (start + bounds[bottleneck]) // 2
    new_bounds = bounds[:bottleneck] + (middle,) + bounds[bottleneck:]
    splits = []
    for pair in (halves, halves[::-1]):
        splits.append((arrangement[:bottleneck] + pair + arrangement[bottleneck + 1:], new_bounds))
    return splits


class _Search:
    """State shared by the descents of one refinement: scorer, budget and move generators."""

    def __init__(self, scorer: ArrangementScorer, config: RefinementConfig) -> None:
        self.scorer, self.config = scorer, config
        self.snapshot = scorer.snapshot
        self.reliable = set(self.snapshot.reliable_indices())
        self.edges = scorer.edges
        self.num_screened = 0

    def list_all_moves(
        self, arrangement: Arrangement, bounds: tuple[int, ...], stage_costs: np.ndarray
    ) -> list[tuple[Arrangement, tuple[int, ...]]]:
        """Every move of the module docstring, each with the boundaries it is screened with."""
        config, snapshot = self.config, self.snapshot
        used = {i for servers, clients in arrangement for i in servers + clients}
        idle = [i for i in range(snapshot.num_devices) if i not in used]
        bottleneck = int(np.argmax(stage_costs))
        donors = [int(k) for k in np.argsort(stage_costs, kind="stable")[: config.num_donor_stages]]
        moves = [
            (candidate, bounds) for candidate in list_moves(
                arrangement, bottleneck, idle, flops=snapshot.flops, reliable=self.reliable,
                count=config.max_candidates_per_stage, donors=sorted(set(donors) - {bottleneck}),
            )
        ]
        if len(arrangement) <= config.max_merge_stages:
            moves += list_merges(arrangement, bounds)
        if len(arrangement) < snapshot.model.num_layers:
            moves += list_splits(arrangement, bounds, bottleneck, self.edges)
        return moves

    def descend(self, arrangement: Arrangement) -> tuple[Arrangement, tuple[int, ...], float]:
        """Steepest descent until no screened move lowers the bottleneck or the budget is spent."""
        scorer, config = self.scorer, self.config
        bounds, cost = scorer.score(arrangement)
        for _ in range(config.max_rounds):
            if not np.isfinite(cost) or self.num_screened >= config.max_screened_moves:
                break
            stage_costs = scorer.stage_costs(arrangement, bounds)
            moves = self.list_all_moves(arrangement, bounds, stage_costs)
            self.num_screened += len(moves)
            base = (arrangement, stage_costs)
            screened = sorted(
                (scorer.score_with_bounds(candidate, fixed, base=base), index)
                for index, (candidate, fixed) in enumerate(moves)
            )
            best = None
            for _, index in screened[: config.num_exact]:
                candidate_bounds, candidate_cost = scorer.score(moves[index][0])
                if candidate_cost < cost * (1 - 1e-9) and (best is None or candidate_cost < best[2]):
                    best = (moves[index][0], candidate_bounds, candidate_cost)
            if best is None:
                break
            arrangement, bounds, cost = best
        return arrangement, bounds, cost

    def kick(self, arrangement: Arrangement, bounds: tuple[int, ...], rng: np.random.Generator) -> Arrangement:
        """Applies ``kick_size`` random moves, ignoring whether they help."""
        for _ in range(self.config.kick_size):
            bounds, cost = self.scorer.score(arrangement)
            if not np.isfinite(cost):
                break
            moves = self.list_all_moves(arrangement, bounds, self.scorer.stage_costs(arrangement, bounds))
            if not moves:
                break
            arrangement = moves[int(rng.integers(len(moves)))][0]
        return arrangement


def refine_arrangement(
    scorer: ArrangementScorer, arrangement: Arrangement, config: RefinementConfig, *,
    rng: np.random.Generator,
) -> tuple[Arrangement, tuple[int, ...], float]:
    """Iterated local search; returns (arrangement, boundaries, bottleneck seconds).

    Each descent round screens every move with the layer boundaries held fixed (a few range
    delays each), re-splits the layers of the ``num_exact`` best exactly, and keeps the best of
    those. After a descent ends, ``num_kicks`` times: perturb the best arrangement with random
    moves (from ``rng``) and descend again, keeping the result if it is better.
    """
    search = _Search(scorer, config)
    best = search.descend(arrangement)
    for _ in range(config.num_kicks):
        if search.num_screened >= config.max_screened_moves or not np.isfinite(best[2]):
            break
        candidate = search.descend(search.kick(best[0], best[1], rng))
        if candidate[2] < best[2] * (1 - 1e-9):
            best = candidate
    return best
