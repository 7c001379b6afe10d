"""Soak: a swarm under steady churn for half an hour; nothing may crash, leak, lose samples or grow (issue 7).

    python bench/soak.py [--minutes 30] [--peers 8] [--event-period 30] [--stages 2] [--seed 0] [--keep-dir DIR]

The run is bench/churn.py's ``ours`` mode, longer, with process-level checks; it reuses churn.py's
start, trace and drain (:func:`bench.churn.start_swarm`, :func:`bench.churn.run_trace`,
:func:`bench.churn.drain_first_stage`) and its metrics (:mod:`bench.churn_metrics`):

1. starts run_bootstrap.py (``--stages``) and ``--peers`` run_peer.py processes on 127.0.0.1
   (``--num-threads 1 --rebalance-period 0 --status-period 1 --recovery replay``), waits until every
   peer trains, then watches ``--warmup`` seconds;
2. chooses ``--protected`` initial peers (default 3) that no event may hit: the first peer of each
   stage, then the next in start order (:func:`bench.soak_metrics.choose_protected`). A crash or
   leave draws its victim, as in churn.py, among the other training peers, initial or rejoined, whose
   stage keeps another training peer. So at least ``--protected`` initial peers live through the
   whole window, one in every stage, and RSS growth always has peers to be measured on;
3. applies the seeded churn trace over ``--minutes``: every ``--event-period`` seconds a crash
   (``killpg`` SIGKILL of the peer's process group), a graceful leave (SIGINT) or a rejoin (a new
   run_peer.py), keeping between ``--min-peers`` and ``--max-peers`` peers planned;
4. stops everything as a user would: SIGINT to the stage-0 peers (they drain their in-flight
   microbatches), then to every other peer, then to the bootstrap; a process still up after
   ``--drain-timeout`` is hung (``hung_at_stop``) and its group is killed. Then it looks for leftovers.

Measurements (one JSON line; ``--keep-dir`` also keeps the logs, events files and ``soak.json`` with
every RSS sample):

* ``events``: crashes, leaves and rejoins applied (``num_skipped``: events with no eligible victim).
* ``survivor_crashes``: peers the bench neither killed nor signalled that exited (any exit code) or
  died, from the moment every peer trained to the end of the window, rejoiners included
  (``crashed_unasked`` names them; ``bootstrap_exited`` says the same of the bootstrap).
  ``unclean_stops`` names the peers that exited non-zero after the final SIGINT, ``unclean_leaves``
  those that did so after a leave of the trace (or were killed after hanging for 60 s).
* ``samples_lost``: as in churn.py (:func:`bench.churn_metrics.count_losses`): samples injected by a
  stage-0 peer that exited cleanly, never finished and not reported unfinished. Crashed data owners'
  in-flight samples are ``samples_lost_at_crashed_peers`` (no scheme recovers those).
* ``rss_growth``: every ~``--rss-period`` seconds the bench reads VmRSS (/proc/<pid>/status) of each
  peer process and of each of its descendants (the hivemind DHT process it forks and that process's
  p2pd), found through the parent chain in /proc. For each survivor, i.e. every initial peer still
  up at the end of the window (the ``--protected`` ones plus the initial peers the trace never hit), the
  growth is (median tree RSS over the last 10 % of the window) / (median over the first 10 %) - 1;
  the line gives the max over survivors and ``rss_growth_per_peer`` (with the growth of the peer,
  p2pd and other children apart, and MiB). VmRSS counts a page shared by the peer and its fork once
  in each, which inflates both medians alike; a growth is not an absolute footprint.
  **Why the warm-up is excluded.** A peer's memory climbs in its first minute for one-off reasons:
  the first optimizer step allocates AdamW's two moment buffers, torch and glibc grow their
  allocator caches and per-thread arenas to the working set, lazy imports load, the DHT routing
  table and p2pd's peer store fill as the swarm forms, and the state download leaves buffers behind.
  Measured from a peer's start, that step would read as a leak of tens of percent in any window
  length; measured from after ``--warmup`` (default 60 s of training, plus the first 10 % of the
  window as the baseline), what remains is what grows with time and churn: queues, ledgers, caches
  of departed peers, connections. The bootstrap's growth is given apart (``rss_growth_bootstrap``).
* ``leaked_processes``: after the stop and a grace of ``--leak-grace`` seconds, processes still alive
  that the bench started or that descend from them: by the parent chain, by the session or process
  group a spawned process led (every peer starts in its own; its DHT child and p2pd inherit both, so
  an orphan re-parented to init is still found), as a descendant seen in an RSS sample (torch's
  ``torch_shm_manager``, which a peer starts, leads a session of its own: after a crash neither the
  chain nor the peer's session leads to it), or p2pd/python processes whose command line mentions
  the workdir; only processes started after the bench, never the bench or its ancestors
  (:func:`bench.proc_table.find_leftovers`). A descendant that lived less than ``--rss-period`` and
  left its session may be missed. ``leaked_sockets``: listening TCP sockets
  (/proc/net/tcp and tcp6, state LISTEN) held open by those processes, matched by socket inode
  through /proc/<pid>/fd, counted once each. The bench then SIGKILLs each leftover by PID (checking
  its start time, so a reused PID is left alone); it signals nothing else.
* ``stale_socket_files``: the unix socket files (/tmp/hivemind-p2pd-*.sock, -p2pclient-*.sock) of
  the p2pd processes seen during the run that still exist after the stop, for peers that were not
  killed (a killed p2pd cannot remove its files; ``stale_socket_files_of_killed`` counts those). A
  peer killed within ``--rss-period`` of its start may be missed (its p2pd was never sampled).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.churn import (
    POLL_PERIOD,
    TrackedPeer,
    drain_first_stage,
    kill_group,
    lives_of,
    note_drained,
    peer_args,
    run_trace,
    start_swarm,
    supported_recovery_flag,
    watch_until,
)
from bench.churn_metrics import count_double, count_losses, make_trace
from bench.proc_table import (
    ProcStat,
    Spawned,
    ancestors,
    descendants,
    find_leftovers,
    kill_leftovers,
    listening_sockets,
    process_table,
    read_cmdline,
    read_rss_kib,
    read_stat,
)
from bench.soak_metrics import RssSample, choose_protected, max_growth, peer_growth

RSS_FRACTION = 0.1  # the first and last 10 % of the window are compared
UNIX_PREFIX = "/unix"  # p2pd's -listen=/unix/tmp/hivemind-p2pd-<uid>.sock


class Monitor:
    """What the bench learns about its processes while they run: each spawned process's identity
    (PID and start time, for the leftover search), RSS samples of each peer's process tree, and the
    socket files of each peer's p2pd."""

    def __init__(self, swarm, tracked: list[TrackedPeer], *, rss_period: float) -> None:
        self.swarm, self.tracked, self.rss_period = swarm, tracked, rss_period
        self.spawned: dict[int, Spawned] = {}
        self.seen: dict[tuple[int, int], ProcStat] = {}  # every descendant sampled, by (PID, start time)
        self.samples: dict[str, list[RssSample]] = {}
        self.socket_files: dict[str, set[str]] = {}
        self.last_sample = -float("inf")

    def on_poll(self, now: float) -> None:
        """Runs every poll (1 s): notes new processes; samples RSS every ``rss_period``."""
        self.note_spawned()
        if now - self.last_sample >= self.rss_period:
            self.sample(now)

    def note_spawned(self) -> None:
        for proc in self.swarm.all_processes():
            if proc.pid not in self.spawned:
                stat = read_stat(proc.pid)  # a process already gone keeps start time -1: matches no live one
                self.spawned[proc.pid] = Spawned(proc.pid, stat.start_ticks if stat else -1)

    def sample(self, now: float) -> None:
        self.note_spawned()
        self.last_sample = now
        table = process_table()
        roots = [(p.name, p.proc) for p in self.tracked]
        if self.swarm.bootstrap is not None:
            roots.append(("bootstrap", self.swarm.bootstrap))
        for name, proc in roots:
            if proc.is_alive() and proc.pid in table:
                by_kind = self.tree_rss(proc.pid, table, name)
                if by_kind:
                    self.samples.setdefault(name, []).append((now, by_kind))

    def tree_rss(self, root: int, table: dict[int, ProcStat], name: str) -> dict[str, int]:
        by_kind = Counter()
        for pid in [root, *descendants(root, table)]:
            rss = read_rss_kib(pid)
            if rss is None:
                continue
            self.seen.setdefault((pid, table[pid].start_ticks), table[pid])
            kind = "peer" if pid == root else "p2pd" if table[pid].comm == "p2pd" else "children"
            by_kind[kind] += rss
            if kind == "p2pd":
                self.socket_files.setdefault(name, set()).update(p2pd_socket_files(read_cmdline(pid)))
        return dict(by_kind)


def p2pd_socket_files(cmdline: list[str]) -> set[str]:
    """The unix socket files of a p2pd: its ``-listen`` socket and the matching p2pclient socket
    (hivemind names both with one uid and removes both on a clean shutdown)."""
    files = set()
    for arg in cmdline:
        if arg.startswith("-listen=" + UNIX_PREFIX):
            path = arg[len("-listen=" + UNIX_PREFIX):]
            files |= {path, path.replace("hivemind-p2pd-", "hivemind-p2pclient-")}
    return files


def run_soak(trace, args: argparse.Namespace, workdir: Path) -> dict:
    """Runs the swarm through warm-up, window and stop; returns what happened (no metrics yet)."""
    from peer.harness.local_swarm import LocalSwarm

    since_ticks = read_stat(os.getpid()).start_ticks
    swarm = LocalSwarm(workdir, run_id="soak")
    try:
        tracked, start_peer = start_swarm(swarm, args, peer_args("replay" if supported_recovery_flag() else None, args))
        monitor = Monitor(swarm, tracked, rss_period=args.rss_period)  # `tracked` grows with every rejoin
        protected = choose_protected([(p.name, p.stage) for p in tracked], args.protected)
        monitor.sample(time.time())
        watch_until(time.time() + args.warmup, tracked, on_poll=monitor.on_poll)
        window_start = time.time()
        monitor.sample(window_start)
        applied = run_trace(trace, tracked, start_peer, window_start=window_start, exclude=protected,
                            on_poll=monitor.on_poll)
        watch_until(window_start + args.minutes * 60, tracked, on_poll=monitor.on_poll)
        window_end = time.time()
        monitor.sample(window_end)
        stop = stop_everything(swarm, tracked, args)
        leftovers = look_for_leftovers(monitor, workdir, since_ticks=since_ticks, grace=args.leak_grace)
    except BaseException:
        print(swarm.logs(), file=sys.stderr)
        raise
    finally:
        swarm.shutdown(timeout=30)  # closes the logs; kills any group still up (after an error)
    note_drained(tracked)
    return {"window": (window_start, window_end), "peers": tracked, "applied": applied, "protected": protected,
            "stop": stop, "leftovers": leftovers, "samples": monitor.samples,
            "socket_files": {name: sorted(files) for name, files in monitor.socket_files.items()},
            "bootstrap_exited": stop["bootstrap_exited"]}


def stop_everything(swarm, tracked: list[TrackedPeer], args: argparse.Namespace) -> dict:
    """SIGINT to stage 0 (draining), then to every other peer, then to the bootstrap; kills the group
    of whatever is still up after ``--drain-timeout``. Returns who hung and who exited non-zero."""
    bootstrap_exited = swarm.bootstrap is not None and not swarm.bootstrap.is_alive()
    signalled = drain_first_stage(tracked, args.drain_timeout)
    rest = [p for p in tracked if p.proc.is_alive() and p not in signalled]
    for peer in rest:
        peer.proc.process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + args.drain_timeout
    hung = []
    for peer in [p for p in signalled if p.proc.is_alive()] + rest:
        try:
            peer.proc.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.append(peer.name)
            kill_group(peer)
            peer.proc.process.wait(10)
    stopped = signalled + rest
    unclean = [p.name for p in stopped if p.name not in hung and p.proc.process.returncode != 0]
    if swarm.bootstrap is not None and swarm.bootstrap.is_alive():
        code = swarm.stop(swarm.bootstrap, timeout=args.drain_timeout)  # SIGINT; its group is killed if it hangs
        if code != 0:
            unclean.append("bootstrap")
    return {"hung_at_stop": hung, "unclean_stops": unclean, "bootstrap_exited": bootstrap_exited,
            "num_stopped": len(stopped)}


def look_for_leftovers(monitor: Monitor, workdir: Path, *, since_ticks: int, grace: float) -> dict:
    """Processes of the bench still alive ``grace`` seconds after the stop (or as soon as none is),
    with the TCP sockets they listen on; then SIGKILLs them by PID."""
    own = {os.getpid(), *ancestors(os.getpid(), process_table())}
    roots = list(monitor.spawned.values())
    deadline = time.monotonic() + grace
    while True:
        found = find_leftovers(roots, seen=list(monitor.seen.values()), workdir=workdir, since_ticks=since_ticks,
                               exclude=own)
        if not found or time.monotonic() >= deadline:
            break
        time.sleep(POLL_PERIOD)
    sockets = listening_sockets(s.pid for s in found)
    described = [{"pid": s.pid, "comm": s.comm, "ppid": s.ppid, "sid": s.sid,
                  "cmdline": " ".join(read_cmdline(s.pid))[:200]} for s in found]
    return {"processes": described,
            "listening": {str(pid): sorted(held.values()) for pid, held in sockets.items()},
            "num_sockets": len({inode for held in sockets.values() for inode in held}),
            "killed": kill_leftovers(found)}


# ---- the line ----------------------------------------------------------------------------------------

def summarize(run: dict, args: argparse.Namespace) -> dict:
    start, end = run["window"]
    peers = run["peers"]
    lives = lives_of(run)
    losses = count_losses(lives)
    killed = {e["peer"] for e in run["applied"] if e["kind"] == "crash" and "peer" in e}
    crashed_unasked = [p.name for p in peers if p.crashed and p.name not in killed]
    survivors = [p.name for p in peers[:args.peers] if p.gone_at is None]
    per_peer = {name: peer_growth(run["samples"].get(name, []), start=start, end=end, fraction=RSS_FRACTION)
                for name in survivors}
    bootstrap = peer_growth(run["samples"].get("bootstrap", []), start=start, end=end, fraction=RSS_FRACTION)
    gone = {p.name for p in peers if p.crashed or p.name in run["stop"]["hung_at_stop"]}
    stale = {name: [f for f in files if Path(f).exists()] for name, files in run["socket_files"].items()}
    return {
        "bench": "soak", "minutes": round((end - start) / 60, 2), "peers": args.peers,
        "events": dict(Counter(e["kind"] for e in run["applied"] if "skipped" not in e)),
        "survivor_crashes": len(crashed_unasked) + int(run["bootstrap_exited"]),
        "samples_lost": losses.lost if losses else None,
        "rss_growth": max_growth(per_peer),
        "leaked_processes": len(run["leftovers"]["processes"]),
        "leaked_sockets": run["leftovers"]["num_sockets"],
        "stale_socket_files": sum(len(f) for name, f in stale.items() if name not in gone),
        "stale_socket_files_of_killed": sum(len(f) for name, f in stale.items() if name in gone),
        "rss_growth_per_peer": per_peer,
        "rss_growth_bootstrap": bootstrap,
        "survivors": survivors, "protected": run["protected"],
        "crashed_unasked": crashed_unasked, "bootstrap_exited": run["bootstrap_exited"],
        "hung_at_stop": run["stop"]["hung_at_stop"], "unclean_stops": run["stop"]["unclean_stops"],
        "unclean_leaves": [p.name for p in peers if p.left and not p.drained],
        "leftovers": run["leftovers"]["processes"], "leftover_listening_ports": run["leftovers"]["listening"],
        "num_skipped": sum("skipped" in e for e in run["applied"]),
        "samples_lost_at_crashed_peers": losses.lost_at_crashed_peers if losses else None,
        "samples_unfinished_at_stop": losses.unfinished if losses else None,
        "samples_pending_at_stop": losses.pending_at_stop if losses else None,
        "samples_double_counted": count_double(lives),
        "num_injected": losses.num_injected if losses else None,
        "peers_started": len(peers), "stages": args.stages, "event_period": args.event_period, "seed": args.seed,
        "warmup_s": args.warmup, "rss_period_s": args.rss_period,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="measured window, minutes (default 30)")
    parser.add_argument("--peers", type=int, default=8, help="peers at the start (default 8)")
    parser.add_argument("--event-period", type=float, default=30.0, help="seconds between churn events (default 30)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    parser.add_argument("--protected", type=int, default=3, help="initial peers no event may hit (default 3: the "
                        "first of each stage, then the next started)")
    parser.add_argument("--min-peers", type=int, default=None, help="the trace keeps at least this many peers "
                        "(default --peers minus 2)")
    parser.add_argument("--max-peers", type=int, default=None, help="and at most this many (default --peers plus 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the churn trace and of the run (default 0)")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of training before the window; RSS "
                        "growth is measured from its end (default 60)")
    parser.add_argument("--rss-period", type=float, default=10.0, help="seconds between RSS samples (default 10)")
    parser.add_argument("--leak-grace", type=float, default=10.0, help="seconds after the stop before a process "
                        "still up counts as leaked (default 10)")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds for every peer to train (default 300)")
    parser.add_argument("--drain-timeout", type=float, default=60.0, help="seconds for peers to exit after SIGINT "
                        "at the end (default 60)")
    parser.add_argument("--peer-arg", action="append", default=[], help="extra run_peer.py argument (repeat)")
    parser.add_argument("--keep-dir", type=Path, default=None, help="keep logs, events files and soak.json here")
    args = parser.parse_args(argv)
    args.min_peers = args.peers - 2 if args.min_peers is None else args.min_peers
    args.max_peers = args.peers + 1 if args.max_peers is None else args.max_peers
    if not (args.minutes > 0 and args.event_period > 0 and args.rss_period > 0 and args.warmup >= 0):
        parser.error("--minutes, --event-period and --rss-period must be positive, --warmup not negative")
    if not 0 <= args.protected < args.min_peers:
        parser.error(f"--protected ({args.protected}) must be below --min-peers ({args.min_peers}), "
                     "or no peer is left to churn")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        trace = make_trace(args.seed, duration=args.minutes * 60, period=args.event_period, num_peers=args.peers,
                           min_peers=args.min_peers, max_peers=args.max_peers)
    except ValueError as e:
        print(f"bench/soak.py: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        workdir = (args.keep_dir or Path(tmp)).resolve()
        run = run_soak(trace, args, workdir)
        line = summarize(run, args)
        if args.keep_dir is not None:
            (workdir / "soak.json").write_text(json.dumps({
                "line": line, "window": run["window"], "applied": run["applied"], "stop": run["stop"],
                "leftovers": run["leftovers"], "samples": run["samples"], "socket_files": run["socket_files"]}))
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
