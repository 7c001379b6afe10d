"""Exact layer split for a fixed ordered list of stage groups.

Seed 000 §3.3.3 gives each partition layers "based on its total computational power"; we solve
that step exactly instead: with the groups fixed, choose boundaries ``0 = b_0 < b_1 < ... < b_K = L``
minimising ``max_k cost_k(b_{k-1}, b_k)`` where ``cost_k`` is the per-stage term of seed 000 Eq. 2
(``planner.costs``). Bottleneck dynamic programming, O(K L^2) cost evaluations::

    best[k][b] = min_{a < b} max(best[k-1][a], cost_k(a, b))

Prior work (DAPPLE, PipeDream) uses the same DP; seed 000 rejects DP only for the *device*
partition, which has no axis, not for the layer axis.
"""

from __future__ import annotations

import numpy as np

from planner.costs import StageGroup, count_inflight, estimate_stage_delay
from planner.snapshot import ModelProfile, SwarmSnapshot


def build_link_terms(snapshot: SwarmSnapshot, senders: np.ndarray, receivers: np.ndarray) -> tuple[float, float]:
    """Link k -> k+1 of seed 000 Eq. 2 as ``(alpha_f + alpha_b, 1/(n beta_f) + 1/(n beta_b))``."""
    latency = snapshot.links.latency_delay
    bandwidth = snapshot.links.bandwidth
    num_streams = min(senders.size, receivers.size)
    forward, backward = np.ix_(senders, receivers), np.ix_(receivers, senders)
    fixed = float(latency[forward].mean() + latency[backward].mean())
    per_byte = float(1.0 / (bandwidth[forward].mean() * num_streams))
    per_byte += float(1.0 / (bandwidth[backward].mean() * num_streams))
    return fixed, per_byte


def build_cost_matrix(
    model: ModelProfile, group: StageGroup, *, num_inflight: int, link_terms: tuple[float, float] | None
) -> np.ndarray:
    """``cost[a, b]`` = stage delay of layers [a, b) plus the outgoing link; inf where a >= b."""
    num_layers = model.num_layers
    cost = np.full((num_layers + 1, num_layers + 1), np.inf)
    if group.clients.size == 0:
        _fill_servers_only(model, group, cost, num_inflight)
    else:
        for a in range(num_layers):
            for b in range(a + 1, num_layers + 1):
                cost[a, b], _ = estimate_stage_delay(model, group, a, b, num_inflight=num_inflight)
    if link_terms is not None:
        fixed, per_byte = link_terms
        out_bytes = model.microbatch_size * np.asarray((0.0,) + model.layer_activation_bytes)
        cost += fixed + per_byte * out_bytes[None, :]
    return cost


def _fill_servers_only(model: ModelProfile, group: StageGroup, cost: np.ndarray, num_inflight: int) -> None:
    """Closed form of ``estimate_stage_delay`` for servers only: ``m F / sum c`` unless memory binds."""
    prefix_flops = np.concatenate([[0.0], np.cumsum(model.layer_flops)])
    prefix_params = np.concatenate([[0.0], np.cumsum(model.layer_param_bytes)])
    prefix_acts = np.concatenate([[0.0], np.cumsum(model.layer_activation_bytes)])
    a, b = np.triu_indices(model.num_layers + 1, k=1)
    total_flops = float(group.flops.sum())
    fast = model.microbatch_size * (prefix_flops[b] - prefix_flops[a]) / total_flops
    weights = (prefix_params[b] - prefix_params[a]) * (1.0 + model.optimizer_bytes_per_param_byte)
    activations = (prefix_acts[b] - prefix_acts[a]) * num_inflight
    shares = model.microbatch_size * group.flops[None, :] / total_flops
    needed = weights[:, None] + activations[:, None] * shares
    fits = np.all(needed <= group.memory_bytes[None, :], axis=1)
    cost[a[fits], b[fits]] = fast[fits]
    for i in np.flatnonzero(~fits):
        cost[a[i], b[i]], _ = estimate_stage_delay(model, group, int(a[i]), int(b[i]), num_inflight=num_inflight)


def split_by_matrices(costs: list[np.ndarray]) -> tuple[tuple[int, ...], float]:
    """Bottleneck DP over per-stage cost matrices.

    Returns:
        (boundaries ``(b_1, ..., b_K)`` with ``b_K = L``, bottleneck cost); the cost is inf and
        the boundaries an even split when no feasible split exists.
    """
    num_stages = len(costs)
    num_layers = costs[0].shape[0] - 1
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} stages cannot split {num_layers} layers")
    best = np.full((num_stages + 1, num_layers + 1), np.inf)
    choice = np.zeros((num_stages + 1, num_layers + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, num_stages + 1):
        for b in range(k, num_layers - (num_stages - k) + 1):
            candidates = np.maximum(best[k - 1, :b], costs[k - 1][:b, b])
            a = int(np.argmin(candidates))
            best[k, b], choice[k, b] = candidates[a], a
    if not np.isfinite(best[num_stages, num_layers]):
        even = tuple(round(num_layers * (k + 1) / num_stages) for k in range(num_stages))
        return even, float("inf")
    bounds = [num_layers]
    for k in range(num_stages, 1, -1):
        bounds.append(int(choice[k, bounds[-1]]))
    return tuple(reversed(bounds)), float(best[num_stages, num_layers])


def split_layers(snapshot: SwarmSnapshot, groups: list[StageGroup]) -> tuple[tuple[int, ...], float]:
    """Optimal contiguous layer split for ``groups`` in pipeline order; see ``split_by_matrices``."""
    model = snapshot.model
    costs = []
    for k, group in enumerate(groups):
        link = None
        if k + 1 < len(groups):
            link = build_link_terms(snapshot, group.servers, groups[k + 1].servers)
        inflight = count_inflight(k, len(groups), model.num_microbatches)
        costs.append(build_cost_matrix(model, group, num_inflight=inflight, link_terms=link))
    return split_by_matrices(costs)
