"""Which published run spec a joiner trusts (peer.join.SpecChooser): the pinned owner, the dialled
bootstrap's key, or the only publisher after a grace period; strangers' specs are refused by name."""

from __future__ import annotations

import logging

import pytest

from dht.records import RunSpec
from dht.registry import PublishedSpec
from peer.config import PeerConfig
from peer.errors import UserError
from peer.join import SpecChooser, bootstrap_peer_ids
from tests.unit.fake_clock import FakeClock

OWNER, ROGUE = "0" * 31 + "b", "0" * 31 + "a"  # the rogue's key sorts first
BOOT = "12D3KooWBootstrap"
OWNED = PublishedSpec(RunSpec(run_id="demo", seed=1), OWNER, bootstrap=BOOT)
ROGUE_SPEC = PublishedSpec(RunSpec(run_id="demo", seed=666), ROGUE, bootstrap="12D3KooWRogue")
UNBOUND = PublishedSpec(RunSpec(run_id="demo", seed=1), OWNER)


def test_the_dialled_bootstraps_key_wins_whichever_key_sorts_first(caplog):
    chooser = SpecChooser("demo", bootstraps={BOOT}, clock=FakeClock())
    with caplog.at_level(logging.INFO, logger="peer.join"):
        assert chooser.choose([ROGUE_SPEC, OWNED]) is OWNED
        assert chooser.choose([ROGUE_SPEC, OWNED]) is OWNED
    refusals = [r.message for r in caplog.records if "refused a run spec" in r.message]
    assert len(refusals) == 1 and ROGUE in refusals[0] and "12D3KooWRogue" in refusals[0]  # named, once
    trusted = [r.message for r in caplog.records if "is owned by key" in r.message]
    assert len(trusted) == 1 and f"--run-owner {OWNER}" in trusted[0] and BOOT in trusted[0]


def test_a_pinned_owner_wins_over_the_bootstrap_dialled():
    chooser = SpecChooser("demo", owner=ROGUE, bootstraps={BOOT}, clock=FakeClock())
    assert chooser.choose([ROGUE_SPEC, OWNED]) is ROGUE_SPEC
    assert chooser.choose([OWNED]) is None  # the pinned key has not published (yet): keep reading


def test_a_stranger_is_not_trusted_before_the_bootstraps_spec_had_its_grace():
    clock = FakeClock()
    chooser = SpecChooser("demo", bootstraps={BOOT}, grace=10.0, clock=clock)
    assert chooser.choose([ROGUE_SPEC]) is None
    clock.advance(9.9)
    assert chooser.choose([ROGUE_SPEC]) is None
    assert chooser.choose([ROGUE_SPEC, OWNED]) is OWNED


def test_a_lone_publisher_is_trusted_on_first_use_after_the_grace(caplog):
    clock = FakeClock()
    chooser = SpecChooser("demo", grace=10.0, clock=clock)
    assert chooser.choose([UNBOUND]) is None
    clock.advance(10.0)
    with caplog.at_level(logging.INFO, logger="peer.join"):
        assert chooser.choose([UNBOUND]) is UNBOUND
    assert any("trusted on first use" in r.message and f"--run-owner {OWNER}" in r.message for r in caplog.records)


def test_several_publishers_and_nothing_to_choose_by_is_the_users_to_settle():
    clock = FakeClock()
    chooser = SpecChooser("demo", bootstraps={"12D3KooWSomeoneElse"}, grace=10.0, clock=clock)
    assert chooser.choose([ROGUE_SPEC, UNBOUND]) is None
    clock.advance(10.0)
    with pytest.raises(UserError, match=f"2 keys publish run 'demo' \\({ROGUE}, {OWNER}\\).*--run-owner"):
        chooser.choose([ROGUE_SPEC, UNBOUND])


def test_two_dialled_bootstraps_of_different_owners_are_refused_as_ambiguous():
    chooser = SpecChooser("demo", bootstraps={BOOT, "12D3KooWRogue"}, clock=FakeClock())
    with pytest.raises(UserError, match="2 keys publish"):
        chooser.choose([ROGUE_SPEC, OWNED])


def test_bootstrap_peer_ids_are_read_from_the_multiaddrs():
    assert bootstrap_peer_ids(["/ip4/1.2.3.4/tcp/5/p2p/QmA", "/ip4/1.2.3.4/tcp/6", "/dns/x/tcp/7/p2p/12D3KooWB"]) == {
        "QmA", "12D3KooWB"}


@pytest.mark.parametrize("bad", ["", "xyz", "0" * 31, "0" * 33, "G" * 32, "A" * 32])
def test_a_malformed_run_owner_is_refused_with_what_to_give(bad):
    with pytest.raises(ValueError, match="--run-owner must be the 32 hex digits the bootstrap prints"):
        PeerConfig(bootstrap=("/ip4/127.0.0.1/tcp/1",), run_owner=bad)
