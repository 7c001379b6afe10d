"""replication.pins and the donor's cache (issue #15): a version a caller pulls is kept while it pulls,
within bounds a hostile caller cannot stretch; an evicted version is declined as gone, one never held is
refused. Time is a FakeClock: nothing here waits on the wall clock."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dht.rpc import Declined
from replication.config import TransferConfig
from replication.pins import VersionPins
from replication.server import VERSION_GONE, ReplicationServer, VersionGoneError
from tests.unit.fake_clock import FakeClock

HOLD = 10.0


def pins(clock: FakeClock, **kwargs) -> VersionPins:
    return VersionPins(hold_timeout=HOLD, clock=clock, **kwargs)


def test_a_pin_lasts_while_its_caller_asks_and_lapses_after():
    clock = FakeClock()
    p = pins(clock)
    p.touch("joiner", 1, 0)
    clock.advance(HOLD)
    assert p.pinned(1) == [0]
    p.touch("joiner", 1, 0)  # another piece request renews it
    clock.advance(HOLD)
    assert p.pinned(1) == [0]
    clock.advance(0.001)
    assert p.pinned(1) == [] and len(p) == 0


def test_one_pin_per_caller_and_stage_the_latest_first():
    clock = FakeClock()
    p = pins(clock)
    p.touch("a", 1, 0)
    clock.advance(1)
    p.touch("b", 1, 3)
    clock.advance(1)
    p.touch("a", 1, 5)  # a moved on to version 5: its pin on 0 is released
    p.touch("a", 2, 7)  # another stage (a backup this donor keeps) is pinned apart
    assert p.pinned(1) == [5, 3] and p.pinned(2) == [7]
    p.release(2)
    assert p.pinned(2) == [] and p.pinned(1) == [5, 3]


def test_keep_holds_the_newest_and_at_most_max_pinned_more():
    clock = FakeClock()
    p = pins(clock, max_pinned=1)
    held = [0, 1, 2, 3]  # least recently used first
    assert p.keep(1, held, max_cached=2) == {2, 3}
    p.touch("joiner", 1, 0)
    assert p.keep(1, held, max_cached=2) == {0, 2, 3}
    p.touch("other", 1, 3)  # a pin on a version kept anyway takes no extra slot
    assert p.keep(1, held, max_cached=2) == {0, 2, 3}
    clock.advance(1)
    p.touch("hostile", 1, 1)  # the slot goes to the version asked for most recently
    assert p.keep(1, held, max_cached=2) == {1, 2, 3}
    assert pins(clock, max_pinned=0).keep(1, held, max_cached=2) == {2, 3}


def test_the_pins_tracked_are_bounded():
    clock = FakeClock()
    p = pins(clock, max_callers=3)
    for n in range(10):
        clock.advance(0.1)
        p.touch(f"sybil{n}", 1, n)
    assert len(p) == 3 and p.pinned(1) == [9, 8, 7]


@pytest.mark.parametrize("kwargs", [{"hold_timeout": 0}, {"hold_timeout": 1, "max_pinned": -1},
                                    {"hold_timeout": 1, "max_callers": 0}])
def test_bad_bounds_are_refused(kwargs):
    with pytest.raises(ValueError):
        VersionPins(**kwargs)


@pytest.mark.parametrize("value", [-1, 101, True, 1.0])
def test_max_version_replans_is_checked(value):
    with pytest.raises(ValueError, match="max_version_replans"):
        TransferConfig(max_version_replans=value)


class LiveHolder:
    """A lone holder's server (no network: the request handlers are called directly) and its step."""

    def __init__(self, clock: FakeClock, **pin_kwargs) -> None:
        self.version = 0

        async def snapshot():
            return self.version, {"w": torch.full((4096,), float(self.version))}

        self.server = ReplicationServer(None, run_id="demo", stage=1, snapshot_fn=snapshot, max_cached=2,
                                        pins=pins(clock, **pin_kwargs))

    def manifest(self, caller: str | None, version: int | None = None) -> int:
        header = {"stage": 1, "shard_bytes": 4096, **({} if version is None else {"version": version})}
        reply, _ = asyncio.run(self.server._process_manifest(header, caller=caller))
        return reply["manifest"]["version"]

    def piece(self, caller: str | None, version: int) -> bytes:
        header = {"stage": 1, "version": version, "shard_bytes": 4096, "index": 0}
        _, tensors = asyncio.run(self.server._process_shard(header, caller=caller))
        return tensors[0].numpy().tobytes()

    def step_and_freeze(self, caller: str = "keeper") -> None:
        """The holder steps and another caller asks for its newest manifest."""
        self.version += 1
        assert self.manifest(caller) == self.version

    def held(self) -> list[int]:
        return [v for v in range(self.version + 1) if self.server.cached_shard_sizes(v)]


def test_a_joiner_keeps_its_version_while_the_holder_steps_and_loses_it_once_it_stops_asking():
    clock = FakeClock()
    holder = LiveHolder(clock)
    assert holder.manifest("joiner") == 0
    for _ in range(3):
        holder.step_and_freeze()
        clock.advance(HOLD / 2)
        holder.piece("joiner", 0)  # the joiner's pull goes on
    assert holder.held() == [0, 2, 3]
    clock.advance(HOLD + 1)  # the joiner died
    holder.step_and_freeze()
    assert holder.held() == [3, 4]
    with pytest.raises(VersionGoneError, match="evicted") as gone:
        holder.piece("joiner", 0)
    assert isinstance(gone.value, Declined) and gone.value.code == VERSION_GONE
    with pytest.raises(VersionGoneError):
        holder.manifest("joiner", version=0)


def test_a_version_never_held_is_refused_and_pins_nothing():
    clock = FakeClock()
    holder = LiveHolder(clock)
    holder.manifest("joiner")
    with pytest.raises(ValueError, match="not held") as never:
        holder.piece("hostile", 99)
    assert not isinstance(never.value, Declined)
    with pytest.raises(ValueError, match="no longer held"):
        holder.manifest("hostile", version=42)
    assert holder.server.pins.pinned(1) == [0]  # only the joiner's


def test_a_caller_with_no_identity_pins_nothing_and_the_cache_stays_bounded():
    clock = FakeClock()
    holder = LiveHolder(clock)
    holder.manifest(None)
    for n in range(6):  # six callers each pin the version they asked for: only one extra is kept
        holder.step_and_freeze(caller=f"caller{n}")
        clock.advance(1)
    assert holder.held() == [4, 5, 6]
    assert len(holder.server.pins) == 6
