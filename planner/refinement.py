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
    """

    max_rounds: int = 40
    max_candidates_per_stage: int = 3

    def __post_init__(self) -> None:
        if self.max_rounds < 0 or self.max_candidates_per_stage < 1:
            raise ValueError("max_rounds must be >= 0 and max_candidates_per_stage >= 1")


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
    reliable: set[int], count: int,
) -> list[Arrangement]:
    """Candidate arrangements one device move away, each touching the bottleneck or its link.

    The bottleneck's cost includes its link to the next stage, whose stream count depends on
    both server groups, so stages ``b - 1``, ``b`` and ``b + 1`` are all targets.
    """
    num_stages = len(arrangement)
    targets = [k for k in (bottleneck, bottleneck + 1, bottleneck - 1) if 0 <= k < num_stages]
    movers: list[tuple[int, int | None, bool]] = []
    for k, (servers, clients) in enumerate(arrangement):
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
    leavers = [(c, False) for c in clients] + ([(s, True) for s in servers] if len(servers) > 1 else [])
    for device, is_server in leavers:
        for target in [None] + [k for k in range(num_stages) if k not in targets]:
            moves.append(_move(arrangement, device, bottleneck, target, is_server=is_server))
    for other in targets[1:]:
        moves += _list_swaps(arrangement, bottleneck, other, flops=flops, count=count)
    for k in range(num_stages - 1):
        merged = (arrangement[k][0] + arrangement[k + 1][0], arrangement[k][1] + arrangement[k + 1][1])
        moves.append(_replace(arrangement[: k + 1] + arrangement[k + 2:], k, *merged))
    return moves


def refine_arrangement(
    scorer: ArrangementScorer, arrangement: Arrangement, config: RefinementConfig
) -> tuple[Arrangement, tuple[int, ...], float]:
    """Steepest descent on the bottleneck; returns (arrangement, boundaries, bottleneck seconds)."""
    snapshot = scorer.snapshot
    reliable = set(snapshot.reliable_indices())
    bounds, cost = scorer.score(arrangement)
    for _ in range(config.max_rounds):
        if not np.isfinite(cost):
            break
        used = {i for servers, clients in arrangement for i in servers + clients}
        idle = [i for i in range(snapshot.num_devices) if i not in used]
        bottleneck = int(np.argmax(scorer.stage_costs(arrangement, bounds)))
        best = None
        for candidate in list_moves(
            arrangement, bottleneck, idle, flops=snapshot.flops, reliable=reliable,
            count=config.max_candidates_per_stage,
        ):
            candidate_bounds, candidate_cost = scorer.score(candidate)
            if candidate_cost < cost * (1 - 1e-9) and (best is None or candidate_cost < best[2]):
                best = (candidate, candidate_bounds, candidate_cost)
        if best is None:
            break
        arrangement, bounds, cost = best
    return arrangement, bounds, cost
