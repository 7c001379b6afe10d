"""peer.session over real hivemind P2P: two stage sessions (stage 0 and stage 1 of one run, each on
its own DHT node) train a real model together; stopping ends ``serve`` with no transition; closing
announces the leave and stops every task the session started; a session reports its services'
counters for the peer's snapshot."""

from __future__ import annotations

import asyncio
import math

import torch

from dht.records import ModelSpec, PeerRecord, RunSpec
from dht.registry import declare_peer
from peer.backup import BackupKeeper
from peer.config import PeerConfig
from peer.event_log import EventLog
from peer.context import PeerContext
from peer.session import StageSession
from swarm.data import load_corpus
from swarm.stage import Stage
from swarm.view import SwarmView

SPEC = RunSpec(run_id="session", model=ModelSpec(d_model=32, num_layers=2, num_heads=2, seq_len=16),
               stage_layers=((0, 1), (1, 2)), microbatch_size=4, target_batch_size=8, lr=3e-3)
SESSION_TASKS = {"heartbeat", "averaging", "status", "failure-detector", "trainer", "backup", "rebalance",
                 "rescue", "layout"}


class Host:
    """The peer's side of a session (``peer.session.SessionHost``): its state and its DHT record."""

    def __init__(self, dht, validator, stage: int) -> None:
        self.dht, self.validator, self.stage = dht, validator, stage
        self.state = "training"
        self.num_leaving = 0
        self.rounds: list[tuple[float, str]] = []

    def is_working(self) -> bool:
        return self.state in ("training", "paused")

    def is_training(self) -> bool:
        return self.state == "training"

    def is_paused(self) -> bool:
        return self.state == "paused"

    def toggle_pause(self) -> None:
        self.state = "training" if self.state == "paused" else "paused"

    def check_memory(self, stage_index: int) -> None:
        pass  # any stage of this tiny model fits

    def leaving(self) -> None:
        self.state = "leaving"
        self.num_leaving += 1

    def averaged(self, at: float, digest: str) -> None:
        self.rounds.append((at, digest))

    async def heartbeat(self) -> None:
        record = PeerRecord(peer_id=self.dht.peer_id.to_base58(), role="reliable", state=self.state,
                            stage=self.stage, flops=1e9)
        await declare_peer(self.dht, self.validator, SPEC.run_id, record, ttl=10)


async def new_session(dht, validator, stage_index: int) -> tuple[StageSession, Host]:
    """A session of ``stage_index`` (not opened yet), on its own DHT node, with its host's record published."""
    config = PeerConfig(bootstrap=("/ip4/127.0.0.1/tcp/1/p2p/QmX",), run_id=SPEC.run_id, stage=stage_index,
                        max_in_flight=2, request_timeout=10.0, status_period=1.0)
    peer_id, p2p = dht.peer_id.to_base58(), await dht.replicate_p2p()
    view, metrics = SwarmView(dht, SPEC.run_id), EventLog(None)
    ctx = PeerContext(config=config, role="reliable", peer_id=peer_id, dht=dht, p2p=p2p, view=view, base_spec=SPEC,
                      keeper=BackupKeeper(p2p, view, SPEC, peer_id=peer_id, config=config, metrics=metrics),
                      metrics=metrics, reputation=None, faults={}, tokens=load_corpus(SPEC.dataset).text())
    host = Host(dht, validator, stage_index)
    await host.heartbeat()
    return StageSession(ctx, SPEC, Stage(SPEC, stage_index, device=torch.device("cpu")), host), host


def running_session_tasks() -> set[str]:
    return {t.get_name() for t in asyncio.all_tasks() if not t.done()} & SESSION_TASKS


def test_two_sessions_train_a_pipeline_then_close_everything_they_opened(dht_nodes):
    _, (dht1, v1), (dht2, v2) = dht_nodes

    async def main() -> None:
        first, first_host = await new_session(dht1, v1, 0)
        last, last_host = await new_session(dht2, v2, 1)
        for session in (first, last):
            await session.open()
        assert first.trainer is not None and first.router is not None and first.gradient_sync is not None
        assert last.trainer is None and last.router is None  # the last stage sends nothing on
        stop = asyncio.Event()
        serving = [asyncio.create_task(session.serve(stop)) for session in (first, last)]
        async with asyncio.timeout(120):
            # two batches through, both stepped at stage 0: a step is applied after its exchange counts (CI
            # rehearsal, loaded: 2 exchanges counted while the version was still 1), so wait for both
            while (last.stage.counters.num_samples < 2 * SPEC.target_batch_size
                   or first.gradient_sync.num_exchanges < 2 or first.stage.version < 2):
                await asyncio.sleep(0.1)
                for task in serving:
                    assert not task.done(), task  # neither session failed nor named a transition
        assert running_session_tasks() >= {"heartbeat", "trainer", "rescue", "layout", "failure-detector"}
        counters = first.counters()
        assert counters.route_failures == 0 and counters.exchanges >= 2  # a step per batch (alone in its stage)
        assert counters.exchanges_alone == counters.exchanges  # no co-replica: every step is taken alone
        assert math.isfinite(last.stage.counters.last_loss) and first.stage.version >= 2
        stop.set()
        assert await asyncio.gather(*serving) == [None, None]  # a stop is no transition
        for session, host in ((first, first_host), (last, last_host)):
            assert await session.close(announce=True) is None
            assert session.is_closed and host.num_leaving == 1 and host.state == "leaving"
        await asyncio.sleep(0)  # let the cancelled tasks finish cancelling
        assert running_session_tasks() == set()
        for session in (first, last):
            await session.ctx.view.shutdown()

    asyncio.run(main())


def test_a_session_closed_with_keep_state_returns_its_stage_state(dht_nodes):
    _, (dht1, v1), _ = dht_nodes

    async def main() -> None:
        session, host = await new_session(dht1, v1, 1)
        expected = await session.stage.run(session.stage.state_tensors)
        async with session:  # closes with announce=True when the block ends, unless closed already
            kept = await session.close(announce=False, keep_state=True)
        assert host.num_leaving == 0  # closed without announcing: no leave
        assert set(kept) == set(expected)
        assert all(torch.equal(kept[name], expected[name]) for name in expected)
        await session.ctx.view.shutdown()

    asyncio.run(main())
