"""A 2 × 2 swarm on emulated home links, beside the same swarm on loopback, in one invocation.

    python bench/wan.py [--seconds 60] [--settings loopback namespaces 100/10 50/25 20/40] [--nat]
                        [--late-joiner] [--link-check]

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
whole life, peers declared down (all of them lived: every one is false) and log lines with a traceback. One JSON line per setting:
``{"bench": "wan", "setting", "rate_mbit", "delay_ms", "nat", "tokens_per_s", "loopback_tokens_per_s",
"ratio_to_loopback", "cpu_busy", ...}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

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


def build_internet(name: str, link: Link, *, nat: bool, num_peers: int) -> tuple[Internet, Host, list[Host]]:
    internet = Internet(seed=len(name))
    server = internet.add_host("bootstrap", link)
    hosts = [internet.add_host(f"peer{i}", link, nat="port-restricted" if nat and i in NATTED else None)
             for i in range(num_peers)]
    internet.start()
    return internet, server, hosts


def run_setting(name: str, link: Link | None, *, nat: bool, seconds: float, workdir: Path, late_joiner: bool,
                bootstrap_args: tuple[str, ...] = ()) -> dict:
    internet, server, hosts = (None, None, []) if link is None else build_internet(
        name, link, nat=nat, num_peers=len(STAGES) + late_joiner)

    def where(i: int | None) -> dict:
        host = server if i is None else hosts[i] if hosts else None
        return {} if host is None else {"host": host.address, "command_prefix": host.command_prefix}

    swarm = LocalSwarm(workdir)
    try:
        swarm.start_bootstrap(*BOOTSTRAP_ARGS, *bootstrap_args, **where(None))
        peers = [swarm.start_peer("--stage", str(stage), *PEER_ARGS, **where(i)) for i, stage in enumerate(STAGES)]
        wait_for(lambda: all(p.events("status") or not p.is_alive() for p in peers), 240, "four peers to train")
        time.sleep(WARMUP_SECONDS)
        bytes_before = [internet.link_bytes(h) for h in hosts[:len(STAGES)]] if internet else []
        cpu_before, start = cpu_times(), time.time()
        time.sleep(seconds)
        cpu_after, end = cpu_times(), time.time()
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
        return {**result, **swarm_figures(swarm, peers, start, end, lived_until)}
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
                                 late_joiner=args.late_joiner, bootstrap_args=extra)
            result["bootstrap_args"] = " ".join(extra)
            loopback = loopback if loopback is not None else result["tokens_per_s"]
            result["loopback_tokens_per_s"] = loopback
            result["ratio_to_loopback"] = round(result["tokens_per_s"] / loopback, 3) if loopback else None
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
