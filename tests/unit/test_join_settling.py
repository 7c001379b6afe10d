"""A joiner's stage choice settles (peer/join.py ``StageConfirmation``): it stands once two complete
reads in a row agree, or once the join timeout passed on the clock; driven read by read on a FakeClock
(tests/integration/test_join_negotiation.py runs the same rule over real DHT nodes). The choice
depends only on older peers' records (``choose_stage_from_view``)."""

from __future__ import annotations

import pytest

from dht.records import PeerRecord, RunSpec
from peer.join import StageConfirmation, as_joiner, choose_stage_from_view
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


# --- whose records a joiner's choice depends on (peer/join.py choose_stage_from_view) --------------

SPEC = RunSpec(run_id="alpha")  # two stages of equal cost


def record(peer_id: str, state: str, stage: int, announced_at: float) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, role="reliable", state=state, stage=stage, flops=1e9, announced_at=announced_at)


def test_a_younger_peer_never_moves_an_older_joiners_choice():
    older, me = record("older", "joining", -1, 1.0), record("me", "joining", -1, 2.0)
    assert choose_stage_from_view(SPEC, [older, me], "me") == 1, "the older joiner takes stage 0 first"
    # a younger peer that already declared a stage is not counted (counting it would give 1 here):
    # it placed itself after this peer, computing this peer's place from this peer's intent
    younger = record("younger", "syncing", 0, 3.0)
    assert choose_stage_from_view(SPEC, [me, younger], "me") == 0
    assert choose_stage_from_view(SPEC, [older, me, younger], "me") == 1
    # an older member counts
    assert choose_stage_from_view(SPEC, [record("member", "training", 0, 0.5), me], "me") == 1
    # announce times tie: the peer id orders them, the same way for everyone
    twin = record("a-twin", "joining", -1, 2.0)
    assert choose_stage_from_view(SPEC, [twin, me], "me") == 1 and choose_stage_from_view(SPEC, [twin, me], "a-twin") == 0


def test_a_joiner_that_declared_asks_again_as_its_intent():
    declared = [record("older", "syncing", 0, 1.0), record("me", "syncing", 0, 2.0)]
    again = as_joiner(declared, "me")
    assert [(r.state, r.stage) for r in again] == [("syncing", 0), ("joining", -1)]
    assert choose_stage_from_view(SPEC, again, "me") == 1
    with pytest.raises(RuntimeError, match="not visible"):
        choose_stage_from_view(SPEC, declared, "me")
