"""Issue #15's join race over real hivemind P2P on loopback: a lone holder steps while a joiner pulls.

On a 20 Mbit/s + 40 ms link a 2 s pull outlived its version: the holder's other callers (its backup
keeper, the bootstrap's samples) froze newer versions, the joiner's was evicted, and the joiner died
with ``version 0 is not held here (held: [1, 3])``. Here the holder's ``load_shard`` holds the
joiner's first requests until the test has stepped the holder twice and a second caller asked for
each new version (what evicted version 0 before): an event, not a sleep, orders the race.

* the holder keeps the version the joiner pulls (a pin, ``replication/pins.py``): the joiner ends
  with version 0, bit for bit;
* with pins off, the holder evicts it; the joiner re-plans on the newest version and ends with it;
* a holder that evicts every version before it serves a piece ends the pull in a ``TransferError``
  that says so, after ``max_version_replans`` re-plans.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Iterator

import pytest
import torch

from dht.rpc import call_peer
from replication.assignment import SearchConfig
from replication.config import TransferConfig
from replication.pins import VersionPins
from replication.server import ReplicationServer, VersionGoneError, manifest_handler
from replication.transfer import PullResult, TransferError, pull_state
from tests.conftest import open_dht_nodes

STAGE = 1
CONFIG = TransferConfig(piece_bytes=64 * 1024, search=SearchConfig(min_shard_bytes=64 * 1024, max_shard_bytes=256 * 1024),
                        request_timeout=10.0, shard_timeout_floor=10.0, min_agreeing_donors=1)
pytestmark = pytest.mark.timeout(90)
_RUN_IDS = (f"race{n}" for n in itertools.count())


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
def nodes() -> Iterator[list]:
    """The joiner, the lone holder, and another caller of the holder (its backup keeper, say)."""
    with open_dht_nodes(3) as nodes:
        yield nodes


def state_at(version: int) -> dict[str, torch.Tensor]:
    """About 2.6 MB that differ from version to version: many pieces, so the pull takes several requests."""
    g = torch.Generator().manual_seed(version)
    return {"layer.weight": torch.randn(512, 1024, generator=g), "optim.exp_avg": torch.randn(128, 1024, generator=g),
            "optim.step": torch.tensor(version, dtype=torch.int64)}


class SteppingHolder(ReplicationServer):
    """A lone holder serving its live state: ``version`` is its step; ``load_shard`` holds every request
    until ``stepped`` is set, and sets ``first_request`` when the first one arrives."""

    def __init__(self, p2p, *, run_id: str, **kwargs) -> None:
        self.version = 0
        self.first_request, self.stepped = asyncio.Event(), asyncio.Event()
        self.versions_served: list[int] = []

        async def live_state():
            return self.version, state_at(self.version)

        super().__init__(p2p, run_id=run_id, stage=STAGE, snapshot_fn=live_state, **kwargs)

    async def load_shard(self, version: int, shard_bytes: int, index: int, count: int = 1, **kwargs):
        self.first_request.set()
        await self.stepped.wait()
        data = await super().load_shard(version, shard_bytes, index, count, **kwargs)
        self.versions_served.append(version)
        return data


async def step_while_pulled(holder: SteppingHolder, other_p2p, holder_id: str, run_id: str, *, steps: int) -> None:
    """Once the joiner asked for its first piece: the holder steps ``steps`` times, and after each step
    another caller asks for its newest manifest (a version frozen, the oldest evicted unless pinned)."""
    await holder.first_request.wait()
    for _ in range(steps):
        holder.version += 1
        reply, _ = await call_peer(other_p2p, holder_id, manifest_handler(run_id),
                                   {"stage": STAGE, "shard_bytes": CONFIG.piece_bytes}, timeout=10, max_payload_bytes=0)
        assert reply["manifest"]["version"] == holder.version
    holder.stepped.set()


async def race(nodes, tmp_path, **server_kwargs) -> tuple[PullResult, SteppingHolder]:
    (joiner, _), (holder_node, _), (other, _) = nodes
    run_id, holder_id = next(_RUN_IDS), holder_node.peer_id.to_base58()
    holder = SteppingHolder(await holder_node.replicate_p2p(), run_id=run_id, **server_kwargs)
    async with holder:
        stepper = asyncio.create_task(step_while_pulled(holder, await other.replicate_p2p(), holder_id, run_id, steps=2))
        try:
            result = await pull_state(await joiner.replicate_p2p(), [holder_id], run_id=run_id, stage=STAGE,
                                      store_dir=tmp_path / "store", config=CONFIG)
        finally:
            stepper.cancel()
        await asyncio.gather(stepper, return_exceptions=True)
    return result, holder


def assert_state(result: PullResult, version: int) -> None:
    expected = state_at(version)
    assert result.version == version and sorted(result.state) == sorted(expected)
    assert all(torch.equal(result.state[name], tensor) for name, tensor in expected.items())


def test_the_lone_holder_keeps_the_version_a_joiner_pulls_while_it_steps(loop, nodes, tmp_path):
    async def main():
        result, holder = await race(nodes, tmp_path)
        assert_state(result, 0)  # the version the joiner agreed on, though two newer ones were frozen since
        assert result.report.num_version_replans == 0 and result.report.failed_donors == {}
        assert set(holder.versions_served) == {0} and holder.cached_shard_sizes(0)
        assert holder.cached_shard_sizes(1) and holder.cached_shard_sizes(2)  # the newest max_cached as well

    loop.run_until_complete(main())


def test_without_pins_the_joiner_replans_on_the_newest_version(loop, nodes, tmp_path):
    async def main():
        result, holder = await race(nodes, tmp_path, pins=VersionPins(hold_timeout=60.0, max_pinned=0))
        assert holder.cached_shard_sizes(0) == ()  # evicted under the joiner
        assert_state(result, 2)
        assert result.report.num_version_replans == 1 and result.report.failed_donors == {}
        assert 2 in holder.versions_served

    loop.run_until_complete(main())


class EvictingHolder(ReplicationServer):
    """Steps and evicts before it serves any piece: every pull of it outlives its version."""

    def __init__(self, p2p, *, run_id: str) -> None:
        self.version = 0

        async def live_state():
            self.version += 1
            return self.version, state_at(self.version)

        super().__init__(p2p, run_id=run_id, stage=STAGE, snapshot_fn=live_state)

    async def load_shard(self, version: int, *args, **kwargs):
        raise VersionGoneError(f"version {version} is not held here; it was evicted: ask for the newest manifest")


def test_a_holder_that_always_moves_on_ends_the_pull_with_one_clear_error(loop, nodes, tmp_path):
    (joiner, _), (holder_node, _), _ = nodes
    run_id, holder_id = next(_RUN_IDS), holder_node.peer_id.to_base58()

    async def main():
        config = dataclasses.replace(CONFIG, max_version_replans=2)
        async with EvictingHolder(await holder_node.replicate_p2p(), run_id=run_id) as holder:
            with pytest.raises(TransferError, match="evicted the version being pulled 3 times") as caught:
                await pull_state(await joiner.replicate_p2p(), [holder_id], run_id=run_id, stage=STAGE,
                                 store_dir=tmp_path / "store", config=config)
        assert caught.value.report.num_version_replans == 2 and holder.version == 3  # three manifests, no more
        assert holder.num_refused == 0  # declined as gone, not refused as bad input

    loop.run_until_complete(main())
