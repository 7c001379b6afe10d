"""Simulator: agrees with the cost model where both are exact; churn costs time, never samples."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from planner.costs import estimate_plan_costs, estimate_stage_costs, estimate_throughput
from planner.simulator import SimulationConfig, simulate_plan
from planner.plan import Plan, Stage
from planner.snapshot import Device, LinkMatrix, ModelProfile, SwarmSnapshot


def _snapshot(num_microbatches: int = 8, reliable: tuple[bool, ...] = (True, True, True)) -> SwarmSnapshot:
    devices = tuple(
        Device(peer_id=f"d{i}", flops=100.0 * (i + 1), memory_bytes=10**12, is_reliable=r)
        for i, r in enumerate(reliable)
    )
    n = len(devices)
    links = LinkMatrix(latency_delay=np.full((n, n), 0.01), bandwidth=np.full((n, n), 1e6))
    model = ModelProfile(
        layer_flops=(300.0,) * 4, layer_param_bytes=(0.0,) * 4, layer_activation_bytes=(100.0,) * 4,
        microbatch_size=2, num_microbatches=num_microbatches,
    )
    return SwarmSnapshot(devices=devices, links=links, model=model)


def test_single_stage_matches_data_parallel_time() -> None:
    snapshot = _snapshot()
    plan = Plan(stages=(Stage(layer_start=0, layer_end=4, server_ids=("d0", "d1", "d2")),))
    result = simulate_plan(snapshot, plan, SimulationConfig(num_steps=2), rng=np.random.default_rng(0))
    # One stage, no links: d micro-batches of m F / sum c each.
    expected = 8 * 2 * 1200.0 / 600.0
    assert result.step_delays == pytest.approx((expected, expected))
    assert result.throughput == pytest.approx(16 / expected)


def test_pipeline_approaches_bottleneck_of_cost_model() -> None:
    snapshot = _snapshot(num_microbatches=64)
    plan = Plan(stages=(
        Stage(layer_start=0, layer_end=2, server_ids=("d0",)),
        Stage(layer_start=2, layer_end=4, server_ids=("d1", "d2")),
    ))
    bottleneck = float(estimate_stage_costs(snapshot, plan).max())
    result = simulate_plan(snapshot, plan, SimulationConfig(num_steps=1), rng=np.random.default_rng(0))
    # The simulator overlaps links with compute, so it is no slower than Eq. 2 past the warm-up.
    assert result.step_delays[0] <= 64 * bottleneck * 1.1
    assert result.step_delays[0] >= 64 * 2 * 600.0 / 100.0 * 0.99  # stage 0 compute alone


def test_simulation_is_deterministic_given_rng() -> None:
    snapshot = _snapshot(reliable=(True, False, False))
    plan = Plan(stages=(Stage(layer_start=0, layer_end=4, server_ids=("d0",), client_ids=("d1", "d2")),))
    config = SimulationConfig(num_steps=3, disconnect_probability=0.9, failure_detect_delay=0.5)
    first = simulate_plan(snapshot, plan, config, rng=np.random.default_rng(3))
    second = simulate_plan(snapshot, plan, config, rng=np.random.default_rng(3))
    assert first == second
    assert first.num_lost_chunks > 0


def test_churn_costs_time_and_task_pool_beats_restart() -> None:
    snapshot = _snapshot(num_microbatches=16, reliable=(True, False, False))
    plan = Plan(stages=(Stage(layer_start=0, layer_end=4, server_ids=("d0",), client_ids=("d1", "d2")),))
    calm = simulate_plan(snapshot, plan, SimulationConfig(num_steps=4), rng=np.random.default_rng(0))
    churn = SimulationConfig(num_steps=4, disconnect_probability=1.0, failure_detect_delay=1.0)
    pooled = simulate_plan(snapshot, plan, churn, rng=np.random.default_rng(0))
    restarted = simulate_plan(
        snapshot, plan, SimulationConfig(num_steps=4, disconnect_probability=1.0, failure_detect_delay=1.0,
                                         is_task_pool=False), rng=np.random.default_rng(0),
    )
    assert pooled.throughput < calm.throughput
    assert restarted.num_restarts > 0
    assert pooled.throughput >= restarted.throughput


def _two_stage_plan(stage0: tuple[str, ...], stage1: tuple[str, ...]) -> Plan:
    return Plan(stages=(
        Stage(layer_start=0, layer_end=2, server_ids=stage0), Stage(layer_start=2, layer_end=4, server_ids=stage1),
    ))


def _equal_snapshot(num_devices: int, *, num_microbatches: int = 4, reliable: tuple[bool, ...] = ()) -> SwarmSnapshot:
    reliable = reliable or (True,) * num_devices
    devices = tuple(Device(peer_id=f"d{i}", flops=100.0, memory_bytes=10**12, is_reliable=r) for i, r in enumerate(reliable))
    n = len(devices)
    links = LinkMatrix(latency_delay=np.full((n, n), 1e-6), bandwidth=np.full((n, n), 1e12))
    model = ModelProfile(
        layer_flops=(300.0,) * 4, layer_param_bytes=(0.0,) * 4, layer_activation_bytes=(100.0,) * 4,
        microbatch_size=2, num_microbatches=num_microbatches,
    )
    return SwarmSnapshot(devices=devices, links=links, model=model)


@pytest.mark.parametrize(("stage0", "stage1", "expected"), [
    (("d0",), ("d1",), 2 / 12.0),  # each stage: 2 samples x 600 FLOPs / 100 FLOP/s = 12 s a micro-batch
    (("d0", "d1"), ("d2",), 2 / 12.0),  # stage 1 stays the bottleneck
    (("d0", "d1"), ("d2", "d3"), 4 / 12.0),  # two replicas per stage: twice the rate
])
def test_murmuration_steady_state_is_the_bottleneck_rate(stage0: tuple, stage1: tuple, expected: float) -> None:
    snapshot = _equal_snapshot(len(stage0) + len(stage1))
    config = SimulationConfig.murmuration(num_steps=8, max_inflight_per_peer=4)
    result = simulate_plan(snapshot, _two_stage_plan(stage0, stage1), config, rng=np.random.default_rng(0))
    assert result.throughput == pytest.approx(expected, rel=0.01)


def test_murmuration_with_one_in_flight_is_serial() -> None:
    # One micro-batch at a time: forward 0 (4 s), fused stage 1 (12 s), backward 0 (8 s) = 24 s each.
    config = SimulationConfig.murmuration(num_steps=4, max_inflight_per_peer=1)
    result = simulate_plan(_equal_snapshot(2), _two_stage_plan(("d0",), ("d1",)), config, rng=np.random.default_rng(0))
    assert result.throughput == pytest.approx(2 / 24.0, rel=0.01)


def test_seed_model_drains_and_is_slower_than_no_drain() -> None:
    snapshot, plan = _equal_snapshot(2), _two_stage_plan(("d0",), ("d1",))
    drained = simulate_plan(snapshot, plan, SimulationConfig(num_steps=8, max_inflight=4), rng=np.random.default_rng(0))
    flowing = simulate_plan(snapshot, plan, replace(SimulationConfig.murmuration(num_steps=8), is_fused_last_stage=False,
                                                    is_fifo=False), rng=np.random.default_rng(0))
    assert drained.throughput < 0.9 * flowing.throughput


def test_no_drain_refuses_churn() -> None:
    with pytest.raises(ValueError):
        SimulationConfig(num_steps=4, is_draining=False, disconnect_probability=0.5)
    with pytest.raises(ValueError):
        SimulationConfig(num_steps=1, is_draining=False)


def test_whole_microbatch_churn_task_pool_wastes_less_than_restart() -> None:
    # Stage 1 has a reliable server and two unreliable clients that get whole micro-batches.
    snapshot = _equal_snapshot(4, num_microbatches=16, reliable=(True, True, False, False))
    plan = Plan(stages=(
        Stage(layer_start=0, layer_end=1, server_ids=("d0",)),
        Stage(layer_start=1, layer_end=4, server_ids=("d1",), client_ids=("d2", "d3")),
    ))
    base = dict(num_steps=4, max_inflight=8, is_whole_microbatch=True, failure_detect_delay=1.0)
    calm = simulate_plan(snapshot, plan, SimulationConfig(**base), rng=np.random.default_rng(0))
    pooled = simulate_plan(snapshot, plan, SimulationConfig(**base, disconnect_probability=1.0), rng=np.random.default_rng(0))
    restarted = simulate_plan(snapshot, plan, SimulationConfig(**base, disconnect_probability=1.0, is_task_pool=False),
                              rng=np.random.default_rng(0))
    assert calm.num_lost_chunks == 0 and calm.wasted_seconds == 0.0
    assert pooled.num_lost_chunks > 0 and pooled.num_restarts == 0
    assert restarted.num_restarts > 0
    assert pooled.throughput < calm.throughput
    assert restarted.wasted_seconds > pooled.wasted_seconds


def test_message_overhead_takes_device_time_like_compute() -> None:
    # Stage 1 (fused) receives the input and sends its gradient: 2 messages x 300 FLOPs / 100 FLOP/s
    # = 6 s on top of its 12 s; stage 0 has one message per task, 2 x 3 s on top of its 12 s.
    config = SimulationConfig.murmuration(num_steps=8, max_inflight_per_peer=4, message_overhead_flops=300.0)
    result = simulate_plan(_equal_snapshot(2), _two_stage_plan(("d0",), ("d1",)), config, rng=np.random.default_rng(0))
    assert result.throughput == pytest.approx(2 / 18.0, rel=0.01)
    serial = simulate_plan(_equal_snapshot(2), _two_stage_plan(("d0",), ("d1",)),
                           replace(config, max_inflight=1), rng=np.random.default_rng(0))
    assert serial.throughput == pytest.approx(2 / (24.0 + 3 + 6 + 3), rel=0.01)  # 4+3, 12+6, 8+3


def test_message_overhead_must_not_be_negative() -> None:
    with pytest.raises(ValueError):
        SimulationConfig(message_overhead_flops=-1.0)


def test_murmuration_flushing_drains_each_step_and_then_averages() -> None:
    # One micro-batch a step through two stages of one peer each: forward 0 (4 s), fused stage 1
    # (12 s), backward 0 (8 s), 24 s a step with or without the drain.
    snapshot = _equal_snapshot(2, num_microbatches=1)
    plan = _two_stage_plan(("d0",), ("d1",))
    flushed = simulate_plan(snapshot, plan, SimulationConfig.murmuration(num_steps=3, is_flushing=True),
                            rng=np.random.default_rng(0))
    assert flushed.step_delays == pytest.approx((24.0, 24.0, 24.0))
    # With 4 a step, the drain costs the fill a pipelined run hides: 4 x 12 s + the ends, not 4 x 12 s.
    snapshot = _equal_snapshot(2, num_microbatches=4)
    flushed = simulate_plan(snapshot, plan, SimulationConfig.murmuration(num_steps=4, is_flushing=True),
                            rng=np.random.default_rng(0))
    flowing = simulate_plan(snapshot, plan, SimulationConfig.murmuration(num_steps=4), rng=np.random.default_rng(0))
    assert flowing.throughput == pytest.approx(2 / 12.0, rel=0.01)
    assert flushed.throughput < 0.85 * flowing.throughput


def test_murmuration_flushing_adds_the_exchange_after_the_drain() -> None:
    # Two replicas of stage 0 with 1 MB of weights over 10 kB/s links: an exchange of minutes.
    snapshot = _equal_snapshot(3, num_microbatches=2)
    snapshot = replace(snapshot, model=replace(snapshot.model, layer_param_bytes=(0.5e6, 0.5e6, 0.0, 0.0)),
                       runtime=replace(snapshot.runtime, averaging_period=0.0),
                       links=LinkMatrix(latency_delay=np.full((3, 3), 1e-6), bandwidth=np.full((3, 3), 1e4)))
    plan = _two_stage_plan(("d0", "d1"), ("d2",))
    flushed = simulate_plan(snapshot, plan, SimulationConfig.murmuration(num_steps=2, is_flushing=True),
                            rng=np.random.default_rng(0))
    quiet = replace(SimulationConfig.murmuration(num_steps=2, is_flushing=True), is_averaging=False)
    pipeline = simulate_plan(snapshot, plan, quiet, rng=np.random.default_rng(0)).step_delays[0]
    longer = simulate_plan(snapshot, plan, replace(SimulationConfig.murmuration(num_steps=2, is_flushing=True),
                                                   is_averaging_after_drain=False), rng=np.random.default_rng(0))
    exchange = longer.step_delays[0]  # max(pipeline, round): the round here, far longer than the pipeline
    assert exchange > pipeline
    assert flushed.step_delays[0] == pytest.approx(pipeline + exchange)
    with pytest.raises(ValueError):
        SimulationConfig(num_steps=2, is_draining=False, is_averaging_after_drain=True)


def test_the_cost_model_and_the_simulator_agree_on_a_flushed_pipeline() -> None:
    # 4 micro-batches a step over two stages of 12 s each: the first takes R = 24 s, each further one
    # 12 s, so a step is 3 x 12 + 24 = 60 s where overlapping steps would take 48.
    snapshot = _equal_snapshot(2, num_microbatches=4)
    plan = _two_stage_plan(("d0",), ("d1",))
    flushed = replace(snapshot, runtime=replace(snapshot.runtime, is_flushing=True))
    assert estimate_throughput(flushed, plan) == pytest.approx(8 / 60.0, rel=1e-3)
    assert estimate_throughput(snapshot, plan) == pytest.approx(8 / 48.0, rel=1e-3)
    simulated = simulate_plan(flushed, plan, SimulationConfig.murmuration(num_steps=3, is_flushing=True),
                              rng=np.random.default_rng(0))
    assert simulated.throughput == pytest.approx(8 / 60.0, rel=1e-3)


def test_under_the_flush_the_round_follows_the_drain_in_the_cost_model() -> None:
    snapshot = _equal_snapshot(3, num_microbatches=2)
    snapshot = replace(snapshot, model=replace(snapshot.model, layer_param_bytes=(0.5e6, 0.5e6, 0.0, 0.0)),
                       runtime=replace(snapshot.runtime, averaging_period=0.0, is_flushing=True),
                       links=LinkMatrix(latency_delay=np.full((3, 3), 1e-6), bandwidth=np.full((3, 3), 1e4)))
    plan = _two_stage_plan(("d0", "d1"), ("d2",))
    costs = estimate_plan_costs(snapshot, plan)
    assert costs.exchange == pytest.approx(2 * 0.5e6 / 1e4)  # half of 1 MB each way, over 10 kB/s
    assert costs.stage_terms.max() < 20.0  # no floor: the round is charged once, after the drain
    overlapping = estimate_plan_costs(replace(snapshot, runtime=replace(snapshot.runtime, is_flushing=False)), plan)
    assert overlapping.exchange == 0.0 and overlapping.stage_terms.max() == pytest.approx(100.0 / 2)
    drained = max(costs.stage_terms.max() + costs.round_trip, costs.round_trip)
    assert costs.seconds_per_microbatch == pytest.approx((drained + 100.0) / 2)
