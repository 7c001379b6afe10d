"""kill -9 of the bootstrap: the running swarm trains on, and a new peer joins through a live peer.

The bootstrap is only a well-known first contact (DESIGN §1 step 1): the run spec and every peer
record are replicated in the DHT, so nothing the swarm needs dies with it.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from peer.harness.local_swarm import wait_for

pytestmark = [pytest.mark.smoke, pytest.mark.timeout(300)]


def reachable_at(peer) -> list[str]:
    """The multiaddrs a peer logged when it joined the DHT."""
    match = re.search(r"reachable at (\S+(?: /\S+)*)", peer.log_path.read_text())
    assert match, f"{peer.name} did not log its addresses:\n{peer.log_tail()}"
    return match.group(1).split()


def test_the_swarm_outlives_its_bootstrap_and_admits_a_joiner_through_a_peer(local_swarm):
    local_swarm.start_bootstrap()
    peers = [local_swarm.start_peer("--num-threads", "1") for _ in range(2)]
    wait_for(lambda: all(p.events("status") for p in peers), 150, "two peers to train")
    first = next(p for p in peers if p.events("status")[-1]["stage"] == 0)

    os.killpg(local_swarm.bootstrap.pid, signal.SIGKILL)  # the bootstrap, its DHT child and its p2pd
    wait_for(lambda: not local_swarm.bootstrap.is_alive(), 10, "the bootstrap to die")
    killed_at = time.time()
    done_at_kill = len(first.events("microbatch"))
    wait_for(lambda: len(first.events("microbatch")) >= done_at_kill + 30, 90,
             "30 more microbatches through the pipeline without the bootstrap")

    # A newcomer knows only a live peer's address; the run spec and the stage map come from the DHT.
    joiner = local_swarm.start_peer("--num-threads", "1", bootstrap=reachable_at(first))
    wait_for(lambda: joiner.events("status") or not joiner.is_alive(), 150, "the joiner to train")
    assert joiner.is_alive(), joiner.log_tail()
    stage = joiner.events("joined")[0]["stage"]
    assert stage in (0, 1)
    downloads = joiner.events("state_download")
    assert len(downloads) == 1 and downloads[0]["version"] >= 0  # its stage was held: it pulled the state
    assert all(p.is_alive() for p in peers)
    assert joiner.events("joined")[0]["t"] > killed_at
