"""Shared fixtures: real hivemind DHT nodes on 127.0.0.1, and a real local swarm of processes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
# the folder a test lives in is its tier, except tests/e2e, whose tests each say which of the two
# they are; a test of another folder may be marked ``scenario`` to leave the gate (a measurement, the
# live fuzz). scripts/test.sh runs ``-m "not scenario"`` unless given --all.
TIER_OF_FOLDER = {"unit": "unit", "sim": "sim", "integration": "integration", "fuzz": "fuzz"}
E2E_TIERS = ("smoke", "scenario")


def pytest_collection_modifyitems(config, items) -> None:
    """Mark every test with its tier; an e2e test that names neither tier (or both) stops the run."""
    untiered = []
    for item in items:
        folder = Path(str(item.path)).relative_to(TESTS).parts[0]
        if folder == "e2e":
            named = [tier for tier in E2E_TIERS if item.get_closest_marker(tier)]
            if len(named) != 1:
                untiered.append(item.nodeid)
        elif folder in TIER_OF_FOLDER:
            item.add_marker(TIER_OF_FOLDER[folder])
        else:
            untiered.append(item.nodeid)
    if untiered:
        raise pytest.UsageError("each test of tests/e2e is marked smoke (the gate) or scenario (--all), exactly one, "
                                "and every other test lives in tests/unit, sim, integration or fuzz: "
                                + ", ".join(untiered[:10]))


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
