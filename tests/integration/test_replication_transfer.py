"""Multi-donor state replication over real hivemind P2P on loopback (seed 003 §III, DESIGN §1 step 5).

Node 0 of ``dht_nodes`` is the joiner, the others are donors. Faults are injected at a known
(donor, shard count) through ``ReplicationServer.load_shard`` overrides — no sleeps.

The four DHT nodes and one event loop are shared by the tests of this module (starting 4 nodes
per test made the file take 100 s on a loaded 2-core machine; a DHT's P2P replica belongs to the
loop that made it). Each test serves under a run id of its own, so no handler of an earlier test
is reached. The test that kills a donor gets nodes of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hivemind.p2p import PeerID

from dht.reputation import Reputation
from dht.rpc import RemoteError, call_peer
from dht.wire import read_message
import replication.transfer as transfer
from peer.faults import ALLOW_ENV, inject_corrupt_shards
from replication.assignment import NeighbourLink, SearchConfig
from replication.config import TransferConfig
from replication.fetcher import CORRUPT_PIECE_STRIKES
from replication.manifest import piece_size_for
from replication.server import ReplicationServer, manifest_handler, probe_handler, shard_handler
from replication.transfer import PullResult, TransferError, pull_state
from tests.conftest import open_dht_nodes

RUN, STAGE, VERSION = "rtest", 1, 7
CONFIG = TransferConfig(piece_bytes=64 * 1024, search=SearchConfig(min_shard_bytes=64 * 1024, max_shard_bytes=256 * 1024),
                        request_timeout=10.0, shard_timeout_floor=10.0)
pytestmark = pytest.mark.timeout(60)


_RUN_IDS = (f"rtest{n}" for n in itertools.count())


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop for the module: a DHT caches its P2P replica, bound to the loop that made it."""
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        leftovers = asyncio.all_tasks(loop)
        for task in leftovers:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


@pytest.fixture(scope="module")
def dht_nodes() -> Iterator[list]:
    with open_dht_nodes(4) as nodes:
        yield nodes


@pytest.fixture
def fresh_nodes() -> Iterator[list]:
    with open_dht_nodes(4) as nodes:
        yield nodes


@pytest.fixture(autouse=True)
def own_run_id(monkeypatch) -> None:
    """A run id per test: the helpers below read ``RUN`` when called."""
    monkeypatch.setattr(sys.modules[__name__], "RUN", next(_RUN_IDS))


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """About 8.3 MB: float32 weights and moments, int64 ids, 0-d step and scale."""
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(1024, 1024, generator=g),
        "layer.bias": torch.randn(1000, generator=g),
        "optim.exp_avg": torch.randn(512, 1024, generator=g),
        "optim.exp_avg_sq": torch.rand(512, 1024, generator=g),
        "embed.ids": torch.randint(0, 1 << 40, (4096, 8), generator=g, dtype=torch.int64),
        "optim.step": torch.tensor(1234, dtype=torch.int64),
        "scale": torch.tensor(0.5),
    }


STATE = make_state()
STATE_BYTES = sum(t.numel() * t.element_size() for t in STATE.values())


class CountingServer(ReplicationServer):
    """Records every shard index it is asked for; ``fault(server, index, data)`` may alter or abort."""

    def __init__(self, *args, fault: Callable | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requested: list[int] = []  # first piece of each request
        self.pieces: list[int] = []  # every piece asked for
        self.fault = fault

    async def load_shard(self, version: int, shard_bytes: int, index: int, count: int = 1,
                         **kwargs) -> bytes | bytearray | memoryview:
        self.requested.append(index)
        self.pieces.extend(range(index, index + count))
        self.shard_bytes = shard_bytes
        data = await super().load_shard(version, shard_bytes, index, count, **kwargs)
        return data if self.fault is None else await self.fault(self, index, data)


async def start_donors(nodes, states: list[dict], faults: dict[int, Callable] | None = None) -> list[CountingServer]:
    servers = []
    for position, ((dht, _), state) in enumerate(zip(nodes, states)):
        async def snapshot(state=state):
            return VERSION, state

        server = CountingServer(await dht.replicate_p2p(), run_id=RUN, stage=STAGE, snapshot_fn=snapshot,
                                fault=(faults or {}).get(position))
        await server.start()
        servers.append(server)
    return servers


def peer_ids(nodes) -> list[str]:
    return [dht.peer_id.to_base58() for dht, _ in nodes]


async def pull(joiner, donors: list[str], store_dir: Path, config: TransferConfig = CONFIG,
               reputation: Reputation | None = None) -> PullResult:
    return await pull_state(await joiner.replicate_p2p(), donors, run_id=RUN, stage=STAGE, store_dir=store_dir,
                            config=config, reputation=reputation)


def assert_identical(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor] = STATE) -> None:
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype and state[name].shape == tensor.shape, name
        assert torch.equal(state[name], tensor), name


def assert_accounted(result: PullResult) -> None:
    """Every shard came from exactly one donor, or from disk."""
    report = result.report
    assert sum(report.shards_by_donor.values()) + report.num_resumed == report.num_shards


def test_joiner_pulls_bit_identical_state_from_three_donors(loop, dht_nodes, tmp_path):
    (joiner, _), *donor_nodes = dht_nodes

    async def main():
        servers = await start_donors(donor_nodes, [STATE] * 3)
        result = await pull(joiner, peer_ids(donor_nodes), tmp_path / "store")
        assert_identical(result.state)
        report = result.report
        assert result.version == VERSION and report.failed_donors == {}
        assert sorted(report.bytes_by_donor) == sorted(peer_ids(donor_nodes))
        assert all(num_bytes > 0 for num_bytes in report.bytes_by_donor.values())
        assert sum(report.bytes_by_donor.values()) == STATE_BYTES
        assert report.num_shards >= 32 and report.num_resumed == 0 and report.num_refetched == 0
        assert report.piece_bytes == CONFIG.piece_bytes and report.shard_bytes % report.piece_bytes == 0
        pieces_per_request = report.shard_bytes // report.piece_bytes
        assert report.num_shard_requests - report.num_duplicated == -(-report.num_shards // pieces_per_request)
        # End-game copies cancelled before the donor read them never reach it.
        assert report.num_shard_requests - report.num_duplicated <= sum(len(s.requested) for s in servers)
        assert sum(len(s.requested) for s in servers) <= report.num_shard_requests
        # One hash pass per donor: the manifest at the piece size only.
        assert [server.cached_shard_sizes(VERSION) for server in servers] == [(CONFIG.piece_bytes,)] * 3
        assert_accounted(result)

    loop.run_until_complete(main())


def test_donor_that_dies_mid_transfer_is_dropped_and_its_shards_refetched(loop, fresh_nodes, tmp_path):
    (joiner, _), *donor_nodes = fresh_nodes
    dying_dht, num_served_before_death = donor_nodes[0][0], 3

    async def die_after_k(server: CountingServer, index: int, data):
        if len(server.requested) > num_served_before_death:  # the (k+1)-th request: the peer is gone
            if dying_dht.is_alive():
                await asyncio.to_thread(dying_dht.shutdown)
            raise ConnectionError("donor died")
        return data

    async def main():
        servers = await start_donors(donor_nodes, [STATE] * 3, faults={0: die_after_k})
        dead = peer_ids(donor_nodes)[0]
        result = await pull(joiner, peer_ids(donor_nodes), tmp_path / "store")
        assert_identical(result.state)
        report = result.report
        assert list(report.failed_donors) == [dead] and "pieces" in report.failed_donors[dead]
        assert report.num_refetched >= 1
        assert report.shards_by_donor.get(dead, 0) <= num_served_before_death * report.shard_bytes // report.piece_bytes
        assert not dying_dht.is_alive() and len(servers[0].requested) > num_served_before_death
        assert_accounted(result)

    loop.run_until_complete(main())


def test_donor_serving_a_corrupted_shard_is_caught_and_dropped(loop, dht_nodes, tmp_path):
    (joiner, _), *donor_nodes = dht_nodes

    async def flip_a_byte(server: CountingServer, index: int, data):
        corrupted = bytearray(data)
        corrupted[len(corrupted) // 2] ^= 0x40
        return corrupted

    async def main():
        servers = await start_donors(donor_nodes, [STATE] * 3, faults={1: flip_a_byte})
        bad = peer_ids(donor_nodes)[1]
        result = await pull(joiner, peer_ids(donor_nodes), tmp_path / "store")
        assert_identical(result.state)
        report = result.report
        assert list(report.failed_donors) == [bad] and "does not match" in report.failed_donors[bad]
        assert bad not in report.shards_by_donor and report.num_refetched >= 1
        assert len(servers[1].requested) >= 1  # it did serve, and every shard it served was rejected
        assert set(report.shards_by_donor) == set(peer_ids(donor_nodes)) - {bad}
        assert_accounted(result)

    loop.run_until_complete(main())


def test_a_donor_that_keeps_serving_corrupted_pieces_is_struck_then_banned_and_not_asked_again(
        loop, dht_nodes, tmp_path, monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")
    (joiner, _), *donor_nodes = dht_nodes
    donors, bans = peer_ids(donor_nodes), []

    async def main():
        servers = await start_donors(donor_nodes, [STATE] * 3)
        inject_corrupt_shards(servers[1])  # every second request it answers (the first too) has each piece's byte flipped
        liar = donors[1]
        reputation = Reputation(max_strikes=2 * CORRUPT_PIECE_STRIKES, window=600.0,
                                on_ban=lambda peer_id, reason: bans.append((peer_id, reason)))
        for attempt in range(1, 3):  # the same joiner pulls twice (say, it moved away and back)
            result = await pull(joiner, donors, tmp_path / f"store{attempt}", reputation=reputation)
            assert_identical(result.state)  # the right state every time, from the honest donors
            report = result.report
            assert list(report.failed_donors) == [liar] and "does not match" in report.failed_donors[liar]
            assert report.num_refetched >= 1  # what it had left went to the others (its honest answers count)
            assert_accounted(result)
            if attempt == 1:  # proof of corruption weighs several strikes, but one run is not yet a ban
                assert CORRUPT_PIECE_STRIKES <= reputation.num_strikes_of(liar) < 2 * CORRUPT_PIECE_STRIKES
                assert not reputation.is_banned(liar)
        assert reputation.banned() == [liar] and reputation.num_bans == 1
        assert bans[0][0] == liar and "corrupted state" in bans[0][1] and "does not match" in bans[0][1]
        assert all(reputation.num_strikes_of(d) == 0 for d in donors if d != liar)
        asked = len(servers[1].requested)
        result = await pull(joiner, donors, tmp_path / "store3", reputation=reputation)
        assert_identical(result.state)
        assert result.report.failed_donors == {liar: "banned here for misbehaviour"}
        assert len(servers[1].requested) == asked  # a banned donor is not asked for anything

    loop.run_until_complete(main())


def test_interrupted_pull_resumes_without_refetching_held_shards(loop, dht_nodes, tmp_path):
    (joiner, _), *donor_nodes = dht_nodes
    donors, store_dir, num_requests_before_cancel = peer_ids(donor_nodes), tmp_path / "store", 15

    async def main():
        enough, servers = asyncio.Event(), []

        async def signal_when_enough(server: CountingServer, index: int, data):
            if sum(len(s.requested) for s in servers) >= num_requests_before_cancel:
                enough.set()
            return data

        servers += await start_donors(donor_nodes, [STATE] * 3, faults={i: signal_when_enough for i in range(3)})
        first = asyncio.create_task(pull(joiner, donors, store_dir))
        waiter = asyncio.create_task(enough.wait())
        async with asyncio.timeout(30):
            await asyncio.wait({first, waiter}, return_when=asyncio.FIRST_COMPLETED)
        assert enough.is_set() and not first.done()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        for server in servers:
            server.requested.clear()
            server.pieces.clear()

        result = await pull(joiner, donors, store_dir)
        assert_identical(result.state)
        report = result.report
        assert 1 <= report.num_resumed < report.num_shards
        num_missing = report.num_shards - report.num_resumed
        assert sum(report.shards_by_donor.values()) == num_missing
        pieces_per_request = report.shard_bytes // report.piece_bytes
        assert report.num_shard_requests - report.num_duplicated <= num_missing
        # Only missing pieces were asked for (end-game copies aside); donors may still see the up
        # to 3 x 2 requests the cancelled pull had in flight.
        again = {piece for server in servers for piece in server.pieces}
        assert num_missing <= len(again) <= num_missing + 6 * pieces_per_request
        assert_accounted(result)

    loop.run_until_complete(main())


def test_donor_with_a_disagreeing_manifest_is_dropped(loop, dht_nodes, tmp_path):
    (joiner, _), *donor_nodes = dht_nodes
    donors = peer_ids(donor_nodes)

    async def main():
        servers = await start_donors(donor_nodes, [STATE, STATE, make_state(seed=1)])
        result = await pull(joiner, donors, tmp_path / "store")
        assert_identical(result.state)
        report = result.report
        assert list(report.failed_donors) == [donors[2]] and "disagrees" in report.failed_donors[donors[2]]
        assert set(report.shards_by_donor) == set(donors[:2]) and servers[2].requested == []
        assert_accounted(result)
        servers[0].requested.clear()
        with pytest.raises(TransferError, match="agree") as refused:  # one against one: nobody to trust
            await pull(joiner, [donors[0], donors[2]], tmp_path / "other")
        assert len(refused.value.report.failed_donors) == 1  # the tie is broken, but nobody is trusted
        assert servers[0].requested == servers[2].requested == []

    loop.run_until_complete(main())


def test_hostile_requests_are_refused_and_the_donor_keeps_serving(loop, dht_nodes, tmp_path):
    (joiner, _), donor_node, *_ = dht_nodes
    donor = peer_ids([donor_node])[0]
    good = {"stage": STAGE, "shard_bytes": 65536}
    hostile = [
        (manifest_handler(RUN), {**good, "stage": STAGE + 1}, "stage"),
        (manifest_handler(RUN), {**good, "stage": True}, "stage"),
        (manifest_handler(RUN), {**good, "shard_bytes": 1}, "shard_bytes"),
        (manifest_handler(RUN), {**good, "shard_bytes": 1 << 40}, "shard_bytes"),
        (manifest_handler(RUN), {**good, "version": VERSION + 5}, "no longer held"),
        (shard_handler(RUN), {**good, "version": VERSION, "index": 10**6}, "out of range"),
        (shard_handler(RUN), {**good, "version": VERSION, "index": -1}, "index"),
        (shard_handler(RUN), {**good, "version": VERSION, "index": "0"}, "index"),
        (shard_handler(RUN), {**good, "version": 99, "index": 0}, "not held"),
        (shard_handler(RUN), {**good, "stage": 0, "version": VERSION, "index": 0}, "stage"),
        (shard_handler(RUN), {"stage": STAGE}, "version"),
        (shard_handler(RUN), {**good, "version": VERSION, "index": 0, "count": 0}, "count"),
        (shard_handler(RUN), {**good, "version": VERSION, "index": 0, "count": True}, "count"),
        (shard_handler(RUN), {**good, "version": VERSION, "index": 0, "count": 1 << 21}, "count"),
        (shard_handler(RUN), {**good, "version": VERSION, "index": 100, "count": 100}, "out of range"),
        (shard_handler(RUN), {**good, "shard_bytes": 1 << 29, "version": VERSION, "index": 0, "count": 4}, "exceed"),
        (probe_handler(RUN), {"nbytes": 1 << 40}, "nbytes"),
        (probe_handler(RUN), {"nbytes": -1}, "nbytes"),
        (probe_handler(RUN), {}, "nbytes"),
    ]

    async def send_raw(p2p, handler: str, raw: bytes) -> dict:
        async with asyncio.timeout(10):
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(donor), handler)
            writer.write(raw)
            await writer.drain()
            reply, _ = await read_message(reader, max_payload_bytes=0, timeout=10)
            writer.close()
        return reply

    async def main():
        (server,) = await start_donors([donor_node], [STATE])
        p2p = await joiner.replicate_p2p()
        reply, _ = await call_peer(p2p, donor, manifest_handler(RUN), good, timeout=10, max_payload_bytes=0)
        assert reply["manifest"]["version"] == VERSION
        for handler, header, reason in hostile:
            with pytest.raises(RemoteError, match=reason):
                await call_peer(p2p, donor, handler, header, timeout=10, max_payload_bytes=1 << 20)
        with pytest.raises(RemoteError, match="payload"):  # a tensor payload nobody asked for
            await call_peer(p2p, donor, probe_handler(RUN), {"nbytes": 8}, [torch.zeros(1000)], timeout=10,
                            max_payload_bytes=1 << 20)
        garbage = await send_raw(p2p, shard_handler(RUN), struct.pack(">I", 5) + b"\xc1" * 5)
        assert garbage["ok"] is False and "msgpack" in garbage["error"]
        oversized = await send_raw(p2p, manifest_handler(RUN), struct.pack(">I", 1 << 31))
        assert oversized["ok"] is False and "exceeds" in oversized["error"]
        assert server.num_refused == len(hostile) + 3 and server.num_shards_served == 0

        result = await pull(joiner, [donor], tmp_path / "store")  # and it keeps serving
        assert_identical(result.state)
        assert result.report.shards_by_donor == {donor: result.report.num_shards}

    loop.run_until_complete(main())


def test_stalled_donor_is_dropped_at_its_deadline_with_a_static_plan(loop, dht_nodes, tmp_path):
    (joiner, _), *donor_nodes = dht_nodes
    donors, num_served_before_stall = peer_ids(donor_nodes), 2
    config = dataclasses.replace(CONFIG, shard_timeout_floor=1.0, shard_timeout_slack=1.0, rebalance=False,
                                 endgame=False)

    async def main():
        never = asyncio.Event()

        async def stall_after_k(server: CountingServer, index: int, data):
            if len(server.requested) > num_served_before_stall:
                await never.wait()  # alive, connected, and silent
            return data

        servers = await start_donors(donor_nodes, [STATE] * 3, faults={0: stall_after_k})
        result = await pull(joiner, donors, tmp_path / "store", config)
        assert_identical(result.state)
        report = result.report
        assert list(report.failed_donors) == [donors[0]] and "Timeout" in report.failed_donors[donors[0]]
        assert report.num_shard_requests >= num_served_before_stall + 1 and report.num_duplicated == 0
        assert len(servers[0].requested) > num_served_before_stall
        assert report.num_refetched >= 1
        assert_accounted(result)

    loop.run_until_complete(main())


def test_stalled_donor_is_routed_around_before_its_deadline(loop, dht_nodes, tmp_path):
    """A donor that goes silent after two requests: with re-planning and the end game, the others
    take its queued runs and copy the ones it sits on, so the pull ends long before the stalled
    requests' deadline (an hour here), and nothing it holds back is waited for."""
    (joiner, _), *donor_nodes = dht_nodes
    donors, num_served_before_stall = peer_ids(donor_nodes), 2
    config = dataclasses.replace(CONFIG, shard_timeout_floor=3600.0)

    async def main():
        never = asyncio.Event()

        async def stall_after_k(server: CountingServer, index: int, data):
            if len(server.requested) > num_served_before_stall:
                await never.wait()
            return data

        servers = await start_donors(donor_nodes, [STATE] * 3, faults={0: stall_after_k})
        async with asyncio.timeout(30):
            result = await pull(joiner, donors, tmp_path / "store", config)
        assert_identical(result.state)
        report = result.report
        assert report.failed_donors == {}
        stalled_requests = len(servers[0].requested) - num_served_before_stall
        assert 1 <= stalled_requests <= config.max_in_flight_per_donor
        assert report.num_duplicated >= stalled_requests  # each run it sat on came from another donor
        assert set(report.shards_by_donor) >= set(donors[1:])
        assert_accounted(result)

    loop.run_until_complete(main())


def test_queued_runs_move_from_a_slow_donor_to_the_fast_ones(loop, dht_nodes, tmp_path):
    """Donor 0 is ten times slower than it probed (each request waits 0.1 s per piece). The plan
    from the probes gives it a third of the runs; measured rates move its queued runs to the others,
    so it ends up serving only a few."""
    (joiner, _), *donor_nodes = dht_nodes
    donors = peer_ids(donor_nodes)

    async def main():
        servers: list[CountingServer] = []

        async def slow_donor_0(server: CountingServer, index: int, data):
            if server is servers[0]:
                await asyncio.sleep(0.1 * len(data) / CONFIG.piece_bytes)  # the fault: a slow link, not a wait
            return data

        servers += await start_donors(donor_nodes, [STATE] * 3, faults={i: slow_donor_0 for i in range(3)})
        result = await pull(joiner, donors, tmp_path / "store")
        assert_identical(result.state)
        report = result.report
        assert report.failed_donors == {} and report.num_replans >= 2
        assert report.shards_by_donor.get(donors[0], 0) < report.num_shards / 6
        assert_accounted(result)

    loop.run_until_complete(main())


def test_a_state_of_many_pieces_is_hashed_at_a_doubled_piece_size(loop, dht_nodes, tmp_path):
    """8.7 MB at 4 KiB pieces would be 2,000+ digests: every donor doubles p until there are at
    most 1,024 pieces, the joiner expects exactly that, and the pull completes bit-identical."""
    (joiner, _), *donor_nodes = dht_nodes
    config = dataclasses.replace(CONFIG, piece_bytes=4096)

    async def main():
        servers = await start_donors(donor_nodes, [STATE] * 3)
        result = await pull(joiner, peer_ids(donor_nodes), tmp_path / "store", config)
        assert_identical(result.state)
        piece = piece_size_for(STATE_BYTES, 4096)
        assert piece > 4096 and result.report.piece_bytes == piece
        assert result.report.num_shards == -(-STATE_BYTES // piece) <= 1024 < -(-STATE_BYTES // (piece // 2))
        assert [server.cached_shard_sizes(VERSION) for server in servers] == [(piece,)] * 3
        assert result.report.failed_donors == {}

    loop.run_until_complete(main())
