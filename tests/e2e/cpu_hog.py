"""A CPU hog for the flake check: one busy process per core beside an e2e test.

The e2e tests wait on events with deadlines, never on the wall clock; the hog is how we show it.
With ``MURMURATION_CPU_HOG=1`` in the environment, ``tests/e2e/conftest.py`` runs every e2e test
inside :func:`open_cpu_hog`, so its peers get about half the CPU they would alone (one spinner per
core competes with them at the same priority). ``scripts/flake_check.py`` sets it; CI does not.

Each spinner is bounded twice: it is killed by PID when the test ends, and it exits on its own after
``max_seconds`` even if the test process dies without cleaning up (SIGKILL, a crashed runner), so a
hog can never outlive its test by more than that.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

HOG_ENV = "MURMURATION_CPU_HOG"
# a busy loop that checks its own deadline: it stops without anyone to stop it
_SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


def is_cpu_hog_requested() -> bool:
    return os.environ.get(HOG_ENV, "") not in ("", "0")


@contextlib.contextmanager
def open_cpu_hog(max_seconds: float, *, num_processes: int | None = None) -> Iterator[list[int]]:
    """Run ``num_processes`` (default: one per core) busy processes for the body; yields their PIDs.

    Args:
        max_seconds: how long a spinner lives at most if nobody stops it (make it the test's timeout
            plus a margin).
        num_processes: how many spinners; ``os.cpu_count()`` by default.
    """
    if max_seconds <= 0:
        raise ValueError(f"max_seconds must be positive, got {max_seconds}")
    spinners: list[subprocess.Popen] = []
    try:
        for _ in range(num_processes or os.cpu_count() or 1):
            spinners.append(subprocess.Popen([sys.executable, "-c", _SPIN, str(max_seconds)],
                                             stdin=subprocess.DEVNULL, start_new_session=True))
        yield [s.pid for s in spinners]
    finally:
        for spinner in spinners:
            if spinner.poll() is None:
                os.kill(spinner.pid, signal.SIGKILL)
        for spinner in spinners:
            spinner.wait(10)
