"""A joiner pulls one stage's state from 4 donors over shaped links: ours against the baselines.

    sudo .venv/bin/python bench/replication.py [--state-mib 128] [--rates 50,100,200,400]

Needs root (network namespaces). Each donor runs in a namespace of its own, joined to the joiner's
namespace by a veth pair whose donor end is shaped with ``tc qdisc ... tbf`` to its rate (Mbit/s,
donor -> joiner; requests the other way are tiny). Traffic goes only to namespaces this script
creates; they are deleted in ``finally``. Every process serves the same state (fixed seed); every
pull is checked bit-identical (torch.equal) before its time counts. Methods, one run each:

* lpt:      ``pull_state`` — probes, Alg. 1 (binary search on s) + Alg. 2 (greedy LPT), 4 donors,
            queued shards re-planned with measured rates when a donor runs dry (the default);
* lpt-static: the same without that re-planning (the plan from the probes alone);
* even:     the same transport, shards split evenly (the planner sees four identical links), static;
* single:   ``pull_state`` from the fastest donor only;
* hivemind: ``DecentralizedAverager.load_state_from_peers``: one donor, the one declaring the
            highest priority, ties broken at random. Peers declare equal priorities by default, so
            a hivemind joiner gets a random donor: it is timed once from each donor (made the top
            priority in turn), and "hivemind" is the mean; "hivemind-fastest" is its best case.

Each line also carries the joiner's CPU seconds (its process and its p2p daemon) during the pull.
Before the methods the joiner asks each donor for one manifest at the piece size, so the
donor's one-off snapshot copy and first hash pass (paid once per version, by the first joiner only)
are not counted. Prints one JSON line per
method: ``{"bench": "replication", "method", "state_bytes", "seconds", "lower_bound_seconds",
"ratio_to_lower_bound"}`` with lower bound = state bytes / sum of link rates.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RUN_ID, STAGE, VERSION, PREFIX = "bench", 0, 1, "bench_avg"
START_TIMEOUT, METHOD_TIMEOUT = 120.0, 120.0


def make_state(state_bytes: int) -> dict:
    """Four float32 tensors of about ``state_bytes`` / 4 bytes each, an int64 step; same on every process."""
    import torch

    generator = torch.Generator().manual_seed(0)
    numel = state_bytes // 16
    state = {f"w{i}": torch.randn(numel, generator=generator) for i in range(4)}
    state["step"] = torch.tensor(1234, dtype=torch.int64)
    return state


def write_atomically(path: Path, text: str) -> None:
    """So that a reader polling for ``path`` never sees it half written."""
    temp = path.with_suffix(".tmp")
    temp.write_text(text)
    os.replace(temp, path)


def wait_for_file(path: Path, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear within {timeout} s")


# ---- donor ------------------------------------------------------------------------------------

def run_donor(args: argparse.Namespace) -> None:
    from hivemind.averaging import DecentralizedAverager

    from dht.node import DHTNodeConfig, open_dht
    from replication.server import ReplicationServer

    joiner = wait_for_file(args.workdir / "joiner.json", START_TIMEOUT)
    host = f"/ip4/10.77.{args.index}.2/tcp/0"
    dht, _ = open_dht(DHTNodeConfig(host_maddrs=(host,),
                                    initial_peers=(f"/ip4/10.77.{args.index}.1/tcp/{joiner['port']}/p2p/{joiner['peer_id']}",)))
    state = make_state(args.state_bytes)
    averager = DecentralizedAverager([t.clone() for t in state.values()], dht, start=True, prefix=PREFIX,
                                     target_group_size=2, allow_state_sharing=True)
    averager.state_sharing_priority = 1.0

    async def serve() -> None:
        async def snapshot():
            return VERSION, state

        server = ReplicationServer(await dht.replicate_p2p(), run_id=RUN_ID, stage=STAGE, snapshot_fn=snapshot)
        async with server:
            write_atomically(args.workdir / f"donor{args.index}.json",
                             json.dumps({"peer_id": dht.peer_id.to_base58(), "rate_mbit": args.rate_mbit}))
            deadline = time.monotonic() + 10 * METHOD_TIMEOUT
            while not (args.workdir / "stop").exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                top = args.workdir / "hivemind_top"  # which donor hivemind's joiner should pick now
                if top.exists():
                    averager.state_sharing_priority = 2.0 if top.read_text() == str(args.index) else 1.0

    try:
        asyncio.run(serve())
    finally:
        averager.shutdown()
        dht.shutdown()


# ---- joiner -----------------------------------------------------------------------------------

def run_joiner(args: argparse.Namespace) -> None:
    import torch
    from hivemind.averaging import DecentralizedAverager

    from dht.node import DHTNodeConfig, open_dht

    dht, _ = open_dht(DHTNodeConfig(host_maddrs=("/ip4/0.0.0.0/tcp/0",)))
    port = int(str(dht.get_visible_maddrs()[0]).split("/tcp/")[1].split("/")[0])
    write_atomically(args.workdir / "joiner.json", json.dumps({"peer_id": dht.peer_id.to_base58(), "port": port}))
    donors = [wait_for_file(args.workdir / f"donor{i}.json", START_TIMEOUT) for i in range(len(args.rates))]
    expected = make_state(args.state_bytes)
    state_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    lower_bound = state_bytes / sum(rate * 1e6 / 8 for rate in args.rates)
    averager = DecentralizedAverager([torch.zeros_like(t) for t in expected.values()], dht, start=True,
                                     prefix=PREFIX, target_group_size=2, allow_state_sharing=False)
    try:
        results = asyncio.run(measure_ours(dht, donors, expected, args.workdir))
        by_donor = {}
        for donor in sorted(donors, key=lambda d: d["rate_mbit"]):
            by_donor[donor["rate_mbit"]] = measure_hivemind(dht, averager, expected, donor, donors, args.workdir)
        # hivemind's joiner takes the donor of highest declared priority, ties broken at random;
        # peers declare equal priorities by default, so its expected time is the mean over donors.
        results["hivemind"] = (sum(s for s, _ in by_donor.values()) / len(by_donor),
                               sum(c for _, c in by_donor.values()) / len(by_donor))
        results["hivemind-fastest"] = by_donor[max(by_donor)]
        print(json.dumps({"hivemind_seconds_by_donor_mbit": {r: round(s, 3) for r, (s, _) in by_donor.items()}}),
              file=sys.stderr, flush=True)
        for method, (seconds, cpu) in results.items():
            print(json.dumps({"bench": "replication", "method": method, "state_bytes": state_bytes,
                              "seconds": round(seconds, 3), "lower_bound_seconds": round(lower_bound, 3),
                              "ratio_to_lower_bound": round(seconds / lower_bound, 3),
                              "joiner_cpu_seconds": round(cpu, 3), "rates_mbit": args.rates}), flush=True)
    finally:
        averager.shutdown()
        dht.shutdown()


async def measure_ours(dht, donors: list[dict], expected: dict, workdir: Path) -> dict[str, float]:
    import replication.transfer as transfer
    from dht.rpc import call_peer
    from replication.config import TransferConfig
    from replication.layout import StateLayout
    from replication.server import manifest_handler

    p2p = await dht.replicate_p2p()
    layout = StateLayout.from_tensors(expected)  # as a peer pulls: only this layout's manifest is accepted
    config = TransferConfig(shard_timeout_floor=30.0)
    peer_ids = [d["peer_id"] for d in donors]
    for peer_id in peer_ids:  # warm-up: each donor's snapshot copy (see the module docstring)
        await call_peer(p2p, peer_id, manifest_handler(RUN_ID), {"stage": STAGE, "shard_bytes": config.piece_bytes},
                        timeout=METHOD_TIMEOUT, max_payload_bytes=0)
    fastest = max(donors, key=lambda d: d["rate_mbit"])["peer_id"]
    results = {}
    static = dataclasses.replace(config, rebalance=False, endgame=False)
    for method, chosen, method_config in (("lpt", peer_ids, config), ("lpt-static", peer_ids, static),
                                          ("even", peer_ids, static),
                                          ("single", [fastest], dataclasses.replace(config, min_agreeing_donors=1))):
        await asyncio.to_thread(os.sync)  # the disk writes of the previous method are not this one's
        real_probe = transfer.probe_donors
        if method == "even":
            transfer.probe_donors = _equal_links(real_probe)
        try:
            started, cpu = time.perf_counter(), joiner_cpu_seconds()
            async with asyncio.timeout(METHOD_TIMEOUT):
                result = await transfer.pull_state(p2p, chosen, run_id=RUN_ID, stage=STAGE,
                                                   store_dir=Path(tempfile.mkdtemp(dir=workdir)), config=method_config,
                                                   expected=layout)
            results[method] = (time.perf_counter() - started, joiner_cpu_seconds() - cpu)
        finally:
            transfer.probe_donors = real_probe
        _check(result.state, expected)
        report = result.report
        print(json.dumps({"method": method, "shard_bytes": report.shard_bytes, "num_shards": report.num_shards,
                          "estimated_seconds": round(report.estimated_seconds, 3),
                          "requests": report.num_shard_requests, "replans": report.num_replans,
                          "duplicated": report.num_duplicated,
                          "phase_seconds": {k: round(v, 3) for k, v in report.phase_seconds.items()},
                          "bytes_by_donor": {p[-6:]: n for p, n in report.bytes_by_donor.items()},
                          "probed_mb_s": {p[-6:]: round(1e-6 / b, 1) for p, (_, b) in report.links.items()},
                          "measured_mb_s": {p[-6:]: round(1e-6 / b, 1) for p, b in report.measured_per_byte.items()},
                          "probed_delay_ms": {p[-6:]: round(d * 1e3, 2) for p, (d, _) in report.links.items()},
                          "failed": report.failed_donors}), file=sys.stderr, flush=True)
    return results


def _equal_links(real_probe):
    """Wraps ``probe_donors`` so the planner sees every donor at the mean speed: an even split."""
    from replication.assignment import NeighbourLink

    async def probe(request, donors, report):
        links = await real_probe(request, donors, report)
        delay = sum(link.propagation_delay for link in links.values()) / len(links)
        per_byte = sum(link.per_byte_delay for link in links.values()) / len(links)
        return {p: NeighbourLink(peer_id=p, propagation_delay=delay, per_byte_delay=per_byte) for p in links}

    return probe


def joiner_cpu_seconds() -> float:
    """CPU seconds of this process and its live descendants (the DHT process, the p2p daemon), from /proc."""
    ticks, parents = os.sysconf("SC_CLK_TCK"), {}
    usage = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        usage[int(entry.name)] = (int(fields[11]) + int(fields[12])) / ticks
    mine, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in mine:
                mine.add(pid)
                frontier.append(pid)
    return sum(usage.get(pid, 0.0) for pid in mine)


def measure_hivemind(dht, averager, expected: dict, donor: dict, donors: list[dict], workdir: Path) -> tuple[float, float]:
    """``load_state_from_peers`` once ``donor`` declares the highest priority (seconds, joiner CPU)."""
    write_atomically(workdir / "hivemind_top", str(donors.index(donor)))
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:  # every declaration is visible, the chosen donor on top
        found = dht.get(f"{PREFIX}.all_averagers", latest=True)
        if found is not None and len(found.value) >= len(donors):
            from hivemind.p2p import PeerID

            priorities = {PeerID(key).to_base58(): item.value for key, item in found.value.items()}
            if priorities.get(donor["peer_id"]) == 2.0 and sorted(priorities.values()).count(2.0) == 1:
                break
        time.sleep(0.1)
    else:
        raise TimeoutError("the donors' priorities did not show in the DHT")
    started, cpu = time.perf_counter(), joiner_cpu_seconds()
    loaded = averager.load_state_from_peers(timeout=METHOD_TIMEOUT)
    seconds, cpu = time.perf_counter() - started, joiner_cpu_seconds() - cpu
    if loaded is None:
        raise RuntimeError("load_state_from_peers found no donor")
    _check(dict(zip(expected, loaded[1])), expected)
    return seconds, cpu


def _check(state: dict, expected: dict) -> None:
    import torch

    for name, tensor in expected.items():
        if not torch.equal(state[name], tensor):
            raise RuntimeError(f"tensor {name} differs after the transfer")


# ---- orchestration (root namespace) -----------------------------------------------------------

def sh(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=30)


def create_network(tag: str, rates: list[int]) -> list[str]:
    """Namespaces ``<tag>j`` and ``<tag>d<i>``, a veth pair per donor, the donor end shaped."""
    joiner_ns, namespaces = f"{tag}j", []
    sh("ip", "netns", "add", joiner_ns)
    namespaces.append(joiner_ns)
    sh("ip", "-n", joiner_ns, "link", "set", "lo", "up")
    for i, rate in enumerate(rates):
        ns, near, far = f"{tag}d{i}", f"{tag}j{i}", f"{tag}d{i}"
        sh("ip", "netns", "add", ns)
        namespaces.append(ns)
        sh("ip", "link", "add", near, "type", "veth", "peer", "name", far)
        sh("ip", "link", "set", near, "netns", joiner_ns)
        sh("ip", "link", "set", far, "netns", ns)
        for where, dev, addr in ((joiner_ns, near, f"10.77.{i}.1/24"), (ns, far, f"10.77.{i}.2/24")):
            sh("ip", "-n", where, "addr", "add", addr, "dev", dev)
            sh("ip", "-n", where, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        burst = max(32 * 1024, rate * 1_000_000 // 8 // 100)  # 10 ms of traffic
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", far, "root", "tbf",
           "rate", f"{rate}mbit", "burst", str(burst), "latency", "100ms")
    return namespaces


def spawn(namespace: str, role_args: list[str], log: Path) -> subprocess.Popen:
    command = ["ip", "netns", "exec", namespace, sys.executable, str(Path(__file__).resolve()), *role_args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=open(log, "w"), start_new_session=True,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def orchestrate(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("bench/replication.py needs root for network namespaces; run it with sudo.", file=sys.stderr)
        return 2
    tag = f"mr{os.getpid() % 100000}"
    workdir = Path(tempfile.mkdtemp(prefix="bench-replication-"))
    common = ["--workdir", str(workdir), "--state-bytes", str(args.state_bytes),
              "--rates", ",".join(map(str, args.rates))]
    processes, namespaces = [], []
    try:
        namespaces = create_network(tag, args.rates)
        joiner = spawn(namespaces[0], ["--role", "joiner", *common], workdir / "joiner.log")
        processes.append(joiner)
        for i, rate in enumerate(args.rates):
            processes.append(spawn(namespaces[1 + i], ["--role", "donor", "--index", str(i),
                                                        "--rate-mbit", str(rate), *common], workdir / f"donor{i}.log"))
        out, _ = joiner.communicate(timeout=START_TIMEOUT + 6 * METHOD_TIMEOUT)
        print(out, end="")
        if joiner.returncode != 0:
            print((workdir / "joiner.log").read_text()[-4000:], file=sys.stderr)
        return joiner.returncode
    finally:
        (workdir / "stop").touch()
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        for ns in reversed(namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("orchestrate", "joiner", "donor"), default="orchestrate")
    parser.add_argument("--state-mib", type=int, default=128, help="state size in MiB (default 128)")
    parser.add_argument("--state-bytes", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rates", default="50,100,200,400", help="donor link rates, Mbit/s, comma-separated")
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rate-mbit", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.rates = [int(rate) for rate in args.rates.split(",")]
    args.state_bytes = args.state_bytes or args.state_mib * 1024 * 1024
    if args.role == "donor":
        run_donor(args)
        return 0
    if args.role == "joiner":
        run_joiner(args)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
