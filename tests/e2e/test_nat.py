"""Volunteers behind home NATs (issue #15, docs/nat.md), on the emulated internet of peer/harness/internet.py.

The swarm: a bootstrap and three public peers (hole punching needs a NATed peer's address confirmed
by four public peers: go-libp2p's identify), one stage-1 peer behind a port-restricted NAT, then a
stage-0 peer behind another (a late joiner: it pulls stage 0's state), then one more peer behind a
third NAT when the relays are full (the bootstrap relays for two, the public peers for none): it
says it cannot be reached and trains as a client of stage 0.

What it shows:
- each peer says in one line how it is reached, and its record says so too;
- the NATed stage-1 peer serves microbatches (some injected by the NATed stage-0 peer, which joined
  after it and which it never dialled: no home can dial into another, so what carries them is the
  relay and the hole it helped punch) and averages with the public stage-1 peer;
- the client, reachable by nobody, injects microbatches and averages in client mode.

Needs root, ``nft`` and ``gcc`` like tests/e2e/test_internet.py; without them it fails with
InternetError's message.
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from peer.harness.internet import InternetError, Link
from peer.harness.local_swarm import LocalSwarm, wait_for

pytestmark = [pytest.mark.timeout(1200), pytest.mark.xdist_group("one_at_a_time")]
LINK = Link(rate_mbit=100, delay_ms=5)
COMMON = ("--num-threads", "1", "--relay-slots", "0", "--heartbeat-ttl", "10")
STATUS_PORT = 8080  # the bootstrap's health page, on its own host
INTERNET_SEED = 15  # the emulated internet's (tests/e2e/conftest.py)


def joined_line(peer) -> str:
    found = re.search(r"joined the DHT as (\S+) \((\w+)\); (.*)", peer.log_path.read_text())
    return found.group(3) if found else ""


def peer_id_of(peer) -> str:
    found = re.search(r"joined the DHT as (\S+) ", peer.log_path.read_text())
    return found.group(1) if found else ""


def injected_by(peer, injector: str) -> list[dict]:
    """The microbatches ``peer`` (the last stage) counted that ``injector`` sent into the pipeline."""
    return [e for e in peer.events("microbatch") if e.get("route") and e["route"][0][0] == injector]


def status_of(host, port: int, *, timeout: float = 120) -> dict:
    """The bootstrap's /status.json, fetched on its own host; asked again until ``timeout`` seconds
    if it does not answer within 15 s (on a loaded 2-core machine the bootstrap shares the CPUs with
    seven peers and another test: in one CI run its first answer took over 10 s)."""
    script = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/status.json', timeout=15).read().decode())"
    fetched: list[dict] = []

    def fetch() -> bool:
        try:
            fetched.append(json.loads(host.run(sys.executable, "-c", script, timeout=30).stdout))
        except InternetError as e:
            print(f"the status page did not answer: {str(e)[-200:]}")
        return bool(fetched)

    wait_for(fetch, timeout, "the bootstrap's /status.json", period=1.0)
    return fetched[0]


@pytest.mark.scenario
def test_peers_behind_nats_serve_average_and_say_how_they_are_reached(internet, tmp_path):
    hosts = {name: internet.add_host(name, LINK) for name in ("bootstrap", "public0", "public1", "public2")}
    for name in ("home1", "home0", "home-client"):
        hosts[name] = internet.add_host(name, LINK, nat="port-restricted")
    internet.start()
    swarm = LocalSwarm(tmp_path / "swarm")

    def start(name: str, *args: str):
        host = hosts[name]
        return swarm.start_peer(*COMMON, *args, host=host.address, command_prefix=host.command_prefix)

    try:
        boot = hosts["bootstrap"]
        swarm.start_bootstrap("--num-stages", "2", "--averaging-period", "8", "--relay-slots", "2",
                              "--status-port", str(STATUS_PORT), host=boot.address, command_prefix=boot.command_prefix)
        public = [start("public0", "--stage", "0"), start("public1", "--stage", "1"), start("public2", "--stage", "0")]
        nat1 = start("home1", "--stage", "1")
        everyone = [*public, nat1]
        wait_for(lambda: "training" in nat1.log_path.read_text() or not all(p.is_alive() for p in everyone), 150,
                 "the NATed stage-1 peer to train")
        assert all(p.is_alive() for p in everyone), swarm.logs()

        nat0 = start("home0", "--stage", "0")  # a late joiner behind another NAT: it pulls stage 0's state
        wait_for(lambda: "(2 of 2 relay slots)" in swarm.bootstrap.log_path.read_text() or not nat0.is_alive(), 90,
                 "the NATed stage-0 peer to take the bootstrap's second relay slot")
        client = start("home-client")  # the bootstrap's two relay slots are taken now: no relay for it
        everyone += [nat0, client]
        wait_for(lambda: (nat0.events("status") and client.events("status")) or not all(p.is_alive() for p in everyone),
                 150, "the late NATed stage-0 peer and the client to train")
        assert all(p.is_alive() for p in everyone), swarm.logs()

        # each says in one line how it is reached
        for peer in public:
            assert joined_line(peer).startswith("reachable at /ip4/11.0."), peer.log_tail()
        for peer in (nat1, nat0):
            assert re.match(r"behind NAT: reachable through relay /ip4/11\.0\.1\.2/tcp/\d+/p2p/\w+/p2p-circuit",
                            joined_line(peer)), peer.log_tail()
        assert joined_line(client).startswith("not reachable: will train as a client of stage 0 and average in "
                                              "client mode (behind a NAT and no public peer has a free relay slot)"), \
            client.log_tail()
        ids = {name: peer_id_of(p) for name, p in (("nat1", nat1), ("nat0", nat0), ("client", client))}

        # the NATed stage-1 peer serves what the late NATed stage-0 peer and the client inject, and averages
        joined_at = nat0.events("joined")[0]["t"]

        def served() -> bool:
            return (len(injected_by(nat1, ids["nat0"])) >= 3 and len(injected_by(nat1, ids["client"])) >= 1
                    and any(e["t"] > joined_at for e in nat1.events("averaged")) and bool(client.events("averaged")))

        wait_for(lambda: served() or not all(p.is_alive() for p in everyone), 240,
                 "microbatches of the late NATed peer and of the client through the NATed stage-1 peer, and rounds")
        assert served(), swarm.logs()
        # it never opened a connection to the late joiner; what carried its microbatches is a punched hole
        # (a home cannot dial into another, and a relayed connection carries at most 128 KiB)
        assert not any(e["peer_id"] == ids["nat0"] for e in nat1.events("dialled")), nat1.log_tail()
        assert any(e["peer_id"] == ids["nat0"] and e["kind"] == "direct" for e in nat1.events("connection")), \
            nat1.events("connection")
        assert nat0.events("state_download"), nat0.log_tail()  # the late joiner pulled stage 0's state

        # and the records say it: the bootstrap's health page lists every peer's reachability
        rows = {row["peer_id"]: row for row in status_of(boot, STATUS_PORT)["peers"]}
        assert {rows[ids[n]]["reachability"] for n in ("nat1", "nat0")} == {"relayed"}, rows
        assert (rows[ids["client"]]["reachability"], rows[ids["client"]]["role"], rows[ids["client"]]["stage"]) == \
            ("unreachable", "unreliable", 0), rows
        assert {rows[peer_id_of(p)]["reachability"] for p in public} == {"direct"}, rows

        swarm.shutdown()
        for peer in everyone:
            assert peer.process.returncode == 0, peer.log_tail()
            assert "Traceback" not in peer.log_path.read_text(), peer.log_tail()
    finally:
        swarm.shutdown(timeout=20)
        print(swarm.logs())


@pytest.mark.smoke
def test_a_peer_behind_a_home_nat_says_in_one_line_that_it_is_reached_through_the_bootstraps_relay(internet, tmp_path):
    """The gate's NAT smoke: the smallest swarm a NATed volunteer meets (a public bootstrap with one
    relay slot, one stage) gives its one-line verdict and trains; the long NAT swarm above is the
    scenario tier's."""
    boot_host = internet.add_host("bootstrap", LINK)
    home = internet.add_host("home", LINK, nat="port-restricted")
    internet.start()
    swarm = LocalSwarm(tmp_path / "swarm")
    try:
        swarm.start_bootstrap("--num-stages", "1", "--relay-slots", "1", host=boot_host.address,
                              command_prefix=boot_host.command_prefix)
        peer = swarm.start_peer(*COMMON, host=home.address, command_prefix=home.command_prefix)
        wait_for(lambda: peer.events("status") or not peer.is_alive(), 150, "the NATed peer to train")
        assert peer.is_alive(), swarm.logs()
        assert re.match(rf"behind NAT: reachable through relay /ip4/{re.escape(boot_host.public_address)}/tcp/\d+/p2p/\w+"
                        r"/p2p-circuit", joined_line(peer)), peer.log_tail()
        wait_for(lambda: "(1 of 1 relay slots)" in swarm.bootstrap.log_path.read_text(), 30,
                 "the bootstrap to log the reservation it granted")
        swarm.shutdown()
        assert peer.process.returncode == 0, peer.log_tail()
        assert "Traceback" not in peer.log_path.read_text(), peer.log_tail()
    finally:
        swarm.shutdown(timeout=20)
        print(swarm.logs())
