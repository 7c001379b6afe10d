"""Mode "live_global" of the swarm-lifetime simulator: the live global plan rule (planner.offline.live_plan)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from planner.global_plan import GlobalPlanConfig
from planner.offline.internet import REGIONS, ChurnTrace, draw_volunteers
from planner.offline.lifetime import LifetimeConfig, _Lifetime, _Swarm, simulate_lifetime
from planner.offline.live_plan import standby_takes_unheld
from planner.offline.scenarios import build_transformer_profile

MODEL = build_transformer_profile(num_layers=8, hidden_size=1024, sequence_length=512)
FAST = dataclasses.replace(GlobalPlanConfig(), max_literature_devices=0, max_simulated_devices=0)  # test time
AUSTRALIA = [r.name for r in REGIONS].index("australia")


def two_regions(horizon: float = 1500.0) -> ChurnTrace:
    """Eight equal GPUs that stay: four in us-east on 100 Mbit/s uplinks, four in Australia on 10."""
    volunteers = draw_volunteers(np.random.default_rng(0), 8)
    uplink = np.array([100e6 / 8] * 4 + [10e6 / 8] * 4)
    volunteers = dataclasses.replace(volunteers, session_s=np.full(8, 1e9), flops=np.full(8, 30e12),
                                     region=np.array([0] * 4 + [AUSTRALIA] * 4), uplink=uplink, downlink=5 * uplink,
                                     memory_bytes=np.full(8, 24.0 * 2**30))
    return ChurnTrace(volunteers=volunteers, arrive_s=np.zeros(8), horizon_s=horizon)


def test_the_live_plan_is_adopted_once_where_it_clearly_wins_and_idles_peers():
    trace = two_regions()
    config = LifetimeConfig(num_stages=2, global_plan=FAST)
    even = simulate_lifetime(trace, MODEL, mode="even", config=config)
    ticks = iter(range(10**6))
    live = simulate_lifetime(trace, MODEL, mode="live_global", config=config, clock=lambda: float(next(ticks)))
    assert live.global_plans == 5 and live.plans_skipped_too_large == 0  # at 300, 600, ..., 1500 s
    assert live.plans_adopted == 1  # the swarm runs the plan: the next ones are the same plan, not adopted again
    assert live.plan_moves >= 1 and live.moves == 0  # the planned peer pulls the layers it lacked
    assert live.last_plan_planned == live.last_plan_current > 0
    assert live.standby_end > 0 and live.standby_max == live.standby_end  # idle peers stand by, online
    assert live.online_min == live.online_max == 8
    assert live.throughput > 2 * even.throughput, (live, even)
    assert live.global_plan_seconds == live.global_plans and live.max_global_plan_seconds == 1.0  # one tick each
    untimed = dict(decisions=0, decision_seconds=0.0, max_decision_seconds=0.0, global_plan_seconds=0.0,
                   max_global_plan_seconds=0.0)
    assert simulate_lifetime(trace, MODEL, mode="live_global", config=config) == dataclasses.replace(
        live, **untimed)  # deterministic; timed only with a clock


def test_above_max_planned_peers_nothing_is_planned_and_it_is_even():
    trace = two_regions()
    config = LifetimeConfig(num_stages=2, global_plan=FAST, max_planned_peers=7)
    even = simulate_lifetime(trace, MODEL, mode="even", config=config)
    capped = simulate_lifetime(trace, MODEL, mode="live_global", config=config)
    assert capped.plans_skipped_too_large == 5 and capped.global_plans == capped.plans_adopted == 0
    assert capped.standby_max == 0
    assert capped.samples == pytest.approx(even.samples, rel=1e-12)  # the periods split the integral only
    assert dataclasses.replace(capped, mode="even", plans_skipped_too_large=0, samples=even.samples) == even
    planned = simulate_lifetime(trace, MODEL, mode="live_global", config=dataclasses.replace(config, max_planned_peers=8))
    assert planned.plans_adopted == 1 and planned.plans_skipped_too_large == 0


def test_a_plan_longer_than_the_horizon_away_is_never_computed():
    trace = two_regions(horizon=250.0)
    live = simulate_lifetime(trace, MODEL, mode="live_global", config=LifetimeConfig(num_stages=2, global_plan=FAST))
    even = simulate_lifetime(trace, MODEL, mode="even", config=LifetimeConfig(num_stages=2))
    assert live.global_plans == 0 and live.samples == even.samples


def test_a_peer_standing_by_takes_a_stage_nobody_holds_and_one_that_leaves_just_leaves():
    swarm = _Swarm(two_regions(), MODEL, LifetimeConfig(num_stages=2))
    swarm.place(0, 0, 0.0)
    swarm.place(1, 1, 0.0)
    swarm.standby = {5, 3, 7}
    assert swarm.remove(7) is None and swarm.standby == {3, 5}  # standing by: no stage, nothing to re-plan
    assert swarm.remove(1) == 1 and swarm.num_held() == 1
    assert standby_takes_unheld(swarm, 10.0) == 1
    assert swarm.serving == {0: 0, 3: 1} and swarm.standby == {5}  # the lowest id, serving at once
    assert swarm.throughput() > 0
    assert standby_takes_unheld(swarm, 20.0) == 0 and swarm.standby == {5}  # every stage held: nobody moves


def test_when_the_served_peers_leave_a_peer_standing_by_takes_over_and_training_goes_on():
    config = LifetimeConfig(num_stages=2, global_plan=FAST)
    first = _Lifetime(two_regions(horizon=300.0), MODEL, "live_global", config, None)
    assert first.run().plans_adopted == 1
    served = set(first.swarm.serving) | set(first.swarm.syncing)
    assert 0 < len(served) < 8 and first.swarm.standby == set(range(8)) - served
    trace = two_regions(horizon=900.0)
    sessions = trace.volunteers.session_s.copy()
    sessions[sorted(served)] = 450.0  # every peer the plan serves leaves at 450 s
    churned = dataclasses.replace(trace, volunteers=dataclasses.replace(trace.volunteers, session_s=sessions))
    result = simulate_lifetime(churned, MODEL, mode="live_global", config=config)
    assert result.leaves == len(served) and result.online_min == 8 - len(served)
    assert result.standby_takeovers == 1 and result.replans == 0  # standing by first; no re-plan was needed
    assert result.final_bounds["compute"] > 0  # the stage is served again


def test_a_planned_peer_pulls_at_the_holders_uplink_into_its_downlink_not_at_its_own_uplink():
    trace = two_regions()
    uplink = np.array([40e6 / 8, 100e6 / 8, 40e6 / 8, 100e6 / 8] + [10e6 / 8] * 4)  # stage 1's best holder: 100
    volunteers = dataclasses.replace(trace.volunteers, uplink=uplink, downlink=5 * uplink)
    run = _Lifetime(dataclasses.replace(trace, volunteers=volunteers, horizon_s=300.0), MODEL, "live_global",
                    LifetimeConfig(num_stages=2, global_plan=FAST), None)
    held = run.swarm.layers
    stage_before = {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1, 6: 0, 7: 1}  # the join rule on equal peers alternates
    assert run.run().plan_moves == 1
    [(mover, (stage, ready))] = run.swarm.syncing.items()
    start, end = run.swarm.layers[stage]
    own = stage_before[mover]
    seconds = 0.0
    for k, (a, b) in enumerate(held):
        lo, hi = max(a, start), min(b, end)
        if k == own or lo >= hi:
            continue
        rates = [min(uplink[p], 5 * uplink[mover]) for p, s in stage_before.items() if s == k and p != mover]
        delays = [volunteer_delay(volunteers, p, mover) for p, s in stage_before.items() if s == k and p != mover]
        piece = 3.0 * sum(MODEL.layer_param_bytes[lo:hi])
        seconds += min(piece / r + 2 * d for r, d in zip(rates, delays))
    assert ready - 300.0 == pytest.approx(seconds, rel=1e-9)


def volunteer_delay(volunteers, p: int, q: int) -> float:
    """The internet model's one-way latency between volunteers ``p`` and ``q``."""
    from planner.offline.internet import region_rtt_seconds

    rtt = region_rtt_seconds()[volunteers.region[p], volunteers.region[q]]
    return float(rtt + volunteers.access_rtt_s[p] + volunteers.access_rtt_s[q]) / 2
