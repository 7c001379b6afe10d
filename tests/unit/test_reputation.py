"""Strikes and bans (dht/reputation.py), on a clock the test moves."""

from __future__ import annotations

import pytest

from dht.reputation import Reputation


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_is_banned_after_enough_strikes_within_the_window_and_forgiven_later():
    clock, bans = Clock(), []
    reputation = Reputation(max_strikes=3, window=10.0, ban_seconds=60.0, clock=clock,
                            on_ban=lambda peer_id, reason: bans.append((peer_id, reason)))
    assert not reputation.strike("bad", "garbage") and not reputation.strike("bad", "garbage")
    clock.now += 11  # the first two strikes age out of the window
    assert not reputation.strike("bad", "garbage") and not reputation.strike("bad", "garbage")
    assert not reputation.is_banned("bad")
    assert reputation.strike("bad", "NaN activations")
    assert reputation.is_banned("bad") and reputation.banned() == ["bad"]
    assert bans == [("bad", "NaN activations")] and reputation.num_bans == 1
    assert not reputation.is_banned("good")
    assert reputation.strike("bad", "more") and reputation.num_bans == 1  # already banned: no second ban
    clock.now += 61
    assert not reputation.is_banned("bad") and reputation.banned() == []
    assert not reputation.strike("bad", "once")  # a fresh start after the ban


def test_strike_records_stay_bounded_under_many_callers():
    clock = Clock()
    reputation = Reputation(max_strikes=2, window=1.0, clock=clock)
    for i in range(10_000):
        clock.now += 0.01
        reputation.strike(f"peer{i}", "failed once")
    assert len(reputation._strikes) <= 4096 + 1
    with pytest.raises(ValueError):
        Reputation(max_strikes=0)
