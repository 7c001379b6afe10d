"""Does planner.simulator predict the real swarm? Loopback swarms against simulated ones (issue 4).

    python bench/simulator_check.py [--seconds 40] [--only 2x1,3,4]

For each configuration (2 peers = 1 + 1, 3 peers, 4 peers on the default 2-stage run spec, every
peer ``--num-threads 1``) it:

1. runs run_bootstrap.py + N run_peer.py on 127.0.0.1 (:class:`peer.harness.local_swarm.LocalSwarm`),
   waits until every peer trains, skips a warm-up, and counts samples finished at stage 0 over
   ``--seconds`` from the peers' metrics files (as bench/pipeline_overhead.py does);
2. builds a :class:`planner.snapshot.SwarmSnapshot` from measured inputs only:
   * compute: ``peer.profiler.measure_flops`` run in N concurrent single-thread processes, in 3 s
     bursts, 3 right before and 3 right after the swarm (median per rank). The simulator has no notion of devices sharing cores, so each device's
     FLOP/s is what one of N peers gets while all N compute at once on this machine (the peers' own
     "joined" figures were measured while the others were still starting, so they are reported but
     not used);
   * model: the cost model of :func:`swarm.model.stage_flops_per_sample` per block (the head's
     FLOPs and parameters on the last block, the embedding's parameters on the first), float32
     activations of ``seq_len x d_model`` per sample, micro-batch and batch of the run spec;
   * links: loopback, 0.2 ms one way (FIELD-NOTES: ~0.4 ms RTT) and 300 MB/s;
3. simulates the assignment the swarm negotiated (each peer's stage from its "joined" event) with
   the simulator configured like this runtime (``SimulationConfig.murmuration``): micro-batches
   routed whole to one peer per stage, ``max_in_flight`` per stage-0 peer, FIFO compute, the last
   stage's forward and backward as one task, no drain at steps, steady state after one step.

4. calibration: the simulator counts compute (the FLOP cost model) but a real peer also spends CPU
   on every message to or from another stage (msgpack and tensor bytes, the p2p daemon, Python
   handlers, bookkeeping). That cost per message, in FLOP-equivalents
   (``SimulationConfig.message_overhead_flops``), is set once from the ``--calibrate-on``
   configuration (default 1 + 1: the value at which the simulator reproduces that run) and then
   used unchanged for the other configurations, which validate it. Each line also gives the
   prediction without the overhead.

Prints one JSON line per configuration:
``{"bench": "simulator_check", "config", "role", "measured_samples_per_s", "predicted_samples_per_s", "error", ...}``
with ``error = (predicted - measured) / measured``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from planner.simulator import SimulationConfig, simulate_plan  # noqa: E402
from planner.plan import Plan, Stage  # noqa: E402
from planner.runtime import RuntimeSettings  # noqa: E402
from planner.snapshot import Device, LinkMatrix, ModelProfile, SwarmSnapshot  # noqa: E402

WARMUP_SECONDS = 10.0
LOOPBACK_LATENCY = 0.2e-3  # one way, seconds
LOOPBACK_BANDWIDTH = 300e6  # bytes per second
MAX_IN_FLIGHT = 4
BURST_SECONDS = 3.0
NUM_BURSTS = 3  # before and after each swarm  # run_peer.py's default --max-in-flight
CONFIGS = {"2x1": 2, "3": 3, "4": 4}  # name -> peers on the 2-stage default run


def measure_swarm(num_peers: int, seconds: float, workdir: Path) -> dict:
    """Runs the swarm; returns stage-0 samples/s over the window and each peer's stage and FLOP/s."""
    from peer.harness.local_swarm import LocalSwarm, wait_for

    with LocalSwarm(workdir) as swarm:
        swarm.start_bootstrap("--num-stages", "2")
        # --rebalance-period 0: the stage map the simulator is given must not change during the run
        peers = [swarm.start_peer("--num-threads", "1", "--rebalance-period", "0") for _ in range(num_peers)]
        try:
            wait_for(lambda: all(p.events("status") for p in peers), 180, "every peer to train")
        except TimeoutError:
            print(swarm.logs(), file=sys.stderr)
            raise
        start = time.time() + WARMUP_SECONDS
        time.sleep(WARMUP_SECONDS + seconds + 1.0)
        end = start + seconds
        samples = sum(e["samples"] for p in peers for e in p.events("microbatch")
                      if e["stage"] == 0 and start <= e["t"] < end)
        joined = [p.events("joined")[0] for p in peers]
        final_stage = [p.events("status")[-1]["stage"] for p in peers]
    if [j["stage"] for j in joined] != final_stage:
        raise RuntimeError(f"peers changed stage during the run: {joined} -> {final_stage}")
    return {
        "samples_per_s": samples / seconds,
        "stages": {j["peer_id"]: j["stage"] for j in joined},
        "joined_flops": {j["peer_id"]: j["flops"] for j in joined},
    }


class FlopsWorkers:
    """``num_processes`` single-thread processes that run ``measure_flops`` at once, in bursts.

    Workers start measuring together (each reports "ready" after its imports and a warm-up, then
    waits for "go"), since importing torch on a busy machine can take longer than a burst; they
    stay up between bursts so that bursts before and after a swarm cost no start-up.
    """

    def __init__(self, num_processes: int) -> None:
        self.workers = [subprocess.Popen([sys.executable, __file__, "--flops-worker"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True) for _ in range(num_processes)]
        for worker in self.workers:
            if worker.stdout.readline().strip() != "ready":
                raise RuntimeError("a FLOP/s worker failed to start")

    def burst(self) -> list[float]:
        """FLOP/s of each worker over one burst while all run, sorted."""
        for worker in self.workers:
            worker.stdin.write("go\n")
            worker.stdin.flush()
        return sorted(float(worker.stdout.readline()) for worker in self.workers)

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.stdin.close()
            worker.wait(30)


def flops_worker() -> None:
    """Per "go": repeats ``measure_flops`` for 3 s and prints the rate over all of it (harmonic mean)."""
    import torch

    from dht.records import RunSpec
    from peer.profiler import measure_flops

    torch.set_num_threads(1)
    spec, device = RunSpec(run_id="bench"), torch.device("cpu")
    measure_flops(spec, device, num_trials=1, min_seconds=0.0)
    print("ready", flush=True)
    while sys.stdin.readline():
        figures, started = [], time.monotonic()
        while time.monotonic() - started < BURST_SECONDS:
            figures.append(measure_flops(spec, device, num_trials=1, min_seconds=0.0))
        print(statistics.harmonic_mean(figures), flush=True)


def build_profile(num_stage0_peers: int) -> ModelProfile:
    """The default run spec as a planner profile, from swarm.model's cost model."""
    from dht.records import RunSpec
    from swarm.model import stage_flops_per_sample, stage_num_params

    spec = RunSpec(run_id="bench", stage_layers=tuple((i, i + 1) for i in range(4)))  # one block per stage
    model = spec.model
    flops = [stage_flops_per_sample(spec, k) for k in range(4)]  # block k; the head rides on block 3
    params = [4.0 * stage_num_params(spec, k) for k in range(4)]  # float32; embedding on 0, head on 3
    activation = 4.0 * model.seq_len * model.d_model  # float32 output of a block, per sample
    # A replica steps every target_batch_size samples; the swarm's step is one per stage-0 peer.
    per_replica = spec.target_batch_size // spec.microbatch_size
    return ModelProfile(
        layer_flops=tuple(flops), layer_param_bytes=tuple(params), layer_activation_bytes=(activation,) * 4,
        microbatch_size=spec.microbatch_size, num_microbatches=per_replica * num_stage0_peers,
        optimizer_bytes_per_param_byte=3.0,
    )


def predict(stages: dict[str, int], flops: list[float], *, num_steps: int, overhead_flops: float = 0.0) -> float:
    """Simulated samples/s of the negotiated assignment on a loopback snapshot."""
    peer_ids = sorted(stages)
    num_stage0 = sum(1 for p in peer_ids if stages[p] == 0)
    devices = tuple(Device(peer_id=p, flops=f, memory_bytes=2**40, is_reliable=True) for p, f in zip(peer_ids, flops))
    n = len(devices)
    links = LinkMatrix(latency_delay=np.full((n, n), LOOPBACK_LATENCY), bandwidth=np.full((n, n), LOOPBACK_BANDWIDTH))
    runtime = RuntimeSettings(max_in_flight_per_peer=MAX_IN_FLIGHT)  # the runtime's settings, as the planner sees them
    snapshot = SwarmSnapshot(devices=devices, links=links, model=build_profile(num_stage0), runtime=runtime)
    plan = Plan(stages=(
        Stage(layer_start=0, layer_end=2, server_ids=tuple(p for p in peer_ids if stages[p] == 0)),
        Stage(layer_start=2, layer_end=4, server_ids=tuple(p for p in peer_ids if stages[p] == 1)),
    ))
    config = SimulationConfig.murmuration(num_steps=num_steps, message_overhead_flops=overhead_flops)
    return simulate_plan(snapshot, plan, config, rng=np.random.default_rng(0)).throughput


def calibrate(predicted: Callable[[float], float], measured: float) -> float:
    """The per-message overhead (FLOP-equivalents) at which ``predicted(overhead)``, the simulated
    samples/s of a run, reproduces its ``measured`` samples/s (bisection; 0 if none is needed)."""
    low, high = 0.0, 1e11
    if predicted(0.0) <= measured:
        return 0.0
    for _ in range(50):
        mid = (low + high) / 2
        if predicted(mid) > measured:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="measured seconds per configuration")
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configurations")
    parser.add_argument("--calibrate-on", default="2x1",
                        help="configuration whose run sets the per-message overhead; the others validate it")
    parser.add_argument("--flops-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flops_worker:
        flops_worker()
        return
    names = args.only.split(",")
    if args.calibrate_on not in names:
        names.insert(0, args.calibrate_on)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="simulator-check-") as tmp:
        for name in names:
            num_peers = CONFIGS[name]
            # Other work on this machine comes and goes, so compute is measured in bursts right
            # before and right after the swarm; per rank, the median burst.
            workers = FlopsWorkers(num_peers)
            try:
                before = [workers.burst() for _ in range(NUM_BURSTS)]
                real = measure_swarm(num_peers, args.seconds, Path(tmp) / name)
                after = [workers.burst() for _ in range(NUM_BURSTS)]
            finally:
                workers.shutdown()
            # Devices are identical cores; give the peers the concurrent figures in a fixed order.
            runs[name] = {"stages": real["stages"], "measured": real["samples_per_s"],
                          "flops": [statistics.median(column) for column in zip(*before, *after)],
                          "bursts": before + after, "joined": real["joined_flops"], "num_peers": num_peers}
    base = runs[args.calibrate_on]
    overhead = calibrate(lambda flops: predict(base["stages"], base["flops"], num_steps=12, overhead_flops=flops),
                         base["measured"])
    for name, run in runs.items():
        predicted = predict(run["stages"], run["flops"], num_steps=12, overhead_flops=overhead)
        uncalibrated = predict(run["stages"], run["flops"], num_steps=12)
        measured = run["measured"]
        per_stage = [sum(1 for s in run["stages"].values() if s == k) for k in (0, 1)]
        print(json.dumps({
            "bench": "simulator_check", "config": f"{run['num_peers']} peers, per stage {per_stage}",
            "role": "calibration" if name == args.calibrate_on else "validation",
            "measured_samples_per_s": round(measured, 2), "predicted_samples_per_s": round(predicted, 2),
            "error": round((predicted - measured) / measured, 3),
            "predicted_without_overhead": round(uncalibrated, 2),
            "error_without_overhead": round((uncalibrated - measured) / measured, 3),
            "message_overhead_gflop": round(overhead / 1e9, 4),
            "concurrent_gflops_used": [round(f / 1e9, 2) for f in run["flops"]],
            "concurrent_gflops_bursts": [[round(f / 1e9, 1) for f in b] for b in run["bursts"]],
            "joined_gflops": [round(f / 1e9, 2) for f in run["joined"].values()],
            "seconds": args.seconds,
        }), flush=True)


if __name__ == "__main__":
    main()
