"""A run is owned by its bootstrap's key: a stranger publishing a competing spec under the same run id
is refused by name, whether or not the joiner pinned the owner (issue "Nobody gets in where they
don't belong", door 1).

The rogue is this test process: a real hivemind DHT node in the swarm whose record key is chosen so
that its fingerprint sorts before the owner's (before, joiners took "the first by publisher key"),
serving a well-signed spec of the same run id with another seed and learning rate.
"""

from __future__ import annotations

import asyncio

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from dht.node import DHTNodeConfig, open_dht
from dht.records import RunSpec
from dht.registry import declare_run_spec, fetch_run_specs, owner_fingerprint
from peer.harness.local_swarm import wait_for

pytestmark = [pytest.mark.scenario, pytest.mark.timeout(300)]
ARGS = ("--num-threads", "1", "--rebalance-period", "0", "--join-timeout", "60")


def rogue_key_sorting_before(owner: str) -> RSAPrivateKey:
    for _ in range(64):  # each fresh key sorts first with probability about 1/2
        key = RSAPrivateKey()
        if owner_fingerprint(RSASignatureValidator(key).local_public_key) < owner:
            return key
    raise AssertionError("no RSA key in 64 sorts before the owner's")


def key_in_the_upper_half() -> RSAPrivateKey:
    """An owner key whose fingerprint sorts after half of all keys (so that a rogue key sorting before
    it is found in a few tries: with a key like 00..., 64 tries are not enough)."""
    for _ in range(64):
        key = RSAPrivateKey()
        if owner_fingerprint(RSASignatureValidator(key).local_public_key) >= "8":
            return key
    raise AssertionError("no RSA key in 64 sorts in the upper half")


def test_joiners_follow_the_owners_spec_and_name_the_rogue(local_swarm, tmp_path):
    (tmp_path / "owner.id.rsa").write_bytes(key_in_the_upper_half().to_bytes())  # the bootstrap's record key
    local_swarm.start_bootstrap("--identity-path", str(tmp_path / "owner.id"))
    owner = local_swarm.run_owner()
    assert owner >= "8"
    identity = tmp_path / "rogue.id"
    (tmp_path / "rogue.id.rsa").write_bytes(rogue_key_sorting_before(owner).to_bytes())
    dht, validator = open_dht(DHTNodeConfig(initial_peers=tuple(local_swarm.maddrs), identity_path=str(identity)))
    try:
        rogue = owner_fingerprint(validator.local_public_key)
        assert rogue < owner
        competing = RunSpec(run_id="demo", seed=666, lr=9.0)
        assert asyncio.run(declare_run_spec(dht, validator, competing))
        published = asyncio.run(fetch_run_specs(dht, "demo"))
        assert [p.owner for p in published] == [rogue, owner]  # the rogue's spec is the first one a reader finds

        unpinned = local_swarm.start_peer("--stage", "0", *ARGS)
        pinned = local_swarm.start_peer("--stage", "1", "--run-owner", owner, *ARGS)
        peers = [unpinned, pinned]
        wait_for(lambda: all(p.events("status") or not p.is_alive() for p in peers), 150, "both peers to train")
        for peer in peers:
            assert peer.is_alive(), peer.log_tail()
            log = peer.log_path.read_text()
            assert "run spec: run demo:" in log and "seed 0" in log and "seed 666" not in log, peer.log_tail()
            assert f"refused a run spec for 'demo' published by key {rogue}" in log, peer.log_tail()
        assert f"is owned by key {owner} (the key of bootstrap" in unpinned.log_path.read_text()
        assert f"is owned by key {owner} (pinned with --run-owner)" in pinned.log_path.read_text()
    finally:
        dht.shutdown()
