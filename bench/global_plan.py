"""The swarm's life at internet scale, simulated: the live decision rules at 256 to 10,000 peers (issue #18).

Prints one JSON line per (peers, mode, compression):

    {"bench": "global_plan_sim", "peers": N, "mode": "even" | "rebalance" | "live_global", "compression_ratio": r,
     "stages": S, "max_in_flight": 8, "pipeline_schedule": "flush" | "delayed", "plan_averaging_period": P,
     "bound_compute" | "bound_links" | "bound_window" | "bound_averaging" | "bound_flush": samples/s each
     part of the cost model allows at the end (null: unbounded), "throughput": mean samples/s over the hour, "planning_seconds": mean per decision, "planning_seconds_max": ...,
     "decisions": ..., "moves": ..., "replans": ..., "joins": ..., "leaves": ..., "online_min": ...,
     "online_max": ..., "sim_seconds": wall-clock of the whole simulation, "simulated_seconds": ...,
     "final_stages": ..., and for "live_global": "max_planned_peers", "global_plans": plans computed,
     "global_plan_seconds": mean plan_global + decide per plan, "global_plan_seconds_max",
     "plans_adopted", "plan_moves": peers that pulled state for them, "plans_skipped_too_large": periods with more peers online than the cap (no plan),
     "plans_deferred": periods with a stage unheld or a move under way, "standby_max", "standby_end",
     "standby_takeovers", "last_plan_current" / "last_plan_planned": the planner's own samples/s
     (with averaging) of the swarm as it ran and of the plan at the last verdict}

Run: .venv/bin/python bench/global_plan.py [--peers 256,1000,10000] [--hours 1] [--compression 1,0.03125]
[--stages 8] [--modes even,rebalance,live_global] [--max-planned-peers 256] [--plan-averaging-period 0]
[--pipeline-schedule flush]

Each run draws one churn trace per swarm size (``planner.offline.internet``: nine regions, home
uplinks of 10–100 Mbit/s, 10–80 TFLOP/s, log-normal sessions of median 2 h, Poisson arrivals that
keep N online) and runs it through ``planner.offline.lifetime`` in each mode, on the same trace:
"even" (the bootstrap's even layout, the live join rule only) and "rebalance" (plus the live
rebalancing rule every 60 s at a 20 % gain) and "live_global" (the even layout, the join rule and the
live global plan rule every 300 s: ``planner.offline.live_plan``; above ``--max-planned-peers``
online, the live cap of 256, it does not plan and is "even"). The planner and the throughput both
run the live step: ``--plan-averaging-period`` 0 = gradients exchanged every step, and
``--pipeline-schedule flush`` = each step drains its micro-batches and then waits for the slowest
stage's exchange (``delayed``: steps overlap; until 2026-12-01 the throughput counted neither the
exchange nor the drain).
The model: 24 identical transformer layers (hidden 2048, 1024 tokens, about 1.2 B parameters),
micro-batches of 4, 8 stages by default (each holds 3 layers: parameters, gradients and AdamW moments
fit the smallest device drawn, 8 GiB), 8 micro-batches in flight per stage-0 peer (the live
``--max-in-flight``). ``--compression`` sets the boundary codec's byte ratio (1/32: the
subspace boundary with int8 of issue #16, about 35x).

``--plan-once`` instead times one global plan (``planner.global_plan.plan_global``) and its verdict
(``planner.adoption.decide``) per swarm size, against the even layout of ``--stages`` with the
peers dealt round-robin (``"mode": "global_plan_once"``).

The harness modes of issue #18 (the same swarm on the network harness under the even layout, today's
rebalancing and the live global plan, ``"bench": "global_plan"``) are bench/global_plan_harness.py.
Timings are wall-clock on one core of this shared machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from planner.adoption import decide  # noqa: E402
from planner.global_plan import plan_global  # noqa: E402
from planner.offline.internet import churn_trace, draw_volunteers, volunteer_snapshot  # noqa: E402
from planner.offline.lifetime import MODES, LifetimeConfig, LifetimeResult, simulate_lifetime  # noqa: E402
from planner.offline.scenarios import build_transformer_profile  # noqa: E402
from planner.runtime import RuntimeSettings  # noqa: E402

MODEL = build_transformer_profile(num_layers=24, hidden_size=2048, sequence_length=1024, microbatch_size=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="256,1000,10000", help="swarm sizes, comma-separated")
    parser.add_argument("--hours", type=float, default=1.0, help="simulated hours (default: 1)")
    parser.add_argument("--compression", default="1,0.03125", help="boundary byte ratios, comma-separated")
    parser.add_argument("--stages", default="8", help="numbers of stages, comma-separated (default: 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default=",".join(MODES), help=f"modes, comma-separated (default: {','.join(MODES)})")
    parser.add_argument("--max-planned-peers", type=int, default=LifetimeConfig().max_planned_peers,
                        help="live_global: no plan above this many peers online (the live cap: 256)")
    parser.add_argument("--plan-averaging-period", type=float, default=LifetimeConfig().plan_averaging_period,
                        help="the stages' averaging period, s, planned and simulated (0: gradients every step, the live default)")
    parser.add_argument("--pipeline-schedule", choices=("flush", "delayed"), default="flush",
                        help="flush (the live default): each step drains, then the exchange; delayed: steps overlap")
    parser.add_argument("--plan-once", action="store_true",
                        help="instead: time one global plan and its verdict per swarm size (mode global_plan_once)")
    args = parser.parse_args()
    if args.plan_once:
        for peers in (int(p) for p in args.peers.split(",")):
            for stages in (int(s) for s in args.stages.split(",")):
                plan_once(peers, stages, seed=args.seed)
        return
    for peers in (int(p) for p in args.peers.split(",")):
        trace = churn_trace(np.random.default_rng(args.seed), peers, args.hours * 3600)
        for ratio, stages in itertools.product((float(r) for r in args.compression.split(",")),
                                               (int(s) for s in args.stages.split(","))):
            for mode in args.modes.split(","):
                started = time.perf_counter()
                config = LifetimeConfig(compression_ratio=ratio, num_stages=stages, max_planned_peers=args.max_planned_peers,
                                        plan_averaging_period=args.plan_averaging_period,
                                        is_flushing=args.pipeline_schedule == "flush")
                result = simulate_lifetime(trace, MODEL, mode=mode, config=config, clock=time.perf_counter)
                print(json.dumps({
                    "bench": "global_plan_sim", "peers": peers, "mode": mode, "compression_ratio": ratio,
                    "stages": stages, "max_in_flight": config.max_in_flight, "pipeline_schedule": args.pipeline_schedule,
                    "plan_averaging_period": config.plan_averaging_period,
                    **{f"bound_{k}": round(v, 2) if math.isfinite(v) else None  # None: unbounded (one stage: no links)
                       for k, v in result.final_bounds.items()},
                    "throughput": round(result.throughput, 3),
                    "planning_seconds": round(result.decision_seconds / max(result.decisions, 1), 6),
                    "planning_seconds_max": round(result.max_decision_seconds, 4), "decisions": result.decisions,
                    "moves": result.moves, "replans": result.replans, "joins": result.joins, "leaves": result.leaves,
                    "online_min": result.online_min, "online_max": result.online_max,
                    "sim_seconds": round(time.perf_counter() - started, 2), "simulated_seconds": trace.horizon_s,
                    "final_stages": result.final_stages, **(live_fields(result, config) if mode == "live_global" else {}),
                }), flush=True)


def live_fields(result: LifetimeResult, config: LifetimeConfig) -> dict:
    """The "live_global" run's planning figures (the module docstring)."""
    return {
        "max_planned_peers": config.max_planned_peers,
        "global_plans": result.global_plans,
        "global_plan_seconds": round(result.global_plan_seconds / max(result.global_plans, 1), 3),
        "global_plan_seconds_max": round(result.max_global_plan_seconds, 3), "plans_adopted": result.plans_adopted,
        "plan_moves": result.plan_moves,
        "plans_skipped_too_large": result.plans_skipped_too_large, "plans_deferred": result.plans_deferred,
        "standby_max": result.standby_max, "standby_end": result.standby_end,
        "standby_takeovers": result.standby_takeovers, "last_plan_current": round(result.last_plan_current, 3),
        "last_plan_planned": round(result.last_plan_planned, 3),
    }


def plan_once(peers: int, stages: int, *, seed: int) -> None:
    """``peers`` volunteers online at once on the bootstrap's even layout of ``stages`` stages (peers
    dealt round-robin): the time ``plan_global`` and ``adoption.decide`` take on one core, and the
    cost model's samples/s of the layout and of the plan."""
    snapshot = volunteer_snapshot(draw_volunteers(np.random.default_rng(seed), peers), MODEL,
                                  runtime=RuntimeSettings(max_in_flight_per_peer=8))
    bounds = [round(k * MODEL.num_layers / stages) for k in range(stages + 1)]
    layers = tuple(zip(bounds[:-1], bounds[1:]))
    stage_of = {d.peer_id: i % stages for i, d in enumerate(snapshot.devices)}
    started = time.perf_counter()
    plan = plan_global(snapshot)
    planned_at = time.perf_counter()
    adoption = decide(snapshot, layers, stage_of, plan)
    print(json.dumps({
        "bench": "global_plan_sim", "mode": "global_plan_once", "peers": peers, "stages": stages,
        "planning_seconds": round(planned_at - started, 3), "decide_seconds": round(time.perf_counter() - planned_at, 3),
        "throughput_even_layout": round(adoption.current, 3), "throughput_planned": round(adoption.planned, 3),
        "plan_stages": len(plan.stages), "plan_peers": len(plan.assigned_peer_ids()), "moves": len(adoption.moves),
        "move_seconds": round(adoption.move_seconds, 1), "payback_seconds": round(adoption.payback_seconds, 1),
        "adopt": adoption.adopt,
    }), flush=True)


if __name__ == "__main__":
    main()
