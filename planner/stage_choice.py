"""Stage choice at join time: fill the stage with the largest throughput deficit.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class StageMember:
    """A peer that already serves a stage.

    Attributes:
        peer_id: the peer's id (any string that orders deterministically).
        stage: the stage it serves, ``0 <= stage < num_stages``.
        flops: its measured compute, FLOP/s.
    """

    peer_id: str
    stage: int
    flops: float


@dataclass(frozen=True, kw_only=True)
class Joiner:
    """A peer that announced its intent to join and has no stage yet.

    Attributes:
        peer_id: the peer's id.
        flops: its measured compute, FLOP/s.
        announced_at: when it announced, seconds of DHT time; earlier joiners are placed first.
    """

    peer_id: str
    flops: float
    announced_at: float


def stage_throughputs(stage_costs: Sequence[float], members: Sequence[StageMember]) -> list[float]:
    """Samples/s each stage can process: ``T_k = sum over peers of flops / cost_k``."""
    _check_costs(stage_costs)
    totals = [0.0] * len(stage_costs)
    for member in sorted(members, key=lambda m: m.peer_id):  # fixed order: same float sums everywhere
        if not 0 <= member.stage < len(stage_costs):
            raise ValueError(f"peer {member.peer_id} claims stage {member.stage} of {len(stage_costs)}")
        totals[member.stage] += max(member.flops, 0.0) / stage_costs[member.stage]
    return totals


def choose_stage(stage_costs: Sequence[float], members: Sequence[StageMember]) -> int:
    """The stage whose throughput ``T_k`` is lowest (largest deficit); ties to the lowest index."""
    totals = stage_throughputs(stage_costs, members)
    return min(range(len(totals)), key=lambda k: (totals[k], k))


def assign_joiners(
    stage_costs: Sequence[float], members: Sequence[StageMember], joiners: Sequence[Joiner]
) -> dict[str, int]:
    """Place concurrent joiners one by one, each on the stage of largest deficit at its turn.

    Returns:
        peer id → stage for every joiner. The result does not depend on the order of the inputs.
    """
    placed = list(members)
    assignment: dict[str, int] = {}
    for joiner in sorted(joiners, key=lambda j: (j.announced_at, j.peer_id)):
        if joiner.peer_id in assignment:
            raise ValueError(f"joiner {joiner.peer_id} is listed twice")
        stage = choose_stage(stage_costs, placed)
        assignment[joiner.peer_id] = stage
        placed.append(StageMember(peer_id=joiner.peer_id, stage=stage, flops=joiner.flops))
    return assignment


def _check_costs(stage_costs: Sequence[float]) -> None:
    if not stage_costs:
        raise ValueError("a run has at least one stage")
    if any(not cost > 0 for cost in stage_costs):
        raise ValueError(f"stage costs must be positive FLOPs per sample, got {list(stage_costs)}")
