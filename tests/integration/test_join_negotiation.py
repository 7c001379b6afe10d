"""A joiner's stage choice over real DHT nodes: it is taken from two reads that agree, so a concurrent
joiner's intent that one read missed still counts."""

from __future__ import annotations

import asyncio

from hivemind.utils import get_dht_time

from dht.records import PeerRecord, RunSpec
from dht.registry import declare_peer
from peer.join import choose_stage_from_view, negotiate_stage
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
