"""Shared fixtures: real hivemind DHT nodes on 127.0.0.1, and a real local swarm of processes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def open_dht_nodes(num_nodes: int) -> Iterator[list]:
    """``num_nodes`` real DHT nodes on loopback, all joined through the first; shut down on exit."""
    from dht.node import DHTNodeConfig, open_dht, visible_maddrs

    nodes = []
    try:
        first = open_dht(DHTNodeConfig())
        nodes.append(first)
        initial = tuple(visible_maddrs(first[0]))
        for _ in range(num_nodes - 1):
            nodes.append(open_dht(DHTNodeConfig(initial_peers=initial)))
        yield nodes
    finally:
        for dht, _validator in nodes:
            dht.shutdown()


@pytest.fixture
def dht_nodes(request) -> Iterator[list]:
    """Three DHT nodes as ``[(dht, validator), ...]``; ask for more with ``@pytest.mark.parametrize`` indirect."""
    with open_dht_nodes(getattr(request, "param", 3)) as nodes:
        yield nodes


@pytest.fixture
def local_swarm(tmp_path) -> Iterator:
    """A LocalSwarm under tmp_path; every process is stopped afterwards, and on failure the logs are printed."""
    from peer.harness.local_swarm import LocalSwarm

    swarm = LocalSwarm(tmp_path / "swarm")
    try:
        yield swarm
    finally:
        swarm.shutdown(timeout=20)
        print(swarm.logs())  # shown by pytest only when the test failed
