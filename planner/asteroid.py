"""Seed 001 (Asteroid) §3.2–3.3: memory footprint, micro-batch allocation (Alg. 1), DP planner (Alg. 2).

The seed's equations lost their symbols in text extraction; the forms below follow its prose.

Memory (Eq. 3), stage k of K with 1F1B and ``K - k`` micro-batches in flight (k from 0)::

    M_k(b) = W_k + O_k + (K - k) A_k(b)       (W: weights and gradients, O: optimizer, A: activations)

HPP-round latency (Eq. 4–6). The round is a chain of steps s (execution steps: a device group
running a stage; communication steps: the transfer between two groups) with per-micro-batch
forward time ``f_s``, backward time ``b_s`` and all-reduce time ``A_s``. The dominant step ``d``
maximises ``f_s + b_s`` and sets the pace of the ``M`` micro-batches; step s waits for the forward
of the steps before it, runs its own pass and the paced ones, and ends with its all-reduce::

    L = max_s ( sum_{j<s} f_j  +  (M - 1)(f_d + b_d) + sum_{j>=s} (f_j + b_j)  +  A_s )

``A_s = 2 (n - 1) / n * W_s / min bandwidth`` in the group (ring all-reduce on the slowest link).

Alg. 1 (per group): phase 1 splits the ``B`` samples in proportion to capacity ``1 / t_i`` (the
per-sample FP+BP time) with each device clamped at its memory budget, the clamped share going to
the others; phase 2 moves one sample at a time from the straggler to the fastest device with
memory to spare while the straggler's time falls.

Alg. 2: devices sorted by memory, descending; ``Q[l][n]`` is the best round latency for the last
``l`` layers on the last ``n`` devices, extended at the head by one stage (layers and devices
contiguous in these orders). Each table entry keeps its step list, so the latency is exact for
the chain it describes (the seed tracks the dominant step for the same purpose).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.assembly import assemble_plan
from planner.simulator import FORWARD_FRACTION
from planner.plan import Plan
from planner.snapshot import ModelProfile, SwarmSnapshot


def estimate_footprint_bytes(
    model: ModelProfile, layer_start: int, layer_end: int, *, num_samples: float, num_inflight: int
) -> float:
    """Seed 001 Eq. 3: weights, optimizer state and ``num_inflight`` micro-batches of activations."""
    weights = sum(model.layer_param_bytes[layer_start:layer_end]) * (1.0 + model.optimizer_bytes_per_param_byte)
    activations = sum(model.layer_activation_bytes[layer_start:layer_end]) * num_samples
    return weights + num_inflight * activations


def allocate_microbatch(
    sample_delays: np.ndarray, sample_caps: np.ndarray, num_samples: int
) -> tuple[np.ndarray, float]:
    """Seed 001 Alg. 1: integer samples per device; returns (allocation, straggler time).

    Args:
        sample_delays: per-sample FP+BP seconds of each device.
        sample_caps: most samples each device's memory holds.
        num_samples: the micro-batch size B.
    """
    caps = np.floor(np.asarray(sample_caps, dtype=np.float64))
    if caps.sum() < num_samples:
        return np.zeros(sample_delays.size, dtype=np.int64), float("inf")
    allocation = np.zeros(sample_delays.size)
    free = caps > 0
    remaining = float(num_samples)
    while remaining > 0 and np.any(free):
        capacity = np.where(free, 1.0 / sample_delays, 0.0)
        share = remaining * capacity / capacity.sum()
        clamped = free & (allocation + share >= caps)
        if not np.any(clamped):
            allocation += share
            break
        remaining -= float((caps[clamped] - allocation[clamped]).sum())
        allocation[clamped] = caps[clamped]
        free &= ~clamped
    allocation = _round_preserving_sum(allocation, num_samples, caps)
    return _offload(allocation, sample_delays, caps)


def _round_preserving_sum(allocation: np.ndarray, total: int, caps: np.ndarray) -> np.ndarray:
    """Floors, then hands the leftover samples to the largest remainders that have room."""
    whole = np.minimum(np.floor(allocation + 1e-9), caps).astype(np.int64)
    order = np.argsort(-(allocation - whole), kind="stable")
    for i in order:
        if whole.sum() >= total:
            break
        if whole[i] < caps[i]:
            whole[i] += 1
    return whole


def _offload(allocation: np.ndarray, sample_delays: np.ndarray, caps: np.ndarray) -> tuple[np.ndarray, float]:
    """Phase 2: move one sample from the straggler to the fastest device with room, while it helps."""
    finish = allocation * sample_delays
    while True:
        straggler = int(np.argmax(finish))
        room = (allocation < caps) & (np.arange(allocation.size) != straggler)
        if not np.any(room):
            break
        target = int(np.flatnonzero(room)[np.argmin((finish + sample_delays)[room])])
        trial = allocation.copy()
        trial[straggler] -= 1
        trial[target] += 1
        if (trial * sample_delays).max() >= finish.max():
            break
        allocation, finish = trial, trial * sample_delays
    return allocation, float(finish.max())


def estimate_round_delay(forward: list[float], backward: list[float], allreduce: list[float], num_microbatches: int) -> float:
    """Seed 001 Eq. 4–6 over a chain of steps (see module docstring)."""
    paced = max(f + b for f, b in zip(forward, backward))
    total = 0.0
    waits = np.concatenate([[0.0], np.cumsum(forward)[:-1]])
    tails = np.cumsum((np.asarray(forward) + np.asarray(backward))[::-1])[::-1]
    for s in range(len(forward)):
        total = max(total, waits[s] + (num_microbatches - 1) * paced + tails[s] + allreduce[s])
    return float(total)


@dataclass(frozen=True, kw_only=True)
class AsteroidConfig:
    """Knobs of the Alg. 2 planner.

    Attributes:
        max_blocks: layers are grouped into at most this many blocks of consecutive layers
            before the DP, which is O(blocks^2 devices^2) table updates.
    """

    max_blocks: int = 12

    def __post_init__(self) -> None:
        if self.max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")


@dataclass(frozen=True, kw_only=True)
class _Chain:
    """A sub-pipeline: its steps (forward, backward, all-reduce) and its stages (blocks, devices)."""

    steps: tuple[tuple[float, float, float], ...]
    stages: tuple[tuple[int, int, int, int], ...]  # blocks covered, tail blocks, devices used, tail used
    delay: float


def _head_step(
    snapshot: SwarmSnapshot, devices: np.ndarray, layers: tuple[int, int], num_inflight: int
) -> tuple[float, float, float] | None:
    """(forward, backward, all-reduce) of a stage, or None when it does not fit or lacks a server."""
    model = snapshot.model
    if not any(snapshot.devices[i].is_reliable for i in devices):
        return None
    start, end = layers
    weights = estimate_footprint_bytes(model, start, end, num_samples=0, num_inflight=0)
    per_sample = estimate_footprint_bytes(model, start, end, num_samples=1, num_inflight=num_inflight) - weights
    caps = np.maximum(snapshot.memory_bytes[devices] - weights, 0.0) / max(per_sample, 1e-30)
    delays = sum(model.layer_flops[start:end]) / snapshot.flops[devices]
    _, straggler = allocate_microbatch(delays, caps, model.microbatch_size)
    if not np.isfinite(straggler):
        return None
    allreduce = 0.0
    if devices.size > 1:
        slowest = float(snapshot.links.bandwidth[np.ix_(devices, devices)].min())
        allreduce = 2.0 * (devices.size - 1) / devices.size * sum(model.layer_param_bytes[start:end]) / slowest
    return FORWARD_FRACTION * straggler, (1 - FORWARD_FRACTION) * straggler, allreduce


def _comm_step(snapshot: SwarmSnapshot, left: np.ndarray, right: np.ndarray, layer_end: int) -> float:
    """Transfer time of one micro-batch's activations between two groups (mean over pairs)."""
    num_bytes = snapshot.model.microbatch_size * snapshot.model.layer_activation_bytes[layer_end - 1]
    pairs = np.ix_(left, right)
    latency = snapshot.links.latency_delay[pairs].mean()
    return float(latency + num_bytes * (1.0 / snapshot.links.bandwidth[pairs]).mean())


def plan_asteroid(snapshot: SwarmSnapshot, config: AsteroidConfig | None = None) -> Plan:
    """Seed 001 Alg. 2 (see module docstring); reliable members serve, unreliable ones are clients."""
    config = config or AsteroidConfig()
    model = snapshot.model
    order = np.array(sorted(range(snapshot.num_devices), key=lambda i: (-snapshot.memory_bytes[i], i)))
    num_devices = order.size
    edges = np.linspace(0, model.num_layers, min(config.max_blocks, model.num_layers) + 1).round().astype(int)
    num_blocks = edges.size - 1
    table: dict[tuple[int, int], _Chain] = {(0, 0): _Chain(steps=(), stages=(), delay=0.0)}
    for blocks in range(1, num_blocks + 1):  # the last `blocks` blocks ...
        for used in range(1, num_devices + 1):  # ... on the last `used` devices
            best = None
            for tail_blocks in range(blocks):
                for tail_used in range(used):
                    tail = table.get((tail_blocks, tail_used))
                    if tail is None:
                        continue
                    chain = _extend(snapshot, order, edges, tail, (blocks, used, tail_blocks, tail_used))
                    if chain is not None and (best is None or chain.delay < best.delay):
                        best = chain
            if best is not None:
                table[(blocks, used)] = best
    finals = [table[(num_blocks, n)] for n in range(1, num_devices + 1) if (num_blocks, n) in table]
    if not finals:
        raise ValueError("no feasible Asteroid plan: the devices cannot hold the model")
    best = min(finals, key=lambda c: c.delay)
    groups, bounds = [], []
    for blocks, tail_blocks, used, tail_used in best.stages:
        members = order[num_devices - used: num_devices - tail_used]
        servers = np.sort([i for i in members if snapshot.devices[i].is_reliable]).astype(np.int64)
        clients = np.sort([i for i in members if not snapshot.devices[i].is_reliable]).astype(np.int64)
        groups.append((servers, clients))
        bounds.append(int(edges[num_blocks - tail_blocks]))
    return assemble_plan(snapshot, groups, tuple(bounds))


def _extend(
    snapshot: SwarmSnapshot, order: np.ndarray, edges: np.ndarray, tail: _Chain,
    shape: tuple[int, int, int, int],
) -> _Chain | None:
    """``tail`` with one head stage on the blocks and devices it leaves (``shape`` as in _Chain)."""
    blocks, used, tail_blocks, tail_used = shape
    num_blocks, num_devices = edges.size - 1, order.size
    layers = (int(edges[num_blocks - blocks]), int(edges[num_blocks - tail_blocks]))
    devices = order[num_devices - used: num_devices - tail_used]
    head = _head_step(snapshot, devices, layers, num_inflight=len(tail.stages) + 1)
    if head is None:
        return None
    steps = (head,)
    if tail.stages:
        tail_devices = order[num_devices - tail_used: num_devices - tail.stages[0][3]]
        comm = _comm_step(snapshot, devices, tail_devices, layers[1])
        steps += ((comm, comm, 0.0),)
    steps += tail.steps
    forward, backward, allreduce = (list(x) for x in zip(*steps))
    delay = estimate_round_delay(forward, backward, allreduce, snapshot.model.num_microbatches)
    return _Chain(steps=steps, stages=((blocks, tail_blocks, used, tail_used),) + tail.stages, delay=delay)
