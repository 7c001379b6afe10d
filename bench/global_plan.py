"""The swarm's life at internet scale, simulated: the live decision rules at 256 to 10,000 peers (issue #18).

Prints one JSON line per (peers, mode, compression):

    {"bench": "global_plan_sim", "peers": N, "mode": "even" | "rebalance", "compression_ratio": r,
     "stages": S, "max_in_flight": 8, "bound_compute" | "bound_links" | "bound_window": samples/s each
     part of the cost model allows at the end, "throughput": mean samples/s over the hour, "planning_seconds": mean per decision, "planning_seconds_max": ...,
     "decisions": ..., "moves": ..., "replans": ..., "joins": ..., "leaves": ..., "online_min": ...,
     "online_max": ..., "sim_seconds": wall-clock of the whole simulation, "simulated_seconds": ...}

Run: .venv/bin/python bench/global_plan.py [--peers 256,1000,10000] [--hours 1] [--compression 1,0.03125]
[--stages 8]

Each run draws one churn trace per swarm size (``planner.offline.internet``: nine regions, home
uplinks of 10–100 Mbit/s, 10–80 TFLOP/s, log-normal sessions of median 2 h, Poisson arrivals that
keep N online) and runs it through ``planner.offline.lifetime`` in each mode, on the same trace:
"even" (the bootstrap's even layout, the live join rule only) and "rebalance" (plus the live
rebalancing rule every 60 s at a 20 % gain). The live global plan has no mode yet (not built).
The model: 24 identical transformer layers (hidden 2048, 1024 tokens, about 1.2 B parameters),
micro-batches of 4, 8 stages by default (each holds 3 layers: parameters, gradients and AdamW moments
fit the smallest device drawn, 8 GiB), 8 micro-batches in flight per stage-0 peer (the live
``--max-in-flight``). ``--compression`` sets the boundary codec's byte ratio (1/32: the
subspace boundary with int8 of issue #16, about 35x).

The harness modes of issue #18 (the same three layouts on the network harness, ``"bench":
"global_plan"``) are not here yet. Timings are wall-clock on one core of this shared machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from planner.offline.internet import churn_trace  # noqa: E402
from planner.offline.lifetime import MODES, LifetimeConfig, simulate_lifetime  # noqa: E402
from planner.offline.scenarios import build_transformer_profile  # noqa: E402

MODEL = build_transformer_profile(num_layers=24, hidden_size=2048, sequence_length=1024, microbatch_size=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="256,1000,10000", help="swarm sizes, comma-separated")
    parser.add_argument("--hours", type=float, default=1.0, help="simulated hours (default: 1)")
    parser.add_argument("--compression", default="1,0.03125", help="boundary byte ratios, comma-separated")
    parser.add_argument("--stages", default="8", help="numbers of stages, comma-separated (default: 8)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for peers in (int(p) for p in args.peers.split(",")):
        trace = churn_trace(np.random.default_rng(args.seed), peers, args.hours * 3600)
        for ratio, stages in itertools.product((float(r) for r in args.compression.split(",")),
                                               (int(s) for s in args.stages.split(","))):
            for mode in MODES:
                started = time.perf_counter()
                config = LifetimeConfig(compression_ratio=ratio, num_stages=stages)
                result = simulate_lifetime(trace, MODEL, mode=mode, config=config, clock=time.perf_counter)
                print(json.dumps({
                    "bench": "global_plan_sim", "peers": peers, "mode": mode, "compression_ratio": ratio,
                    "stages": stages, "max_in_flight": config.max_in_flight,
                    **{f"bound_{k}": round(v, 2) for k, v in result.final_bounds.items()},
                    "throughput": round(result.throughput, 3),
                    "planning_seconds": round(result.decision_seconds / max(result.decisions, 1), 6),
                    "planning_seconds_max": round(result.max_decision_seconds, 4), "decisions": result.decisions,
                    "moves": result.moves, "replans": result.replans, "joins": result.joins, "leaves": result.leaves,
                    "online_min": result.online_min, "online_max": result.online_max,
                    "sim_seconds": round(time.perf_counter() - started, 2), "simulated_seconds": trace.horizon_s,
                }), flush=True)


if __name__ == "__main__":
    main()
