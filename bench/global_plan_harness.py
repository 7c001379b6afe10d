"""The global plan on the network harness (issue #18): one swarm, three ways of laying it out, measured
one after another in one run.

The swarm of tests/e2e/test_global_plan.py: a bootstrap and six peers, three in each of two regions
of the emulated internet (peer/harness/internet.py; needs root, ``nft`` and ``gcc``): 50 Mbit/s and
5 ms access links, and between the regions a 10 Mbit/s path 40 ms further each way. The modes:

- ``even``: the bootstrap's even two-stage layout, each peer's stage chosen at join (by deficit) and
  never changed (``--rebalance-period 0``);
- ``rebalance``: the same, plus today's rebalancing (``--rebalance-period 30``);
- ``live_global``: the same, plus the live global plan (``--global-plan-period 30``, acted on).

In ``even`` and ``rebalance`` the peers still compute the global plan every 30 s but never act on it
(``--global-plan-min-gain`` 1e6): its events carry the cost model's samples/s for the layout as it
runs, and the planner's input (the snapshot of records: measured FLOP/s and link figures), from
which the planner's simulator (``SimulationConfig.murmuration``) runs the layout the peers serve at
the window's end. Both are printed beside the measured figure: their error on this swarm.

Each mode starts a fresh internet and swarm, waits until the six peers train, lets it settle for
``--settle`` seconds (the live global plan moves then), and measures for ``--window`` seconds the
tokens stage 0 completed (every microbatch whose loss came back). Prints one JSON line per mode:

    {"bench": "global_plan", "mode": ..., "tokens_per_s": ..., "speedup_vs_even": ..., "samples_per_s": ...,
     "cost_model_samples_per_s": ..., "simulated_samples_per_s": ..., "layout": [[start, end], ...], "peers_per_stage": [...],
     "standing_by": n, "window_s": ..., "load_avg_start": ..., "load_avg_end": ...}

Run: .venv/bin/python bench/global_plan_harness.py [--settle 150] [--window 90] [--modes even,rebalance,live_global]

All seven processes share this machine's cores: a layout that idles peers gives the others more CPU,
which a real swarm of separate machines would not. Read the ratios with that in mind.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from peer.harness.internet import Internet, Link  # noqa: E402
from peer.harness.local_swarm import LocalSwarm, wait_for  # noqa: E402
from peer.plan_worker import from_wire  # noqa: E402
from planner.adoption import layout_plan  # noqa: E402
from planner.simulator import SimulationConfig, simulate_plan  # noqa: E402

ACCESS = Link(rate_mbit=50, delay_ms=5)
BETWEEN = Link(rate_mbit=10, delay_ms=40)
PERIOD = 30
COMMON = ("--num-threads", "1", "--heartbeat-ttl", "10", "--global-plan-period", str(PERIOD))
MODES = {
    "even": ("--rebalance-period", "0", "--global-plan-min-gain", "1e6"),
    "rebalance": ("--rebalance-period", str(PERIOD), "--global-plan-min-gain", "1e6"),
    "live_global": ("--rebalance-period", "0"),
}


def current_stage(peer) -> int:
    """The stage ``peer`` serves now (-1: standing by), from its newest status or layout change."""
    latest = max((e for e in peer.events() if e["event"] in ("status", "relayout")), key=lambda e: e["t"])
    return latest["stage"]


def simulated(plans: list[dict], layout: list[list[int]], stage_of: dict[str, int]) -> float | None:
    """The planner simulator's samples/s for ``layout`` served as ``stage_of`` says, on the snapshot of
    the newest of ``plans`` (global_plan events) that carries one."""
    carrying = [e for e in plans if "snapshot" in e]
    if not carrying:
        return None
    snapshot = from_wire(base64.b64decode(max(carrying, key=lambda e: e["t"])["snapshot"]))
    plan = layout_plan([tuple(r) for r in layout], {p: k for p, k in stage_of.items() if p in snapshot.index_by_peer_id},
                       snapshot)
    if plan is None:
        return None
    config = SimulationConfig.murmuration(num_steps=4, is_flushing=snapshot.runtime.is_flushing)
    return simulate_plan(snapshot, plan, config, rng=np.random.default_rng(0)).throughput


def run_mode(mode: str, *, settle: float, window: float, workdir: Path) -> dict:
    internet = Internet(seed=18)
    boot = internet.add_host("bootstrap", ACCESS)
    east = [internet.add_host(f"east{i}", ACCESS) for i in range(3)]
    west = [internet.add_host(f"west{i}", ACCESS) for i in range(3)]
    internet.connect_regions([boot, *east], west, BETWEEN)
    swarm = LocalSwarm(workdir / mode)
    load_start = os.getloadavg()[0]
    try:
        internet.start()
        swarm.start_bootstrap("--num-stages", "2", host=boot.address, command_prefix=boot.command_prefix)
        peers = [swarm.start_peer(*COMMON, *MODES[mode], host=h.address, command_prefix=h.command_prefix)
                 for h in (*east, *west)]
        wait_for(lambda: all(p.events("status") or not p.is_alive() for p in peers), 300, "six peers to train")
        if not all(p.is_alive() for p in peers):
            raise RuntimeError(f"a peer died while joining:\n{swarm.logs()[-4000:]}")
        begin = time.time() + settle
        end = begin + window
        wait_for(lambda: time.time() > end or not all(p.is_alive() for p in peers), settle + window + 60, "the window")
        done = [e for p in peers for e in p.events("microbatch") if "tokens" in e and begin <= e["t"] < end]
        stages = [current_stage(p) for p in peers]
        serving = [p.events("status")[-1] for p, k in zip(peers, stages) if k >= 0]
        plans = [p.events("global_plan")[-1] for p, k in zip(peers, stages) if k >= 0 and p.events("global_plan")]
        layout = next((p.events("relayout")[-1]["stage_layers"] for p in peers if p.events("relayout")), [[0, 2], [2, 4]])
        stage_of = {p.events("joined")[0]["peer_id"]: k for p, k in zip(peers, stages) if k >= 0}
        simulation = simulated(plans, layout, stage_of)
        return {
            "bench": "global_plan", "mode": mode,
            "tokens_per_s": round(sum(e["tokens"] for e in done) / window, 1),
            "samples_per_s": round(sum(e["samples"] for e in done) / window, 2),
            "cost_model_samples_per_s": round(statistics.median(e["current"] for e in plans), 2) if plans else None,
            "simulated_samples_per_s": round(simulation, 2) if simulation is not None else None,
            "layout": layout,
            "peers_per_stage": serving[0]["peers_per_stage"] if serving else [],
            "standing_by": sum(k < 0 for k in stages),
            "moves": sum(len(p.events("relayout")) + len(p.events("moved")) for p in peers),
            "window_s": window, "settle_s": settle,
            "load_avg_start": round(load_start, 2), "load_avg_end": round(os.getloadavg()[0], 2),
        }
    finally:
        swarm.shutdown(timeout=30)
        internet.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle", type=float, default=150.0, help="seconds after all peers train before the window")
    parser.add_argument("--window", type=float, default=90.0, help="seconds of measurement")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from " + ", ".join(MODES))
    parser.add_argument("--workdir", default="", help="keep each mode's logs and event logs here (default: a new "
                        "temporary folder, kept; its path goes to stderr)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}: choose from {', '.join(MODES)}")
    even = None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="global-plan-harness-"))
    print(f"logs and event logs under {workdir}", file=sys.stderr)
    for mode in modes:
        result = run_mode(mode, settle=args.settle, window=args.window, workdir=workdir)
        if mode == "even":
            even = result["tokens_per_s"]
        result["speedup_vs_even"] = round(result["tokens_per_s"] / even, 3) if even else None
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
