"""E2E fixtures: the opt-in CPU hog (``MURMURATION_CPU_HOG=1``, see tests/e2e/cpu_hog.py), and one
network-namespace test at a time."""

from __future__ import annotations

import fcntl
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cpu_hog import is_cpu_hog_requested, open_cpu_hog

HOG_MARGIN = 60.0
NETNS_LOCK = Path(tempfile.gettempdir()) / "murmuration-netns-tests.lock"  # seconds a spinner may outlive its test's timeout if the test process dies


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
def one_namespace_test_at_a_time(request) -> Iterator[None]:
    """Tests marked ``xdist_group("netns")`` (whole swarms on emulated links) run one at a time.

    ``--dist loadgroup`` keeps the group on one worker, so the other worker runs the rest meanwhile.
    That needs pytest 8 (pinned): with pytest 9.2 xdist 3.8's group marking is lost and the group
    ran on both workers. Two of these swarms side by side starve each other's peers of CPU until
    their neighbours declare them down, so the tests also take a file lock, which holds in a venv
    that still has pytest 9 and across two test runs on one machine: a test waits (an event, not a
    clock) until the other one is done."""
    if request.node.get_closest_marker("xdist_group") is None:
        yield
        return
    with open(NETNS_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
