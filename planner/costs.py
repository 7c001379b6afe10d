"""Cost models of seed 000 (Eq. 1–3) with seed 001's memory footprint (Eq. 3).

Notation (seed 000 §3.1.3): a stage k holds layers [a, b) with ``F_k`` FLOPs per sample, a
micro-batch has ``m`` samples, device i computes ``c_i`` FLOP/s, ``alpha`` is latency (s) and
``beta`` bandwidth (B/s) between two devices, ``t_l`` the activation bytes per sample after layer l.

Data-parallel stage time (seed 000 Eq. 1). The micro-batch is split into shares ``w_i`` over the
stage's servers S and clients U. A server computes only; a client also receives its input from
and returns its output to the servers, forward and backward::

    T_i(w_i) = w_i F_k / c_i                                                   (i in S)
    T_i(w_i) = 4 alpha_iS + w_i (F_k / c_i + 2 (t_{a-1} + t_{b-1}) / beta_iS)    (i in U)
    DT_k = min over shares with sum w_i = m and w_i <= cap_i of max_{w_i > 0} T_i(w_i)

where ``alpha_iS`` and ``1 / beta_iS`` are means over the stage's servers (seed 000 §3.3.3
"average delay" ``mean_j alpha_ij + t / beta_ij``) and ``cap_i`` is the memory cap below. The min-max is solved exactly by water-filling
(the continuous form of seed 001 Alg. 1 phase 1: balance by capacity, clamp at memory budgets).

Memory (seed 001 Eq. 3, 1F1B with ``min(K - k, d)`` micro-batches in flight)::

    M_i = W_k (1 + o) + min(K - k, d) w_i A_k,   A_k = sum_{l in [a, b)} t_l

A server whose ``W_k (1 + o)`` exceeds its memory makes the stage infeasible; a client that
cannot hold the weights gets ``cap_i = 0``.

Pipeline time (seed 000 Eq. 2), with the link k -> k+1 between the servers of both stages,
segmented over ``n = min(|S_k|, |S_{k+1}|)`` parallel streams (seed 000 §3.2); ``alpha`` and
``1 / beta`` are means over the server pairs (forward: S_k to S_{k+1}; backward: the reverse)::

    PT = d max_k (DT_k + alpha_kf + m t_{b-1} / (n beta_kf) + alpha_kb + m t_{b-1} / (n beta_kb))

Averaging (not in seed 000's model). Eq. 1 drops parameter aggregation because delayed parameter
updates overlap it with training; it can overlap at most one step, so a step lasts at least the
averaging time of every stage. Parameter-server averaging ships ``W_k / |S_k|`` from every member
to each server and back, so ``AT_k = 2 W_k max_i mean_{j in S_k} 1 / beta_ij`` and each stage
term of Eq. 2 becomes ``max(DT_k + link_k, AT_k / d)``.

Throughput is ``d m / PT`` samples per second. Seed 000 Eq. 3 approximates ``DT_k`` by
``m sum_l F_l / (p sum_i c_i)`` when ``p`` clusters share the work evenly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.plan import Plan
from planner.snapshot import ModelProfile, SwarmSnapshot


@dataclass(frozen=True, kw_only=True, eq=False)
class StageGroup:
    """The devices of one stage with their link figures to the stage's servers precomputed.

    Attributes:
        servers: device indices of the servers, ascending.
        clients: device indices of the clients, ascending.
        flops: FLOP/s of servers then clients.
        memory_bytes: memory of servers then clients.
        offset_delays: fixed per-micro-batch delay of each device (0 for servers, 4 alpha_iS).
        inverse_bandwidths: 2 / beta_iS per device (0 for servers).
        averaging_per_byte: seconds per parameter byte of one averaging round,
            ``2 max_i mean_{j in S} 1 / beta_ij`` over members i (0 for a lone device).
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
    if clients.size:
        latency = snapshot.links.latency_delay
        bandwidth = snapshot.links.bandwidth
        alpha = (latency[np.ix_(clients, servers)] + latency[np.ix_(servers, clients)].T) / 2
        per_byte = (1.0 / bandwidth[np.ix_(clients, servers)] + 1.0 / bandwidth[np.ix_(servers, clients)].T) / 2
        offsets[servers.size:] = 4.0 * alpha.mean(axis=1)
        inverse[servers.size:] = 2.0 * per_byte.mean(axis=1)
    averaging = 0.0
    if members.size > 1:
        averaging = 2.0 * float((1.0 / snapshot.links.bandwidth[np.ix_(members, servers)]).mean(axis=1).max())
    return StageGroup(
        servers=servers, clients=clients, flops=snapshot.flops[members],
        memory_bytes=snapshot.memory_bytes[members], offset_delays=offsets,
        inverse_bandwidths=inverse, averaging_per_byte=averaging,
    )


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
    no row exceeds a cap (rarely more than a few passes). Returns the finish time of each row.
    """
    num_rows, _ = per_sample_delays.shape
    order = np.argsort(offset_delays, kind="stable")
    a = offset_delays[order]
    inverse_b = 1.0 / per_sample_delays[:, order]
    caps = caps[:, order]
    active = caps > 0
    fixed = np.zeros_like(inverse_b)
    remaining = np.full(num_rows, float(num_samples))
    next_offsets = np.append(a[1:], np.inf)
    shares = np.zeros_like(inverse_b)
    pending = np.ones(num_rows, dtype=bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        while np.any(pending):
            weight = np.where(active, inverse_b, 0.0)
            levels = (remaining[:, None] + np.cumsum(weight * a, axis=1)) / np.cumsum(weight, axis=1)
            stop = np.argmax(levels <= next_offsets[None, :], axis=1)
            level = levels[np.arange(num_rows), stop]
            trial = np.where(active, np.maximum(level[:, None] - a[None, :], 0.0) * inverse_b, 0.0)
            over = active & (trial > caps) & pending[:, None]
            done = pending & ~np.any(over, axis=1)
            shares[done] = fixed[done] + trial[done]
            fixed[over] = caps[over]
            remaining -= np.where(over, caps, 0.0).sum(axis=1)
            active &= ~over
            pending &= ~done
            starved = pending & ~np.any(active, axis=1)
            shares[starved] = np.nan
            pending &= ~starved
    finish = np.where(shares > 0, a[None, :] + shares / inverse_b, 0.0).max(axis=1)
    infeasible = np.isnan(shares).any(axis=1) | (shares.sum(axis=1) < num_samples * (1 - 1e-9))
    return np.where(infeasible, np.inf, finish)


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
        caps = np.where(group.memory_bytes >= weight_bytes, np.inf, 0.0)
    boundary_bytes = model.layer_activation_bytes[layer_end - 1]
    if layer_start > 0:
        boundary_bytes += model.layer_activation_bytes[layer_start - 1]
    per_sample = stage_flops / group.flops + boundary_bytes * group.inverse_bandwidths
    per_sample = np.maximum(per_sample, 1e-30)
    return fill_workload(group.offset_delays, per_sample, caps, model.microbatch_size)


def estimate_averaging_floor(model: ModelProfile, group: StageGroup, layer_start: int, layer_end: int) -> float:
    """Averaging time of the stage per micro-batch, ``W_k * averaging_per_byte / d`` (see module doc)."""
    weight_bytes = sum(model.layer_param_bytes[layer_start:layer_end])
    return weight_bytes * group.averaging_per_byte / model.num_microbatches


def estimate_link_delay(
    snapshot: SwarmSnapshot, senders: np.ndarray, receivers: np.ndarray, num_bytes: float
) -> float:
    """Seed 000 Eq. 2 link term: forward activations and backward gradients of one micro-batch."""
    latency = snapshot.links.latency_delay
    bandwidth = snapshot.links.bandwidth
    num_streams = min(senders.size, receivers.size)
    forward = latency[np.ix_(senders, receivers)].mean()
    forward += num_bytes / num_streams * (1.0 / bandwidth[np.ix_(senders, receivers)]).mean()
    backward = latency[np.ix_(receivers, senders)].mean()
    backward += num_bytes / num_streams * (1.0 / bandwidth[np.ix_(receivers, senders)]).mean()
    return float(forward + backward)


def count_inflight(stage_index: int, num_stages: int, num_microbatches: int) -> int:
    """Micro-batches whose activations a 1F1B stage holds at once (seed 001 §3.2)."""
    return max(1, min(num_stages - stage_index, num_microbatches))


def estimate_stage_costs(snapshot: SwarmSnapshot, plan: Plan) -> np.ndarray:
    """Per-stage term of seed 000 Eq. 2: ``DT_k`` plus the link to the next stage, in seconds."""
    model = snapshot.model
    groups = [
        profile_group(snapshot, snapshot.indices_of(s.server_ids), snapshot.indices_of(s.client_ids))
        for s in plan.stages
    ]
    costs = np.zeros(plan.num_stages)
    for k, (stage, group) in enumerate(zip(plan.stages, groups)):
        inflight = count_inflight(k, plan.num_stages, model.num_microbatches)
        costs[k], _ = estimate_stage_delay(
            model, group, stage.layer_start, stage.layer_end, num_inflight=inflight
        )
        if k + 1 < plan.num_stages:
            num_bytes = model.microbatch_size * model.layer_activation_bytes[stage.layer_end - 1]
            costs[k] += estimate_link_delay(snapshot, group.servers, groups[k + 1].servers, num_bytes)
        costs[k] = max(costs[k], estimate_averaging_floor(model, group, stage.layer_start, stage.layer_end))
    return costs


def estimate_throughput(snapshot: SwarmSnapshot, plan: Plan) -> float:
    """Samples per second of ``plan`` under seed 000 Eq. 2: ``d m / PT``; 0 when infeasible."""
    plan.check_fits(snapshot)
    bottleneck = float(estimate_stage_costs(snapshot, plan).max())
    if not np.isfinite(bottleneck) or bottleneck <= 0:
        return 0.0 if not np.isfinite(bottleneck) else float("inf")
    return snapshot.model.microbatch_size / bottleneck


def approximate_pipeline_delay(
    model: ModelProfile, total_flops: float, *, num_clusters: int, max_link_delay: float
) -> float:
    """Seed 000 Eq. 2 with Eq. 3's ``DT_k ~ B |H| / (d p sum C)``; ``total_flops`` is ``sum C``."""
    if num_clusters < 1 or total_flops <= 0:
        raise ValueError("num_clusters must be >= 1 and total_flops > 0")
    stage_delay = model.microbatch_size * sum(model.layer_flops) / (num_clusters * total_flops)
    return model.num_microbatches * (max_link_delay + stage_delay)
