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
