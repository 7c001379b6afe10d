"""E2E fixtures: the opt-in CPU hog (``MURMURATION_CPU_HOG=1``, see tests/e2e/cpu_hog.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.cpu_hog import is_cpu_hog_requested, open_cpu_hog

HOG_MARGIN = 60.0  # seconds a spinner may outlive its test's timeout if the test process dies


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
