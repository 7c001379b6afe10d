"""run_bootstrap.py: a persistent identity keeps the peer id; peers may list several bootstrap addresses."""

from __future__ import annotations

import pytest

from peer.harness.local_swarm import LocalSwarm, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
DEAD_BOOTSTRAP = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWSat51nqvjB9HV13Cyqw1FMSJRYXAY8nqF5Hh2Wbxkbss"


def peer_id_of(maddr: str) -> str:
    return maddr.rsplit("/p2p/", 1)[1]


def test_identity_file_keeps_the_peer_id_across_restarts(tmp_path):
    identity = tmp_path / "bootstrap.id"
    ids = []
    for attempt in range(2):
        with LocalSwarm(tmp_path / f"run{attempt}") as swarm:
            maddrs = swarm.start_bootstrap("--identity-path", str(identity))
            ids.append({peer_id_of(m) for m in maddrs})
            assert swarm.stop(swarm.bootstrap) == 0
    assert len(ids[0]) == 1 and ids[0] == ids[1]
    assert identity.exists() and (tmp_path / "bootstrap.id.rsa").exists()


def test_a_peer_joins_when_one_of_its_bootstrap_addresses_is_dead(local_swarm):
    local_swarm.start_bootstrap()
    peer = local_swarm.start_peer("--num-threads", "1", bootstrap=[DEAD_BOOTSTRAP, *local_swarm.maddrs])
    wait_for(lambda: peer.events("joined") or not peer.is_alive(), 90, "the peer to join")
    assert peer.is_alive(), peer.log_tail()
    assert peer.events("joined")[0]["stage"] == 0
