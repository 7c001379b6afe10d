"""Stage choice at join time: fill the stage with the largest throughput deficit; and rebalancing.

Cost model. A stage ``k`` costs ``cost_k`` FLOPs per sample (forward + backward of its layers).
A peer with measured compute ``f`` FLOP/s processes ``f / cost_k`` samples/s when it serves ``k``.
A stage's throughput is the sum over its peers, ``T_k = sum_p f_p / cost_k``, and the pipeline runs
at its bottleneck ``min_k T_k``. Adding a peer to the stage of least ``T_k`` is the only move that
can raise the bottleneck, so that is the stage with the largest deficit. Ties go to the lower stage
index, which makes an empty swarm fill stages in order.

Unlike Petals' weakest-block rule, which counts servers, this counts measured throughput, so a
fast GPU and a slow laptop are not the same contribution (DESIGN §1 step 4, seed 000 §3.2).

Concurrent joiners. Peers that join at the same moment see the same members and each other's
join intents. Every joiner evaluates :func:`assign_joiners` on that same snapshot: joiners are
placed one by one in (announce time, peer id) order, each seeing the earlier ones already placed,
so they spread over the stages instead of all taking the same one.

Reachability (``planner.reachability``). A peer nobody can dial ("unreachable") can only serve stage
0, which dials out and is never dialled by the pipeline: it is placed there and never moved. A
relayed peer adds less to a stage ``k >= 1`` than its compute alone, by the relay's extra latency per
microbatch (``serving_throughput``: pass ``relay_delay`` and ``microbatch_size``; 0 leaves every
figure as plain ``f / cost_k``).

Rebalancing (:func:`choose_move`). Later, when peers have left, one peer may move from a stage with
spare throughput to the bottleneck stage, if that raises the bottleneck by a clear margin
(hysteresis); every peer computes the same move from the same records, and only the peer it names
moves.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from planner.reachability import serving_throughput


@dataclass(frozen=True, kw_only=True)
class StageMember:
    """A peer that already serves a stage.

    Attributes:
        peer_id: the peer's id (any string that orders deterministically).
        stage: the stage it serves, ``0 <= stage < num_stages``.
        flops: its measured compute, FLOP/s.
        memory_bytes: the memory it may use for a stage, bytes (0: not known, no limit assumed).
        reachability: "direct", "relayed" or "unreachable" (``planner.reachability``).
    """

    peer_id: str
    stage: int
    flops: float
    memory_bytes: float = 0.0
    reachability: str = "direct"


@dataclass(frozen=True, kw_only=True)
class Joiner:
    """A peer that announced its intent to join and has no stage yet.

    Attributes:
        peer_id: the peer's id.
        flops: its measured compute, FLOP/s.
        announced_at: when it announced, seconds of DHT time; earlier joiners are placed first.
        reachability: "direct", "relayed" or "unreachable" (placed at stage 0 whatever the deficits).
    """

    peer_id: str
    flops: float
    announced_at: float
    reachability: str = "direct"


def stage_throughputs(stage_costs: Sequence[float], members: Sequence[StageMember], *,
                      microbatch_size: int = 1, relay_delay: float = 0.0) -> list[float]:
    """Samples/s each stage can process: ``T_k = sum over peers of flops / cost_k`` (a relayed peer's
    share at ``k >= 1`` less its relay delay, ``planner.reachability.serving_throughput``)."""
    _check_costs(stage_costs)
    totals = [0.0] * len(stage_costs)
    for member in sorted(members, key=lambda m: m.peer_id):  # fixed order: same float sums everywhere
        if not 0 <= member.stage < len(stage_costs):
            raise ValueError(f"peer {member.peer_id} claims stage {member.stage} of {len(stage_costs)}")
        totals[member.stage] += _share(member, member.stage, stage_costs, microbatch_size, relay_delay)
    return totals


def choose_stage(stage_costs: Sequence[float], members: Sequence[StageMember], **cost: float) -> int:
    """The stage whose throughput ``T_k`` is lowest (largest deficit); ties to the lowest index.
    ``cost``: ``microbatch_size`` and ``relay_delay`` of :func:`stage_throughputs`."""
    totals = stage_throughputs(stage_costs, members, **cost)
    return min(range(len(totals)), key=lambda k: (totals[k], k))


def assign_joiners(
    stage_costs: Sequence[float], members: Sequence[StageMember], joiners: Sequence[Joiner], *,
    microbatch_size: int = 1, relay_delay: float = 0.0,
) -> dict[str, int]:
    """Place concurrent joiners one by one, each on the stage of largest deficit at its turn (an
    unreachable one on stage 0). Precisely: on the stage where it leaves the bottleneck highest,
    counting what it would add there (less for a relayed peer at ``k >= 1``), then the largest
    deficit, then the lowest index; for a direct peer that is :func:`choose_stage`'s stage.

    Returns:
        peer id → stage for every joiner. The result does not depend on the order of the inputs.
    """
    placed = list(members)
    assignment: dict[str, int] = {}
    for joiner in sorted(joiners, key=lambda j: (j.announced_at, j.peer_id)):
        if joiner.peer_id in assignment:
            raise ValueError(f"joiner {joiner.peer_id} is listed twice")
        if joiner.reachability == "unreachable":
            stage = 0
        else:
            stage = _best_stage_for(joiner, placed, stage_costs, microbatch_size, relay_delay)
        assignment[joiner.peer_id] = stage
        placed.append(StageMember(peer_id=joiner.peer_id, stage=stage, flops=joiner.flops,
                                  reachability=joiner.reachability))
    return assignment


def _best_stage_for(joiner: Joiner, placed: list[StageMember], stage_costs: Sequence[float],
                    microbatch_size: int, relay_delay: float) -> int:
    totals = stage_throughputs(stage_costs, placed, microbatch_size=microbatch_size, relay_delay=relay_delay)

    def after(k: int) -> tuple[float, float, int]:
        joined = StageMember(peer_id=joiner.peer_id, stage=k, flops=joiner.flops, reachability=joiner.reachability)
        grown = [t + (_share(joined, k, stage_costs, microbatch_size, relay_delay) if i == k else 0.0)
                 for i, t in enumerate(totals)]
        return -min(grown), totals[k], k

    return min(range(len(stage_costs)), key=after)


def _share(member: StageMember, stage: int, stage_costs: Sequence[float], microbatch_size: int,
           relay_delay: float) -> float:
    return serving_throughput(member.flops, stage_costs[stage], stage=stage, reachability=member.reachability,
                              microbatch_size=microbatch_size, relay_delay=relay_delay)


@dataclass(frozen=True, kw_only=True)
class StageMove:
    """One peer moving from the stage it serves to another, and what that does to the bottleneck.

    Attributes:
        peer_id: the peer that moves.
        from_stage / to_stage: the stage it leaves and the stage it joins.
        bottleneck_before / bottleneck_after: ``min_k T_k`` before and after the move, samples/s.
    """

    peer_id: str
    from_stage: int
    to_stage: int
    bottleneck_before: float
    bottleneck_after: float

    @property
    def gain(self) -> float:
        """Relative rise of the bottleneck throughput (0.25 = 25 % faster pipeline)."""
        return self.bottleneck_after / self.bottleneck_before - 1.0


def choose_move(stage_costs: Sequence[float], members: Sequence[StageMember], *, min_gain: float,
                microbatch_size: int = 1, relay_delay: float = 0.0, pinned: Collection[str] = ()) -> StageMove | None:
    """The single move that raises the bottleneck most, if it raises it by ``min_gain`` or more.

    Rebalancing with hysteresis (DESIGN §1 step 8). Only a move onto the bottleneck stage can raise
    ``min_k T_k``, so every member of another stage is tried there; a stage is never emptied (its
    state would be lost), and an empty stage is never a target (there is no state to pull from).
    A move must beat the current bottleneck by the relative ``min_gain``: measurement noise then
    moves nobody, and a move is never undone by the next decision, which would need a gain too.

    Every peer evaluates this on the same records and gets the same answer, so exactly one peer,
    the one named, moves; best gain first, then the slower peer (a smaller loss to its stage), then
    the smaller peer id. An unreachable peer never moves (it can serve stage 0 only), nor one in
    ``pinned`` (started with ``--stage``: its user chose its stage), though both count where they are.

    Returns:
        The move, or None when no move clears ``min_gain`` (the swarm is balanced enough).
    """
    if min_gain < 0:
        raise ValueError(f"min_gain must be >= 0, got {min_gain}")
    cost = {"microbatch_size": microbatch_size, "relay_delay": relay_delay}
    totals = stage_throughputs(stage_costs, members, **cost)
    counts = [0] * len(stage_costs)
    for member in members:
        counts[member.stage] += 1
    held = [k for k in range(len(stage_costs)) if counts[k] > 0]
    if len(held) < len(stage_costs):  # a stage nobody holds: no move can fill it with its state
        return None
    before = min(totals)
    target = min(range(len(totals)), key=lambda k: (totals[k], k))
    best: tuple | None = None
    for member in sorted(members, key=lambda m: m.peer_id):
        if (member.stage == target or counts[member.stage] < 2 or member.reachability == "unreachable"
                or member.peer_id in pinned):
            continue
        after = list(totals)
        after[member.stage] -= _share(member, member.stage, stage_costs, microbatch_size, relay_delay)
        after[target] += _share(member, target, stage_costs, microbatch_size, relay_delay)
        key = (-min(after), member.flops, member.peer_id)
        if best is None or key < best[0]:
            best = (key, member, min(after))
    if best is None or before <= 0 or best[2] <= before * (1.0 + min_gain):  # a move must gain something
        return None
    _, member, after_bottleneck = best
    return StageMove(peer_id=member.peer_id, from_stage=member.stage, to_stage=target,
                     bottleneck_before=before, bottleneck_after=after_bottleneck)


def _check_costs(stage_costs: Sequence[float]) -> None:
    if not stage_costs:
        raise ValueError("a run has at least one stage")
    if any(not cost > 0 for cost in stage_costs):
        raise ValueError(f"stage costs must be positive FLOPs per sample, got {list(stage_costs)}")
