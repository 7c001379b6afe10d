"""E2E fixtures: the opt-in CPU hog (``MURMURATION_CPU_HOG=1``, see tests/e2e/cpu_hog.py), one
CPU-hungry swarm test at a time, and an emulated internet torn down after its test."""

from __future__ import annotations

import fcntl
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from peer.harness.internet import Internet
from tests.e2e.cpu_hog import is_cpu_hog_requested, open_cpu_hog

HOG_MARGIN = 60.0  # seconds a spinner may outlive its test's timeout if the test process dies
ONE_AT_A_TIME_LOCK = Path(tempfile.gettempdir()) / "murmuration-one-at-a-time-tests.lock"


@pytest.fixture(autouse=True)
def cpu_hog(request) -> Iterator[None]:
    """One busy process per core for the length of the test, when the environment asks for it.

    Autouse and first in line, so the hog is already spinning while the swarm starts and is stopped
    only after the swarm's own teardown.
    """
    if not is_cpu_hog_requested():
        yield
        return
    marker = request.node.get_closest_marker("timeout")
    timeout = float(marker.args[0]) if marker and marker.args else float(request.config.getini("timeout") or 300)
    with open_cpu_hog(timeout + HOG_MARGIN):
        yield


@pytest.fixture(autouse=True)
def one_at_a_time(request) -> Iterator[None]:
    """Tests marked ``xdist_group("one_at_a_time")`` (whole swarms on emulated links, several swarms
    at once) run one at a time.

    ``--dist loadgroup`` keeps the group on one worker, so the other worker runs the rest meanwhile.
    That needs pytest 8 (pinned): with pytest 9.2 xdist 3.8's group marking is lost and the group
    ran on both workers. Two of these swarms side by side starve each other's peers of CPU until
    their neighbours declare them down, so the tests also take a file lock, which holds in a venv
    that still has pytest 9 and across two test runs on one machine: a test waits (an event, not a
    clock) until the other one is done. The Byzantine test is one of them: its swarms (then two at
    once) beside the 20 Mbit/s swarm pushed a 2-core host to a load average of 28, where a peer
    starved for 5 s was declared down and hivemind's matchmaking raced (CI 2026-11-28, and again
    here beside it)."""
    if request.node.get_closest_marker("xdist_group") is None:
        yield
        return
    with open(ONE_AT_A_TIME_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def internet(request) -> Iterator[Internet]:
    """An emulated internet (peer/harness/internet.py; seeded by the module's ``INTERNET_SEED``) for
    the test to add hosts to and start; shut down afterwards, and no namespace of it may survive."""
    made = Internet(seed=getattr(request.module, "INTERNET_SEED", 0))
    yield made
    made.shutdown()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert made.tag + "-" not in listed, f"namespaces survived their test:\n{listed}"
