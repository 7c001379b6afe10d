"""Exact layer split for a fixed ordered list of stage groups.

Seed 000 §3.3.3 gives each partition layers "based on its total computational power"; we solve
that step exactly instead: with the groups fixed, choose boundaries ``0 = b_0 < b_1 < ... < b_K = L``
minimising ``max_k cost_k(b_{k-1}, b_k)`` where ``cost_k`` is the per-stage term ``term_k`` of
the cost model (``planner.costs``). The window bound ``R / W`` is a sum over stages, not a
maximum, so the DP leaves it out; callers score the split it returns with the whole model. Bottleneck dynamic programming, O(K L^2) cost evaluations::

    best[k][b] = min_{a < b} max(best[k-1][a], cost_k(a, b))

Prior work (DAPPLE, PipeDream) uses the same DP; seed 000 rejects DP only for the *device*
partition, which has no axis, not for the layer axis.
"""

from __future__ import annotations

import numpy as np

from planner.costs import MAX_AVERAGING_SHARE, StageGroup, count_inflight, estimate_link_terms, fill_workloads
from planner.runtime import RuntimeSettings
from planner.snapshot import ModelProfile, SwarmSnapshot


def compute_range_delays(
    model: ModelProfile, group: StageGroup, starts: np.ndarray, ends: np.ndarray, *, num_inflight: int
) -> np.ndarray:
    """Stage delay ``DT`` of the group for each layer range [starts[r], ends[r]), vectorised.

    The same model as ``costs.estimate_stage_delay``; inf where a server cannot hold the range.
    A range's delay depends on the range only through four figures (its FLOPs, boundary bytes,
    weight bytes and window activations), and a model of repeated blocks gives many ranges the
    same four exactly (24 identical layers: 300 ranges, 47 distinct), so each distinct set (equal
    bytes) is filled once and the results are spread back: the same arithmetic on the same values.
    """
    prefix_flops, prefix_params, prefix_acts = model.prefix_sums
    outputs = np.asarray((0.0,) + model.layer_activation_bytes)
    a, b = np.asarray(starts), np.asarray(ends)
    figures = np.stack([
        prefix_flops[b] - prefix_flops[a],
        outputs[b] + np.where(a > 0, outputs[a], 0.0),
        (prefix_params[b] - prefix_params[a]) * (1.0 + model.optimizer_bytes_per_param_byte),
        (prefix_acts[b] - prefix_acts[a]) * max(num_inflight, 1),
    ], axis=1)
    if a.size < 2:
        return _fill_ranges(model, group, figures)
    rows = np.ascontiguousarray(figures).view(np.dtype((np.void, figures.itemsize * 4))).reshape(-1)
    _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)  # byte-equal rows
    return _fill_ranges(model, group, figures[first])[inverse.reshape(-1)]


def _fill_ranges(model: ModelProfile, group: StageGroup, figures: np.ndarray) -> np.ndarray:
    """``compute_range_delays`` of ranges given by their rows of (FLOPs per sample, boundary bytes
    per sample, weight bytes with optimizer state, activation bytes of the window)."""
    stage_flops, boundary, weights, activations = figures.T
    per_sample = stage_flops[:, None] / group.flops[None, :]
    per_sample = np.maximum(per_sample + boundary[:, None] * group.inverse_bandwidths[None, :], 1e-30)
    free = np.maximum(group.memory_bytes[None, :] - weights[:, None], 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        caps = np.where(activations[:, None] > 0, free / activations[:, None], np.inf)
    caps = np.where(group.memory_bytes[None, :] >= weights[:, None], caps, 0.0)
    servers_fit = np.all(group.memory_bytes[None, : group.num_servers] >= weights[:, None], axis=1)
    delays = np.full(weights.size, np.inf)
    if np.any(servers_fit):  # a range no server can hold is inf whatever the clients do: not filled
        delays[servers_fit] = fill_workloads(
            group.offset_delays, per_sample[servers_fit], caps[servers_fit], model.microbatch_size
        )
    return delays


def build_cost_matrix(
    model: ModelProfile, group: StageGroup, *, num_inflight: int, link_per_byte: float | None,
    runtime: RuntimeSettings,
) -> np.ndarray:
    """``cost[a, b]`` = ``term_k`` of layers [a, b) with the outgoing link; inf where a >= b.

    ``link_per_byte`` is ``LinkTerms.bottleneck_per_byte`` of the outgoing link (None: last stage).
    """
    num_layers = model.num_layers
    a, b = model.layer_ranges
    cost = np.full((num_layers + 1, num_layers + 1), np.inf)
    cost[a, b] = compute_range_delays(model, group, a, b, num_inflight=num_inflight)
    if link_per_byte is not None:
        cost = np.maximum(cost, build_link_matrix(model, group, link_per_byte, runtime=runtime))
    return np.maximum(cost, build_floor_matrix(model, group, runtime=runtime))


def build_link_matrix(
    model: ModelProfile, group: StageGroup, link_per_byte: float, *, runtime: RuntimeSettings
) -> np.ndarray:
    """``L_k`` for every range [a, b): the outgoing transfer slowed by the averaging share."""
    outputs = np.asarray((0.0,) + model.layer_activation_bytes)
    share = np.zeros((model.num_layers + 1, model.num_layers + 1))
    if runtime.averaging_period > 0:
        share = model.range_param_bytes * group.averaging_per_byte / runtime.averaging_period
    slowdown = 1.0 / (1.0 - np.minimum(share, MAX_AVERAGING_SHARE))
    return link_per_byte * model.microbatch_size * outputs[None, :] * slowdown


def build_floor_matrix(model: ModelProfile, group: StageGroup, *, runtime: RuntimeSettings) -> np.ndarray:
    """``floor[a, b]`` = blocking averaging per micro-batch of layers [a, b) (``costs`` module doc);
    0 under the flush schedule, whose round is charged once per step (``costs.estimate_exchange``)."""
    if runtime.is_flushing:
        return np.zeros_like(model.range_param_bytes, dtype=float)
    excess = model.range_param_bytes * group.averaging_per_byte - runtime.averaging_period
    return np.maximum(excess, 0.0) / model.num_microbatches


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
        candidates = np.maximum(best[k - 1][:, None], costs[k - 1])
        choice[k] = np.argmin(candidates, axis=0)
        best[k] = candidates[choice[k], np.arange(num_layers + 1)]
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
    inflight = count_inflight(snapshot.runtime, groups[0].num_servers)
    costs = []
    for k, group in enumerate(groups):
        link = None
        if k + 1 < len(groups):
            link = estimate_link_terms(snapshot, group.servers, groups[k + 1].servers).bottleneck_per_byte
        costs.append(build_cost_matrix(model, group, num_inflight=inflight, link_per_byte=link, runtime=snapshot.runtime))
    return split_by_matrices(costs)
