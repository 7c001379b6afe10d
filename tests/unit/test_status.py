"""peer.status.local: the peer's own status (local_status of a snapshot), recent rates, the state
download progress; and the snapshot a real :class:`peer.lifecycle.Peer` takes of itself."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from dht.records import PEER_STATES, PeerRecord, RunSpec
from dht.wire import Traffic
from peer.config import PeerConfig
from peer.lifecycle import Peer
from peer.status.local import SOFTWARE_VERSION, StatusHistory, StatusSample, SyncProgress, local_status, sample_of
from peer.status.snapshot import PeerSnapshot, PeerState, ServiceCounters, describe_activity
from swarm.stage import Stage
from swarm.view import SwarmView

STATUS_KEYS = {
    "peer_id", "run_id", "role", "client_mode", "stage", "num_stages", "state", "activity", "software_version",
    "step", "tokens_per_s", "samples_per_s", "microbatches_per_s", "bytes_sent_per_s", "bytes_received_per_s",
    "loss", "val_loss", "bytes_sent", "bytes_received", "uptime_s", "num_samples", "num_microbatches", "flops",
    "time", "sync", "checkpoint",
}


def make_snapshot(**fields) -> PeerSnapshot:
    """A joining peer's snapshot, with ``fields`` changed."""
    base = dict(time=1000.0, run_id="demo", role="unreliable", client_mode=True, state=PeerState.JOINING,
                activity="joining the swarm", peer_id="QmPeerABCDEF", flops=2.5e9, uptime_s=12.0,
                bytes_sent=1000, bytes_received=2000)
    return PeerSnapshot(**{**base, **fields})


def make_peer() -> Peer:
    """A real peer, not started: what it shows before it joins, and after the test gives it a stage."""
    return Peer(PeerConfig(bootstrap=("/ip4/127.0.0.1/tcp/1/p2p/QmX",), run_id="demo", client_mode=True))


def sample(t: float, num_samples: int, *, loss: float = 3.0, sent: int = 0, received: int = 0) -> StatusSample:
    return StatusSample(t=t, num_samples=num_samples, num_microbatches=num_samples // 16, loss=loss,
                        bytes_sent=sent, bytes_received=received)


def test_local_status_of_a_joining_peer_has_every_key_and_is_json():
    status = local_status(make_snapshot())
    assert set(status) == STATUS_KEYS
    assert status["state"] == "joining" and status["stage"] == -1 and status["num_stages"] is None
    assert status["role"] == "unreliable" and status["client_mode"] is True
    assert status["loss"] is None and status["val_loss"] is None and status["tokens_per_s"] == 0.0
    assert status["uptime_s"] == 12.0 and status["software_version"] == SOFTWARE_VERSION != "unknown"
    assert (status["bytes_sent"], status["bytes_received"]) == (1000, 2000)
    json.dumps(status, allow_nan=False)  # strict JSON: no NaN


def test_local_status_of_a_training_peer_reads_its_snapshot_and_recent_rates():
    history = StatusHistory(seq_len=64)
    history.record(sample(1000.0, 0, sent=0))
    history.record(sample(1002.0, 64, sent=4000))
    snapshot = make_snapshot(state=PeerState.TRAINING, activity="training stage 1", stage=1, num_stages=2, step=3,
                             num_samples=16, num_microbatches=1, loss=2.5, val_loss=2.25)
    status = local_status(snapshot, history)
    assert (status["stage"], status["num_stages"], status["state"], status["step"]) == (1, 2, "training", 3)
    assert status["activity"] == "training stage 1"
    assert status["samples_per_s"] == 32.0 and status["tokens_per_s"] == 32.0 * 64
    assert status["microbatches_per_s"] == 2.0 and status["bytes_sent_per_s"] == 2000.0
    assert status["loss"] == 2.5 and status["val_loss"] == 2.25
    assert status["num_samples"] == 16 and status["num_microbatches"] == 1
    json.dumps(status, allow_nan=False)


def test_peer_states_are_the_records_states():
    assert tuple(state.value for state in PeerState) == PEER_STATES


def test_the_activity_says_what_a_volunteer_needs_to_know():
    assert describe_activity(PeerState.JOINING, stage=-1, joined=False, unheld=[]) == "joining the swarm"
    assert describe_activity(PeerState.SYNCING, stage=1, joined=True, unheld=[]) == "loading the state of stage 1"
    assert describe_activity(PeerState.TRAINING, stage=0, joined=True, unheld=[]) == "training stage 0"
    assert describe_activity(PeerState.TRAINING, stage=0, joined=True, unheld=[1, 2]) == "waiting: stage 1 has no holder"
    assert describe_activity(PeerState.PAUSED, stage=0, joined=True, unheld=[]).startswith("paused")


def test_a_real_peer_snapshots_itself_before_it_joins():
    peer = make_peer()
    snapshot = peer.snapshot
    assert snapshot.state is PeerState.JOINING and snapshot.activity == "joining the swarm"
    assert (snapshot.stage, snapshot.num_stages, snapshot.run_id, snapshot.role) == (-1, None, "demo", "unreliable")
    assert snapshot.services == ServiceCounters() and snapshot.uptime_s >= 0.0
    assert set(local_status(snapshot)) == STATUS_KEYS


def test_a_real_peer_snapshot_follows_its_stage_and_state():
    peer = make_peer()
    spec = RunSpec(run_id="demo")
    peer.spec, peer.stage, peer.flops = spec, Stage(spec, 1, device=torch.device("cpu")), 2.5e9
    try:
        peer.stage.counters.add_samples(16, now=100.0)
        peer.stage.counters.last_loss = 2.5
        peer._set_state(PeerState.TRAINING)  # a change of state publishes at once
        snapshot = peer.snapshot
        assert (snapshot.state, snapshot.stage, snapshot.num_stages) == (PeerState.TRAINING, 1, 2)
        assert snapshot.activity == "training stage 1"
        assert (snapshot.num_samples, snapshot.num_microbatches, snapshot.loss, snapshot.flops) == (16, 1, 2.5, 2.5e9)
        peer._set_state(PeerState.PAUSED)
        assert peer.snapshot.state is PeerState.PAUSED and peer.is_paused() and peer.is_working()
        assert not peer.is_training()
    finally:
        peer.stage.shutdown()


def test_rates_cover_the_recent_window_only():
    history = StatusHistory(seq_len=10, window=10.0)
    history.record(sample(0.0, 0))
    history.record(sample(50.0, 5000))  # a fast past...
    for t in range(51, 62):
        history.record(sample(float(t), 5000 + (t - 50)))  # ...then 1 sample/s
    assert history.rates()["samples_per_s"] == pytest.approx(1.0)
    assert history.rates()["tokens_per_s"] == pytest.approx(10.0)


def test_history_ignores_samples_out_of_order_and_keeps_a_bounded_series():
    history = StatusHistory(seq_len=1, max_points=5)
    for t in range(10):
        history.record(sample(float(t), t, loss=math.nan if t == 3 else 4.0 - t / 10))
    history.record(sample(5.0, 999))  # older than the latest: dropped
    points = history.series()
    assert [p["t"] for p in points] == [6.0, 7.0, 8.0, 9.0]
    assert all(p["tokens_per_s"] == 1.0 for p in points)
    assert history.latest.num_samples == 9


def test_rates_are_zero_with_fewer_than_two_samples():
    history = StatusHistory(seq_len=8)
    assert history.rates()["tokens_per_s"] == 0.0
    history.record(sample(1.0, 10))
    assert history.rates()["samples_per_s"] == 0.0


def test_sync_progress_counts_bytes_received_since_it_began_and_estimates_the_eta():
    traffic = Traffic(bytes_received=5_000)
    progress = SyncProgress(total_bytes=1_000, traffic=traffic)
    assert progress.as_dict()["done_bytes"] == 0 and progress.as_dict()["eta_s"] is None
    traffic.bytes_received += 250
    shown = progress.as_dict(now=progress.started_at + 2.0)
    assert shown["done_bytes"] == 250 and shown["eta_s"] == pytest.approx(6.0)
    traffic.bytes_received += 10_000  # more than the state (other traffic): never past 100 %
    assert progress.done_bytes == 1_000
    progress.finish()
    assert progress.as_dict()["finished"] is True and progress.as_dict()["received_bytes"] == 10_250


def test_a_sample_of_a_joining_peer_is_all_zero():
    got = sample_of(make_snapshot(time=5.0))
    assert (got.t, got.num_samples, got.num_microbatches, got.bytes_sent) == (5.0, 0, 0, 1000)
    assert math.isnan(got.loss)


def test_a_training_peer_whose_pipeline_lacks_a_stage_says_it_waits():
    peer = make_peer()
    spec = RunSpec(run_id="demo")
    peer.spec, peer.stage = spec, Stage(spec, 1, device=torch.device("cpu"))
    peer.view = SwarmView(None, "demo")
    peer.view.records = [PeerRecord(peer_id="QmSelf", role="reliable", state="training", stage=1, flops=1e9)]
    try:
        peer._set_state(PeerState.TRAINING)
        assert peer.snapshot.activity == "waiting: stage 0 has no holder"
        peer.view.records.append(PeerRecord(peer_id="QmOther", role="reliable", state="training", stage=0, flops=1e9))
        peer._set_state(PeerState.TRAINING)
        assert peer.snapshot.activity == "training stage 1"
    finally:
        peer.stage.shutdown()
