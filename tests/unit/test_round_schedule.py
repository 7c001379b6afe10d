"""When a replica looks for its next averaging round: replicas that skip rounds still meet."""

from __future__ import annotations

import pytest

from swarm.averaging import next_round_time

LEAD = 3.0  # matchmaking_time + PREPARE_AHEAD, the defaults
FAILED_ROUND = 2.02  # a round that found no group ends just after the step's 2 s timeout


def test_the_next_round_is_the_next_multiple_of_the_period_far_enough_ahead():
    assert next_round_time(101.9, 5.0, lead=LEAD) == 105.0
    assert next_round_time(100.0, 15.0, lead=LEAD) == 105.0
    assert next_round_time(102.5, 5.0, lead=LEAD) == 110.0  # 105 is too close: the next even round
    assert next_round_time(107.5, 5.0, lead=LEAD) == 120.0  # 110 is too close, 115 is odd
    assert next_round_time(103.0, 15.0, lead=LEAD) == 120.0


@pytest.mark.parametrize("period", [2.0, 4.0, 5.0, 6.0, 15.0])
def test_a_round_is_far_enough_ahead_and_a_skip_lands_on_an_even_round(period):
    for now in (x / 10 for x in range(1000, 2000)):
        at = next_round_time(now, period, lead=LEAD)
        assert at - now >= LEAD and at % period == 0, (now, at)
        assert at - now < LEAD + 2 * period, (now, at)  # never more than one round skipped beyond the even one
        if -now % period < LEAD:  # the next round is too close
            assert at % (2 * period) == 0, (now, at)


def skip_one_round(now: float, period: float, *, lead: float) -> float:
    """The rule before: a round too close is skipped for the next one (it let replicas alternate)."""
    at = -(-now // period) * period
    return at if at - now >= lead else at + period


def attempts_until_they_meet(first: list[float], period: float, *, schedule=next_round_time,
                             max_attempts: int = 10) -> int | None:
    """Two replicas whose first rounds are ``first``; a round one of them tries alone fails and ends
    ``FAILED_ROUND`` late. How many rounds they tried in all before one had both (None: never)."""
    rounds = list(first)
    for attempt in range(max_attempts):
        if rounds[0] == rounds[1]:
            return attempt
        alone = 0 if rounds[0] < rounds[1] else 1
        rounds[alone] = schedule(rounds[alone] + FAILED_ROUND, period, lead=LEAD)
    return None


@pytest.mark.parametrize("period", [4.0, 5.0])
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_two_replicas_that_fail_a_round_each_meet_instead_of_alternating(period, offset):
    """The replica that started later misses the other's first round; before, each failed round made
    it skip one, so the two tried alternate rounds for ever."""
    for first_round in (100, 101):
        met = attempts_until_they_meet([first_round * period, (first_round + offset) * period], period)
        assert met is not None and met <= 4, (first_round, offset, met)
    if offset % 2:  # what the test guards against: under the old rule they never meet
        assert attempts_until_they_meet([100 * period, (100 + offset) * period], period, schedule=skip_one_round) is None
