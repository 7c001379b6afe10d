"""Peer records bound to their peer ids, through real hivemind DHT nodes on 127.0.0.1.

A forger writes records that are correctly RSA-signed under its own record key (the DHT stores
them) but claim another node's peer id: readers drop them with a logged reason, whether the victim
is alive (its own record keeps counting) or dead (the forgery does not keep it alive).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from hivemind.utils import get_dht_time

from dht.identity import identity_of
from dht.node import DHTNodeConfig, open_dht, visible_maddrs
from dht.records import PeerRecord, peers_key
from dht.registry import declare_peer, fetch_peers

RUN = "alpha"


def peer_id(dht) -> str:
    return dht.peer_id.to_base58()


async def forge(forger, validator, record: PeerRecord, *, bind: bool, ttl: float = 60.0) -> bool:
    """Store ``record`` under the forger's own record key (a valid DHT signature), with the forger's
    own binding (``bind``: a valid signature, by the wrong identity) or none."""
    if bind:
        peer_key, signature = identity_of(forger).bind(RUN, validator.local_public_key)
        record = dataclasses.replace(record, peer_key=peer_key, peer_signature=signature)
    return await forger.store(peers_key(RUN), record.to_wire(), get_dht_time() + ttl,
                              subkey=validator.local_public_key, return_future=True)


def test_a_record_claiming_a_live_peers_id_is_dropped_and_its_own_record_counts(dht_nodes, caplog):
    (victim, victim_validator), (forger, forger_validator), (reader, _) = dht_nodes
    honest = PeerRecord(peer_id=peer_id(victim), role="reliable", state="training", stage=1, flops=1e9,
                        samples_per_s=5.0, version=12, announced_at=get_dht_time())
    lie = dataclasses.replace(honest, stage=0, role="unreliable", samples_per_s=1e9, flops=1e18, version=10**9,
                              announced_at=get_dht_time() + 100, backup_stage=0, backup_version=10**9)

    async def main():
        assert await declare_peer(victim, victim_validator, RUN, honest, ttl=60)
        assert await forge(forger, forger_validator, lie, bind=True)
        for _ in range(3):  # read again and again: the forgery is logged once, not once per read
            assert [_figures(r) for r in await fetch_peers(reader, RUN)] == [_figures(honest)]
        assert await forge(forger, forger_validator, lie, bind=False)  # replaces the forger's entry
        assert [_figures(r) for r in await fetch_peers(reader, RUN)] == [_figures(honest)]

    with caplog.at_level(logging.WARNING, logger="dht.rpc"):
        asyncio.run(main())
    refusals = [r.getMessage() for r in caplog.records if f"claiming peer id {peer_id(victim)}" in r.getMessage()]
    assert len(refusals) == 2, refusals  # each distinct forgery once, not once per read
    assert "does not verify" in refusals[0] and "no binding" in refusals[1]


def _figures(record: PeerRecord) -> tuple:
    return (record.peer_id, record.role, record.stage, record.flops, record.samples_per_s, record.version,
            record.backup_stage)


def test_forged_heartbeats_do_not_keep_a_dead_peer_alive(dht_nodes):
    (bootstrap, _), (forger, forger_validator), (reader, _) = dht_nodes
    victim, victim_validator = open_dht(DHTNodeConfig(initial_peers=tuple(visible_maddrs(bootstrap))))
    victim_id = peer_id(victim)
    record = PeerRecord(peer_id=victim_id, role="reliable", state="training", stage=0, flops=1e9,
                        announced_at=get_dht_time())

    async def main():
        assert await declare_peer(victim, victim_validator, RUN, record, ttl=2.0)
        assert [r.peer_id for r in await fetch_peers(reader, RUN)] == [victim_id]
        victim.shutdown()  # dead: its last heartbeat expires in 2 s
        deadline = get_dht_time() + 8.0
        while get_dht_time() < deadline:  # the forger keeps "heartbeating" for it, fresher every time
            now = get_dht_time()
            assert await forge(forger, forger_validator, dataclasses.replace(record, announced_at=now), bind=True,
                               ttl=5.0)
            seen = [r.peer_id for r in await fetch_peers(reader, RUN)]
            if now > deadline - 5.0:  # well past the real heartbeat's expiry
                assert seen == [], seen
            await asyncio.sleep(0.5)  # the forger's heartbeat cadence (the attack), not a synchronisation

    try:
        asyncio.run(main())
    finally:
        victim.shutdown()


def test_a_persistent_rsa_identity_binds_its_records_across_restarts(tmp_path, dht_nodes):
    (bootstrap, _), _, (reader, _) = dht_nodes
    config = DHTNodeConfig(initial_peers=tuple(visible_maddrs(bootstrap)), identity_path=str(tmp_path / "peer.id"))
    seen = [_declare_and_read(config, reader) for _ in range(2)]
    assert seen[0] == seen[1] == [(seen[0][0][0], True)]


def _declare_and_read(config: DHTNodeConfig, reader) -> list[tuple[str, bool]]:
    """Start a node with ``config``, declare its record, read what ``reader`` sees; stop the node."""
    node, validator = open_dht(config)
    try:
        assert peer_id(node).startswith("Qm")  # hivemind's RSA identity format: the key is hashed, not inlined
        record = PeerRecord(peer_id=peer_id(node), role="reliable", state="training", stage=0, flops=1e9,
                            announced_at=get_dht_time())

        async def main():
            assert await declare_peer(node, validator, RUN, record, ttl=60)
            return [(r.peer_id, len(r.peer_key) > 0) for r in await fetch_peers(reader, RUN)]
        return asyncio.run(main())
    finally:
        node.shutdown()
