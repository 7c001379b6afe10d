"""Recovery of a stage that lost its only holder with no peer to spare: layer-wise re-plan against
waiting for a replacement volunteer (issue 4, seed 001 §3.4).

    python bench/replan.py [--replan-after 10] [--replacement-delay 30] [--window 45] [--modes replan,wait]

Each mode, one after the other in one invocation (this machine is noisy: compare within one run),
starts run_bootstrap.py with ``--stages`` (default 3) and as many run_peer.py processes on 127.0.0.1
(``--num-threads 1 --rebalance-period 0 --backup-period 3``), so every stage has one peer and no
rescue is possible; trains ``--warmup`` plus ``--window`` seconds from the first microbatch, then kills
the middle stage's peer (``os.killpg(SIGKILL)``: the peer, its DHT child and its p2pd).

* ``replan``: the peers run with ``--replan-after``; the survivors re-plan the layout without the
  lost stage (``peer/relayout.py``) and train on two stages.
* ``wait``: the peers run with ``--replan-after 0`` (the behaviour before re-planning existed); a
  replacement peer starts ``--replacement-delay`` seconds after the kill (a volunteer arriving),
  joins the empty stage and loads the backup the next stage's peer kept.

Per mode, from the peers' events files: ``stall_seconds`` (the kill to the end of the longest gap
between stage-0 microbatch completions after it: microbatches already past the middle stage still
finish just after the kill), ``goodput_before`` / ``goodput_after`` (samples/s finished at stage 0 over
``--window`` seconds before the kill and after the stall), the last stage's mean loss over the 20
microbatches before the kill and the 20 after the stall, and, for ``replan``, when the layout
changed, how long building the new stages took and which layers restarted from the seed (none
expected: the lost stage's layers come from its backup). Prints one JSON line per mode
(``"bench": "replan"``) and, with both modes, a line ``"bench": "replan_vs_wait"`` with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from peer.harness.local_swarm import LocalSwarm, wait_for  # noqa: E402

MODES = ("replan", "wait")
PEER_FLAGS = ("--num-threads", "1", "--rebalance-period", "0", "--backup-period", "3", "--status-period", "1")


def stage_of(peer) -> int:
    return peer.events("status")[-1]["stage"]


def stage0_samples(peers, start: float, end: float) -> int:
    return sum(e.get("samples", e.get("batch_size", 0)) for p in peers for e in p.events("microbatch")
               if e["stage"] == 0 and start <= e["t"] < end)


def last_losses(peers, start: float, end: float) -> list[tuple[float, float]]:
    """(time, loss) of microbatches whose loss the last stage computed, in [start, end), by time."""
    losses = []
    for peer in peers:
        last = None
        for event in peer.events():
            if event.get("event") == "status":
                last = len(event["peers_per_stage"]) - 1
            if event.get("event") == "microbatch" and event.get("loss") is not None and event["stage"] == last:
                if start <= event["t"] < end:
                    losses.append((event["t"], event["loss"]))
    return sorted(losses)


def resume_time(peers, killed_at: float, *, after_gap: int = 5) -> float | None:
    """The end of the longest gap between stage-0 microbatch completions that reaches past
    ``killed_at``, once ``after_gap`` completions followed it; None until then."""
    times = sorted(e["t"] for p in peers for e in p.events("microbatch") if e["stage"] == 0 and e["t"] >= killed_at - 5)
    gaps = [(b - a, i + 1) for i, (a, b) in enumerate(zip(times, times[1:])) if b > killed_at]
    if not gaps:
        return None
    _, end = max(gaps)
    return times[end] if len(times) - end > after_gap else None


def run_mode(mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    swarm = LocalSwarm(workdir / mode)
    flags = [*PEER_FLAGS, "--replan-after", str(args.replan_after if mode == "replan" else 0)]
    try:
        swarm.start_bootstrap("--num-stages", str(args.stages))
        peers = [swarm.start_peer(*flags) for _ in range(args.stages)]
        wait_for(lambda: all(p.events("status") for p in peers), args.start_timeout, "every peer to train")
        by_stage = {stage_of(p): p for p in peers}
        if sorted(by_stage) != list(range(args.stages)):
            raise RuntimeError(f"the peers did not spread one per stage: {sorted(by_stage)}")
        first = by_stage[0]
        wait_for(lambda: first.events("microbatch"), args.start_timeout, "the first microbatch")
        started_at = first.events("microbatch")[0]["t"]
        time.sleep(max(0.0, started_at + args.warmup + args.window - time.time()))  # a full window before the kill
        victim = by_stage[args.stages // 2]
        killed_at = time.time()
        os.killpg(victim.pid, signal.SIGKILL)
        survivors = [p for p in peers if p is not victim]
        if mode == "wait":
            time.sleep(args.replacement_delay)
            survivors.append(swarm.start_peer(*flags))
        # microbatches already past the middle stage still finish just after the kill: the stall is the
        # longest gap between stage-0 completions after it, once a few have come after the gap
        wait_for(lambda: resume_time(survivors, killed_at) is not None, args.recover_timeout,
                 "training to resume after the kill")
        resumed_at = resume_time(survivors, killed_at)
        time.sleep(args.window)
        relayouts = [e for p in survivors for e in p.events("relayout")]
        before = [loss for _, loss in last_losses(peers, killed_at - args.window, killed_at)][-20:]
        after = [loss for _, loss in last_losses(survivors, resumed_at, time.time())][:20]
        line = {
            "bench": "replan", "mode": mode, "stages": args.stages,
            "stall_seconds": round(resumed_at - killed_at, 2),
            "goodput_before": round(stage0_samples(peers, killed_at - args.window, killed_at) / args.window, 2),
            "goodput_after": round(stage0_samples(survivors, resumed_at, resumed_at + args.window) / args.window, 2),
            "loss_before": round(statistics.mean(before), 3) if before else None,
            "loss_after": round(statistics.mean(after), 3) if after else None,
            "stages_after": len(survivors[0].events("status")[-1]["peers_per_stage"]),
        }
        if mode == "replan":
            line.update({
                "layout_changed_seconds": round(max(e["t"] for e in relayouts) - killed_at, 2) if relayouts else None,
                "build_seconds": [round(e["seconds"], 3) for e in relayouts],
                "reseeded_layers": sorted({part for e in relayouts for part in e["reseeded"]}),
                "replan_after": args.replan_after,
            })
        else:
            line["replacement_delay"] = args.replacement_delay
        return line
    finally:
        swarm.shutdown(timeout=20)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=3, help="stages, one peer each (default 3; >= 2)")
    parser.add_argument("--replan-after", type=float, default=10.0, help="the peers' --replan-after in mode replan")
    parser.add_argument("--replacement-delay", type=float, default=30.0,
                        help="seconds after the kill before the replacement peer starts, in mode wait")
    parser.add_argument("--window", type=float, default=45.0, help="seconds of goodput measured before and after")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of training before the window before the kill")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--recover-timeout", type=float, default=300.0)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated among replan,wait")
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes must name some of {', '.join(MODES)}")
    if args.stages < 2 or not args.window > 0:
        parser.error("--stages must be >= 2 and --window positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lines = {}
    with tempfile.TemporaryDirectory(prefix="bench-replan-") as tmp:
        for mode in args.modes:
            lines[mode] = run_mode(mode, args, Path(tmp))
            print(json.dumps(lines[mode]), flush=True)
    if set(lines) == set(MODES):
        replan, wait = lines["replan"], lines["wait"]
        print(json.dumps({
            "bench": "replan_vs_wait",
            "stall_ratio": round(replan["stall_seconds"] / wait["stall_seconds"], 3),
            "goodput_after_ratio": round(replan["goodput_after"] / wait["goodput_after"], 3) if wait["goodput_after"] else None,
            "goodput_after_over_before": {m: round(lines[m]["goodput_after"] / lines[m]["goodput_before"], 3)
                                          for m in MODES if lines[m]["goodput_before"]},
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
