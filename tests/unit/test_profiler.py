"""Peer profiler: memory a stage needs, measured compute throughput."""

from __future__ import annotations

import dataclasses
import math

import pytest

from dht.layouts import even_stage_layers
from dht.records import ModelSpec, RunSpec
from peer.profiler import FIXED_OVERHEAD_BYTES, measure_flops, resolve_device, stage_memory_bytes
from swarm.model import stage_num_params


def spec_with(num_layers: int, num_stages: int, **model) -> RunSpec:
    return RunSpec(run_id="p", model=ModelSpec(num_layers=num_layers, **model),
                   stage_layers=even_stage_layers(num_layers, num_stages))


def test_stage_memory_grows_with_the_graphs_a_stage_holds():
    spec = spec_with(4, 2)  # flush, a batch of 64 samples in microbatches of 16
    first = [stage_memory_bytes(spec, 0, max_in_flight=n) for n in (1, 2, 4, 16)]
    assert first[0] < first[1] < first[2] == first[3], "under flush no more than a batch is in flight"
    delayed = dataclasses.replace(spec, pipeline_schedule="delayed", replica_sync="periodic")
    assert stage_memory_bytes(delayed, 0, max_in_flight=16) > stage_memory_bytes(delayed, 0, max_in_flight=4)
    # the last stage runs a microbatch's forward, loss and backward in one go: it holds one graph
    assert len({stage_memory_bytes(spec, 1, max_in_flight=n) for n in (1, 2, 4, 16)}) == 1
    for stage in range(2):  # weights, the weight version and AdamW's two moments at the least
        assert stage_memory_bytes(spec, stage, max_in_flight=1) > FIXED_OVERHEAD_BYTES + stage_num_params(spec, stage) * 16


def test_stage_memory_grows_with_layers():
    a = stage_memory_bytes(spec_with(6, 3), 1, max_in_flight=4)   # 2 layers
    b = stage_memory_bytes(spec_with(9, 3), 1, max_in_flight=4)   # 3 layers
    c = stage_memory_bytes(spec_with(12, 3), 1, max_in_flight=4)  # 4 layers
    assert a < b < c
    # linear in layers for a middle stage (no embedding, no head)
    assert c - b == b - a
    uneven = RunSpec(run_id="p", model=ModelSpec(num_layers=6), stage_layers=((0, 1), (1, 2), (2, 5), (5, 6)))
    assert stage_memory_bytes(uneven, 2, max_in_flight=4) > stage_memory_bytes(uneven, 1, max_in_flight=4)


def test_measure_flops_is_positive_and_finite():
    spec = RunSpec(run_id="p", model=ModelSpec(d_model=16, num_layers=2, num_heads=2, seq_len=8),
                   stage_layers=((0, 1), (1, 2)), microbatch_size=2, target_batch_size=2)
    flops = measure_flops(spec, resolve_device("cpu"), num_trials=2)
    assert isinstance(flops, float) and math.isfinite(flops) and flops > 0


def test_measure_flops_takes_the_median_trial_over_a_window_of_at_least_min_seconds():
    spec = RunSpec(run_id="p", model=ModelSpec(d_model=16, num_layers=2, num_heads=2, seq_len=8),
                   stage_layers=((0, 1), (1, 2)), microbatch_size=2, target_batch_size=2)
    block_flops = (6 * 12 * 16 * 16 + 12 * 8 * 16) * 8 * 2
    # the clock read at the warm-up's start, then at each trial's start and end: trials of 0.4 s (a
    # crowded one), 0.1 s (one alone on a core) and 0.3 s
    readings = iter([0.0, 10.0, 10.4, 11.0, 11.1, 12.0, 12.3])
    flops = measure_flops(spec, resolve_device("cpu"), num_trials=3, min_seconds=0.0, timer=readings.__next__)
    assert flops == pytest.approx(block_flops / 0.3)
    ticks = iter([0.0, *[x for k in range(1, 20) for x in (float(k), k + 0.25)]])  # trials of 0.25 s
    flops = measure_flops(spec, resolve_device("cpu"), num_trials=1, min_seconds=1.0, timer=ticks.__next__)
    assert flops == pytest.approx(block_flops / 0.25)
    assert next(ticks) == 5.0  # four trials of 0.25 s fill the 1 s window, and no more were run


def test_resolve_device():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type in ("cpu", "cuda")
