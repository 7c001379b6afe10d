"""run_bootstrap.py: a persistent identity keeps the peer id and the run's owner key; peers may list
several bootstrap addresses."""

from __future__ import annotations

import pytest

from peer.harness.local_swarm import LocalSwarm, wait_for

pytestmark = [pytest.mark.smoke, pytest.mark.timeout(240)]
DEAD_BOOTSTRAP = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWSat51nqvjB9HV13Cyqw1FMSJRYXAY8nqF5Hh2Wbxkbss"


def peer_id_of(maddr: str) -> str:
    return maddr.rsplit("/p2p/", 1)[1]


def test_identity_file_keeps_the_peer_id_and_the_run_owner_across_restarts(tmp_path):
    identity = tmp_path / "bootstrap.id"
    ids, owners = [], []
    for attempt in range(2):
        with LocalSwarm(tmp_path / f"run{attempt}") as swarm:
            maddrs = swarm.start_bootstrap("--identity-path", str(identity))
            ids.append({peer_id_of(m) for m in maddrs})
            owners.append(swarm.run_owner())
            assert swarm.stop(swarm.bootstrap) == 0
    assert len(ids[0]) == 1 and ids[0] == ids[1]
    assert owners[0] == owners[1]
    assert identity.exists() and (tmp_path / "bootstrap.id.rsa").exists()


def test_a_peer_joins_when_one_of_its_bootstrap_addresses_is_dead(local_swarm):
    local_swarm.start_bootstrap()
    peer = local_swarm.start_peer("--num-threads", "1", bootstrap=[DEAD_BOOTSTRAP, *local_swarm.maddrs])
    wait_for(lambda: peer.events("joined") or not peer.is_alive(), 90, "the peer to join")
    assert peer.is_alive(), peer.log_tail()
    assert peer.events("joined")[0]["stage"] == 0


def test_a_second_bootstrap_serves_the_first_ones_run_and_its_peers_trust_that_owner(local_swarm, tmp_path):
    local_swarm.start_bootstrap()
    owner = local_swarm.run_owner()
    with LocalSwarm(tmp_path / "second") as second:
        maddrs = second.start_bootstrap("--initial-peers", *local_swarm.maddrs)
        assert second.run_owner() == owner  # it publishes no spec of its own
        assert "publishes no spec of its own" in second.bootstrap.log_path.read_text()
        peer = local_swarm.start_peer("--num-threads", "1", bootstrap=maddrs)  # knows only the second bootstrap
        wait_for(lambda: peer.events("joined") or not peer.is_alive(), 90, "the peer to join")
        assert peer.is_alive(), peer.log_tail()
        assert f"is owned by key {owner} (the only key that publishes it" in peer.log_path.read_text()
