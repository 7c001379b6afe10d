"""The cost model of a plan, shared by every planner here and by the simulator (issue #18).

Notation (seed 000 §3.1.3): a stage k holds layers [a, b) with ``F_k`` FLOPs per sample, a
micro-batch has ``m`` samples, device i computes ``c_i`` FLOP/s, ``alpha`` is latency (s) and
``beta`` bandwidth (B/s) between two devices, ``t_l`` the activation bytes per sample after layer l,
``r`` the runtime's boundary compression ratio (``RuntimeSettings``).

Data-parallel stage time (seed 000 Eq. 1). The micro-batch is split into shares ``w_i`` over the
stage's servers S and clients U. A server computes only; a client also receives its input from
and returns its output to the servers, forward and backward::

    T_i(w_i) = w_i F_k / c_i                                                     (i in S)
    T_i(w_i) = 4 alpha_iS + w_i (F_k / c_i + 2 r (t_{a-1} + t_{b-1}) / beta_iS)    (i in U)
    DT_k = min over shares with sum w_i = m and w_i <= cap_i of max_{w_i > 0} T_i(w_i)

where ``alpha_iS`` and ``1 / beta_iS`` are means over the stage's servers. The min-max is solved
exactly by water-filling (seed 001 Alg. 1 phase 1: balance by capacity, clamp at memory budgets).
With whole micro-batches routed to the earliest finisher (the runtime), ``1 / DT_k`` is the
stage's service rate in micro-batches per second.

Memory (seed 001 Eq. 3 with the runtime's window). The runtime keeps ``W = max_in_flight x |S_0|``
micro-batches in the pipeline, and all of them can queue at one stage (the bottleneck does)::

    M_i = W_k (1 + o) + W w_i A_k,   A_k = sum_{l in [a, b)} t_l

A member (server or client) that cannot hold ``W_k (1 + o)`` makes the plan unfit; the shares are
capped by the rest. ``is_within_memory`` is the check the planner and the simulator both apply: a
plan that does not fit is worth 0.

Links. Activations k -> k+1 and gradients k+1 -> k travel on two FIFO resources (one per
direction), each split over ``n = min(|S_k|, |S_{k+1}|)`` parallel streams; means of ``1 / beta``
over the server pairs. Averaging (below) takes a share ``u_k`` of stage k's links::

    L_k = r m t_{b-1} max(mean 1/beta_f, mean 1/beta_b) / (n (1 - u_k))

Averaging. A round ships ``W_k / |S|`` from every member to each server and back:
``AT_k = 2 W_k max_i mean_{j in S_k} 1 / beta_ij``. With a period ``P > 0`` (the runtime: rounds in
the background, only optimizer steps pause) the round takes ``u_k = min(AT_k / P, 1/2)`` of the
stage's links (a flow gets at least half of a shared link). A round longer than its period holds
the stage's optimizer for the excess, which we charge as blocking time once per step: a floor of
``max(0, AT_k - P) / d`` per micro-batch. With ``P = 0`` (seed 000: every step, blocking) that is
seed 000's floor ``AT_k / d``: a step lasts at least the round. ``P = 0`` is also how the live peer
describes its default gradient exchange (``replica_sync`` "gradients"), in which every replica sends
its whole sum to every co-replica rather than a butterfly's share, so there
``AT_k = W_k max_i sum_{j in S_k} 1 / beta_ij``, ``|S_k| / 2`` times the butterfly's
(``round_per_byte``; the same for two replicas; until 2026-12-01 the butterfly was charged).

Throughput. The stage terms are resources working in parallel, so the pipeline's service time per
micro-batch is their maximum; the window bounds it by Little's law with the round trip ``R`` of
one micro-batch (its time on a mean server of every stage, both latencies and both transfers of
every link, each over one pair of peers: a whole micro-batch goes to one replica, so its transfer
takes ``n`` times what the boundary's ``n`` streams take per micro-batch)::

    term_k = max(DT_k, L_k, floor_k)
    R = sum_k (m F_k / mean_{i in S_k} c_i) + sum_k (alpha_kf + alpha_kb + n_k (L_k^f + L_k^b))
    throughput = m / max(max_k term_k, R / W)     samples per second; 0 when the plan does not fit

Flush (``RuntimeSettings.is_flushing``, the runtime's default schedule). A step's ``d``
micro-batches drain before the step ends, and the replicas' round follows the drain instead of
overlapping the next step. The first micro-batch takes ``R``, each further one the bottleneck, and
the window admits ``W`` at a time; the slowest stage's round ``X = max_k max(0, AT_k - P)`` comes
after (the averaging floors are then 0: the round is charged here, once)::

    seconds per micro-batch = (max((d - 1) max_k term_k + R, ceil(d / W) R) + X) / d

The simulator's ``SimulationConfig.murmuration(is_flushing=True)`` runs the same schedule.

Until 2026-11-27 ``R`` divided the transfers by ``n`` too, as if each micro-batch were cut over the
stage's servers (seed 000's runtime): with many replicas per stage that made the window bound
vanish (a swarm of 256 peers in 8 stages was credited 32x shorter transfers than one pair can make).

Seed 000 Eq. 2 adds the link to the stage delay and charges both directions in one term; the
simulator (``simulator``) runs them as separate resources, and so does this model now.
Seed 000 Eq. 3 approximates ``DT_k`` by ``m sum_l F_l / (p sum_i c_i)`` when ``p`` clusters share
the work evenly (``approximate_pipeline_delay``, used by the clustering's stop rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.plan import Plan
from planner.runtime import RuntimeSettings
from planner.snapshot import ModelProfile, SwarmSnapshot

MAX_AVERAGING_SHARE = 0.5  # a flow gets at least half of a link it shares with another


@dataclass(frozen=True, kw_only=True, eq=False)
class StageGroup:
    """The devices of one stage with their link figures to the stage's servers precomputed.

    Attributes:
        servers: device indices of the servers, ascending.
        clients: device indices of the clients, ascending.
        flops: FLOP/s of servers then clients.
        memory_bytes: memory of servers then clients.
        offset_delays: fixed per-micro-batch delay of each device (0 for servers, 4 alpha_iS).
        inverse_bandwidths: 2 r / beta_iS per device (0 for servers), compression included.
        averaging_per_byte: seconds per parameter byte of one averaging round (``round_per_byte``:
            ``2 max_i mean_{j in S} 1 / beta_ij`` over members i for periodic rounds, ``max_i sum_j``
            for the gradient exchange every step; 0 for a lone device).
    """

    servers: np.ndarray
    clients: np.ndarray
    flops: np.ndarray
    memory_bytes: np.ndarray
    offset_delays: np.ndarray
    inverse_bandwidths: np.ndarray
    averaging_per_byte: float = 0.0

    @property
    def num_servers(self) -> int:
        """Number of servers."""
        return int(self.servers.size)


def profile_group(snapshot: SwarmSnapshot, servers: np.ndarray, clients: np.ndarray) -> StageGroup:
    """Builds a StageGroup; servers and clients are device indices."""
    servers = np.sort(np.asarray(servers, dtype=np.int64))
    clients = np.sort(np.asarray(clients, dtype=np.int64))
    if servers.size == 0:
        raise ValueError("a stage group needs at least one server")
    members = np.concatenate([servers, clients])
    offsets = np.zeros(members.size)
    inverse = np.zeros(members.size)
    links = snapshot.links
    if clients.size:
        between = np.ix_(clients, servers)
        offsets[servers.size:] = 4.0 * links.mean_latency[between].mean(axis=1)
        ratio = snapshot.runtime.boundary_compression_ratio
        inverse[servers.size:] = 2.0 * ratio * links.mean_inverse_bandwidth[between].mean(axis=1)
    averaging = 0.0
    if members.size > 1:
        averaging = round_per_byte(float(links.inverse_bandwidth[np.ix_(members, servers)].sum(axis=1).max()),
                                   servers.size, snapshot.runtime.averaging_period)
    return StageGroup(
        servers=servers, clients=clients, flops=snapshot.flops[members],
        memory_bytes=snapshot.memory_bytes[members], offset_delays=offsets,
        inverse_bandwidths=inverse, averaging_per_byte=averaging,
    )


def round_per_byte(max_row_sum: float, num_servers: int, averaging_period: float) -> float:
    """Seconds per parameter byte of a stage's round, from ``max_i sum_{j in S} 1 / beta_ij`` over its
    members ``i`` (``beta_ii`` infinite). Every step (``averaging_period`` 0) it is the runtime's
    gradient exchange, in which each replica sends its whole sum to every co-replica
    (``swarm.gradient_sync``): that sum, ``n / 2`` times a butterfly's at ``n`` replicas. Periodic rounds
    are hivemind's butterfly all-reduce, in which each member ships ``W / |S|`` to each server and gets
    as much back: ``2 max_i mean_j 1 / beta_ij``."""
    if averaging_period == 0:
        return max_row_sum
    return 2.0 * max_row_sum / max(num_servers, 1)


def fill_workload(
    offset_delays: np.ndarray, per_sample_delays: np.ndarray, caps: np.ndarray, num_samples: float
) -> tuple[float, np.ndarray]:
    """Splits ``num_samples`` to minimise the latest finish ``a_i + w_i b_i`` under ``w_i <= cap_i``.

    Water-filling: find T with ``sum_i min(cap_i, max(0, (T - a_i) / b_i)) = num_samples``; devices
    that would exceed their cap are clamped and the rest refilled (seed 001 Alg. 1, phase 1).

    Returns:
        (finish time, shares); the time is inf when the caps cannot hold ``num_samples``.
    """
    shares = np.zeros(offset_delays.size)
    active = caps > 0
    remaining = float(num_samples)
    while remaining > 1e-12:
        if not np.any(active):
            return float("inf"), shares
        index = np.flatnonzero(active)
        order = index[np.argsort(offset_delays[index], kind="stable")]
        a = offset_delays[order]
        inverse_b = 1.0 / per_sample_delays[order]
        levels = (remaining + np.cumsum(a * inverse_b)) / np.cumsum(inverse_b)
        next_offsets = np.append(a[1:], np.inf)
        count = int(np.argmax(levels <= next_offsets)) + 1
        level = levels[count - 1]
        trial = np.zeros(offset_delays.size)
        trial[order[:count]] = (level - a[:count]) * inverse_b[:count]
        over = active & (trial > caps)
        if not np.any(over):
            shares += trial
            break
        shares[over] = caps[over]
        remaining -= float(caps[over].sum())
        active &= ~over
    used = shares > 0
    finish = offset_delays[used] + shares[used] * per_sample_delays[used]
    return (float(finish.max()) if finish.size else 0.0), shares


def fill_workloads(
    offset_delays: np.ndarray, per_sample_delays: np.ndarray, caps: np.ndarray, num_samples: float
) -> np.ndarray:
    """``fill_workload`` for many problems at once: rows of ``per_sample_delays`` and ``caps``.

    All rows share the offsets, so one sort serves every row; clamping at the caps repeats until
    no row exceeds a cap (rarely more than a few passes). Each pass works on the rows still
    pending only: every row's arithmetic is its own, so a row's result does not depend on which
    other rows share the pass, and a swarm-sized group's later passes touch a few rows, not all.
    Returns the finish time of each row.
    """
    order = np.argsort(offset_delays, kind="stable")
    a = offset_delays[order]
    inverse_b = 1.0 / per_sample_delays[:, order]
    caps = caps[:, order]
    active = caps > 0
    fixed = np.zeros_like(inverse_b)
    remaining = np.full(inverse_b.shape[0], float(num_samples))
    shares = np.zeros_like(inverse_b)
    rows = np.arange(inverse_b.shape[0])
    with np.errstate(divide="ignore", invalid="ignore"):
        while rows.size:
            rows = _fill_pass(a, inverse_b, caps, active, fixed, remaining, shares, rows)
    finish = np.where(shares > 0, a[None, :] + shares / inverse_b, 0.0).max(axis=1)
    infeasible = np.isnan(shares).any(axis=1) | (shares.sum(axis=1) < num_samples * (1 - 1e-9))
    return np.where(infeasible, np.inf, finish)


def _fill_pass(
    a: np.ndarray, inverse_b: np.ndarray, caps: np.ndarray, active: np.ndarray, fixed: np.ndarray,
    remaining: np.ndarray, shares: np.ndarray, rows: np.ndarray,
) -> np.ndarray:
    """One water-filling pass of ``fill_workloads`` over the pending ``rows`` (offsets sorted).

    Fills every pending row to its level; a row that exceeds no cap is done (its shares written),
    the devices of the others that exceed their caps are clamped there and leave ``active``, and
    a row left with no active device is infeasible (NaN shares). Updates the arrays in place and
    returns the rows still pending.
    """
    live, inverse, cap = active[rows], inverse_b[rows], caps[rows]
    weight = np.where(live, inverse, 0.0)
    levels = (remaining[rows][:, None] + np.cumsum(weight * a, axis=1)) / np.cumsum(weight, axis=1)
    stop = np.argmax(levels <= np.append(a[1:], np.inf)[None, :], axis=1)
    level = levels[np.arange(rows.size), stop]
    trial = np.where(live, np.maximum(level[:, None] - a[None, :], 0.0) * inverse, 0.0)
    over = live & (trial > cap)
    done = ~np.any(over, axis=1)
    shares[rows[done]] = fixed[rows[done]] + trial[done]
    fixed[rows] = np.where(over, cap, fixed[rows])
    remaining[rows] -= np.where(over, cap, 0.0).sum(axis=1)
    live &= ~over
    active[rows] = live
    starved = ~done & ~np.any(live, axis=1)
    shares[rows[starved]] = np.nan
    return rows[~done & ~starved]


def estimate_stage_delay(
    model: ModelProfile, group: StageGroup, layer_start: int, layer_end: int, *, num_inflight: int
) -> tuple[float, np.ndarray]:
    """Seed 000 Eq. 1 for one micro-batch: ``DT_k`` and the per-device shares (see module doc)."""
    stage_flops = sum(model.layer_flops[layer_start:layer_end])
    weight_bytes = sum(model.layer_param_bytes[layer_start:layer_end])
    weight_bytes *= 1.0 + model.optimizer_bytes_per_param_byte
    activation_bytes = sum(model.layer_activation_bytes[layer_start:layer_end])
    if np.any(group.memory_bytes[: group.num_servers] < weight_bytes):
        return float("inf"), np.zeros(group.flops.size)
    free_bytes = np.maximum(group.memory_bytes - weight_bytes, 0.0)
    if activation_bytes > 0:
        caps = free_bytes / (max(num_inflight, 1) * activation_bytes)
    else:
        caps = np.full(group.flops.size, np.inf)
    caps = np.where(group.memory_bytes >= weight_bytes, caps, 0.0)
    boundary_bytes = model.layer_activation_bytes[layer_end - 1]
    if layer_start > 0:
        boundary_bytes += model.layer_activation_bytes[layer_start - 1]
    per_sample = stage_flops / group.flops + boundary_bytes * group.inverse_bandwidths
    per_sample = np.maximum(per_sample, 1e-30)
    return fill_workload(group.offset_delays, per_sample, caps, model.microbatch_size)


def estimate_averaging_floor(
    model: ModelProfile, group: StageGroup, layer_start: int, layer_end: int, *, runtime: RuntimeSettings
) -> float:
    """Blocking averaging per micro-batch, ``max(0, AT_k - P) / d`` (module doc); 0 under the flush
    schedule, whose round follows the drain (``estimate_exchange``)."""
    if runtime.is_flushing:
        return 0.0
    return _round_excess(model, group, layer_start, layer_end, runtime) / model.num_microbatches


def estimate_exchange(
    model: ModelProfile, group: StageGroup, layer_start: int, layer_end: int, *, runtime: RuntimeSettings
) -> float:
    """The part of a stage's round that holds a flushed step, ``max(0, AT_k - P)`` seconds (module
    doc, "Flush"); 0 when steps overlap (the round's share is then ``estimate_averaging_floor``)."""
    return _round_excess(model, group, layer_start, layer_end, runtime) if runtime.is_flushing else 0.0


def _round_excess(model: ModelProfile, group: StageGroup, layer_start: int, layer_end: int,
                  runtime: RuntimeSettings) -> float:
    """``max(0, AT_k - P)``: how long a stage's round outlasts its period."""
    weight_bytes = sum(model.layer_param_bytes[layer_start:layer_end])
    return max(0.0, weight_bytes * group.averaging_per_byte - runtime.averaging_period)


def estimate_averaging_share(
    model: ModelProfile, group: StageGroup, layer_start: int, layer_end: int, *, runtime: RuntimeSettings
) -> float:
    """Share ``u_k`` of the stage's links that background averaging takes (module doc)."""
    if runtime.averaging_period <= 0:
        return 0.0
    weight_bytes = sum(model.layer_param_bytes[layer_start:layer_end])
    return min(weight_bytes * group.averaging_per_byte / runtime.averaging_period, MAX_AVERAGING_SHARE)


@dataclass(frozen=True, kw_only=True)
class LinkTerms:
    """The link between two server groups, per byte of a layer's output as profiled.

    Attributes:
        round_trip_latency: ``mean alpha_f + mean alpha_b`` in seconds.
        forward_per_byte: ``r mean(1 / beta_f) / n`` seconds per byte.
        backward_per_byte: ``r mean(1 / beta_b) / n`` seconds per byte.
    """

    round_trip_latency: float
    forward_per_byte: float
    backward_per_byte: float
    num_streams: int = 1

    @property
    def bottleneck_per_byte(self) -> float:
        """The slower direction: the two directions are separate resources."""
        return max(self.forward_per_byte, self.backward_per_byte)

    @property
    def round_trip_per_byte(self) -> float:
        """One micro-batch's forward and backward transfer, seconds per byte: a whole micro-batch
        crosses one pair of peers, at ``mean(1 / beta)``, not over the ``n`` streams that the
        boundary's capacity counts."""
        return (self.forward_per_byte + self.backward_per_byte) * self.num_streams


def estimate_link_terms(snapshot: SwarmSnapshot, senders: np.ndarray, receivers: np.ndarray) -> LinkTerms:
    """``LinkTerms`` of the link from server group ``senders`` to ``receivers`` (module doc)."""
    latency = snapshot.links.latency_delay
    inverse = snapshot.links.inverse_bandwidth
    streams = min(senders.size, receivers.size)
    scale = snapshot.runtime.boundary_compression_ratio / streams
    forward, backward = np.ix_(senders, receivers), np.ix_(receivers, senders)
    return LinkTerms(
        round_trip_latency=float(latency[forward].mean() + latency[backward].mean()),
        forward_per_byte=float(inverse[forward].mean()) * scale,
        backward_per_byte=float(inverse[backward].mean()) * scale,
        num_streams=int(streams),
    )


def count_inflight(runtime: RuntimeSettings, num_first_servers: int) -> int:
    """Micro-batches in the pipeline at once, ``W``: each stage-0 server keeps its own window."""
    return runtime.max_in_flight_per_peer * max(num_first_servers, 1)


def count_flushed(runtime: RuntimeSettings, model: ModelProfile) -> int:
    """Micro-batches a step drains under the flush schedule, ``d``; 0 while steps overlap."""
    return model.num_microbatches if runtime.is_flushing else 0


@dataclass(frozen=True, kw_only=True, eq=False)
class PlanCosts:
    """The cost model's figures of one plan (module doc), in seconds per micro-batch.

    Attributes:
        stage_terms: ``term_k`` per stage.
        round_trip: ``R``.
        window: ``W``.
        is_within_memory: False when a member cannot hold its stage.
    """

    stage_terms: np.ndarray
    round_trip: float
    window: int
    is_within_memory: bool
    exchange: float = 0.0
    num_flushed: int = 0

    @property
    def seconds_per_microbatch(self) -> float:
        """``max(max_k term_k, R / W)``, or the flushed step's share (``seconds_per_microbatch``);
        inf when the plan does not fit."""
        if not self.is_within_memory:
            return float("inf")
        return seconds_per_microbatch(float(self.stage_terms.max()), self.round_trip, self.window,
                                      exchange=self.exchange, num_flushed=self.num_flushed)


def seconds_per_microbatch(bottleneck: float, round_trip: float, window: int, *, exchange: float = 0.0,
                           num_flushed: int = 0) -> float:
    """The pipeline's seconds per micro-batch (module doc): ``max(b, R / W)`` while steps overlap
    (``num_flushed`` 0); under the flush schedule, steps of ``num_flushed`` micro-batches that each
    drain and then wait ``exchange`` seconds for the round: ``(max((d - 1) b + R, ceil(d / W) R) + X) / d``."""
    if num_flushed <= 0:
        return max(bottleneck, round_trip / window)
    d = num_flushed
    drained = max((d - 1) * bottleneck + round_trip, math.ceil(d / window) * round_trip)
    return (drained + exchange) / d


def profile_stages(snapshot: SwarmSnapshot, plan: Plan) -> list[StageGroup]:
    """The ``StageGroup`` of every stage of ``plan``."""
    return [
        profile_group(snapshot, snapshot.indices_of(s.server_ids), snapshot.indices_of(s.client_ids))
        for s in plan.stages
    ]


def estimate_plan_costs(snapshot: SwarmSnapshot, plan: Plan) -> PlanCosts:
    """Every figure of the cost model for ``plan`` (module doc)."""
    bounds = (0,) + tuple(stage.layer_end for stage in plan.stages)
    return estimate_group_costs(snapshot, profile_stages(snapshot, plan), bounds)


def estimate_group_costs(snapshot: SwarmSnapshot, groups: list[StageGroup], bounds: tuple[int, ...]) -> PlanCosts:
    """``estimate_plan_costs`` of the stages ``groups`` holding layers ``[bounds[k], bounds[k + 1])``:
    the figures need the members and layers only, so a planner that scores many layouts need not
    build a Plan (its server roles) for each."""
    model, runtime = snapshot.model, snapshot.runtime
    window = count_inflight(runtime, groups[0].num_servers)
    terms = np.zeros(len(groups))
    round_trip = exchange = 0.0
    fits = True
    for k, group in enumerate(groups):
        a, b = bounds[k], bounds[k + 1]
        weight_bytes = sum(model.layer_param_bytes[a:b]) * (1.0 + model.optimizer_bytes_per_param_byte)
        fits &= bool(np.all(group.memory_bytes >= weight_bytes))
        delay, _ = estimate_stage_delay(model, group, a, b, num_inflight=window)
        terms[k] = max(delay, estimate_averaging_floor(model, group, a, b, runtime=runtime))
        exchange = max(exchange, estimate_exchange(model, group, a, b, runtime=runtime))
        round_trip += model.microbatch_size * sum(model.layer_flops[a:b]) / float(group.flops[: group.num_servers].mean())
        if k + 1 < len(groups):
            link = estimate_link_terms(snapshot, group.servers, groups[k + 1].servers)
            slowdown = 1.0 / (1.0 - estimate_averaging_share(model, group, a, b, runtime=runtime))
            num_bytes = model.microbatch_size * model.layer_activation_bytes[b - 1] * slowdown
            terms[k] = max(terms[k], link.bottleneck_per_byte * num_bytes)
            round_trip += link.round_trip_latency + link.round_trip_per_byte * num_bytes
    fits &= bool(np.all(np.isfinite(terms)))
    return PlanCosts(stage_terms=terms, round_trip=round_trip, window=window, is_within_memory=fits,
                     exchange=exchange, num_flushed=count_flushed(runtime, model))


def estimate_stage_costs(snapshot: SwarmSnapshot, plan: Plan) -> np.ndarray:
    """Per-stage ``term_k`` in seconds (inf where a stage does not fit)."""
    return estimate_plan_costs(snapshot, plan).stage_terms


def is_within_memory(snapshot: SwarmSnapshot, plan: Plan) -> bool:
    """True when every member holds its stage's weights and optimizer state, and every stage the
    window's activations (module doc): the one memory check of the planner and the simulator."""
    plan.check_fits(snapshot)
    return estimate_plan_costs(snapshot, plan).is_within_memory


def estimate_throughput(snapshot: SwarmSnapshot, plan: Plan) -> float:
    """Samples per second of ``plan`` under the cost model (module doc); 0 when it does not fit."""
    plan.check_fits(snapshot)
    return throughput_of(snapshot, estimate_plan_costs(snapshot, plan))


def throughput_of(snapshot: SwarmSnapshot, costs: PlanCosts) -> float:
    """Samples per second of a layout with figures ``costs`` (``estimate_throughput``)."""
    seconds = costs.seconds_per_microbatch
    if not np.isfinite(seconds):
        return 0.0
    if seconds <= 0:
        return float("inf")
    return snapshot.model.microbatch_size / seconds


def approximate_pipeline_delay(
    model: ModelProfile, total_flops: float, *, num_clusters: int, max_link_delay: float
) -> float:
    """Seed 000 Eq. 2 with Eq. 3's ``DT_k ~ B |H| / (d p sum C)``; ``total_flops`` is ``sum C``."""
    if num_clusters < 1 or total_flops <= 0:
        raise ValueError("num_clusters must be >= 1 and total_flops > 0")
    stage_delay = model.microbatch_size * sum(model.layer_flops) / (num_clusters * total_flops)
    return model.num_microbatches * (max_link_delay + stage_delay)
