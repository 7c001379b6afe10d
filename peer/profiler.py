"""Measuring this peer: compute throughput on its device, and the memory it has for a stage (what a
stage needs is :mod:`peer.memory_model`'s estimate, imported here for the peer's callers).

Throughput is measured, not declared: one transformer block of the run's shape is timed forward
and backward on a microbatch (after a warm-up), repeatedly for at least ``MIN_MEASURE_SECONDS``,
and FLOP/s = the block's FLOPs (the cost model of :func:`swarm.model.stage_flops_per_sample`) / the
median trial's time. Other processes on the machine slow trials down, and now and then a trial runs
alone on a core: the median over a window of trials is the figure least swayed by either. (The
fastest trial was tried on 2026-11-26: under a CPU hog, one of four demo peers on one machine then
measured 51.6 GFLOP/s against 10.3–12.0 for the others and the peers placed themselves 1 + 3.)
That figure is what the planner uses to place the peer (seed 002 §3.2, seed 001 §3.3 profile
compute the same way).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from dht.records import ModelSpec, RunSpec
from peer.errors import UserError
from peer.memory_model import FIXED_OVERHEAD_BYTES, MIB, layer_memory_bytes, stage_memory_bytes
from swarm.model import block_matmul_params, new_block

__all__ = ["FIXED_OVERHEAD_BYTES", "MIB", "available_memory_bytes", "layer_memory_bytes", "measure_flops",
           "resolve_device", "stage_memory_budget", "stage_memory_bytes"]

MIN_MEASURE_SECONDS = 0.5  # measure_flops repeats its trials for at least this long (a window of the machine's load)
MAX_TRIALS = 200  # a bound on measure_flops' trials, however short each one is


def measure_flops(spec: RunSpec, device: torch.device, *, num_trials: int = 5,
                  min_seconds: float = MIN_MEASURE_SECONDS, timer: Callable[[], float] = time.perf_counter) -> float:
    """FLOP/s of forward+backward of one block of the run's model on ``device``: the median of at
    least ``num_trials`` trials, more until ``min_seconds`` have passed (at most ``MAX_TRIALS``)."""
    model: ModelSpec = spec.model
    block = new_block(model).to(device)
    x = torch.randn(spec.microbatch_size, model.seq_len, model.d_model, device=device, requires_grad=True)
    d, seq_len = model.d_model, model.seq_len
    # the block term of stage_flops_per_sample: 6 FLOPs per weight per token plus attention
    flops = (6 * block_matmul_params(model) + 12 * seq_len * d) * seq_len * spec.microbatch_size
    times: list[float] = []
    trial = 0
    while trial <= num_trials or (sum(times) < min_seconds and trial <= MAX_TRIALS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = timer()
        block(x).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if trial:  # the first run warms up kernels and allocator
            times.append(timer() - started)
        trial += 1
    return flops / max(statistics.median(times), 1e-9)


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device: MemAvailable for CPU, free VRAM for CUDA."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read available memory from /proc/meminfo")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this machine has no usable CUDA device; use --device cpu")
    return device


def stage_memory_budget(spec: RunSpec, stage: int, *, max_in_flight: int, max_memory_mb: float,
                        device: torch.device, checkpoint_activations: bool = False) -> int:
    """The bytes a peer may use for ``stage`` (``--max-memory-mb``, else what ``device`` has free).

    Raises:
        UserError: ``stage`` needs more than that, with what to do about it.
    """
    needed = stage_memory_bytes(spec, stage, max_in_flight=max_in_flight, checkpoint_activations=checkpoint_activations)
    budget = max_memory_mb * MIB if max_memory_mb else available_memory_bytes(device)
    if needed > budget:
        source = "--max-memory-mb allows" if max_memory_mb else f"{device} has available"
        raise UserError(
            f"Stage {stage} needs about {needed / MIB:.0f} MiB but this peer's budget ({source}) is "
            f"{budget / MIB:.0f} MiB; raise --max-memory-mb, free memory, lower --max-in-flight"
            f"{'' if checkpoint_activations else ', or give --activation-checkpointing'}.", exit_code=3)
    return int(budget)
