"""The swarm-lifetime simulator at internet scale (planner.offline.lifetime, planner.offline.internet)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dht.layouts import even_stage_layers
from planner.costs import estimate_throughput
from planner.offline.internet import (
    REGIONS, ChurnTrace, churn_trace, draw_volunteers, great_circle_km, region_rtt_seconds,
)
from planner.offline.lifetime import (
    LifetimeConfig, StepSettings, _Fleet, _Swarm, even_layers, fleet_throughput, simulate_lifetime,
)
from planner.offline.scenarios import build_transformer_profile
from planner.plan import Plan, Stage
from planner.runtime import RuntimeSettings
from planner.snapshot import Device, LinkMatrix, SwarmSnapshot
from planner.stage_choice import StageMember, choose_stage

MODEL = build_transformer_profile(num_layers=8, hidden_size=1024, sequence_length=512)


def test_the_internet_model_gives_the_round_trips_its_docstring_states():
    by_name = {r.name: r for r in REGIONS}
    assert great_circle_km(by_name["us-east"], by_name["uk"]) == pytest.approx(5570, rel=0.01)
    rtt = region_rtt_seconds()
    index = {r.name: i for i, r in enumerate(REGIONS)}
    assert rtt[index["us-east"], index["uk"]] == pytest.approx(0.084, abs=0.002)
    assert rtt[index["us-east"], index["japan"]] == pytest.approx(0.163, abs=0.003)
    assert np.allclose(rtt, rtt.T) and rtt.diagonal() == pytest.approx(2 * 400 * 1.5 / 200 / 1000)
    volunteers = draw_volunteers(np.random.default_rng(1), 5000)
    assert 10e6 / 8 <= volunteers.uplink.min() and volunteers.uplink.max() <= 100e6 / 8
    assert np.all(volunteers.downlink >= volunteers.uplink)
    assert np.median(volunteers.session_s) == pytest.approx(7200, rel=0.1)


def test_the_churn_keeps_about_as_many_peers_online_as_asked():
    trace = churn_trace(np.random.default_rng(2), 400, 3600.0)
    events = trace.events()
    online, lowest, highest = 0, 10**9, 0
    for at, kind, _ in events:
        online += 1 if kind == "join" else -1
        if at > 0:
            lowest, highest = min(lowest, online), max(highest, online)
    assert 300 < lowest <= highest < 500
    assert [e[0] for e in events] == sorted(e[0] for e in events)


def test_the_even_layout_is_the_bootstraps():
    for layers, stages in ((24, 8), (7, 3), (10, 4), (5, 5)):
        assert even_layers(layers, stages) == even_stage_layers(layers, stages)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("period", "is_flushing"), [(1e12, False), (1e12, True), (0.0, False), (0.0, True),
                                                     (5.0, False), (5.0, True)])
def test_the_fleet_throughput_is_the_cost_model_of_the_same_swarm(seed, period, is_flushing):
    """Per-stage sums give ``planner.costs.estimate_throughput`` of the plan with every peer a server,
    links at the sender's uplink (no downlink binds) and round trips from the internet model: without
    averaging (a period of 1e12 s), with a gradient exchange every step (0) or rounds every 5 s, steps
    overlapping or flushed."""
    rng = np.random.default_rng(seed)
    count, num_stages = 12, 3
    volunteers = draw_volunteers(rng, count)
    trace = ChurnTrace(volunteers=volunteers, arrive_s=np.zeros(count), horizon_s=1.0)
    stage_of = rng.permutation(np.arange(count) % num_stages)
    layers = even_layers(MODEL.num_layers, num_stages)
    fleet = _Fleet(num_stages, len(REGIONS))
    for peer in range(count):
        fleet.add(int(stage_of[peer]), peer, trace)
    stage_costs = np.array([sum(MODEL.layer_flops[a:b]) for a, b in layers])
    boundary = np.array([MODEL.layer_activation_bytes[b - 1] for _, b in layers[:-1]])
    param_bytes = np.array([sum(MODEL.layer_param_bytes[a:b]) for a, b in layers])
    step = StepSettings(param_bytes=param_bytes, period=period, num_microbatches=MODEL.num_microbatches,
                        is_flushing=is_flushing)
    ours = fleet_throughput(fleet, stage_costs, boundary, region_rtt_seconds(), microbatch_size=MODEL.microbatch_size,
                            max_in_flight=4, step=step)
    rtt = region_rtt_seconds()[volunteers.region][:, volunteers.region]
    latency = (rtt + volunteers.access_rtt_s[:, None] + volunteers.access_rtt_s[None, :]) / 2
    bandwidth = np.repeat(volunteers.uplink[:, None], count, axis=1)
    devices = tuple(Device(peer_id=f"{p:03d}", flops=float(volunteers.flops[p]), memory_bytes=1 << 40, is_reliable=True)
                    for p in range(count))
    snapshot = SwarmSnapshot(devices=devices, links=LinkMatrix(latency_delay=latency, bandwidth=bandwidth), model=MODEL,
                             runtime=RuntimeSettings(averaging_period=period, is_flushing=is_flushing))
    plan = Plan(stages=tuple(Stage(layer_start=a, layer_end=b,
                                   server_ids=tuple(f"{p:03d}" for p in range(count) if stage_of[p] == k))
                             for k, (a, b) in enumerate(layers)))
    assert ours == pytest.approx(estimate_throughput(snapshot, plan), rel=1e-9)


def test_a_stages_slowest_uplink_follows_its_members_as_they_come_and_go():
    volunteers = draw_volunteers(np.random.default_rng(5), 6)
    trace = ChurnTrace(volunteers=volunteers, arrive_s=np.zeros(6), horizon_s=1.0)
    fleet = _Fleet(1, len(REGIONS))
    assert fleet.slowest_uplink(0) == float("inf") and fleet.averaging_per_byte(0.0)[0] == 0.0
    order = list(np.argsort(volunteers.uplink))  # slowest first
    for peer in order:
        fleet.add(0, int(peer), trace)
    for gone in order[:-1]:  # the slowest leaves each time
        fleet.add(0, int(gone), trace, sign=-1.0)
        left = [p for p in order if p not in order[: order.index(gone) + 1]]
        assert fleet.slowest_uplink(0) == min(volunteers.uplink[p] for p in left)
    assert fleet.averaging_per_byte(0.0)[0] == 0.0  # one member left: no round
    fleet.add(0, int(order[0]), trace)
    fleet.add(0, int(order[1]), trace)  # three replicas: an exchange every step sends two sums, a butterfly 4 / 3
    assert fleet.averaging_per_byte(0.0)[0] == pytest.approx(2 / volunteers.uplink[order[0]])
    assert fleet.averaging_per_byte(15.0)[0] == pytest.approx(2 * (2 / 3) / volunteers.uplink[order[0]])


def test_the_join_sums_pick_what_the_live_rule_picks_at_every_arrival():
    trace = churn_trace(np.random.default_rng(3), 60, 1800.0)
    swarm = _Swarm(trace, MODEL, LifetimeConfig(num_stages=4))
    checked = 0
    for at, kind, peer in trace.events():
        if kind == "leave":
            swarm.remove(peer)
            continue
        everyone = {**swarm.serving, **{p: s for p, (s, _) in swarm.syncing.items()}}
        members = [StageMember(peer_id=f"{p:06d}", stage=s, flops=float(trace.volunteers.flops[p]))
                   for p, s in everyone.items()]
        live = choose_stage(list(swarm.stage_costs), members)
        assert swarm.join_stage() == live
        swarm.place(peer, live, at)
        checked += 1
    assert checked > 60


def trace_of(sessions: list[float], flops: list[float], horizon: float) -> ChurnTrace:
    """Peers all present at time 0, each leaving after its session."""
    volunteers = draw_volunteers(np.random.default_rng(0), len(sessions))
    volunteers = dataclasses.replace(volunteers, session_s=np.array(sessions), flops=np.array(flops),
                                     region=np.zeros(len(sessions), dtype=np.int64))
    return ChurnTrace(volunteers=volunteers, arrive_s=np.zeros(len(sessions)), horizon_s=horizon)


def test_a_stage_everyone_left_is_replanned_away_and_training_goes_on():
    # 4 peers on 2 stages (joins alternate by deficit: 0, 1, 0, 1 for equal peers); both stage-1 peers leave
    trace = trace_of([1e9, 100.0, 1e9, 200.0], [30e12] * 4, 3600.0)
    result = simulate_lifetime(trace, MODEL, mode="even", config=LifetimeConfig(num_stages=2))
    assert result.replans == 1 and result.final_stages == 1
    assert result.throughput > 0
    stayed = simulate_lifetime(trace_of([1e9] * 4, [30e12] * 4, 3600.0), MODEL, mode="even",
                               config=LifetimeConfig(num_stages=2))
    assert stayed.replans == 0 and stayed.final_stages == 2


def test_rebalancing_moves_a_peer_onto_the_stage_churn_thinned_and_gains():
    # stage 0 gets peers 0, 2, 4; stage 1 peers 1, 3, 5; two of stage 1's leave early
    trace = trace_of([1e9, 1e9, 1e9, 60.0, 1e9, 90.0], [30e12] * 6, 3600.0)
    config = LifetimeConfig(num_stages=2, compression_ratio=1 / 64)  # compute-bound, where a move counts
    even = simulate_lifetime(trace, MODEL, mode="even", config=config)
    rebalanced = simulate_lifetime(trace, MODEL, mode="rebalance", config=config)
    assert even.moves == 0 and rebalanced.moves >= 1
    assert rebalanced.throughput > 1.2 * even.throughput, (rebalanced, even)
    assert simulate_lifetime(trace, MODEL, mode="rebalance", config=config) == rebalanced  # deterministic


def test_decisions_are_timed_only_with_a_clock_and_bad_input_is_refused():
    trace = churn_trace(np.random.default_rng(4), 20, 600.0)
    ticks = iter(range(10**6))
    timed = simulate_lifetime(trace, MODEL, mode="rebalance", config=LifetimeConfig(num_stages=4),
                              clock=lambda: float(next(ticks)))
    assert timed.decisions == timed.joins + 10 and timed.decision_seconds == timed.decisions
    assert simulate_lifetime(trace, MODEL, mode="rebalance", config=LifetimeConfig(num_stages=4)).decisions == 0
    with pytest.raises(ValueError, match="mode"):
        simulate_lifetime(trace, MODEL, mode="global")
    huge = build_transformer_profile(num_layers=4, hidden_size=16384, sequence_length=512)
    with pytest.raises(ValueError, match="does not fit"):
        simulate_lifetime(trace, huge, mode="even", config=LifetimeConfig(num_stages=2))
