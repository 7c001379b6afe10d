"""Local search on an arrangement: move single devices onto the bottleneck stage.

Not in the seeds: seed 000 §3.3.3 builds the plan in one pass (clusters, order, clients, layers);
its greedy steps can leave a stage that is clearly the bottleneck. We finish with a steepest-
descent search whose moves all target the bottleneck stage b of the current best layer split:

* a client or a spare server (its stage keeps at least one) of another stage moves to b;
* an idle device joins b (as a server if reliable);
* a member of b leaves b for idle (a far server can cost b more in link time than it gives);
* one server (or client) of b swaps with one of a neighbouring stage;
* two adjacent stages merge (fewer hops, more parallel link streams).

Only the ``max_candidates_per_stage`` fastest movers of each stage are tried, which bounds one
round at ``O(K * max_candidates_per_stage)`` scorings whatever the swarm size. A move is accepted
only when it lowers the bottleneck, so the search ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
    """

    max_rounds: int = 40
    max_candidates_per_stage: int = 2
    num_exact: int = 6
    max_merge_stages: int = 12
    num_donor_stages: int = 3
    max_screened_moves: int = 1500

    def __post_init__(self) -> None:
        if self.max_rounds < 0 or self.max_screened_moves < 0:
            raise ValueError("max_rounds and max_screened_moves must be >= 0")
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
    """Every merge of two adjacent stages, with the boundary between them removed."""
    merges = []
    for k in range(len(arrangement) - 1):
        merged = (arrangement[k][0] + arrangement[k + 1][0], arrangement[k][1] + arrangement[k + 1][1])
        merges.append((_replace(arrangement[: k + 1] + arrangement[k + 2:], k, *merged), bounds[:k] + bounds[k + 1:]))
    return merges


def refine_arrangement(
    scorer: ArrangementScorer, arrangement: Arrangement, config: RefinementConfig
) -> tuple[Arrangement, tuple[int, ...], float]:
    """Steepest descent on the bottleneck; returns (arrangement, boundaries, bottleneck seconds).

    Each round screens every move with the layer boundaries held fixed (a few range delays
    each), re-splits the layers of the ``num_exact`` best exactly, and keeps the best of those.
    """
    snapshot = scorer.snapshot
    reliable = set(snapshot.reliable_indices())
    bounds, cost = scorer.score(arrangement)
    num_screened = 0
    for _ in range(config.max_rounds):
        if not np.isfinite(cost) or num_screened >= config.max_screened_moves:
            break
        used = {i for servers, clients in arrangement for i in servers + clients}
        idle = [i for i in range(snapshot.num_devices) if i not in used]
        stage_costs = scorer.stage_costs(arrangement, bounds)
        bottleneck = int(np.argmax(stage_costs))
        donors = [int(k) for k in np.argsort(stage_costs, kind="stable")[: config.num_donor_stages]]
        moves = [
            (candidate, bounds) for candidate in list_moves(
                arrangement, bottleneck, idle, flops=snapshot.flops, reliable=reliable,
                count=config.max_candidates_per_stage, donors=sorted(set(donors) - {bottleneck}),
            )
        ]
        if len(arrangement) <= config.max_merge_stages:
            moves += list_merges(arrangement, bounds)
        num_screened += len(moves)
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
