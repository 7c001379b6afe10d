"""The dial-back check and relay slots on real hivemind DHTs on 127.0.0.1 (docs/nat.md).

Loopback has no NAT: a peer listening on 127.0.0.1 is reachable, and one that names a port where
nothing listens is not. tests/e2e/test_nat.py runs the same code behind emulated home NATs.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from dht.node import BootstrapError, DHTNodeConfig, open_dht, visible_maddrs
from dht.reachability import DialBackServer, call_dial_back, dial_fresh, listen_ports
from dht.relays import RelaySlots, request_slot
from peer.config import PeerConfig
from peer.reachability import obtain_relays, probe

pytestmark = pytest.mark.timeout(120)


def closed_port() -> int:
    """A TCP port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("dht_nodes", [2], indirect=True)
def test_a_checker_dials_the_asker_back_at_its_own_address_only(dht_nodes):
    (checker_dht, _), (asker_dht, _) = dht_nodes
    asker_id = asker_dht.peer_id.to_base58()
    dialled = []

    async def recording_dial(peer_id, maddrs, *, timeout):
        dialled.append((peer_id.to_base58(), list(maddrs)))
        return await dial_fresh(peer_id, maddrs, timeout=timeout)

    async def main():
        checker_p2p, asker_p2p = await checker_dht.replicate_p2p(), await asker_dht.replicate_p2p()
        checker = checker_dht.peer_id.to_base58()
        port = listen_ports(visible_maddrs(asker_dht))[0]
        async with DialBackServer(checker_p2p, dial=recording_dial, per_peer_period=0.0) as server:
            answer = await call_dial_back(asker_p2p, checker, ports=[port])
            assert answer.reachable is True and answer.observed.startswith("127.0.0.1:")
            nobody = closed_port()
            assert (await call_dial_back(asker_p2p, checker, ports=[nobody])).reachable is False
            # only the asker's own peer id, at the address its connection came from
            assert dialled == [(asker_id, [f"/ip4/127.0.0.1/tcp/{port}"]), (asker_id, [f"/ip4/127.0.0.1/tcp/{nobody}"])]
            assert (server.num_checks, server.num_reachable) == (2, 1)
            server.per_peer_period = 60.0  # the last check was just now
            assert (await call_dial_back(asker_p2p, checker, ports=[port])).reachable is None  # declined: too soon
            assert server.num_declined == 1 and len(dialled) == 2

    asyncio.run(main())


@pytest.mark.parametrize("dht_nodes", [3], indirect=True)
def test_a_relay_grants_at_most_its_slots(dht_nodes):
    (relay_dht, _), (a_dht, _), (b_dht, _) = dht_nodes

    async def main():
        relay = relay_dht.peer_id.to_base58()
        a_p2p, b_p2p = await a_dht.replicate_p2p(), await b_dht.replicate_p2p()
        async with RelaySlots(await relay_dht.replicate_p2p(), slots=1) as slots:
            assert await request_slot(a_p2p, relay) == slots.lease
            assert await request_slot(b_p2p, relay) is None  # full
            assert await request_slot(a_p2p, relay) == slots.lease  # a renewal
            assert slots.holders() == [a_dht.peer_id.to_base58()]
            config = PeerConfig(bootstrap=tuple(visible_maddrs(relay_dht)), host_maddrs=("/ip4/127.0.0.1/tcp/0",))
            assert await obtain_relays(a_p2p, config, [relay]) == [visible_maddrs(relay_dht)[0]]
            assert await obtain_relays(b_p2p, config, [relay]) == []

    asyncio.run(main())


def test_the_probe_finds_a_loopback_peer_reachable_through_the_bootstraps_check():
    boot_dht, _ = open_dht(DHTNodeConfig())
    try:
        async def main():
            async with DialBackServer(await boot_dht.replicate_p2p()):
                config = PeerConfig(bootstrap=tuple(visible_maddrs(boot_dht)), host_maddrs=("/ip4/127.0.0.1/tcp/0",))
                reach = await probe(config, DHTNodeConfig(initial_peers=config.bootstrap))
                assert (reach.kind, reach.verdict.reachable, reach.verdict.num_answers) == ("direct", True, 1)
                assert reach.verdict.mapping == "kept"  # it dialled out from the port it listens on

        asyncio.run(main())
    finally:
        boot_dht.shutdown()


def daemon_command_lines() -> list[str]:
    lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "p2pd" in line:
            lines.append(line)
    return lines


def test_a_node_behind_a_nat_reserves_on_its_granted_relays_only():
    """hivemind's P2P has no argument for ``-relayDiscovery``; the DHT's process adds it (dht.node)."""
    relay_dht, _ = open_dht(DHTNodeConfig(daemon_reachability="private"))
    relays = (visible_maddrs(relay_dht)[0],)
    node = None
    try:
        config = DHTNodeConfig(initial_peers=relays, relays=relays, daemon_reachability="private")
        try:
            node, _ = open_dht(config)
        except BootstrapError:  # CI: under load the daemon's dial of its one bootstrap peer timed out; once more
            node, _ = open_dht(config)
        mine = [line for line in daemon_command_lines() if f"-trustedRelays={relays[0]}" in line]
        assert len(mine) == 1 and "-relayDiscovery=0" in mine[0] and "-autoRelay=1" in mine[0], mine
        assert "-forceReachabilityPrivate=1" in mine[0]
        assert node.get(b"anything") is None  # a working DHT node
    finally:
        if node is not None:
            node.shutdown()
        relay_dht.shutdown()
