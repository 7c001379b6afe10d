"""Synthetic swarms for tests, benchmarks and the simulator: random regions and seed 000's cases.

Every generator takes a ``numpy.random.Generator``; nothing here reads a clock or a global RNG.
Units: FLOP/s, bytes, seconds, bytes per second.
"""

from __future__ import annotations

import numpy as np

from planner.snapshot import Device, LinkMatrix, ModelProfile, SwarmSnapshot

MEGABIT = 1e6 / 8
GIGABYTE = 1e9
V100_FLOPS = 30e12  # sustained mixed-precision training throughput, roughly
RTX2080_FLOPS = V100_FLOPS / 1.55  # seed 000 §4.1 Case 3: "increased the training time ... by 55%"


def build_transformer_profile(
    *, num_layers: int, hidden_size: int, sequence_length: int, microbatch_size: int = 4,
    num_microbatches: int = 32,
) -> ModelProfile:
    """Identical transformer layers (seed 000 §3.1.2): 12 h^2 params, 6 * params * tokens FLOPs."""
    params = 12 * hidden_size * hidden_size
    flops = 6.0 * params * sequence_length
    activation_bytes = 2.0 * sequence_length * hidden_size  # fp16 layer output
    return ModelProfile(
        layer_flops=(flops,) * num_layers, layer_param_bytes=(2.0 * params,) * num_layers,
        layer_activation_bytes=(activation_bytes,) * num_layers, microbatch_size=microbatch_size,
        num_microbatches=num_microbatches,
    )


def build_region_snapshot(
    rng: np.random.Generator, *, num_devices: int, num_regions: int, model: ModelProfile,
    unreliable_fraction: float = 0.3, memory_range_bytes: tuple[float, float] = (8e9, 24e9),
) -> SwarmSnapshot:
    """Devices spread over regions: fast links inside a region, slow and far links between regions.

    Peer ids are random hex strings, so the sorted order is unrelated to the region.
    """
    if num_devices < 1 or num_regions < 1:
        raise ValueError("num_devices and num_regions must be >= 1")
    region = rng.integers(0, num_regions, size=num_devices)
    same = region[:, None] == region[None, :]
    latency = np.where(same, rng.uniform(0.001, 0.01, (num_devices,) * 2), rng.uniform(0.03, 0.15, (num_devices,) * 2))
    bandwidth = np.where(
        same, rng.uniform(200, 1000, (num_devices,) * 2) * MEGABIT, rng.uniform(50, 300, (num_devices,) * 2) * MEGABIT
    )
    latency, bandwidth = (latency + latency.T) / 2, (bandwidth + bandwidth.T) / 2
    flops = rng.uniform(0.3, 1.0, num_devices) * V100_FLOPS
    memory = rng.uniform(*memory_range_bytes, num_devices)
    reliable = rng.random(num_devices) >= unreliable_fraction
    reliable[int(np.argmax(flops))] = True
    ids = [f"{int(x):012x}" for x in rng.choice(2**46, size=num_devices, replace=False)]
    devices = tuple(
        Device(peer_id=ids[i], flops=float(flops[i]), memory_bytes=int(memory[i]), is_reliable=bool(reliable[i]))
        for i in range(num_devices)
    )
    return SwarmSnapshot(devices=devices, links=LinkMatrix(latency_delay=latency, bandwidth=bandwidth), model=model)


def build_case3_snapshot(rng: np.random.Generator, model: ModelProfile) -> SwarmSnapshot:
    """Seed 000 §4.1 Case 3: two HPCs of four V100s and eight standalone RTX 2080s.

    Inside an HPC: 2 GB/s and 1 ms (Case 1's datacenter link). Between an HPC and anything else,
    and between standalone GPUs: 50–300 Mb/s and 100–150 ms. The V100s are reliable, the RTX
    2080s unreliable (seed 000 §4.2 uses the same split).
    """
    site = np.array([0] * 4 + [1] * 4 + list(range(2, 10)))
    num_devices = site.size
    same = site[:, None] == site[None, :]
    latency = np.where(same, 0.001, rng.uniform(0.100, 0.150, (num_devices,) * 2))
    bandwidth = np.where(same, 2e9, rng.uniform(50, 300, (num_devices,) * 2) * MEGABIT)
    latency, bandwidth = (latency + latency.T) / 2, (bandwidth + bandwidth.T) / 2
    devices = tuple(
        Device(
            peer_id=(f"hpc{site[i]}-v100-{i % 4}" if i < 8 else f"rtx2080-{i - 8:02d}"),
            flops=V100_FLOPS if i < 8 else RTX2080_FLOPS, memory_bytes=int(32 * GIGABYTE if i < 8 else 11 * GIGABYTE),
            is_reliable=i < 8,
        )
        for i in range(num_devices)
    )
    return SwarmSnapshot(devices=devices, links=LinkMatrix(latency_delay=latency, bandwidth=bandwidth), model=model)


def build_clustered_snapshot(
    rng: np.random.Generator, *, model: ModelProfile, num_clusters: int, cluster_size: int, num_edge: int,
    inter_cluster_megabits: float = 1000.0, edge_megabits: float = 100.0,
    cluster_memory_bytes: tuple[float, ...] = (32 * GIGABYTE,), edge_memory_bytes: tuple[float, float] = (8e9, 16e9),
) -> SwarmSnapshot:
    """Clusters of fast GPUs joined to each other and to edge devices by slower links (issue #18).

    Inside a cluster: 10 Gbit/s and 0.5 ms, GPUs of 2-3x a V100, memory drawn from
    ``cluster_memory_bytes``. Between clusters: ``inter_cluster_megabits`` and 10-40 ms. Edge
    devices (0.2-0.6 V100, ``edge_memory_bytes``, two thirds reliable): ``edge_megabits`` and
    20-60 ms to everything. Peer ids are random hex, unrelated to the structure.
    """
    num_fast = num_clusters * cluster_size
    num_devices = num_fast + num_edge
    site = np.array([i // cluster_size for i in range(num_fast)] + [num_clusters + i for i in range(num_edge)])
    same = site[:, None] == site[None, :]
    is_edge = site >= num_clusters
    touches_edge = is_edge[:, None] | is_edge[None, :]
    shape = (num_devices, num_devices)
    latency = np.where(same, 0.0005, np.where(touches_edge, rng.uniform(0.02, 0.06, shape), rng.uniform(0.01, 0.04, shape)))
    megabits = np.where(same, 10_000.0, np.where(touches_edge, edge_megabits, inter_cluster_megabits))
    latency = (latency + latency.T) / 2
    flops = np.where(is_edge, rng.uniform(0.2, 0.6, num_devices), rng.uniform(2.0, 3.0, num_devices)) * V100_FLOPS
    memory = np.where(
        is_edge, rng.uniform(*edge_memory_bytes, num_devices),
        np.array(cluster_memory_bytes)[rng.integers(0, len(cluster_memory_bytes), num_devices)],
    )
    reliable = ~is_edge | (rng.random(num_devices) < 2 / 3)
    ids = [f"{int(x):012x}" for x in rng.choice(2**46, size=num_devices, replace=False)]
    devices = tuple(
        Device(peer_id=ids[i], flops=float(flops[i]), memory_bytes=int(memory[i]), is_reliable=bool(reliable[i]))
        for i in range(num_devices)
    )
    links = LinkMatrix(latency_delay=latency, bandwidth=megabits * MEGABIT)
    return SwarmSnapshot(devices=devices, links=links, model=model)
