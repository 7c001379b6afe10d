"""Does planner.simulator predict a real swarm on the emulated internet? (issue #18)

    python bench/simulator_harness.py [--seconds 60] [--only same,across,2x2,3x3] [--calibrate-on same]

``bench/simulator_check.py`` on loopback, taken to the network harness of
``tests/e2e/test_global_plan.py`` (peer/harness/internet.py; needs root, ``nft`` and ``gcc``): two
regions, 50 Mbit/s and 5 ms access links, and between the regions a 10 Mbit/s path 40 ms further
each way. Each configuration is a bootstrap and N peers on the default two-stage run spec, every
peer ``--num-threads 1``, ``--rebalance-period 0`` and ``--global-plan-period 0`` (the stage map
holds still and no planner runs beside the swarm), ``--flow-control fixed`` (the window is
``--max-in-flight``, as the simulator has it):

- ``same``: 2 peers in one region (1 + 1 over 50 Mbit/s);
- ``across``: 1 peer in each region (1 + 1 over the 10 Mbit/s path);
- ``2x2``: 4 peers, 2 in each region;
- ``3x3``: 6 peers, 3 in each region (the e2e test's swarm).

For each it counts stage-0 samples/s over ``--seconds`` after a warm-up, then simulates the stage
assignment the peers negotiated (each peer's stage from its "joined" event) with
``SimulationConfig.murmuration``, on a snapshot whose every input is measured or known, not taken
from the peers' records:

- compute: ``peer.profiler.measure_flops`` in N concurrent single-thread processes, in bursts right
  before and right after the swarm (``simulator_check.FlopsWorkers``; the simulator has no notion of
  devices sharing cores);
- links: the emulated internet's own figures (one way: both access delays, plus the path's between
  regions; bandwidth: the slowest of the sender's upload, the receiver's download and the path);
- model and runtime: as a live peer builds them for its planner (``peer.plan_watch.model_profile``,
  its ``RuntimeSettings``: ``--max-in-flight`` 8, replicas exchanging gradients every batch), and the
  run's flush schedule (``SimulationConfig.murmuration(is_flushing=True)``: each step drains, then
  the replicas exchange gradients); ``predicted_pipelined`` is the same without drains, as the
  planner's callers simulated until now.

The per-message device cost (``SimulationConfig.message_overhead_flops``) is set on the
``--calibrate-on`` configuration and used unchanged on the others, which validate it. The user-space
delay line runs on this machine's cores too, beside the peers, and is not in the model.

Prints one JSON line per configuration:
``{"bench": "simulator_harness", "config", "role", "measured_samples_per_s", "predicted_samples_per_s", "error", ...}``
with ``error = (predicted - measured) / measured``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from dht.records import RunSpec  # noqa: E402
from peer.harness.internet import Internet, Link  # noqa: E402
from peer.harness.local_swarm import LocalSwarm, wait_for  # noqa: E402
from peer.plan_watch import model_profile  # noqa: E402
from planner.plan import Plan, Stage  # noqa: E402
from planner.runtime import RuntimeSettings  # noqa: E402
from planner.simulator import SimulationConfig, simulate_plan  # noqa: E402
from planner.snapshot import Device, LinkMatrix, SwarmSnapshot  # noqa: E402
from simulator_check import NUM_BURSTS, FlopsWorkers, calibrate  # noqa: E402  (bench/ is the script's own folder)
from swarm.subspace import microbatch_ratios  # noqa: E402

ACCESS = Link(rate_mbit=50, delay_ms=5)
BETWEEN = Link(rate_mbit=10, delay_ms=40)
MAX_IN_FLIGHT = 8  # run_peer.py's default --max-in-flight
WARMUP_SECONDS = 20.0
PEER_ARGS = ("--num-threads", "1", "--rebalance-period", "0", "--global-plan-period", "0", "--flow-control", "fixed")
CONFIGS = {"same": (2, 0), "across": (1, 1), "2x2": (2, 2), "3x3": (3, 3)}  # name -> peers in (east, west)


def path_figures(hosts: list[tuple[Link, str]]) -> tuple[np.ndarray, np.ndarray]:
    """One-way delay (s) and bandwidth (bytes/s) between every two of ``hosts`` ((access link, region))."""
    n = len(hosts)
    delay, bandwidth = np.zeros((n, n)), np.full((n, n), np.inf)
    for i, (a, region_a) in enumerate(hosts):
        for j, (b, region_b) in enumerate(hosts):
            if i == j:
                continue
            rates = [a.upload_mbit, b.rate_mbit]
            delay[i, j] = (a.delay_ms + b.delay_ms) / 1e3
            if region_a != region_b:
                delay[i, j] += BETWEEN.delay_ms / 1e3
                rates.append(BETWEEN.rate_mbit)
            bandwidth[i, j] = min(r for r in rates if r is not None) * 1e6 / 8
    np.fill_diagonal(bandwidth, 1e12)
    return delay, bandwidth


def measure_swarm(east: int, west: int, seconds: float, workdir: Path, *, averaging_period: float) -> dict:
    """Runs the configuration; returns stage-0 samples/s over the window and each peer's stage and region."""
    internet = Internet(seed=18)
    boot = internet.add_host("bootstrap", ACCESS)
    hosts = [(internet.add_host(f"east{i}", ACCESS), "east") for i in range(east)]
    hosts += [(internet.add_host(f"west{i}", ACCESS), "west") for i in range(west)]
    if west:
        internet.connect_regions([boot, *(h for h, r in hosts if r == "east")], [h for h, r in hosts if r == "west"], BETWEEN)
    swarm = LocalSwarm(workdir)
    try:
        internet.start()
        swarm.start_bootstrap("--num-stages", "2", "--averaging-period", str(averaging_period), host=boot.address,
                              command_prefix=boot.command_prefix)
        peers = [swarm.start_peer(*PEER_ARGS, host=h.address, command_prefix=h.command_prefix) for h, _ in hosts]
        try:
            wait_for(lambda: all(p.events("status") for p in peers), 300, "every peer to train")
        except TimeoutError:
            print(swarm.logs()[-6000:], file=sys.stderr)
            raise
        start = time.time() + WARMUP_SECONDS
        end = start + seconds
        wait_for(lambda: time.time() > end + 1.0, seconds + WARMUP_SECONDS + 30, "the window")
        samples = sum(e["samples"] for p in peers for e in p.events("microbatch")
                      if e["stage"] == 0 and "tokens" in e and start <= e["t"] < end)
        joined = [p.events("joined")[0] for p in peers]
        final_stage = [p.events("status")[-1]["stage"] for p in peers]
    finally:
        swarm.shutdown(timeout=30)
        internet.shutdown()
    if [j["stage"] for j in joined] != final_stage:
        raise RuntimeError(f"peers changed stage during the run: {[j['stage'] for j in joined]} -> {final_stage}")
    return {
        "samples_per_s": samples / seconds,
        "peers": [(j["peer_id"], j["stage"], region) for j, (_, region) in zip(joined, hosts)],
        "joined_flops": [j["flops"] for j in joined],
    }


def predict(run: dict, *, num_steps: int, overhead_flops: float = 0.0, flushing: bool = True) -> float:
    """Simulated samples/s of the run's stage assignment on its measured compute and known links;
    ``flushing``: as the runtime's flush schedule runs it (each step drains, then the replicas
    exchange gradients), else pipelined without drains (what the planner's callers assumed)."""
    spec = RunSpec(run_id="bench")
    peers = run["peers"]
    ids = [p for p, _, _ in peers]
    devices = tuple(Device(peer_id=p, flops=f, memory_bytes=2**40, is_reliable=True) for p, f in zip(ids, run["flops"]))
    delay, bandwidth = path_figures([(ACCESS, region) for _, _, region in peers])
    averaging_period = 0.0 if spec.replica_sync == "gradients" else spec.averaging_period
    runtime = RuntimeSettings(max_in_flight_per_peer=MAX_IN_FLIGHT, averaging_period=averaging_period,
                              boundary_compression_ratio=min(1.0, 1.0 / microbatch_ratios(spec)[0]),
                              is_flushing=spec.pipeline_schedule == "flush")
    model = model_profile(spec, num_stage0_peers=sum(k == 0 for _, k, _ in peers))
    snapshot = SwarmSnapshot(devices=devices, links=LinkMatrix(latency_delay=delay, bandwidth=bandwidth),
                             model=model, runtime=runtime)
    (start, middle), (_, end) = spec.stage_layers
    plan = Plan(stages=(Stage(layer_start=start, layer_end=middle, server_ids=tuple(p for p, k, _ in peers if k == 0)),
                        Stage(layer_start=middle, layer_end=end, server_ids=tuple(p for p, k, _ in peers if k == 1))))
    config = SimulationConfig.murmuration(num_steps=num_steps, message_overhead_flops=overhead_flops,
                                          is_flushing=flushing and spec.pipeline_schedule == "flush")
    return simulate_plan(snapshot, plan, config, rng=np.random.default_rng(0)).throughput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds per configuration")
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated, from " + ", ".join(CONFIGS))
    parser.add_argument("--calibrate-on", default="same",
                        help="configuration whose run sets the per-message overhead; the others validate it")
    parser.add_argument("--averaging-period", type=float, default=15.0,
                        help="the run's periodic averaging rounds (run_bootstrap.py --averaging-period; a day: none "
                        "in the window, to see what they cost beside the per-batch gradient exchange)")
    parser.add_argument("--workdir", default="", help="keep each configuration's logs here (default: a temporary folder)")
    args = parser.parse_args()
    names = args.only.split(",")
    if args.calibrate_on not in names:
        names.insert(0, args.calibrate_on)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}: choose from {', '.join(CONFIGS)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="simulator-harness-"))
    print(f"logs under {workdir}", file=sys.stderr)
    runs = {}
    for name in names:
        east, west = CONFIGS[name]
        load_start = os.getloadavg()[0]
        workers = FlopsWorkers(east + west)
        try:
            before = [workers.burst() for _ in range(NUM_BURSTS)]
            real = measure_swarm(east, west, args.seconds, workdir / name, averaging_period=args.averaging_period)
            after = [workers.burst() for _ in range(NUM_BURSTS)]
        finally:
            workers.shutdown()
        runs[name] = {**real, "measured": real["samples_per_s"], "bursts": before + after,
                      "flops": [statistics.median(column) for column in zip(*before, *after)],
                      "load_avg": [round(load_start, 2), round(os.getloadavg()[0], 2)]}
    base = runs[args.calibrate_on]
    overhead = calibrate(lambda flops: predict(base, num_steps=12, overhead_flops=flops), base["measured"])
    for name, run in runs.items():
        predicted = predict(run, num_steps=12, overhead_flops=overhead)
        uncalibrated = predict(run, num_steps=12)
        pipelined = predict(run, num_steps=12, overhead_flops=overhead, flushing=False)
        measured = run["measured"]
        print(json.dumps({
            "bench": "simulator_harness", "config": name,
            "stages": {region: [k for _, k, r in run["peers"] if r == region] for region in ("east", "west")},
            "role": "calibration" if name == args.calibrate_on else "validation",
            "measured_samples_per_s": round(measured, 2), "predicted_samples_per_s": round(predicted, 2),
            "error": round((predicted - measured) / measured, 3) if measured else None,
            "predicted_without_overhead": round(uncalibrated, 2),
            "error_without_overhead": round((uncalibrated - measured) / measured, 3) if measured else None,
            "predicted_pipelined": round(pipelined, 2),
            "error_pipelined": round((pipelined - measured) / measured, 3) if measured else None,
            "message_overhead_gflop": round(overhead / 1e9, 4),
            "concurrent_gflops_used": [round(f / 1e9, 2) for f in run["flops"]],
            "joined_gflops": [round(f / 1e9, 2) for f in run["joined_flops"]],
            "seconds": args.seconds, "averaging_period": args.averaging_period, "load_avg_start_end": run["load_avg"],
        }), flush=True)


if __name__ == "__main__":
    main()
