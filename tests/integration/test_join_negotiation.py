"""A joiner's stage choice over real DHT nodes: it is taken from two reads that agree, so a concurrent
joiner's intent that one read missed still counts; and an older joiner's intent that arrives after
the choice was declared still moves it."""

from __future__ import annotations

import asyncio
import dataclasses

from hivemind.utils import get_dht_time

from dht.records import PeerRecord, RunSpec
from dht.registry import declare_peer
from peer.join import choose_stage_from_view, negotiate_stage, settle_stage
from swarm.view import SwarmView

SPEC = RunSpec(run_id="alpha")  # two stages


def test_a_concurrent_joiner_that_the_first_read_missed_still_counts(dht_nodes):
    (me, my_validator), (other, other_validator), _ = dht_nodes
    me_id, other_id = me.peer_id.to_base58(), other.peer_id.to_base58()
    now = get_dht_time()
    # the other joiner announced first, so it picks first; it is stored only after this peer's first read
    other_intent = PeerRecord(peer_id=other_id, role="reliable", state="joining", stage=-1, flops=1e9, announced_at=now - 1)
    my_intent = PeerRecord(peer_id=me_id, role="reliable", state="joining", stage=-1, flops=1e9, announced_at=now)

    async def main():
        assert await declare_peer(me, my_validator, SPEC.run_id, my_intent, ttl=60)
        view = SwarmView(me, SPEC.run_id)
        read, reads = view.refresh, []

        async def refresh_then_the_other_announces():
            records = await read()
            reads.append(choose_stage_from_view(SPEC, records, me_id))
            if len(reads) == 1:
                assert await declare_peer(other, other_validator, SPEC.run_id, other_intent, ttl=60)
            return records

        view.refresh = refresh_then_the_other_announces
        stage, snapshot = await negotiate_stage(view, SPEC, me_id, settle_delay=0.0, timeout=20.0)
        return stage, snapshot, reads

    stage, snapshot, reads = asyncio.run(main())
    assert reads[0] == 0, "alone, this peer would take stage 0"
    assert {r.peer_id for r in snapshot} == {me_id, other_id}
    assert stage == 1, f"the other joiner picks first and takes stage 0; reads gave {reads}"
    assert len(reads) >= 3 and reads[-1] == reads[-2] == 1


def test_an_older_joiners_late_intent_moves_a_joiner_that_already_declared(dht_nodes):
    """The race two confirming reads cannot close: the older joiner's intent reaches the DHT only after
    this peer confirmed and declared its stage. The recheck after declaring sees it and moves this
    peer before it takes any state (peer/join.py settle_stage)."""
    (me, my_validator), (other, other_validator), _ = dht_nodes
    me_id, other_id = me.peer_id.to_base58(), other.peer_id.to_base58()
    now = get_dht_time()
    my_intent = PeerRecord(peer_id=me_id, role="reliable", state="joining", stage=-1, flops=1e9, announced_at=now)
    other_intent = PeerRecord(peer_id=other_id, role="reliable", state="joining", stage=-1, flops=1e9, announced_at=now - 1)
    declared: list[int] = []

    async def main() -> tuple[int, list[PeerRecord]]:
        assert await declare_peer(me, my_validator, SPEC.run_id, my_intent, ttl=60)

        async def declare(stage: int) -> None:
            declared.append(stage)
            mine = dataclasses.replace(my_intent, state="syncing", stage=stage)
            assert await declare_peer(me, my_validator, SPEC.run_id, mine, ttl=60)
            if len(declared) == 1:  # the older intent lands only now
                assert await declare_peer(other, other_validator, SPEC.run_id, other_intent, ttl=60)

        return await settle_stage(SwarmView(me, SPEC.run_id), SPEC, me_id, settle_delay=0.0, timeout=20.0,
                                  declare=declare, recheck=3.0)

    stage, snapshot = asyncio.run(main())
    assert declared == [0, 1], "alone it declared stage 0; the older joiner's intent moved it to stage 1"
    assert stage == 1 and choose_stage_from_view(SPEC, snapshot, me_id) == 1
    assert {r.peer_id for r in snapshot} == {me_id, other_id}


def test_a_joiner_keeps_its_declared_stage_when_no_older_intent_arrives(dht_nodes):
    (me, my_validator), (other, other_validator), _ = dht_nodes
    me_id, other_id = me.peer_id.to_base58(), other.peer_id.to_base58()
    now = get_dht_time()
    my_intent = PeerRecord(peer_id=me_id, role="reliable", state="joining", stage=-1, flops=1e9, announced_at=now)
    younger = PeerRecord(peer_id=other_id, role="reliable", state="syncing", stage=0, flops=1e9, announced_at=now + 1)
    declared: list[int] = []

    async def main() -> tuple[int, list[PeerRecord]]:
        assert await declare_peer(me, my_validator, SPEC.run_id, my_intent, ttl=60)

        async def declare(stage: int) -> None:
            declared.append(stage)
            assert await declare_peer(me, my_validator, SPEC.run_id, dataclasses.replace(my_intent, state="syncing", stage=stage), ttl=60)
            # a younger peer that declared the same stage (it missed this one): not this peer's to fix
            assert await declare_peer(other, other_validator, SPEC.run_id, younger, ttl=60)

        return await settle_stage(SwarmView(me, SPEC.run_id), SPEC, me_id, settle_delay=0.0, timeout=20.0,
                                  declare=declare, recheck=2.0)

    stage, _ = asyncio.run(main())
    assert declared == [0] and stage == 0
