"""Goodput under churn: crashes, graceful leaves and rejoins, ours against the SWARM baseline (issues 5, 15).

    python bench/churn.py [--minutes 10] [--event-period 30] [--peers 6] [--seed 0] [--modes no_churn,ours,baseline]
                          [--link 20/40]

Each mode, one after the other in one invocation (this machine is noisy: compare within one run):

1. starts run_bootstrap.py (``--stages``, default 2) and ``--peers`` run_peer.py processes on 127.0.0.1
   (:class:`peer.harness.local_swarm.LocalSwarm`; ``--num-threads 1 --rebalance-period 0``, so the stage map
   changes only through churn; ``--status-period 1``, so a peer's first status line dates its start
   of training within a second), waits until every peer trains, then ``--warmup`` seconds;
2. opens the measured window of ``--minutes`` and applies the seeded churn trace
   (:func:`bench.churn_metrics.make_trace`; the same seed gives the same trace in every mode): every
   ``--event-period`` seconds one of
   * crash: ``os.killpg(SIGKILL)`` of a training peer's process group (the peer, its DHT child, its p2pd);
   * leave: SIGINT to a training peer (it announces its leave and drains);
   * rejoin: a new run_peer.py, which negotiates its stage;
   keeping the planned number of peers within [``--min-peers``, ``--max-peers``]. A crash or leave
   picks its victim, with the trace's draw, among training peers whose stage keeps another training
   peer, so no stage is ever emptied by the bench (:func:`bench.churn_metrics.choose_victim`).
   ``no_churn`` applies no event.
3. at the end of the window sends SIGINT to every stage-0 peer still up and waits up to
   ``--drain-timeout`` for each to exit (a leave lets its in-flight microbatches finish through the
   stage-1 peers, which are still up), then stops everything else.

Modes: ``no_churn`` and ``ours`` run the peers with ``--recovery replay`` (a failed hop is re-sent at
that hop; stage 0 replays a microbatch whose route broke, same id, de-duplicated downstream);
``baseline`` with ``--recovery restart`` (SWARM: a broken microbatch is dropped and retried from
stage 0). A peer without the flag is run without it, and the line says ``"recovery": "unsupported"``.

Metrics, from the peers' events files (:mod:`bench.churn_metrics`):

* goodput: samples of microbatches finished at stage 0 (``"microbatch"`` events of stage 0: the
  gradient came back and was accumulated) per second of the window.
* capacity online: at each instant, min over stages of (training peers of the stage x that stage's
  per-peer rate), integrated over the window. The per-peer rate of stage k is the no_churn run's
  goodput over its number of stage-k peers (every sample passes every stage, so each stage ran at
  that goodput); without a no_churn run in the invocation, the mode's own first event period (all
  initial peers, no churn yet) stands in. A peer counts from its start of training until the bench
  kills it or signals its leave. This is the throughput the swarm would have had if each stage scaled
  linearly in its replicas and churn cost nothing else. Caveat: on a host with fewer cores than peers
  (this one: 2 cores, 6+ peers) the peers share CPU, so a thinned swarm gives each survivor more of
  it and the linear model underestimates what is online: the ratio can exceed 1 there, and
  ``goodput_vs_no_churn`` (raw goodput over the no_churn run's) is reported beside it.
  ``goodput_ratio`` = goodput / capacity online; it is 1 for no_churn by construction.
* samples_lost: samples of microbatches "injected" by a stage-0 peer that did not crash and that
  exited cleanly after its leave (during the churn, or the SIGINT at the end), which that peer never
  finished (no stage-0 "microbatch" with the same mb_id) and did not list in its "unfinished" event
  (what its trainer still held when it stopped, waiting for a replay or cut off by a hard stop:
  ``samples_unfinished_at_stop``).
  What crashed stage-0 peers injected and never finished is ``samples_lost_at_crashed_peers`` (the
  data owner died; no scheme recovers it), and what a peer that did not exit cleanly after its
  SIGINT (killed after the grace period) never finished, ``samples_pending_at_stop``.
* samples_double_counted: per stage, over all its replicas (crashed ones up to their crash), samples
  of each mb_id "accumulated" more than once (times the extra count); ``..._live`` leaves out the
  crashed replicas' accumulations (their buffers died with them). The baseline retries a microbatch
  under the same mb_id (swarm/trainer.py), so its duplicates show here.
* detect_seconds: per crash, the first "peer_down" about the victim on any other peer minus the kill
  time: median and max (``num_missing``: crashes no one reported). ``leave_detect_seconds`` likewise
  for graceful leaves, from the SIGINT, counting "notice" events too. ``false_suspicions``: "peer_down"
  events (not from a leave notice) about a peer the bench had neither killed nor signalled by then.
* recover_seconds: per crash, the first s after the kill such that stage-0 goodput over
  [s, s + ``--recover-window``) reaches 90 % of the capacity online over the same window; s minus
  the kill time (0: no dip). Median and max; ``num_missing``: never back before the window closed.
  On a machine whose speed drifts between modes, the absolute 90 % may never be reached:
  ``recover_seconds_vs_pre_crash`` asks instead for 90 % of the goodput ratio of the 20 s before the
  crash (above 1 where peers share cores: there, a thinned swarm's survivors get more CPU each, so
  only this variant sees a stall that the linear capacity hides).

Prints one JSON line per mode: ``{"bench": "churn", "mode", "goodput_ratio", "samples_lost",
"samples_double_counted", "detect_seconds", "recover_seconds", ...}``; the baseline's line carries
``ours_over_baseline`` when ``ours`` ran. Metrics whose events the peers do not write are null.
Logs and events go to a temporary directory, deleted at the end; ``--keep-dir`` keeps them with each
mode's ``run.json`` (window, applied trace, how each peer ended), from which ``--reanalyze DIR``
prints the lines again without starting anything (e.g. with another ``--recover-window``).

``--link RATE_MBIT/ONE_WAY_DELAY_MS`` (e.g. ``20/40``; root) runs every process of a mode (bootstrap,
peers, each rejoiner afresh) on its own host of the emulated internet (:class:`bench.host_pool.HostPool`),
whose access link has that rate both ways and that one-way delay (two peers are 4 x delay apart), rather
than on 127.0.0.1: where a restart from stage 0 pays every hop's transfers again. Lines carry ``"link"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.churn_metrics import (  # noqa: E402
    PeerLife, TraceEvent, capacity_rates, capacity_segments, choose_victim, completions, count_double, count_losses,
    detect_delays, false_suspicions, integrate, make_trace, per_peer_rates, pre_crash_ratios, recover_delays,
    samples_between, spread, stage_counts,
)
from bench.churn_runs import load_run, save_run  # noqa: E402
from bench.host_pool import HostPool, parse_link  # noqa: E402

MODES = ("no_churn", "ours", "baseline")
RECOVERY = {"no_churn": "replay", "ours": "replay", "baseline": "restart"}
STATUS_PERIOD = 1.0
NUM_STAGES = 2  # the default of --stages
POLL_PERIOD = 1.0
LEAVE_KILL_AFTER = 60.0  # a leaving peer still up after this long is killed (its LEAVE_TIMEOUT is 10 s)
RECOVER_THRESHOLD = 0.9
PRE_CRASH_SECONDS = 20.0  # recover_seconds_vs_pre_crash: the goodput ratio of this long before a crash is "normal"


class TrackedPeer:
    """A peer process and an incremental reader of its events file (re-reading whole files each
    second would cost the peers CPU they are being measured on)."""

    def __init__(self, proc) -> None:
        self.proc = proc
        self.events: list[dict] = []
        self.offset = 0
        self.stage: int | None = None  # from its first status line: it trains
        self.gone_at: float | None = None
        self.crashed = self.left = self.drained = False

    @property
    def name(self) -> str:
        return self.proc.name

    def poll(self) -> None:
        try:
            with open(self.proc.metrics_path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n")
        if end < 0:
            return
        for line in data[:end].splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.events.append(event)
            if self.stage is None and event.get("event") == "status":
                self.stage = event.get("stage")
        self.offset += end + 1

    def is_training(self) -> bool:
        return self.gone_at is None and self.stage is not None and self.proc.is_alive()


def supported_recovery_flag() -> bool:
    from peer.config import PeerConfig

    return "recovery" in {f.name for f in dataclasses.fields(PeerConfig)}


def run_mode(mode: str, trace: list[TraceEvent], args: argparse.Namespace, workdir: Path, *, has_recovery: bool) -> dict:
    """Runs one mode's swarm through the window; returns what happened (no metrics yet)."""
    from peer.harness.local_swarm import LocalSwarm

    events = trace if mode != "no_churn" else []
    hosts = None if args.link is None else HostPool(
        parse_link(args.link), num_hosts=1 + args.peers + sum(e.kind == "rejoin" for e in events), seed=args.seed)
    swarm = LocalSwarm(workdir / mode, run_id=f"churn-{mode.replace('_', '-')}")
    try:
        if hosts is not None:
            hosts.start()  # inside the try: a failed start still tears down what it built
        flags = peer_args(RECOVERY[mode] if has_recovery else None, args)
        tracked, start_peer = start_swarm(swarm, args, flags, place=hosts.next_placement if hosts else dict)
        time.sleep(args.warmup)
        window_start = time.time()
        applied = run_trace(events, tracked, start_peer, window_start=window_start)
        watch_until(window_start + args.minutes * 60, tracked)
        window_end = time.time()
        drain_first_stage(tracked, args.drain_timeout)
    except BaseException:
        print(swarm.logs(), file=sys.stderr)
        raise
    finally:
        swarm.shutdown(timeout=30)
        if hosts is not None:
            hosts.shutdown()
    note_drained(tracked)
    return {"window": (window_start, window_end), "peers": tracked, "applied": applied}


def peer_args(recovery: str | None, args: argparse.Namespace) -> list[str]:
    """run_peer.py's arguments in a churn run: one torch thread, no rebalancing (the stage map changes
    only through churn), a status line every second; ``recovery`` None: a peer without the flag."""
    flags = ["--num-threads", "1", "--rebalance-period", "0", "--status-period", str(STATUS_PERIOD)]
    if recovery is not None:
        flags += ["--recovery", recovery]
    return flags + list(args.peer_arg)


def start_swarm(swarm, args: argparse.Namespace, flags: list[str], *,
                place: Callable[[], dict] = dict) -> tuple[list[TrackedPeer], Callable[[], TrackedPeer]]:
    """Starts the bootstrap (``args.stages``, ``args.seed``) and ``args.peers`` peers with ``flags`` on
    ``swarm`` (a :class:`peer.harness.local_swarm.LocalSwarm`) and waits until every peer trains. Returns the
    tracked peers (a list that grows with every later start) and the function that starts one more.
    ``place()``, called once per process started, gives its ``host``/``command_prefix`` (default: none, loopback)."""
    from peer.harness.local_swarm import wait_for

    tracked: list[TrackedPeer] = []

    def start_peer() -> TrackedPeer:
        peer = TrackedPeer(swarm.start_peer(*flags, **place()))
        tracked.append(peer)
        return peer

    def all_training() -> bool:
        for peer in tracked:
            peer.poll()
            if not peer.proc.is_alive():
                raise RuntimeError(f"{peer.name} exited while starting:\n{peer.proc.log_tail()}")
        return all(p.stage is not None for p in tracked)

    swarm.start_bootstrap("--num-stages", str(args.stages), "--seed", str(args.seed), **place())
    for _ in range(args.peers):
        start_peer()
    wait_for(all_training, args.start_timeout, "every peer to train", period=POLL_PERIOD)
    return tracked, start_peer


def run_trace(trace: list[TraceEvent], tracked: list[TrackedPeer], start_peer: Callable[[], TrackedPeer], *,
              window_start: float, exclude: Collection[str] = (), on_poll: Callable[[float], None] | None = None) -> list[dict]:
    """Applies each event of ``trace`` at ``window_start + event.at``, watching the peers in between;
    returns the applied events. ``exclude``: names of peers never chosen as victims; ``on_poll``: see
    :func:`watch_until`."""
    applied = []
    for event in trace:
        watch_until(window_start + event.at, tracked, on_poll=on_poll)
        applied.append({"at": event.at, **apply_event(event, tracked, start_peer, exclude=exclude)})
    return applied


def note_drained(tracked: list[TrackedPeer]) -> None:
    """Reads the last events and marks which leavers exited cleanly, once every peer has stopped."""
    for peer in tracked:
        peer.poll()
        if peer.left:  # killed for hanging (LEAVE_KILL_AFTER) is not a clean drain
            peer.drained = peer.proc.process.returncode == 0


def watch_until(deadline: float, tracked: list[TrackedPeer], *, on_poll: Callable[[float], None] | None = None) -> None:
    """Sleep until ``deadline``, reading events, killing leavers that hang, noting peers that die unasked;
    ``on_poll(now)`` runs after every poll (every ``POLL_PERIOD`` seconds)."""
    while (remaining := deadline - time.time()) > 0:
        time.sleep(min(POLL_PERIOD, remaining))
        now = time.time()
        for peer in tracked:
            peer.poll()
            if peer.gone_at is None and not peer.proc.is_alive():
                peer.gone_at, peer.crashed = now, True  # a crash it was not asked for: "died_unasked"
            elif peer.left and peer.proc.is_alive() and now - peer.gone_at > LEAVE_KILL_AFTER:
                kill_group(peer)
        if on_poll is not None:
            on_poll(now)


def kill_group(peer: TrackedPeer) -> None:
    """SIGKILL of the peer's process group: the peer, its DHT child and its p2pd, without warning."""
    try:
        os.killpg(peer.proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it exited a moment ago
        pass


def apply_event(event: TraceEvent, tracked: list[TrackedPeer], start_peer: Callable[[], TrackedPeer], *,
                exclude: Collection[str] = ()) -> dict:
    """Applies one churn event; a crash or leave never hits a peer named in ``exclude``."""
    if event.kind == "rejoin":
        peer = start_peer()
        return {"t": time.time(), "kind": "rejoin", "peer": peer.name}
    training = [(p.name, p.stage) for p in tracked if p.is_training()]
    name = choose_victim(event.pick, training, exclude=exclude)
    if name is None:
        outside = f" outside {sorted(exclude)}" if exclude else ""
        return {"t": time.time(), "kind": event.kind, "skipped": f"no stage has two training peers{outside}: {training}"}
    peer = next(p for p in tracked if p.name == name)
    peer.gone_at = time.time()
    if event.kind == "crash":
        kill_group(peer)
        peer.crashed = True
    else:
        peer.proc.process.send_signal(signal.SIGINT)  # a graceful leave
        peer.left = True
    return {"t": peer.gone_at, "kind": event.kind, "peer": name, "stage": peer.stage}


def drain_first_stage(tracked: list[TrackedPeer], timeout: float) -> list[TrackedPeer]:
    """SIGINT to the stage-0 peers still up; each drains its in-flight microbatches and exits. Returns
    the peers signalled."""
    first = [p for p in tracked if p.gone_at is None and p.proc.is_alive() and p.stage == 0]
    for peer in first:
        peer.proc.process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + timeout
    for peer in first:
        try:
            peer.drained = peer.proc.process.wait(max(0.1, deadline - time.monotonic())) == 0
        except subprocess.TimeoutExpired:
            peer.drained = False
    return first


# ---- metrics ---------------------------------------------------------------------------------

def lives_of(run: dict) -> list[PeerLife]:
    lives = []
    for peer in run["peers"]:
        life = PeerLife(peer.name, peer.events, gone_at=peer.gone_at, crashed=peer.crashed, drained=peer.drained)
        life.mark_training(STATUS_PERIOD)
        lives.append(life)
    return lives


def reference_of(run: dict) -> dict:
    """The no_churn run's goodput and per-peer rate of each stage, for the other modes' capacity."""
    start, end = run["window"]
    lives = lives_of(run)
    goodput = samples_between(completions(lives), start, end) / (end - start)
    return {"goodput": goodput, "rates": per_peer_rates(goodput, stage_counts(lives, start, end, num_stages(run)))}


def num_stages(run: dict) -> int:
    return int(run.get("settings", {}).get("stages", NUM_STAGES))  # runs kept before --stages had 2


def summarize(mode: str, run: dict, args: argparse.Namespace, *, reference: dict | None, recovery: str) -> dict:
    """The mode's JSON line. ``reference``: the no_churn run's goodput and per-peer rates, if it ran."""
    start, end = run["window"]
    lives = lives_of(run)
    counts = stage_counts(lives, start, end, num_stages(run))
    done = completions(lives)
    goodput = samples_between(done, start, end) / (end - start)
    first_event = min([e["at"] for e in run["applied"]] or [end - start])
    pre_churn = samples_between(done, start, start + first_event) / first_event
    rates, source = capacity_rates(mode, lives=lives, reference=reference, pre_churn=pre_churn, start=start,
                                   first_event=first_event, num_stages=num_stages(run))
    capacity = capacity_segments(counts, rates)
    capacity_mean = integrate(capacity, start, end) / (end - start)
    crashes = [(e["t"], next(life.peer_id for life in lives if life.name == e["peer"]))
               for e in run["applied"] if e["kind"] == "crash" and "peer" in e]
    leaves = [(e["t"], next(life.peer_id for life in lives if life.name == e["peer"]))
              for e in run["applied"] if e["kind"] == "leave" and "peer" in e]
    crash_times = [t for t, _ in crashes]
    suspicions = false_suspicions(lives)
    losses = count_losses(lives)
    kinds = Counter(e["kind"] for e in run["applied"] if "skipped" not in e)
    alive_at_end = [life for life in lives if life.gone_at is None]
    return {
        "bench": "churn", "mode": mode,
        "goodput_ratio": round(goodput / capacity_mean, 3) if capacity_mean > 0 else None,
        "samples_lost": losses.lost if losses else None,
        "samples_double_counted": count_double(lives),
        "detect_seconds": spread(detect_delays(crashes, lives)),
        "recover_seconds": spread(recover_delays(crash_times, done, capacity, window=args.recover_window,
                                                 threshold=RECOVER_THRESHOLD, end=end)),
        "recover_seconds_vs_pre_crash": spread(recover_delays(
            crash_times, done, capacity, window=args.recover_window, threshold=RECOVER_THRESHOLD, end=end,
            scales=pre_crash_ratios(crash_times, done, capacity, before=PRE_CRASH_SECONDS, start=start))),
        "goodput_samples_per_s": round(goodput, 2),
        "capacity_samples_per_s": round(capacity_mean, 2),
        "capacity_source": source,
        "per_peer_rates": [round(r, 2) for r in rates],
        "goodput_vs_no_churn": round(goodput / reference["goodput"], 3) if reference else None,
        "pre_churn_samples_per_s": round(pre_churn, 2),
        "samples_lost_at_crashed_peers": losses.lost_at_crashed_peers if losses else None,
        "samples_unfinished_at_stop": losses.unfinished if losses else None,
        "samples_pending_at_stop": losses.pending_at_stop if losses else None,
        "samples_double_counted_live": count_double(lives, include_crashed=False),
        "num_injected": losses.num_injected if losses else None,
        "num_replayed": losses.num_replayed if losses else None,
        "false_suspicions": len(suspicions),
        "false_suspicions_by_how": dict(Counter(f["how"] for f in suspicions)),
        "leave_detect_seconds": spread(detect_delays(leaves, lives, kinds=("peer_down", "notice"))),
        "events": dict(kinds), "num_skipped": sum("skipped" in e for e in run["applied"]),
        "died_unasked": [life.name for life in lives if life.crashed and not any(
            e.get("peer") == life.name and e["kind"] == "crash" for e in run["applied"])],
        "peers": args.peers, "stages": num_stages(run),
        "peers_per_stage_at_end": [sum(1 for life in alive_at_end if life.stage == k) for k in range(num_stages(run))],
        "minutes": round((end - start) / 60, 2), "event_period": args.event_period, "seed": args.seed,
        "recovery": recovery, "link": getattr(args, "link", None),  # runs kept before --link were on loopback
        "trace": [trace_entry(e, lives) for e in run["applied"]],
    }


def trace_entry(applied: dict, lives: list[PeerLife]) -> dict:
    """One applied event for the JSON line: seconds into the window, kind, peer and its stage (a
    rejoiner's as it negotiated; null if it never trained)."""
    entry = {"at": applied["at"], "kind": applied["kind"]}
    if "skipped" in applied:
        return {**entry, "skipped": True}
    stage = next((life.stage for life in lives if life.name == applied["peer"]), None)
    return {**entry, "peer": applied["peer"], "stage": stage}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="measured window per mode, minutes (default 10)")
    parser.add_argument("--event-period", type=float, default=30.0, help="seconds between churn events (default 30)")
    parser.add_argument("--peers", type=int, default=6, help="peers at the start (default 6: 3 + 3)")
    parser.add_argument("--stages", type=int, default=NUM_STAGES, help="pipeline stages (default 2; 3 puts crashes "
                        "in a middle stage, where a re-send at the hop and a restart from stage 0 differ most)")
    parser.add_argument("--min-peers", type=int, default=4, help="the trace keeps at least this many peers (default 4)")
    parser.add_argument("--max-peers", type=int, default=7, help="and at most this many (default 7)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the churn trace and of the run (default 0)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, among no_churn,ours,baseline, run in that order (default all three)")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds of training before the window (default 20)")
    parser.add_argument("--recover-window", type=float, default=5.0, help="sliding window of recover_seconds (default 5)")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds for every peer to train (default 300)")
    parser.add_argument("--drain-timeout", type=float, default=60.0, help="seconds for stage-0 peers to drain at the end")
    parser.add_argument("--peer-arg", action="append", default=[], help="extra run_peer.py argument (repeat, e.g. "
                        "--peer-arg=--max-in-flight --peer-arg=8)")
    parser.add_argument("--link", default=None, metavar="RATE_MBIT/ONE_WAY_DELAY_MS", help="run every process on "
                        "its own host of the emulated internet with this access link, e.g. 20/40 (root; default: loopback)")
    parser.add_argument("--keep-dir", type=Path, default=None, help="keep logs, events files and each mode's "
                        "run.json here")
    parser.add_argument("--reanalyze", type=Path, default=None, help="start nothing: print the lines again from "
                        "a --keep-dir of an earlier run")
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes must name some of {', '.join(MODES)}")
    if not (args.minutes > 0 and args.event_period > 0 and args.recover_window > 0):
        parser.error("--minutes, --event-period and --recover-window must be positive")
    if args.link is not None:
        try:
            parse_link(args.link)
        except ValueError as e:
            parser.error(f"--link: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reanalyze is not None:
        return reanalyze(args)
    try:
        trace = make_trace(args.seed, duration=args.minutes * 60, period=args.event_period, num_peers=args.peers,
                           min_peers=args.min_peers, max_peers=args.max_peers)
    except ValueError as e:
        print(f"bench/churn.py: {e}", file=sys.stderr)
        return 2
    has_recovery = supported_recovery_flag()
    if not has_recovery:
        print("run_peer.py has no --recovery flag: every mode runs the peer's one recovery", file=sys.stderr)
    lines: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-churn-") as tmp:
        workdir = args.keep_dir or Path(tmp)
        for mode in sorted(args.modes, key=MODES.index):  # no_churn first: the others' capacity comes from it
            run = run_mode(mode, trace, args, workdir, has_recovery=has_recovery)
            run["settings"] = {"peers": args.peers, "stages": args.stages, "event_period": args.event_period, "seed": args.seed,
                               "recovery": RECOVERY[mode] if has_recovery else "unsupported", "link": args.link}
            if args.keep_dir is not None:
                save_run(run, workdir / mode / "run.json")
            report(mode, run, args, lines)
    return 0


def report(mode: str, run: dict, args: argparse.Namespace, lines: dict[str, dict]) -> None:
    """Prints the mode's line; ``lines`` holds the lines printed before (no_churn's gives the capacity)."""
    settings = argparse.Namespace(recover_window=args.recover_window, **{k: v for k, v in run["settings"].items()
                                                                          if k != "recovery"})
    reference = lines["no_churn"]["_reference"] if "no_churn" in lines else None
    line = summarize(mode, run, settings, reference=reference, recovery=run["settings"]["recovery"])
    baseline, ours = line, lines.get("ours")
    if mode == "baseline" and ours is not None and baseline["goodput_samples_per_s"] > 0:
        line["ours_over_baseline"] = {
            "goodput": round(ours["goodput_samples_per_s"] / baseline["goodput_samples_per_s"], 3),
            "goodput_ratio": round(ours["goodput_ratio"] / baseline["goodput_ratio"], 3)
            if ours["goodput_ratio"] and baseline["goodput_ratio"] else None}
    print(json.dumps(line), flush=True)
    lines[mode] = {**line, "_reference": reference_of(run) if mode == "no_churn" else None}


def reanalyze(args: argparse.Namespace) -> int:
    """The lines again from a --keep-dir of an earlier run (e.g. with another --recover-window)."""
    lines: dict[str, dict] = {}
    for mode in MODES:
        path = args.reanalyze / mode / "run.json"
        if path.exists():
            report(mode, load_run(path), args, lines)
    if not lines:
        print(f"bench/churn.py: no <mode>/run.json under {args.reanalyze}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
