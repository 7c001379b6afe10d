"""A joiner's stage choice settles (peer/join.py ``StageConfirmation``): it stands once two complete
reads in a row agree, or once the join timeout passed on the clock; driven read by read on a FakeClock
(tests/integration/test_join_negotiation.py runs the same rule over real DHT nodes)."""

from __future__ import annotations

from peer.join import StageConfirmation
from tests.unit.fake_clock import FakeClock

TIMEOUT = 20.0


def test_a_choice_stands_once_two_complete_reads_in_a_row_agree():
    confirmation = StageConfirmation(timeout=TIMEOUT, clock=FakeClock())
    assert not confirmation.confirms(0, complete_reads=1), "one read is not enough"
    assert not confirmation.confirms(1, complete_reads=2), "the second read disagrees (it saw another joiner)"
    assert confirmation.confirms(1, complete_reads=3)


def test_a_read_that_waited_out_a_dht_timeout_breaks_the_agreement():
    confirmation = StageConfirmation(timeout=TIMEOUT, clock=FakeClock())
    assert not confirmation.confirms(1, complete_reads=1)
    assert not confirmation.confirms(1, complete_reads=0), "a slow read may have missed an intent"
    assert not confirmation.confirms(1, complete_reads=1), "the count restarts: one complete read again"
    assert confirmation.confirms(1, complete_reads=2)


def test_at_the_deadline_the_last_choice_stands():
    clock = FakeClock(50.0)
    confirmation = StageConfirmation(timeout=TIMEOUT, clock=clock)
    clock.advance(TIMEOUT - 0.5)
    assert not confirmation.is_expired()
    assert not confirmation.confirms(0, complete_reads=0)
    clock.advance(0.5)
    assert confirmation.is_expired()
    assert confirmation.confirms(1, complete_reads=0), "slow reads only, but the joiner must choose"
