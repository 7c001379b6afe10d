"""Join and rebalance decisions on a full ``Plan`` under the cost model (``costs``), evaluated offline.

Not what the live peer runs. A running peer decides where to join and whether to move with
``planner.stage_choice`` (``assign_joiners``, ``choose_move``): stage throughput from measured
FLOP/s alone, one move at a time. This module answers the same two questions on a ``Plan`` and a
``SwarmSnapshot`` with links, unreliable clients, memory and the averaging floor; ``bench/planner.py``
times its join decision on 1024 peers and the tests check it against brute force.

Both keep the layer boundaries fixed: a peer that moves downloads its new stage, and no other
peer reloads anything (DESIGN §1 step 8; Petals reloads unchanged blocks, we never do).

Join (seed 000 §3.2 "Dynamic client participation", refined). The joiner is added to each stage
in turn — as a server if reliable, a client otherwise — and the stage that yields the lowest
bottleneck term of the cost model (``costs``; the window bound is left out, and memory is checked
with the plan's window ``W`` even when a reliable joiner of stage 0 would widen it) wins; ties go to the stage with the best mean bandwidth to
the joiner (seed 000's own rule), then the lower index. Only the changed stage and its predecessor
(whose outgoing link changes) are re-evaluated from running sums kept in a ``JoinContext`` (built
once per plan in O(n)), so a decision costs O(K * stage size) with small constants.

Rebalance. Greedy single-peer moves onto the bottleneck stage (``refinement.list_moves``, no
peer is ever dropped), each lowering the bottleneck, up to ``max_moves``. The moves are returned
only if the bottleneck throughput rises by ``min_gain`` or more; otherwise nothing moves. This is
the hysteresis that keeps peers from flapping between stages on measurement noise. The gain is
the plan's ``estimate_throughput`` over the input plan's: the search scores arrangements with the
stage roles it assigns itself, and a plan whose frontal and backward servers were chosen otherwise
can score higher under its own roles than the search's start (a property test found a greedy
"gain" of 4 % that was a 4 % loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.assembly import plan_groups
from planner.costs import (
    StageGroup, count_inflight, estimate_averaging_floor, estimate_averaging_share, estimate_stage_delay,
    estimate_throughput, profile_group, round_per_byte,
)
from planner.evaluation import Arrangement, ArrangementScorer
from planner.refinement import list_moves
from planner.plan import Plan
from planner.snapshot import SwarmSnapshot


@dataclass(frozen=True, kw_only=True)
class RebalanceConfig:
    """Hysteresis and budget of rebalancing.

    Attributes:
        min_gain: relative bottleneck-throughput gain needed before anyone moves (0.1 = 10 %);
            raise it when measurements are noisy.
        max_moves: peers moved per decision at most.
        max_candidates_per_stage: fastest movers tried per stage per round.
    """

    min_gain: float = 0.1
    max_moves: int = 4
    max_candidates_per_stage: int = 3

    def __post_init__(self) -> None:
        if self.min_gain < 0 or self.max_moves < 0 or self.max_candidates_per_stage < 1:
            raise ValueError("min_gain and max_moves must be >= 0, max_candidates_per_stage >= 1")


@dataclass(frozen=True, kw_only=True)
class Move:
    """One peer changing stage.

    Attributes:
        peer_id: the peer.
        from_stage: its stage before, or None if it was idle.
        to_stage: its stage after.
    """

    peer_id: str
    from_stage: int | None
    to_stage: int


@dataclass(frozen=True, kw_only=True)
class RebalanceDecision:
    """Outcome of ``plan_rebalance``.

    Attributes:
        plan: the plan to run (the input plan when nothing moves).
        moves: the peers that change stage, sorted by peer id.
        gain: relative bottleneck-throughput gain of ``plan`` over the input plan.
    """

    plan: Plan
    moves: tuple[Move, ...]
    gain: float


def _arrangement_of(snapshot: SwarmSnapshot, plan: Plan) -> tuple[Arrangement, tuple[int, ...]]:
    groups = plan_groups(snapshot, plan)
    arrangement = [(tuple(s.tolist()), tuple(c.tolist())) for s, c in groups]
    return arrangement, tuple(stage.layer_end for stage in plan.stages)


@dataclass(frozen=True, kw_only=True, eq=False)
class _StageSums:
    """Running sums of one stage that a joiner updates in O(stage size)."""

    group: StageGroup
    layer_start: int
    layer_end: int
    num_inflight: int
    client_latency_sums: np.ndarray  # per client: sum over servers of (alpha_cs + alpha_sc) / 2
    client_per_byte_sums: np.ndarray  # per client: sum over servers of (1/beta_cs + 1/beta_sc) / 2
    member_averaging_sums: np.ndarray  # per member: sum over servers of 1 / beta_is
    link_delay: float  # outgoing link term of Eq. 2 (0 for the last stage)
    link_sums: tuple[float, float, float, float]  # over S_k x S_k+1: alpha fwd, 1/beta fwd, bwd
    delay: float  # DT_k
    floor: float  # averaging floor AT_k / d


@dataclass(frozen=True, kw_only=True, eq=False)
class JoinContext:
    """Per-plan state for join decisions, built once by ``prepare_join`` in O(n).

    Attributes:
        snapshot: the swarm, including peers that may join.
        plan: the running plan.
        stage_costs: current per-stage terms of seed 000 Eq. 2 (with the averaging floor).
    """

    snapshot: SwarmSnapshot
    plan: Plan
    stage_costs: np.ndarray
    sums: tuple[_StageSums, ...]


def prepare_join(snapshot: SwarmSnapshot, plan: Plan) -> JoinContext:
    """Builds the JoinContext of ``plan`` on ``snapshot``."""
    scorer = ArrangementScorer(snapshot)
    arrangement, bounds = _arrangement_of(snapshot, plan)
    latency, per_byte = snapshot.links.latency_delay, 1.0 / snapshot.links.bandwidth
    sums = []
    model = snapshot.model
    for k, (servers, clients) in enumerate(arrangement):
        link_delay, link_sums = 0.0, (0.0, 0.0, 0.0, 0.0)
        start, end = plan.stages[k].layer_start, plan.stages[k].layer_end
        if k + 1 < len(arrangement):
            link_delay = float(scorer.link_matrix(arrangement[k], arrangement[k + 1][0])[start, end])
            forward, backward = np.ix_(servers, arrangement[k + 1][0]), np.ix_(arrangement[k + 1][0], servers)
            link_sums = (
                float(latency[forward].sum()), float(per_byte[forward].sum()),
                float(latency[backward].sum()), float(per_byte[backward].sum()),
            )
        s, c = np.array(servers, dtype=np.int64), np.array(clients, dtype=np.int64)
        members = np.concatenate([s, c])
        group = profile_group(snapshot, s, c)
        inflight = count_inflight(snapshot.runtime, len(arrangement[0][0]))
        sums.append(_StageSums(
            link_sums=link_sums, delay=estimate_stage_delay(model, group, start, end, num_inflight=inflight)[0],
            floor=estimate_averaging_floor(model, group, start, end, runtime=snapshot.runtime),
            group=group, layer_start=start, layer_end=end, num_inflight=inflight,
            client_latency_sums=((latency[np.ix_(c, s)] + latency[np.ix_(s, c)].T) / 2).sum(axis=1),
            client_per_byte_sums=((per_byte[np.ix_(c, s)] + per_byte[np.ix_(s, c)].T) / 2).sum(axis=1),
            member_averaging_sums=per_byte[np.ix_(members, s)].sum(axis=1), link_delay=float(link_delay),
        ))
    costs = scorer.stage_costs(arrangement, bounds)
    return JoinContext(snapshot=snapshot, plan=plan, stage_costs=costs, sums=tuple(sums))


class _InverseBandwidth:
    """``1 / bandwidth[index]`` computed on the indexed entries only (never the whole matrix)."""

    def __init__(self, bandwidth: np.ndarray) -> None:
        self.bandwidth = bandwidth

    def __getitem__(self, index: tuple) -> np.ndarray:
        return 1.0 / self.bandwidth[index]


def _joined_group(context: JoinContext, k: int, joiner: int) -> StageGroup:
    """Stage k's group with ``joiner`` added, from the running sums."""
    sums, snapshot = context.sums[k], context.snapshot
    group = sums.group
    latency, bandwidth = snapshot.links.latency_delay, snapshot.links.bandwidth
    s, c = group.servers, group.clients
    per_byte = _InverseBandwidth(bandwidth)
    num_servers = s.size
    ratio = snapshot.runtime.boundary_compression_ratio
    if snapshot.devices[joiner].is_reliable:
        latency_sums = sums.client_latency_sums + (latency[c, joiner] + latency[joiner, c]) / 2
        per_byte_sums = sums.client_per_byte_sums + (per_byte[c, joiner] + per_byte[joiner, c]) / 2
        members = np.concatenate([s, c])
        averaging = np.append(sums.member_averaging_sums + per_byte[members, joiner], per_byte[joiner, s].sum())
        servers, clients = np.append(s, joiner), c
        count = num_servers + 1
        offsets = np.concatenate([np.zeros(count), 4.0 * latency_sums / count])
        inverse = np.concatenate([np.zeros(count), 2.0 * ratio * per_byte_sums / count])
    else:
        own_latency = ((latency[joiner, s] + latency[s, joiner]) / 2).sum()
        own_per_byte = ((per_byte[joiner, s] + per_byte[s, joiner]) / 2).sum()
        averaging = np.append(sums.member_averaging_sums, per_byte[joiner, s].sum())
        servers, clients = s, np.append(c, joiner)
        count = num_servers
        offsets = np.append(group.offset_delays, 4.0 * own_latency / count)
        inverse = np.append(group.inverse_bandwidths, 2.0 * ratio * own_per_byte / count)
    members = np.concatenate([servers, clients])
    return StageGroup(
        servers=servers, clients=clients, flops=snapshot.flops[members],
        memory_bytes=snapshot.memory_bytes[members], offset_delays=offsets, inverse_bandwidths=inverse,
        averaging_per_byte=round_per_byte(float(averaging.max()), count, snapshot.runtime.averaging_period),
    )


def _joined_link(context: JoinContext, k: int, joiner: int, *, is_sender: bool, group: StageGroup) -> float:
    """Link term ``L_k`` when the reliable ``joiner`` joins stage k (sender) or k+1 (receiver).

    ``group`` is stage k's group as it will be (its averaging share slows the link).
    """
    snapshot, sums = context.snapshot, context.sums[k]
    per_byte = _InverseBandwidth(snapshot.links.bandwidth)
    senders, receivers = sums.group.servers, context.sums[k + 1].group.servers
    other = receivers if is_sender else senders
    out_index, in_index = (joiner, other) if is_sender else (other, joiner)
    _, pb_f, _, pb_b = sums.link_sums
    pb_f += per_byte[out_index, in_index].sum()
    pb_b += per_byte[in_index, out_index].sum()
    num_senders = senders.size + (1 if is_sender else 0)
    num_receivers = receivers.size + (0 if is_sender else 1)
    pairs = num_senders * num_receivers
    model = snapshot.model
    share = estimate_averaging_share(model, group, sums.layer_start, sums.layer_end, runtime=snapshot.runtime)
    num_bytes = model.microbatch_size * model.layer_activation_bytes[sums.layer_end - 1] / (1.0 - share)
    per_byte = max(pb_f, pb_b) / pairs / min(num_senders, num_receivers) * snapshot.runtime.boundary_compression_ratio
    return per_byte * num_bytes


def choose_join_stage(context: JoinContext, peer_id: str) -> int:
    """The stage ``peer_id`` (in the snapshot, not in the plan) should join; see module docstring."""
    if context.plan.stage_of(peer_id) is not None:
        raise ValueError(f"peer {peer_id} already serves stage {context.plan.stage_of(peer_id)}")
    snapshot = context.snapshot
    model = snapshot.model
    joiner = int(snapshot.indices_of((peer_id,))[0])
    is_reliable = snapshot.devices[joiner].is_reliable
    num_stages = len(context.sums)
    per_byte = 1.0 / snapshot.links.bandwidth[joiner]
    best_key, best_stage = None, 0
    for k, sums in enumerate(context.sums):
        group = _joined_group(context, k, joiner)
        delay, _ = estimate_stage_delay(model, group, sums.layer_start, sums.layer_end, num_inflight=sums.num_inflight)
        link = 0.0
        if k + 1 < num_stages and is_reliable:
            link = _joined_link(context, k, joiner, is_sender=True, group=group)
        elif k + 1 < num_stages:  # a client: same servers, but it joins the averaging
            old, new = (
                estimate_averaging_share(model, g, sums.layer_start, sums.layer_end, runtime=snapshot.runtime)
                for g in (sums.group, group)
            )
            link = sums.link_delay * (1.0 - old) / (1.0 - new)
        costs = context.stage_costs.copy()
        floor = estimate_averaging_floor(model, group, sums.layer_start, sums.layer_end, runtime=snapshot.runtime)
        costs[k] = max(delay, link, floor)
        if is_reliable and k > 0:
            previous = context.sums[k - 1]
            joined = _joined_link(context, k - 1, joiner, is_sender=False, group=previous.group)
            costs[k - 1] = max(previous.delay, joined, previous.floor)
        key = (float(costs.max()), float(per_byte[sums.group.servers].mean()), k)
        if best_key is None or key < best_key:
            best_key, best_stage = key, k
    return best_stage


def plan_rebalance(
    snapshot: SwarmSnapshot, plan: Plan, config: RebalanceConfig | None = None
) -> RebalanceDecision:
    """Greedy moves with hysteresis (module docstring); idle snapshot devices may be placed."""
    config = config or RebalanceConfig()
    scorer = ArrangementScorer(snapshot)
    arrangement, bounds = _arrangement_of(snapshot, plan)
    assigned = {i for servers, clients in arrangement for i in servers + clients}
    reliable = set(snapshot.reliable_indices())
    start_cost = cost = scorer.score_with_bounds(arrangement, bounds)
    for _ in range(config.max_moves):
        stage_costs = scorer.stage_costs(arrangement, bounds)
        bottleneck = int(np.argmax(stage_costs))
        used = {i for servers, clients in arrangement for i in servers + clients}
        idle = [i for i in range(snapshot.num_devices) if i not in used]
        donors = [k for k in range(len(arrangement)) if k != bottleneck]
        candidates = [
            c for c in list_moves(
                arrangement, bottleneck, idle, flops=snapshot.flops, reliable=reliable,
                count=config.max_candidates_per_stage, donors=donors,
            )
            if assigned <= {i for servers, clients in c for i in servers + clients}
        ]
        base = (arrangement, stage_costs)
        scored = [(scorer.score_with_bounds(c, bounds, base=base), index) for index, c in enumerate(candidates)]
        if not scored or min(scored)[0] >= cost * (1 - 1e-9):
            break
        cost, index = min(scored)
        arrangement = candidates[index]
    gain = start_cost / cost - 1.0 if cost > 0 else 0.0
    if not np.isfinite(gain) or gain < config.min_gain:
        return RebalanceDecision(plan=plan, moves=(), gain=0.0)
    new_plan = scorer.to_plan(arrangement, bounds)
    if (before := estimate_throughput(snapshot, plan)) > 0:  # the input plan's own roles (module docstring)
        gain = estimate_throughput(snapshot, new_plan) / before - 1.0
        if gain < config.min_gain:
            return RebalanceDecision(plan=plan, moves=(), gain=0.0)
    moves = tuple(
        Move(peer_id=p, from_stage=plan.stage_of(p), to_stage=new_plan.stage_of(p))
        for p in new_plan.assigned_peer_ids() if plan.stage_of(p) != new_plan.stage_of(p)
    )
    return RebalanceDecision(plan=new_plan, moves=moves, gain=float(gain))
