"""peer.status: the peer's own status (local_status), recent rates, and the state download progress."""

from __future__ import annotations

import json
import math
import time
import types

import pytest
import torch

from dht.records import RunSpec
from dht.wire import Traffic
from peer.config import PeerConfig
from peer.status import SOFTWARE_VERSION, StatusHistory, StatusSample, SyncProgress, local_status, sample_peer
from swarm.stage import Stage

STATUS_KEYS = {
    "peer_id", "run_id", "role", "client_mode", "stage", "num_stages", "state", "software_version", "step",
    "tokens_per_s", "samples_per_s", "microbatches_per_s", "bytes_sent_per_s", "bytes_received_per_s", "loss",
    "bytes_sent", "bytes_received", "uptime_s", "num_samples", "num_microbatches", "flops", "time", "sync", "checkpoint",
}


def make_peer(*, stage: Stage | None = None, spec: RunSpec | None = None, state: str = "joining") -> types.SimpleNamespace:
    """The attributes of peer.lifecycle.Peer that local_status reads, around a real Stage."""
    config = PeerConfig(bootstrap=("/ip4/127.0.0.1/tcp/1/p2p/QmX",), run_id="demo", client_mode=True)
    return types.SimpleNamespace(
        peer_id="QmPeerABCDEF", config=config, role=config.resolved_role, state=state, stage=stage, spec=spec,
        flops=2.5e9, started_at=time.monotonic() - 12.0, traffic=Traffic(bytes_sent=1000, bytes_received=2000),
        history=StatusHistory(seq_len=spec.model.seq_len) if spec else None, sync_progress=None)


def sample(t: float, num_samples: int, *, loss: float = 3.0, sent: int = 0, received: int = 0) -> StatusSample:
    return StatusSample(t=t, num_samples=num_samples, num_microbatches=num_samples // 16, loss=loss,
                        bytes_sent=sent, bytes_received=received)


def test_local_status_of_a_joining_peer_has_every_key_and_is_json():
    status = local_status(make_peer())
    assert set(status) == STATUS_KEYS
    assert status["state"] == "joining" and status["stage"] == -1 and status["num_stages"] is None
    assert status["role"] == "unreliable" and status["client_mode"] is True
    assert status["loss"] is None and status["tokens_per_s"] == 0.0
    assert status["uptime_s"] >= 12.0 and status["software_version"] == SOFTWARE_VERSION != "unknown"
    assert (status["bytes_sent"], status["bytes_received"]) == (1000, 2000)
    json.dumps(status, allow_nan=False)  # strict JSON: no NaN


def test_local_status_of_a_training_peer_reads_its_stage_and_recent_rates():
    spec = RunSpec(run_id="demo")
    stage = Stage(spec, 1, device=torch.device("cpu"))
    try:
        peer = make_peer(stage=stage, spec=spec, state="training")
        stage.counters.add_samples(16, now=100.0)
        stage.counters.last_loss = 2.5
        peer.history.record(sample(1000.0, 0, sent=0))
        peer.history.record(sample(1002.0, 64, sent=4000))
        status = local_status(peer)
        assert (status["stage"], status["num_stages"], status["state"]) == (1, 2, "training")
        assert status["samples_per_s"] == 32.0 and status["tokens_per_s"] == 32.0 * spec.model.seq_len
        assert status["microbatches_per_s"] == 2.0 and status["bytes_sent_per_s"] == 2000.0
        assert status["loss"] == 2.5 and status["num_samples"] == 16 and status["num_microbatches"] == 1
        json.dumps(status, allow_nan=False)
    finally:
        stage.shutdown()


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


def test_sample_peer_before_a_stage_is_all_zero():
    got = sample_peer(make_peer(), now=5.0)
    assert (got.t, got.num_samples, got.num_microbatches, got.bytes_sent) == (5.0, 0, 0, 1000)
    assert math.isnan(got.loss)
