"""Which neighbour sends which shard: greedy LPT (seed 003 Alg. 2) + binary search on s (Alg. 1).

Pure and deterministic: stdlib + numpy, no torch, no clock, no RNG. Every peer that evaluates
these functions on the same inputs gets the same plan, whatever order the neighbours come in
(neighbours are sorted by ``peer_id`` before any float arithmetic; ties go to the smaller id).

Cost model (seed 003 §III-A, Eq. 1-2, in the paper's notation where it exists):

    d_u = ``propagation_delay``  seconds paid per shard request to neighbour u   (t^prop_u)
    b_u = ``per_byte_delay``     seconds per byte from u to the joiner           (t^trans_u)
    f_u = ``free_time``          absolute time at which u can start serving      (tau^sync_u)

    l_u    <- max(f_u, now)                                  (load of u before any shard)
    finish <- l_u + d_u + x * b_u                            (u sends one more shard of x bytes)
    theta  =  max over u that send something of l_u          (makespan, absolute seconds)

Alg. 2 walks the shards largest first (LPT; ties by shard index) and gives each to the neighbour
with the least ``finish``; Alg. 1 binary-searches the shard size s to minimise theta.

Deviations from the paper, and why:

* d_u is paid per shard, not once per neighbour. The network layer fetches a shard with one
  request/response, so each shard costs a round trip. With the paper's Eq. 1 (d_u once) the
  objective never rises as s shrinks and Alg. 1 would always pick the smallest s; the per-shard
  delay is what makes the trade-off of §III-B ("small shards balance better, but transmission
  becomes inefficient") real. A transport that pipelines requests passes a smaller effective d_u.
* ``now`` enters the model: a neighbour free in the past starts now, not at f_u.
* A neighbour may receive no shard (the paper's constraint |K_u| > 0 is dropped): a slow
  neighbour would otherwise raise the makespan for nothing.
* Shards are byte ranges of one buffer, so the last one may be shorter than s (the paper
  assumes s divides |w|). Greedy stays LPT: the short shard goes last.
* Alg. 1 also evaluates both ends of the range and returns the best size it tried, so the
  result is never worse than either end; sizes are multiples of ``shard_align_bytes`` and the
  range is clipped so that no plan has more than ``max_num_shards`` shards.

Optimality: with equal-size shards each shard costs u a constant d_u + s*b_u, and earliest-finish
greedy is optimal (it takes the K cheapest completion slots). With identical neighbours and
arbitrary sizes it is Graham's LPT, within (4/3 - 1/(3|U|)) of optimal. Heterogeneous neighbours
with unequal shards carry no such bound; tests measure the ratio against brute force.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "NeighbourLink",
    "SearchConfig",
    "ShardAssignment",
    "ShardPlan",
    "assign_shards_greedy",
    "count_shards",
    "list_shard_sizes",
    "plan_replication",
    "replan",
]


@dataclass(frozen=True, kw_only=True)
class NeighbourLink:
    """What the joiner knows about one donor (seed 003 §III-A: t^prop, t^trans, tau^sync).

    Attributes:
        peer_id: the donor's id; ties are broken by it (smaller wins).
        propagation_delay: seconds of fixed cost per shard request (round trip + handling), d_u.
        per_byte_delay: seconds per byte on the link donor -> joiner (1 / bandwidth), b_u.
        free_time: absolute time (same clock as ``now``) when the donor can start serving, f_u.
    """

    peer_id: str
    propagation_delay: float
    per_byte_delay: float
    free_time: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, str) or not self.peer_id:
            raise ValueError(f"peer_id must be a non-empty str, got {self.peer_id!r}")
        for name in ("propagation_delay", "per_byte_delay", "free_time"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
        if self.propagation_delay < 0 or self.per_byte_delay < 0:
            raise ValueError(f"delays must be >= 0 for {self.peer_id}")


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """Bounds of Alg. 1's search over the shard size s.

    Attributes:
        min_shard_bytes: smallest s tried; raise it when per-request overhead dominates.
        max_shard_bytes: largest s tried; lower it to bound the memory of one in-flight shard.
        shard_align_bytes: s is a multiple of this (page-friendly I/O; 1 in exhaustive tests).
        max_num_shards: s is raised until a plan has at most this many shards (bounds the
            manifest size and the planning time, which is O(K |U| log S)).
    """

    min_shard_bytes: int = 256 * 1024
    max_shard_bytes: int = 256 * 1024 * 1024
    shard_align_bytes: int = 4096
    max_num_shards: int = 4096

    def __post_init__(self) -> None:
        for name in ("min_shard_bytes", "max_shard_bytes", "shard_align_bytes", "max_num_shards"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.min_shard_bytes > self.max_shard_bytes:
            raise ValueError("min_shard_bytes must be <= max_shard_bytes")
        if self.max_shard_bytes < self.shard_align_bytes:
            raise ValueError("max_shard_bytes must be >= shard_align_bytes")


@dataclass(frozen=True)
class ShardAssignment:
    """Result of Alg. 2.

    Attributes:
        shards_by_peer: every neighbour's id (sorted) -> its shard indices, in sending order.
        finish_times: estimated absolute finish time of each neighbour that sends something.
        makespan: estimated absolute time when the last shard arrives (``now`` if none), theta.
    """

    shards_by_peer: dict[str, tuple[int, ...]]
    finish_times: dict[str, float]
    makespan: float


@dataclass(frozen=True)
class ShardPlan:
    """Result of Alg. 1: the chosen shard size and its assignment.

    Attributes:
        shard_bytes: the chosen s.
        assignment: Alg. 2's assignment of the shards of size s.
        tried_shard_bytes: every s evaluated, in order (for logs and tests).
    """

    shard_bytes: int
    assignment: ShardAssignment
    tried_shard_bytes: tuple[int, ...] = field(default=())


def count_shards(total_bytes: int, shard_bytes: int) -> int:
    """Returns K = ceil(total_bytes / shard_bytes), the number of byte-range shards."""
    if total_bytes < 0 or shard_bytes < 1:
        raise ValueError(f"bad sizes: total_bytes={total_bytes}, shard_bytes={shard_bytes}")
    return -(-total_bytes // shard_bytes)


def list_shard_sizes(total_bytes: int, shard_bytes: int) -> list[int]:
    """Returns the size of every shard: all ``shard_bytes`` but the last, which holds the rest."""
    num_shards = count_shards(total_bytes, shard_bytes)
    return [min(shard_bytes, total_bytes - i * shard_bytes) for i in range(num_shards)]


def _sort_neighbours(neighbours: Iterable[NeighbourLink]) -> list[NeighbourLink]:
    ordered = sorted(neighbours, key=lambda link: link.peer_id)
    for left, right in zip(ordered, ordered[1:]):
        if left.peer_id == right.peer_id:
            raise ValueError(f"duplicate neighbour {left.peer_id!r}")
    return ordered


def assign_shards_greedy(
    shard_sizes: Mapping[int, int], neighbours: Sequence[NeighbourLink], *, now: float
) -> ShardAssignment:
    """Seed 003 §III-B Alg. 2: greedy LPT, each shard to the neighbour that finishes it first.

    Args:
        shard_sizes: shard index -> size in bytes (a subset of shards when re-planning).
        neighbours: the donors; any order, ids unique.
        now: current absolute time; a donor cannot start before it.

    Returns:
        The assignment; identical for any ordering of ``neighbours`` and of ``shard_sizes``.

    Raises:
        ValueError: no neighbours while shards remain, duplicate ids, a negative size, or a
            non-finite ``now``.
    """
    links = _sort_neighbours(neighbours)
    if not math.isfinite(now):
        raise ValueError(f"now must be finite, got {now!r}")
    if shard_sizes and not links:
        raise ValueError("no neighbour left to fetch the remaining shards from")
    if any(size < 0 for size in shard_sizes.values()):
        raise ValueError("shard sizes must be >= 0")
    loads = np.array([max(link.free_time, now) for link in links], dtype=np.float64)
    delays = np.array([link.propagation_delay for link in links], dtype=np.float64)
    rates = np.array([link.per_byte_delay for link in links], dtype=np.float64)
    picked: list[list[int]] = [[] for _ in links]
    for index, size in sorted(shard_sizes.items(), key=lambda item: (-item[1], item[0])):
        finish = loads + delays + float(size) * rates
        best = int(np.argmin(finish))  # first minimum = smallest peer_id among ties
        loads[best] = finish[best]
        picked[best].append(index)
    finish_times = {
        link.peer_id: float(loads[i]) for i, link in enumerate(links) if picked[i]
    }
    return ShardAssignment(
        shards_by_peer={link.peer_id: tuple(picked[i]) for i, link in enumerate(links)},
        finish_times=finish_times,
        makespan=max(finish_times.values(), default=float(now)),
    )


def _search_range(total_bytes: int, config: SearchConfig) -> tuple[int, int]:
    """Alg. 1's [s_l, s_h] in units of ``shard_align_bytes``, clipped to useful sizes."""
    align = config.shard_align_bytes
    high = config.max_shard_bytes // align
    high = min(high, max(1, -(-total_bytes // align)))  # s > total only repeats s = total
    low = max(1, -(-config.min_shard_bytes // align))
    low = max(low, -(-total_bytes // (config.max_num_shards * align)))
    return min(low, high), high


def plan_replication(
    total_bytes: int,
    neighbours: Sequence[NeighbourLink],
    *,
    now: float,
    config: SearchConfig = SearchConfig(),
) -> ShardPlan:
    """Seed 003 §III-B Alg. 1: binary search on the shard size s around Alg. 2.

    Both ends of the range are evaluated first; then, as in the paper, an improvement moves
    the search to smaller s and anything else to larger s. The best s tried wins (ties: the
    first tried), so the result is never worse than either end.

    Args:
        total_bytes: |w|, the size of the stage state.
        neighbours: the donors; any order.
        now: current absolute time.
        config: bounds of the search.

    Returns:
        The chosen s, its assignment, and every s tried.
    """
    align = config.shard_align_bytes
    low, high = _search_range(total_bytes, config)
    evaluated: dict[int, ShardAssignment] = {}

    def evaluate(units: int) -> float:
        if units not in evaluated:
            sizes = list_shard_sizes(total_bytes, units * align)
            evaluated[units] = assign_shards_greedy(dict(enumerate(sizes)), neighbours, now=now)
        return evaluated[units].makespan

    best_units = low if evaluate(low) <= evaluate(high) else high
    best = evaluate(best_units)
    while low <= high:
        mid = (low + high) // 2
        theta = evaluate(mid)
        if theta < best:
            best, best_units, high = theta, mid, mid - 1
        else:
            low = mid + 1
    return ShardPlan(
        shard_bytes=best_units * align,
        assignment=evaluated[best_units],
        tried_shard_bytes=tuple(units * align for units in evaluated),
    )


def replan(
    missing_shards: Iterable[int],
    survivors: Sequence[NeighbourLink],
    *,
    total_bytes: int,
    shard_bytes: int,
    now: float,
) -> ShardAssignment:
    """Re-assigns the shards still missing after a donor died, stalled or sent a bad shard.

    The shard size is fixed by the manifest once a download started, so this is Alg. 2 alone
    over the missing shards; ``survivors`` should carry updated ``free_time`` values (when each
    finishes what it is still sending) and must not contain the failed donor.

    Raises:
        ValueError: a shard index out of range, or shards missing and no survivors.
    """
    sizes = list_shard_sizes(total_bytes, shard_bytes)
    missing = sorted(set(missing_shards))
    if missing and not 0 <= missing[0] <= missing[-1] < len(sizes):
        raise ValueError(f"shard index out of range 0..{len(sizes) - 1}")
    return assign_shards_greedy({i: sizes[i] for i in missing}, survivors, now=now)
