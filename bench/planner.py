"""Planner benchmarks: quality against brute force, seed 000 Cases 3–4 in simulation, speed.

Prints one JSON line per measurement:

    {"bench": "planner_quality", "median_gap": ..., "worst_gap": ..., ...}
    {"bench": "planner_case", "case": ..., "method": ..., "throughput": ..., "speedup_vs_even": ...}
    {"bench": "planner_speed", "peers": N, "seconds": ...}
    {"bench": "planner_join", "peers": N, "seconds": ...}
    {"bench": "planner_global_speed", "peers": N, "seconds": ..., "model_vs_even": ..., "model_vs_old": ...}
    {"bench": "planner_heldout", "topology": ..., "seed": ..., "method": ..., "model_throughput": ...,
     "simulated_throughput": ..., "model_vs_even": ..., "simulated_vs_even": ..., "fits": ..., "seconds": ...}

Run: .venv/bin/python bench/planner.py [--quick] [--only quality,case,speed,join,heldout,global_speed]

``heldout`` (issue #18) compares the seed 000 planner as it was used before (``old``: all reliable
devices, the caller's rng, seeds 0 and 1) with ``plan_global`` (``new``) and every baseline, on
topologies the planner was not tuned on (``HELDOUT``), under the cost model and the simulator (as ``plan_global`` runs it) with
the runtime's settings (window 4 per stage-0 peer, no compression, averaging every 15 s).
Timings are wall-clock on one core (the planner is single-threaded Python + numpy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from planner.costs import estimate_throughput  # noqa: E402
from planner.asteroid import plan_asteroid  # noqa: E402
from planner.baselines import plan_even, plan_petals, plan_swarm  # noqa: E402
from planner.canonical import plan_canonically  # noqa: E402
from planner.offline.exhaustive import find_optimal_plan  # noqa: E402
from planner.global_plan import GlobalPlanConfig, plan_global, simulation_config  # noqa: E402
from planner.partition import plan_partition  # noqa: E402
from planner.offline.rebalance import choose_join_stage, prepare_join  # noqa: E402
from planner.offline.scenarios import (  # noqa: E402
    GIGABYTE, build_case3_snapshot, build_clustered_snapshot, build_region_snapshot, build_transformer_profile,
)
from planner.simulator import SimulationConfig, simulate_plan  # noqa: E402
from planner.spantrain import plan_spantrain  # noqa: E402
from planner.snapshot import LinkMatrix, SwarmSnapshot  # noqa: E402


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def bench_quality(num_instances: int) -> None:
    """Plan throughput vs the brute-force optimum on random feasible instances of 3–7 devices."""
    rng = np.random.default_rng(2024)
    model = build_transformer_profile(num_layers=8, hidden_size=5120, sequence_length=1024)
    gaps = []
    while len(gaps) < num_instances:
        snapshot = build_region_snapshot(
            rng, num_devices=int(rng.integers(3, 8)), num_regions=int(rng.integers(1, 4)), model=model
        )
        _, optimum = find_optimal_plan(snapshot)
        if optimum <= 0:  # no plan fits in memory at all; nothing to compare
            continue
        ours = estimate_throughput(snapshot, plan_partition(snapshot, rng=np.random.default_rng(0)))
        new = estimate_throughput(snapshot, plan_global(snapshot))
        gaps.append((max(0.0, 1.0 - ours / optimum), max(0.0, 1.0 - new / optimum)))
    for index, method in enumerate(("old", "new")):
        column = [g[index] for g in gaps]
        emit({
            "bench": "planner_quality", "method": method, "median_gap": round(float(np.median(column)), 4),
            "worst_gap": round(float(np.max(column)), 4), "num_instances": num_instances,
            "num_optimal": int(sum(g < 1e-9 for g in column)),
        })


def bench_cases(num_steps: int) -> None:
    """Seed 000 §4.1 Cases 3 and 4 (batch 512, micro-batch 4), simulated throughput per method."""
    model = build_transformer_profile(
        num_layers=32, hidden_size=4096, sequence_length=512, microbatch_size=4, num_microbatches=128
    )
    snapshot = build_case3_snapshot(np.random.default_rng(3), model)
    plans = {
        "ours": plan_partition(snapshot, rng=np.random.default_rng(0)),
        "even": plan_even(snapshot), "petals": plan_petals(snapshot), "swarm": plan_swarm(snapshot),
        "asteroid": plan_asteroid(snapshot), "spantrain": plan_spantrain(snapshot, rng=np.random.default_rng(0)),
    }
    config = SimulationConfig(num_steps=num_steps)
    results = {m: simulate_plan(snapshot, p, config, rng=np.random.default_rng(1)) for m, p in plans.items()}
    for method, result in results.items():
        emit({
            "bench": "planner_case", "case": "case3", "method": method,
            "throughput": round(result.throughput, 4),
            "speedup_vs_even": round(result.throughput / results["even"].throughput, 3),
            "model_throughput": round(estimate_throughput(snapshot, plans[method]), 4),
            "num_stages": plans[method].num_stages,
        })
    bench_case4(snapshot, plans, num_steps)


def bench_case4(snapshot: SwarmSnapshot, plans: dict, num_steps: int) -> None:
    """Seed 000 §4.1 Case 4: Case 3 plus unreliable devices (the RTX 2080s) that drop mid-step.

    Clients pull whole micro-batches from the stage's task pool (``is_whole_microbatch``), so a
    client that is the earliest finisher for a task gets it, latency included (with chunked
    micro-batches the 100-150 ms client latency keeps them idle and churn has nothing to hit).
    Reported twice: ``throughput`` with the averaging floor (a step lasts at least the averaging
    time, which delayed updates overlap with the pipeline and which hides churn when it dominates)
    and ``pipeline_throughput`` without it. Each unreliable device in a plan drops with probability 0.5 per step, at a uniform time, and
    is noticed after 2 s. Three runs per plan, same draws: "calm" (no churn), "task_pool" (lost
    tasks go to the stage's least loaded server, seed 000) and "restart" (the micro-batch starts
    again from stage 0 and its finished work is wasted, SWARM).
    """
    base = dict(num_steps=num_steps, is_whole_microbatch=True, max_inflight=16, failure_detect_delay=2.0)
    modes = {
        "calm": SimulationConfig(**base),
        "task_pool": SimulationConfig(**base, disconnect_probability=0.5),
        "restart": SimulationConfig(**base, disconnect_probability=0.5, is_task_pool=False),
    }
    for method, plan in plans.items():
        results = {mode: simulate_plan(snapshot, plan, c, rng=np.random.default_rng(1)) for mode, c in modes.items()}
        pipeline = {  # the same draws without the averaging floor: what churn does to the pipeline
            mode: simulate_plan(snapshot, plan, replace(c, is_averaging=False), rng=np.random.default_rng(1))
            for mode, c in modes.items()
        }
        for mode, result in results.items():
            emit({
                "bench": "planner_case", "case": "case4", "method": method, "recovery": mode,
                "throughput": round(result.throughput, 4),
                "pipeline_throughput": round(pipeline[mode].throughput, 4),
                "pipeline_vs_calm": round(pipeline[mode].throughput / pipeline["calm"].throughput, 3),
                "num_lost_chunks": result.num_lost_chunks, "num_restarts": result.num_restarts,
                "wasted_seconds": round(result.wasted_seconds, 2),
                "num_clients": sum(len(s.client_ids) for s in plan.stages),
            })


def bench_speed(sizes: list[int]) -> None:
    """Wall time of one global plan for swarms of ``sizes`` peers in 8 regions."""
    model = build_transformer_profile(num_layers=32, hidden_size=5120, sequence_length=1024)
    for num_peers in sizes:
        snapshot = build_region_snapshot(np.random.default_rng(num_peers), num_devices=num_peers, num_regions=8, model=model)
        start = time.perf_counter()
        plan = plan_partition(snapshot, rng=np.random.default_rng(0))
        seconds = time.perf_counter() - start
        emit({
            "bench": "planner_speed", "peers": num_peers, "seconds": round(seconds, 3),
            "num_stages": plan.num_stages, "throughput": round(estimate_throughput(snapshot, plan), 4),
        })


def bench_global_speed(sizes: list[int]) -> None:
    """Wall time of one ``plan_global`` on the swarms of ``bench_speed``, with its gain over old and even."""
    model = build_transformer_profile(num_layers=32, hidden_size=5120, sequence_length=1024)
    for num_peers in sizes:
        snapshot = build_region_snapshot(np.random.default_rng(num_peers), num_devices=num_peers, num_regions=8, model=model)
        start = time.perf_counter()
        plan = plan_global(snapshot)
        seconds = time.perf_counter() - start
        ours = estimate_throughput(snapshot, plan)
        old = estimate_throughput(snapshot, plan_partition(snapshot, rng=np.random.default_rng(0)))
        even = estimate_throughput(snapshot, plan_even(snapshot))
        emit({
            "bench": "planner_global_speed", "peers": num_peers, "seconds": round(seconds, 3),
            "num_stages": plan.num_stages, "model_vs_even": round(ours / even, 3) if even > 0 else None,
            "model_vs_old": round(ours / old, 3) if old > 0 else None,
        })


def bench_join(num_peers: int, num_repeats: int = 20) -> None:
    """Median time of one join decision (``choose_join_stage``) on a plan of ``num_peers`` peers.

    ``prepare_join`` runs once per plan version (when the plan changes, not per joiner) and is
    reported separately.
    """
    model = build_transformer_profile(num_layers=32, hidden_size=5120, sequence_length=1024)
    snapshot = build_region_snapshot(np.random.default_rng(7), num_devices=num_peers + 1, num_regions=8, model=model)
    joiner = snapshot.devices[-1].peer_id
    keep = np.arange(num_peers)
    members = SwarmSnapshot(
        devices=snapshot.devices[:num_peers], model=model, links=LinkMatrix(
            latency_delay=snapshot.links.latency_delay[np.ix_(keep, keep)],
            bandwidth=snapshot.links.bandwidth[np.ix_(keep, keep)],
        ),
    )
    plan = plan_partition(members, rng=np.random.default_rng(0))
    start = time.perf_counter()
    context = prepare_join(snapshot, plan)
    prepare_seconds = time.perf_counter() - start
    timings = []
    for _ in range(num_repeats):
        start = time.perf_counter()
        choose_join_stage(context, joiner)
        timings.append(time.perf_counter() - start)
    emit({
        "bench": "planner_join", "peers": num_peers, "seconds": round(float(np.median(timings)), 5),
        "prepare_seconds": round(prepare_seconds, 4), "num_stages": plan.num_stages,
    })


def build_heldout(name: str, seed: int) -> SwarmSnapshot:
    """The held-out topologies of issue #18 (none of them is used to tune the planner)."""
    rng = np.random.default_rng(seed)
    model = build_transformer_profile(num_layers=24, hidden_size=4096, sequence_length=1024, num_microbatches=16)
    if name == "cluster_edge":  # 8 fast GPUs (32 GB) + 8 edge devices on 100 Mbit/s
        return build_clustered_snapshot(rng, model=model, num_clusters=1, cluster_size=8, num_edge=8)
    if name == "two_clusters_slow":  # 2 x 4 GPUs of 16/32/80 GB joined by 50 Mbit/s, + 4 edge devices
        return build_clustered_snapshot(
            rng, model=model, num_clusters=2, cluster_size=4, num_edge=4, inter_cluster_megabits=50.0,
            cluster_memory_bytes=(16 * GIGABYTE, 32 * GIGABYTE, 80 * GIGABYTE),
        )
    if name == "three_clusters":  # 3 x 4 GPUs joined by 1 Gbit/s, + 6 edge devices on 20 Mbit/s
        return build_clustered_snapshot(
            rng, model=model, num_clusters=3, cluster_size=4, num_edge=6, edge_megabits=20.0,
        )
    if name == "regions_small_memory":  # 16 devices in 3 regions, 4-12 GB each: memory binds
        return build_region_snapshot(rng, num_devices=16, num_regions=3, model=model, memory_range_bytes=(4e9, 12e9))
    raise ValueError(f"unknown topology {name!r}")


HELDOUT = ("cluster_edge", "two_clusters_slow", "three_clusters", "regions_small_memory")


def bench_heldout(seeds: list[int]) -> None:
    """Old vs new vs every baseline on ``HELDOUT`` topologies (module docstring).

    Every plan is simulated as ``plan_global`` checks its finalists (at least 256 micro-batches
    after the warm-up).
    """
    for name in HELDOUT:
        for seed in seeds:
            snapshot = build_heldout(name, seed)
            simulation = simulation_config(GlobalPlanConfig(), snapshot)
            methods = {
                "old": lambda s: plan_partition(s, rng=np.random.default_rng(0)),
                "old_rng1": lambda s: plan_partition(s, rng=np.random.default_rng(1)),
                "new": plan_global, "even": plan_even, "petals": plan_petals, "swarm": plan_swarm,
                "asteroid": lambda s: plan_canonically(s, plan_asteroid),
                "spantrain": lambda s: plan_canonically(s, lambda c: plan_spantrain(c, rng=np.random.default_rng(0))),
            }
            rows = {}
            for method, planner in methods.items():
                start = time.perf_counter()
                try:
                    plan = planner(snapshot)
                except ValueError:  # this planner finds no plan that fits
                    rows[method] = (0.0, 0.0, False, time.perf_counter() - start, 0)
                    continue
                seconds = time.perf_counter() - start
                simulated = simulate_plan(snapshot, plan, simulation, rng=np.random.default_rng(0))
                rows[method] = (
                    estimate_throughput(snapshot, plan), simulated.throughput, simulated.is_within_memory,
                    seconds, plan.num_stages,
                )
            even_model, even_simulated = rows["even"][:2]
            for method, (model, simulated, fits, seconds, num_stages) in rows.items():
                emit({
                    "bench": "planner_heldout", "topology": name, "seed": seed, "method": method,
                    "model_throughput": round(model, 3), "simulated_throughput": round(simulated, 3),
                    "model_vs_even": round(model / even_model, 3) if even_model > 0 else None,
                    "simulated_vs_even": round(simulated / even_simulated, 3) if even_simulated > 0 else None,
                    "fits": fits, "seconds": round(seconds, 2), "num_stages": num_stages,
                })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer instances and steps")
    parser.add_argument("--only", default="quality,case,speed,join,heldout,global_speed", help="comma-separated parts to run")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    if "quality" in parts:
        bench_quality(8 if args.quick else 24)
    if "case" in parts:
        bench_cases(1 if args.quick else 3)
    if "speed" in parts:
        bench_speed([16, 256] if args.quick else [16, 256, 1024, 4096])
    if "join" in parts:
        bench_join(1024)
    if "global_speed" in parts:
        bench_global_speed([16, 256] if args.quick else [16, 256, 1024])
    if "heldout" in parts:
        bench_heldout([0] if args.quick else [0, 1, 2])


if __name__ == "__main__":
    main()
