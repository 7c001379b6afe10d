"""A 2 × 2 swarm on emulated home links, beside the same swarm on loopback, in one invocation.

    python bench/wan.py [--seconds 60] [--settings loopback namespaces 100/10 50/25 20/40] [--nat]
                        [--late-joiner] [--link-check] [--bootstrap-args '...'] [--peer-args '...']
                        [--no-idle-restart]

Needs root (peer/harness/internet.py). Every setting runs the same swarm: ``run_bootstrap.py``
(default model, 2 stages) and four ``run_peer.py`` with stages pinned 0, 1, 0, 1 and one torch
thread each. ``loopback`` runs it on 127.0.0.1 (the reference; ``rate_mbit`` null); every other
setting gives each process a host of its own on the emulated internet:

- ``namespaces``: unshaped links with no delay (the cost of the namespaces and the delay line alone);
- ``R/D``: every access link R Mbit/s both ways and D ms one way, so a peer-to-peer round trip is
  4·D ms (D each way on both ends' links).

``--nat`` runs every shaped setting a second time with one stage-0 and one stage-1 peer behind
port-restricted home NATs (``"nat": true``). ``--late-joiner`` starts a fifth peer (``--stage 1``)
after the measured window and reports how long its state download took. ``--link-check`` first
prints a ``wan_link`` line: a 100 Mbit/s + 10 ms link's round trip idle and its goodput with how
late the delay line wrote the packets of that transfer (what the emulation adds to the delay).

Each setting: the swarm starts, trains for a warm-up, then is measured over ``--seconds``: stage-0
tokens/s (from the peers' metrics), the last stage's mean loss over the window's last 20
microbatches, the CPU busy fraction of the whole machine (/proc/stat), each peer's uplink use
(bytes its link sent ÷ rate × time), averaging rounds that succeeded and failed; over the swarm's
whole life, peers declared down (all of them lived: every one is false) and log lines with a traceback.

Where the time and the CPU go (issue #16): ``cpu_ms_per_microbatch`` splits the window's CPU time
per microbatch (utime + stime from /proc/<pid>/stat) into the peers' own Python processes, their
``p2pd`` daemons, their other children (hivemind's DHT and averager processes), the bootstrap's
tree, the delay line, and the whole machine (the rest of ``machine`` is the kernel: namespaces,
``tc``, TCP). From the peers' events: the median stage-0 microbatch round trip and the flow window it
was sent under (``window_mean``, ``window_max``, ``window_changes``), microbatches replayed, and under
``flush`` a batch's microbatches (``batch_pipeline_s``) against its step (``batch_close_s``) and each
stage's gradient exchange with its co-replica (``exchange_s``, stage 0 then 1). ``--no-idle-restart``
turns off TCP's slow start after idle on the emulated hosts, to see what it costs a step whose
bursts follow idle gaps (``"tcp_slow_start_after_idle": false``). One JSON line per setting:
``{"bench": "wan", "setting", "rate_mbit", "delay_ms", "nat", "tokens_per_s", "loopback_tokens_per_s",
"ratio_to_loopback", "cpu_busy", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.proc_table import descendants, process_table  # noqa: E402
from peer.harness.internet import Host, Internet, Link  # noqa: E402
from peer.harness.local_swarm import REPO_ROOT, LocalSwarm, wait_for  # noqa: E402

WARMUP_SECONDS = 15.0
STAGES = (0, 1, 0, 1)
NATTED = (0, 3)  # with --nat: one stage-0 and one stage-1 peer behind home NATs
PEER_ARGS = ("--num-threads", "1")
BOOTSTRAP_ARGS = ("--num-stages", "2")
PROBE = (sys.executable, str(REPO_ROOT / "peer" / "harness" / "link_probe.py"))


def parse_setting(name: str) -> Link | None:
    if name == "loopback":
        return None
    if name == "namespaces":
        return Link()
    rate, delay = name.split("/")
    return Link(rate_mbit=float(rate), delay_ms=float(delay))


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def cpu_ticks(pid: int, *, thread: int | None = None) -> int:
    """utime + stime of process ``pid`` (or only of its thread ``thread``) in clock ticks (0 once gone)."""
    path = Path(f"/proc/{pid}/stat") if thread is None else Path(f"/proc/{pid}/task/{thread}/stat")
    try:
        fields = path.read_text().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return int(fields[11]) + int(fields[12])


def process_kinds(peers: list, bootstrap) -> dict[str, list[int]]:
    """The swarm's processes by kind: each peer's own Python process, the p2pd daemons and the other
    children (hivemind's DHT and averager processes) of the peers, the bootstrap's tree, the delay line.
    ``peer_loop`` is the main thread of each peer (its event loop: handlers, serialization, routing)."""
    table = process_table()
    kinds: dict[str, list[int]] = {"peer": [], "peer_loop": [], "p2pd": [], "peer_children": [], "bootstrap": [],
                                   "delay_line": []}
    for peer in peers:
        kinds["peer"].append(peer.pid)
        kinds["peer_loop"].append(-peer.pid)  # negative: the main thread alone
        for pid in descendants(peer.pid, table):
            kinds["p2pd" if table[pid].comm == "p2pd" else "peer_children"].append(pid)
    kinds["bootstrap"] = [bootstrap.pid, *descendants(bootstrap.pid, table)]
    ours = set(descendants(os.getpid(), table))  # (not another run's delay line)
    kinds["delay_line"] = [pid for pid in ours if table[pid].comm.startswith("delay_line")]  # delay_line-<hash>
    return kinds


def cpu_by_kind(kinds: dict[str, list[int]]) -> dict[str, int]:
    return {kind: sum(cpu_ticks(pid) if pid > 0 else cpu_ticks(-pid, thread=-pid) for pid in pids)
            for kind, pids in kinds.items()}


def build_internet(name: str, link: Link, *, nat: bool, num_peers: int,
                   idle_restart: bool = True) -> tuple[Internet, Host, list[Host]]:
    """``idle_restart=False`` turns off TCP's slow start after idle (``net.ipv4.tcp_slow_start_after_idle``,
    per namespace) on every host: a connection idle for a retransmission timeout then keeps its
    congestion window instead of starting again from 10 segments (an experiment, not the default)."""
    internet = Internet(seed=len(name))
    server = internet.add_host("bootstrap", link)
    hosts = [internet.add_host(f"peer{i}", link, nat="port-restricted" if nat and i in NATTED else None)
             for i in range(num_peers)]
    internet.start()
    if not idle_restart:
        for host in (server, *hosts):
            host.run("sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0")
    return internet, server, hosts


def run_setting(name: str, link: Link | None, *, nat: bool, seconds: float, workdir: Path, late_joiner: bool,
                bootstrap_args: tuple[str, ...] = (), peer_args: tuple[str, ...] = (), idle_restart: bool = True) -> dict:
    internet, server, hosts = (None, None, []) if link is None else build_internet(
        name, link, nat=nat, num_peers=len(STAGES) + late_joiner, idle_restart=idle_restart)

    def where(i: int | None) -> dict:
        host = server if i is None else hosts[i] if hosts else None
        return {} if host is None else {"host": host.address, "command_prefix": host.command_prefix}

    swarm = LocalSwarm(workdir)
    try:
        swarm.start_bootstrap(*BOOTSTRAP_ARGS, *bootstrap_args, **where(None))
        peers = [swarm.start_peer("--stage", str(stage), *PEER_ARGS, *peer_args, **where(i)) for i, stage in enumerate(STAGES)]
        wait_for(lambda: all(p.events("status") or not p.is_alive() for p in peers), 240, "four peers to train")
        time.sleep(WARMUP_SECONDS)
        bytes_before = [internet.link_bytes(h) for h in hosts[:len(STAGES)]] if internet else []
        kinds = process_kinds(peers, swarm.bootstrap)
        cpu_before, kinds_before, start = cpu_times(), cpu_by_kind(kinds), time.time()
        time.sleep(seconds)
        cpu_after, kinds_after, end = cpu_times(), cpu_by_kind(kinds), time.time()
        uplink = [(after[0] - before[0]) * 8 / (link.upload_mbit * 1e6 * (end - start)) for before, after in
                  zip(bytes_before, [internet.link_bytes(h) for h in hosts[:len(STAGES)]])] if internet and link.upload_mbit else []
        download = None
        if late_joiner:
            late = swarm.start_peer("--stage", "1", *PEER_ARGS, **where(len(STAGES)))
            wait_for(lambda: late.events("state_download") or not late.is_alive(), 180, "the late joiner's download")
            download = (late.events("state_download") or [{}])[0]
        lived_until = time.time()
        delay_line = internet.delay_line_stats() if internet else {}
        swarm.shutdown()
        result = {"bench": "wan", "setting": name, "rate_mbit": None if link is None else link.rate_mbit,
                  "delay_ms": None if link is None else link.delay_ms,
                  "peer_rtt_ms": None if link is None else 4 * link.delay_ms, "nat": nat,
                  "cpu_busy": round((cpu_after[0] - cpu_before[0]) / max(1, cpu_after[1] - cpu_before[1]), 3),
                  "uplink_used_max": round(max(uplink), 3) if uplink else None,
                  "uplink_used_mean": round(statistics.mean(uplink), 3) if uplink else None,
                  "late_joiner_download_s": None if download is None else download.get("seconds"),
                  "late_joiner_version": None if download is None else download.get("version"),
                  "delay_line_late_max_us": delay_line.get("late_max_us")}
        figures = swarm_figures(swarm, peers, start, end, lived_until)
        ms_per_tick = 1000 / os.sysconf("SC_CLK_TCK")
        per_mb = {kind: round((kinds_after[kind] - kinds_before[kind]) * ms_per_tick / max(1, figures["microbatches"]), 1)
                  for kind in kinds}
        machine = (cpu_after[0] - cpu_before[0]) * ms_per_tick / max(1, figures["microbatches"])
        result["cpu_ms_per_microbatch"] = {**per_mb, "machine": round(machine, 1)}
        return {**result, **figures}
    finally:
        swarm.shutdown(timeout=20)
        if internet is not None:
            internet.shutdown()


def swarm_figures(swarm: LocalSwarm, peers: list, start: float, end: float, lived_until: float) -> dict:
    """What the peers' metrics and logs say of the window [start, end) (and of their whole life)."""
    tokens = sum(e["tokens"] for p in peers for e in p.events("microbatch") if e["stage"] == 0 and start <= e["t"] < end)
    losses = [e["loss"] for _, e in sorted((e["t"], e) for p in peers for e in p.events("microbatch")
                                           if e["stage"] == 1 and e.get("loss") is not None and start <= e["t"] < end)]
    logs = [p.log_path.read_text(errors="replace") for p in swarm.all_processes()]
    return {
        "tokens_per_s": round(tokens / (end - start), 1), "seconds": round(end - start, 1),
        "loss": round(statistics.mean(losses[-20:]), 3) if losses else None, "microbatches": len(losses),
        "averaged_rounds": sum(len(p.events("averaged")) for p in peers),
        "failed_rounds": sum("averaging round at" in line and " failed: " in line for log in logs for line in log.splitlines()),
        # every peer lived until the swarm was shut down: each of these is a false verdict
        "peer_down_events": sum(e["t"] < lived_until for p in peers for e in p.events("peer_down")),
        "tracebacks": sum(log.count("Traceback (most recent call last)") for log in logs),
        "exit_codes": [p.process.returncode for p in peers],
        **pipeline_figures(peers, start, end),
    }


def pipeline_figures(peers: list, start: float, end: float) -> dict:
    """Where a step's time goes, from the peers' events in [start, end): a stage-0 microbatch's round
    trip and the flow window it was sent under; under ``flush``, a batch's microbatches
    (``pipeline_s``) and its step (``close_s``), and each stage's gradient exchange with its co-replica."""
    def within(event: str, stage: int) -> list[dict]:
        return [e for p in peers for e in p.events(event) if e["stage"] == stage and start <= e["t"] < end]

    def mean(values: list[float]) -> float | None:
        return round(statistics.mean(values), 3) if values else None

    sent = within("microbatch", 0)
    batches = within("batch_done", 0)
    return {
        "mb_round_trip_s_p50": round(statistics.median(e["seconds"] for e in sent), 3) if sent else None,
        "window_mean": mean([e["window"] for e in sent if "window" in e]),
        "window_max": max((e["window"] for e in sent if "window" in e), default=None),
        "window_changes": len(within("flow_window", 0)), "replayed": len(within("replayed", 0)),
        "batch_pipeline_s": mean([e["pipeline_s"] for e in batches]), "batch_close_s": mean([e["close_s"] for e in batches]),
        "exchange_s": [mean([e["seconds"] for e in within("gradients_exchanged", stage)]) for stage in (0, 1)],
    }


def link_check() -> dict:
    """Round trip idle and goodput at 100 Mbit/s + 10 ms, and how late the delay line was meanwhile."""
    internet = Internet(seed=7)
    a = internet.add_host("a", Link(rate_mbit=100, delay_ms=10))
    b = internet.add_host("b", Link(rate_mbit=100, delay_ms=10))
    with internet:
        for command in (("echo", "9000"), ("sink", "9001")):
            server = a.spawn(*PROBE, *command, stdout=subprocess.PIPE, text=True)
            server.stdout.readline()
        idle = json.loads(b.run(*PROBE, "ping", a.address, "9000", "50").stdout)
        internet.delay_line_stats()
        sent = json.loads(b.run(*PROBE, "send", a.address, "9001", "10", timeout=90).stdout)
        held = internet.delay_line_stats()
    return {"bench": "wan_link", "rate_mbit": 100, "delay_ms": 10, "expected_rtt_ms": 40,
            "idle_rtt_min_ms": round(idle["min_ms"], 2), "idle_rtt_p50_ms": round(idle["p50_ms"], 2),
            "goodput_mbit_per_s": round(sent["mbit_per_s"], 1), "delay_line_packets": held["packets"],
            "late_p50_us": held["late_p50_us"], "late_p99_us": held["late_p99_us"], "late_max_us": held["late_max_us"],
            "dropped": held["dropped_full"] + held["dropped_write"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds per setting (default 60)")
    parser.add_argument("--settings", nargs="+", default=["loopback", "namespaces", "100/10", "50/25", "20/40"],
                        help="loopback, namespaces or RATE_MBIT/ONE_WAY_DELAY_MS (default: all five)")
    parser.add_argument("--nat", action="store_true", help="also run each shaped setting with two peers behind NATs")
    parser.add_argument("--late-joiner", action="store_true", help="after the window, time a fifth peer's state download")
    parser.add_argument("--link-check", action="store_true", help="first measure the emulated link itself")
    parser.add_argument("--bootstrap-args", default="", help="more flags for run_bootstrap.py, e.g. "
                        "'--pipeline-schedule delayed --replica-sync periodic' (the first round's schedule)")
    parser.add_argument("--peer-args", default="", help="more flags for every run_peer.py, e.g. "
                        "'--flow-control fixed --max-in-flight 4' (the constant window before issue #16)")
    parser.add_argument("--no-idle-restart", action="store_true", help="turn off TCP's slow start after idle on "
                        "the emulated hosts (net.ipv4.tcp_slow_start_after_idle=0): how much of a step is that")
    parser.add_argument("--keep", metavar="DIR", help="keep the swarms' logs and metrics under DIR")
    args = parser.parse_args()
    if args.link_check:
        print(json.dumps(link_check()), flush=True)
    settings = ["loopback"] + [s for s in args.settings if s != "loopback"]
    runs = [(s, False) for s in settings] + [(s, True) for s in settings if args.nat and s not in ("loopback", "namespaces")]
    loopback = None
    extra = tuple(args.bootstrap_args.split())
    with tempfile.TemporaryDirectory(prefix="wan-") as tmp:
        for i, (name, nat) in enumerate(runs):
            workdir = Path(args.keep or tmp) / f"run{i}-{name.replace('/', '_')}{'-nat' if nat else ''}"
            result = run_setting(name, parse_setting(name), nat=nat, seconds=args.seconds, workdir=workdir,
                                 late_joiner=args.late_joiner, bootstrap_args=extra, peer_args=tuple(args.peer_args.split()),
                                 idle_restart=not args.no_idle_restart)
            result["bootstrap_args"], result["peer_args"] = " ".join(extra), args.peer_args
            result["tcp_slow_start_after_idle"] = not args.no_idle_restart
            loopback = loopback if loopback is not None else result["tokens_per_s"]
            result["loopback_tokens_per_s"] = loopback
            result["ratio_to_loopback"] = round(result["tokens_per_s"] / loopback, 3) if loopback else None
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
