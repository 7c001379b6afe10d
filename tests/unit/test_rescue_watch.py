"""The peer's side of backups, on views built from records: when a keeper pulls or drops its copy
(BackupKeeper.due), when a peer acts on an unheld stage (RescueWatch: settle, joiners first, grace
for the one named), and the backup digest matching what a stage reports once the backup is loaded.
Time is a number passed in (``now``) or a FakeClock (``clock=``): no test waits on the wall clock."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from dht.records import PeerRecord, RunSpec
from peer.backup import (
    BACKOFF_FACTOR,
    MIN_COMPLETE_READS,
    RESCUE_GRACE,
    BackupKeeper,
    RescueWatch,
    StageBackup,
    state_digest,
)
from peer.config import PeerConfig
from peer.event_log import EventLog
from replication.transfer import TransferError
from swarm.stage import Stage
from swarm.view import SwarmView
from tests.unit.fake_clock import FakeClock

SPEC = RunSpec(run_id="run")
SETTLE = 3.0


def record(peer_id: str, stage: int, *, state: str = "training", backup_stage: int = -1,
           backup_version: int = 0, version: int = 0, pinned: bool = False) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, role="reliable", state=state, stage=stage, flops=1e9, announced_at=100.0,
                      backup_stage=backup_stage, backup_version=backup_version, version=version, pinned=pinned)


PERIOD = 30.0


def keeper(peer_id: str, records: list[PeerRecord], **kwargs) -> BackupKeeper:
    view = SwarmView(None, "run")
    view.records = records
    config = PeerConfig(bootstrap=("/ip4/127.0.0.1/tcp/1/p2p/QmX",), backup_period=PERIOD)
    return BackupKeeper(None, view, SPEC, peer_id=peer_id, config=config, metrics=EventLog(None), **kwargs)


def copy_of(stage: int, holder: str, *, step: int, at: float, seconds: float = 0.5) -> StageBackup:
    return StageBackup(stage=stage, version=step, holder_id=holder, holder_step=step, state={}, pulled_at=at,
                       seconds=seconds, digest="")


def test_the_keeper_pulls_at_once_then_when_the_holder_stepped_and_a_period_passed():
    records = [record("a", 0, version=5), record("b", 1), record("c", 1)]
    k = keeper("b", records)
    stage, holder = k.due(0.0)
    assert (stage, holder.peer_id) == (0, "a")
    assert keeper("c", records).due(0.0) is None, "only the lowest peer id of the next stage keeps it"
    k.backup = copy_of(0, "a", step=5, at=0.0)
    assert k.due(PERIOD + 1) is None  # the holder has not stepped since
    k.view.records = [record("a", 0, version=9), *records[1:]]
    assert k.due(PERIOD - 1) is None  # it has, but the period is not over
    assert k.due(PERIOD)[0] == 0
    k.view.records = [record("j", 0), *records[1:]]  # a new holder (after a rescue or a rejoin): at once
    assert k.due(1.0)[1].peer_id == "j"


def test_a_slow_pull_stretches_the_period_so_backups_take_a_fifth_of_the_upload_at_most():
    records = [record("a", 0, version=50), record("b", 1), record("c", 1)]
    k = keeper("b", records)
    k.backup = copy_of(0, "a", step=5, at=0.0, seconds=20.0)  # a large stage on a slow link
    assert k.due(PERIOD + 1) is None and k.due(79.0) is None
    assert k.due(80.0)[0] == 0


def test_the_copy_is_kept_while_its_stage_is_unheld_and_dropped_once_someone_else_keeps_it():
    k = keeper("b", [record("b", 1), record("c", 1)])  # stage 0's holder is gone
    k.backup = copy_of(0, "a", step=5, at=0.0)
    assert k.due(1.0) is None and k.backup is not None
    k.view.records = [record("j", 0, state="syncing"), record("b", 1), record("c", 1)]
    assert k.due(2.0) is None and k.backup is not None  # a joiner is pulling it (maybe from this copy)
    k.view.records = [record("j", 0), record("k", 0), record("b", 1), record("c", 1)]
    assert k.due(3.0) is None and k.backup is None  # two holders: no backup needed


def test_a_peer_standing_by_keeps_the_stage_of_a_one_stage_layout_and_hands_it_to_its_own_rescue():
    """peer.standby: before, the one peer serving a one-stage layout had no keeper, and its crash
    restarted the stage from a checkpoint or the seed."""
    one_stage = RunSpec(run_id="run", stage_layers=((0, 4),))
    view = SwarmView(None, "run")
    view.records = [record("m", 0, version=7), record("s1", -1, state="standby"), record("s2", -1, state="standby")]
    config = PeerConfig(bootstrap=("/ip4/127.0.0.1/tcp/1/p2p/QmX",), backup_period=PERIOD)
    first, second = (BackupKeeper(None, view, one_stage, peer_id=p, config=config, metrics=EventLog(None)) for p in ("s1", "s2"))
    stage, holder = first.due(0.0)
    assert (stage, holder.peer_id) == (0, "m") and second.due(0.0) is None  # the one that would take the stage
    first.backup = copy_of(0, "m", step=7, at=0.0)
    view.records = view.records[1:]  # the holder crashed: the copy stays for the rescue
    assert first.due(1.0) is None and first.take(0).version == 7


def watches(records: list[PeerRecord], *, complete_reads: int = MIN_COMPLETE_READS) -> dict[str, RescueWatch]:
    view = SwarmView(None, "run")
    view.records, view.complete_reads = records, complete_reads
    return {r.peer_id: RescueWatch(view, SPEC, peer_id=r.peer_id, settle=SETTLE) for r in records}


def test_the_only_copy_of_a_lost_stage_is_not_replaced_by_another_duty():
    """Three stages, one peer each; stage 1's peer dies. Its keeper ("c", stage 2) is now also the
    keeper of stage 0 (the next held stage after it): pulling stage 0 would replace the only copy of
    stage 1 (found by tests/e2e/test_replan.py: the re-plan then restarted stage 1's layers from the seed)."""
    spec = RunSpec(run_id="run", stage_layers=((0, 1), (1, 3), (3, 4)))
    view = SwarmView(None, "run")
    view.records = [record("a", 0, version=9), record("c", 2)]
    config = PeerConfig(bootstrap=("/ip4/127.0.0.1/tcp/1/p2p/QmX",), backup_period=PERIOD)
    k = BackupKeeper(None, view, spec, peer_id="c", config=config, metrics=EventLog(None))
    k.backup = copy_of(1, "b", step=5, at=0.0)
    assert k.due(PERIOD + 1) is None and k.backup.stage == 1
    view.records = [record("a", 0, version=9), record("j", 1), record("k", 1), record("c", 2)]  # held again, twice
    assert k.due(PERIOD + 2) is None and k.backup is None, "then the copy goes (stage 1 needs none; j keeps stage 0)"


def test_the_keeper_is_named_once_the_stage_stayed_unheld_for_the_settle_time():
    records = [record("b", 1, backup_stage=0, backup_version=9), record("c", 1)]
    peers = watches(records)
    assert all(w.check(10.0) is None for w in peers.values())  # first seen unheld now
    assert all(w.check(10.0 + SETTLE - 0.1) is None for w in peers.values())
    rescue = peers["b"].check(10.0 + SETTLE)
    assert rescue is not None and (rescue.to_stage, rescue.from_stage, rescue.source) == (0, 1, "local-backup")
    assert peers["c"].check(10.0 + SETTLE) is None


def test_a_stage_held_again_resets_the_clock():
    records = [record("b", 1, backup_stage=0), record("c", 1)]
    watch = watches(records)["b"]
    watch.check(0.0)
    watch.view.records = [*records, record("j", 0, state="syncing")]  # a joiner is pulling it
    assert watch.check(SETTLE) is None
    watch.view.records = records  # it vanished again
    assert watch.check(2 * SETTLE) is None and watch.check(3 * SETTLE) is not None


def test_an_absence_counts_only_in_reads_that_beat_the_dht_timeout():
    # a peer whose own link is slow reads partial records: it must not restore a stage that is held
    records = [record("b", 1, backup_stage=0, backup_version=9), record("c", 1)]
    watch = watches(records, complete_reads=0)["b"]
    assert watch.check(0.0) is None and watch.check(10 * SETTLE) is None  # stage 0 "unheld" all along
    watch.view.complete_reads = MIN_COMPLETE_READS  # reads complete again: the settle time starts now
    assert watch.check(10 * SETTLE + SETTLE - 0.1) is None
    assert watch.check(10 * SETTLE + SETTLE - 0.1 + SETTLE) is not None


def test_nobody_moves_while_a_joiner_is_choosing():
    records = [record("b", 1, backup_stage=0), record("c", 1), record("j", -1, state="joining")]
    watch = watches(records)["b"]
    assert watch.check(0.0) is None and watch.check(100.0) is None


def test_other_peers_give_the_named_rescuer_its_grace_period_then_plan_again():
    # c is named first; b watches c leave (record "leaving"), and only after the grace is b named
    records = [record("a", 1), record("b", 1), record("c", 1, backup_stage=0)]
    peers = watches(records)  # one view, shared: they all see the same records
    others = (peers["a"], peers["b"])
    assert all(w.check(0.0) is None for w in others)
    assert all(w.check(SETTLE) is None for w in others)  # c is the one named
    peers["b"].view.records = [record("a", 1), record("b", 1), record("c", 1, state="leaving")]
    assert all(w.check(SETTLE + 1.0) is None for w in others)
    assert all(w.check(SETTLE + RESCUE_GRACE - 1.0) is None for w in others)
    late = [w.check(SETTLE + RESCUE_GRACE) for w in others]
    assert late[0] is not None and late[1] is None, "once the grace is over, exactly one other peer is named"
    assert (late[0].to_stage, late[0].source) == (0, "none")  # c's copy left with it


def test_the_backup_digest_is_the_digest_of_the_stage_that_loads_it():
    stage = Stage(SPEC, 1, device=torch.device("cpu"))
    try:
        state = stage.state_tensors()
        name = next(k for k in state if k.startswith("model."))
        state[name] += 1.0  # a trained state, not the seed's
        stage.load_state_tensors(state)
        assert state_digest(state) == stage.params_digest()
        assert state_digest(state) != state_digest(Stage(SPEC, 1, device=torch.device("cpu")).state_tensors())
    finally:
        stage.shutdown()


def test_the_watch_remembers_who_held_a_stage_it_now_sees_unheld():
    records = [record("a", 0), record("b", 1, backup_stage=0), record("c", 1)]
    watch = watches(records)["b"]
    assert watch.check(0.0) is None and watch.last_holders(0) == ("a",)
    watch.view.records = records[1:]  # a's record is gone from this view
    assert watch.check(1.0) is None and watch.check(1.0 + SETTLE) is not None
    assert watch.last_holders(0) == ("a",) and watch.last_holders(1) == ("b", "c")


def test_a_rescue_waits_while_the_last_holder_still_answers_a_ping():
    """A live holder whose record went missing (its heartbeats stuck on a slow link) is not replaced
    from an older backup; once it stops answering, the rescue goes ahead."""
    records = [record("a", 0), record("b", 1, backup_stage=0), record("c", 1)]
    watch = watches(records)["b"]
    watch.check(0.0)
    watch.view.records = records[1:]
    watch.check(-SETTLE - 1.0)  # first seen unheld long ago: the next check names the rescue at once
    alive, pinged, skipped = {"a"}, [], []

    async def is_answering(peer_id: str) -> bool:
        pinged.append(peer_id)
        return peer_id in alive

    def on_skipped(rescue, answering: list[str]) -> None:
        skipped.append((rescue.to_stage, answering))
        watch._named.clear()  # as if the grace period were over: name it again at the next check
        alive.clear()  # ... and by then the holder is really gone

    rescue = asyncio.run(asyncio.wait_for(watch.wait_verified_rescue(is_answering, on_skipped=on_skipped), 10))
    assert skipped == [(0, ["a"])] and pinged == ["a", "a"]
    assert (rescue.peer_id, rescue.to_stage) == ("b", 0)


def test_a_stage_never_seen_held_is_rescued_without_a_ping():
    watch = watches([record("b", 1, backup_stage=0), record("c", 1)])["b"]
    watch.check(-SETTLE - 1.0)

    async def is_answering(peer_id: str) -> bool:
        raise AssertionError("nobody to ping")

    assert asyncio.run(asyncio.wait_for(watch.wait_verified_rescue(is_answering), 10)).to_stage == 0


def test_a_holder_only_suspected_by_this_peer_is_not_rescued_until_its_record_is_gone():
    records = [record("a", 0), record("b", 1, backup_stage=0), record("c", 1)]
    watch = watches(records)["b"]
    watch.view.mark_departed("a")  # b's detector suspects a (a slow link), a's record is fresh
    assert watch.check(0.0) is None and watch.check(10 * SETTLE) is None
    watch.view.records = records[1:]  # a's record expired: the DHT's verdict
    assert watch.check(11 * SETTLE) is None and watch.check(12 * SETTLE).to_stage == 0


def test_the_watch_names_the_rescue_on_its_injected_clock_only_once_settled():
    clock = FakeClock(1000.0)
    view = SwarmView(None, "run")
    view.records = [record("b", 1, backup_stage=0, backup_version=9), record("c", 1)]
    view.complete_reads = MIN_COMPLETE_READS
    watch = RescueWatch(view, SPEC, peer_id="b", settle=SETTLE, clock=clock)
    assert watch.check() is None  # stage 0 first seen unheld now
    clock.advance(SETTLE - 0.5)
    assert watch.check() is None, "not before the settle time"
    clock.advance(0.5)
    rescue = watch.check()
    assert rescue is not None and (rescue.peer_id, rescue.to_stage) == ("b", 0)


def pull_taking(clock: FakeClock, seconds: float, pulls: list[tuple[int, float]], *, fails: bool = False):
    """A stand-in for ``peer.backup.pull_copy`` that takes ``seconds`` on ``clock`` and serves a
    state that says it is of the stage asked for (or fails), noting (stage, start) in ``pulls``."""
    async def pull(p2p, spec, stage, donors, *, request_timeout, reputation=None):
        pulls.append((stage, clock()))
        clock.advance(seconds)
        if fails:
            raise TransferError("the holder hung up", None)
        identity = torch.tensor([stage, *spec.stage_layers[stage]], dtype=torch.int64)
        return SimpleNamespace(version=7, state={"stage.layers": identity})
    return pull


def test_a_pull_is_timed_on_the_keepers_clock_and_a_slow_one_stretches_the_next_refresh(monkeypatch):
    clock, pulls = FakeClock(500.0), []
    monkeypatch.setattr("peer.backup.pull_copy", pull_taking(clock, 20.0, pulls))
    records = [record("a", 0, version=7), record("b", 1), record("c", 1)]
    k = keeper("b", records, clock=clock)
    asyncio.run(k.refresh_once())
    assert pulls == [(0, 500.0)]
    assert (k.backup.stage, k.backup.pulled_at, k.backup.seconds, k.backup.holder_step) == (0, 520.0, 20.0, 7)
    asyncio.run(k.refresh_once())
    assert len(pulls) == 1, "the holder has not stepped since"
    k.view.records = [record("a", 0, version=9), *records[1:]]
    clock.advance(BACKOFF_FACTOR * 20.0 - 1.0)  # past --backup-period, within four times the pull
    asyncio.run(k.refresh_once())
    assert len(pulls) == 1
    clock.advance(1.0)
    asyncio.run(k.refresh_once())
    assert pulls[1:] == [(0, 600.0)]


def test_a_failed_pull_waits_a_period_from_when_it_failed(monkeypatch):
    clock, pulls = FakeClock(500.0), []
    monkeypatch.setattr("peer.backup.pull_copy", pull_taking(clock, 2.0, pulls, fails=True))
    k = keeper("b", [record("a", 0, version=5), record("b", 1), record("c", 1)], clock=clock)
    asyncio.run(k.refresh_once())
    assert pulls == [(0, 500.0)] and k.backup is None
    clock.advance(PERIOD - 0.5)  # a period after the pull started, not after it failed (at 502)
    assert k.due() is None
    clock.advance(0.5)
    assert k.due()[0] == 0


def test_a_pinned_keeper_is_never_named_and_another_peer_pulls_its_copy():
    """Issue #15: a peer pinned with --stage was moved by a rescue. The pinned keeper "a" says so in
    its record; "b" names itself at once (no grace spent on a), and pulls a's copy."""
    view = SwarmView(None, "run")
    view.records = [record("a", 1, backup_stage=0, backup_version=9, pinned=True), record("b", 1)]
    view.complete_reads = MIN_COMPLETE_READS
    pinned = RescueWatch(view, SPEC, peer_id="a", settle=SETTLE, pinned=True)
    other = RescueWatch(view, SPEC, peer_id="b", settle=SETTLE)
    assert pinned.check(0.0) is None and other.check(0.0) is None
    rescue = other.check(SETTLE)
    assert (rescue.peer_id, rescue.keeper_id, rescue.source) == ("b", "a", "backup-donor")
    assert all(pinned.check(SETTLE + k * RESCUE_GRACE) is None for k in range(10))


def test_a_pinned_peer_whose_record_is_not_out_yet_is_not_named():
    """Issue #15's run: peers started with --stage 0 and --stage 1, stage 1's holder without a record
    yet; stage 0's peers are pinned, their own watches know it before their records say so."""
    view = SwarmView(None, "run")
    view.records = [record("a", 0), record("b", 0, pinned=True)]
    view.complete_reads = MIN_COMPLETE_READS
    a = RescueWatch(view, SPEC, peer_id="a", settle=SETTLE, pinned=True)
    b = RescueWatch(view, SPEC, peer_id="b", settle=SETTLE, pinned=True)
    assert all(w.check(now) is None for now in (0.0, SETTLE, 10 * RESCUE_GRACE) for w in (a, b))
    assert a.unrescuable == {} == b.unrescuable  # never seen held: a swarm still forming, left to a joiner
