"""peer.status.swarm: the stage map, the bottleneck, peer rows and the /status.json document."""

from __future__ import annotations

import json
import math

from dht.records import PeerRecord
from peer.status.swarm import SwarmHistory, peer_rows, stage_map, swarm_status, swarm_totals

SEQ_LEN = 64


def record(peer_id: str, stage: int, *, state: str = "training", flops: float = 1e9, samples_per_s: float = 10.0,
           loss: float = math.nan, **more) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, role="reliable", state=state, stage=stage, flops=flops,
                      samples_per_s=samples_per_s, loss=loss, **more)


def test_stage_map_counts_peers_and_throughput_per_stage():
    records = [record("b", 0), record("a", 0, samples_per_s=5.0), record("c", 1, loss=2.0), record("j", -1, state="joining")]
    mapped = stage_map(records, stage_flops=[1e6, 2e6], seq_len=SEQ_LEN)
    s0, s1 = mapped["stages"]
    assert s0["peer_ids"] == ["a", "b"] and s0["num_peers"] == 2 and s0["num_training"] == 2
    assert s0["tokens_per_s"] == 15.0 * SEQ_LEN
    assert s0["capacity_tokens_per_s"] == 2e9 / 1e6 * SEQ_LEN
    assert s1["capacity_tokens_per_s"] == 1e9 / 2e6 * SEQ_LEN
    assert mapped["bottleneck"] == 1


def test_the_bottleneck_is_the_stage_of_least_capacity_not_of_least_measured_throughput():
    # in a steady pipeline every stage measures the same samples/s; capacity tells them apart
    records = [record("a", 0, flops=4e9), record("b", 1, flops=1e9), record("c", 2, flops=2e9)]
    assert stage_map(records, stage_flops=[1.0, 1.0, 1.0], seq_len=SEQ_LEN)["bottleneck"] == 1


def test_an_empty_stage_is_the_bottleneck_and_ties_go_to_the_lower_index():
    assert stage_map([record("a", 0)], stage_flops=[1.0, 1.0, 1.0], seq_len=1)["bottleneck"] == 1
    assert stage_map([], stage_flops=[1.0, 1.0], seq_len=1)["bottleneck"] == 0
    assert stage_map([], stage_flops=[], seq_len=1) == {"stages": [], "bottleneck": None}


def test_peers_that_are_not_training_are_listed_but_add_no_throughput():
    records = [record("a", 0, state="syncing", samples_per_s=3.0), record("b", 0, state="leaving")]
    (s0,) = stage_map(records, stage_flops=[1.0], seq_len=1)["stages"]
    assert s0["num_peers"] == 2 and s0["num_training"] == 0
    assert s0["tokens_per_s"] == 0.0 and s0["capacity_tokens_per_s"] == 0.0


def test_peer_rows_order_and_fields():
    records = [record("z", 1, loss=2.25, software_version="0.1.0", bytes_sent=7, num_samples=99, version=3),
               record("y", 0), record("x", -1, state="joining", samples_per_s=0.0)]
    rows = peer_rows(records, seq_len=SEQ_LEN)
    assert [r["peer_id"] for r in rows] == ["x", "y", "z"]
    z = rows[2]
    assert (z["loss"], z["software_version"], z["bytes_sent"], z["num_samples"], z["step"]) == (2.25, "0.1.0", 7, 99, 3)
    assert z["tokens_per_s"] == 10.0 * SEQ_LEN and rows[1]["loss"] is None and rows[1]["software_version"] is None
    assert z["reachability"] == "direct"  # how others reach it (docs/nat.md)


def test_totals_come_from_the_last_stage():
    records = [record("a", 0, samples_per_s=100.0, loss=9.0, val_loss=2.0), record("e", 0, val_loss=3.0),
               record("f", 0, state="syncing", val_loss=9.0), record("b", 1, loss=2.0, val_loss=8.0),
               record("c", 1, loss=3.0), record("d", 1, state="syncing", loss=1.0)]
    totals = swarm_totals(records, num_stages=2, seq_len=2)
    # training loss from the last stage; held-out loss from the stage-0 peers that measured it
    assert totals == {"tokens_per_s": 40.0, "loss": 2.5, "val_loss": 2.5, "num_peers": 6, "num_training": 4}
    assert swarm_totals([record("a", 1)], num_stages=2, seq_len=2)["loss"] is None


def test_history_keeps_points_in_time_order_and_bounded():
    history = SwarmHistory(max_points=3)
    stages = [{"tokens_per_s": 1.0}, {"tokens_per_s": 2.0}]
    for t in (1.0, 2.0, 2.0, 3.0, 4.0):
        history.record(t, {"loss": 5.0 - t, "val_loss": 6.0 - t, "tokens_per_s": 3.0 * t}, stages)
    points = history.points()
    assert [p["t"] for p in points] == [2.0, 3.0, 4.0]
    assert points[-1] == {"t": 4.0, "loss": 1.0, "val_loss": 2.0, "tokens_per_s": 12.0, "stage_tokens_per_s": [1.0, 2.0]}


def test_status_document_shape_is_strict_json():
    history = SwarmHistory()
    records = [record("a", 0), record("b", 1, loss=2.0)]
    doc = swarm_status(run_id="demo", records=records, stage_flops=[1e6, 1e6], seq_len=SEQ_LEN, history=history,
                       local={"peer_id": "a"}, now=1234.5)
    assert set(doc) == {"run_id", "time", "num_stages", "local", "totals", "stages", "bottleneck", "peers", "history", "sample"}
    assert doc["num_stages"] == 2 and doc["local"] == {"peer_id": "a"} and len(doc["peers"]) == 2
    assert json.loads(json.dumps(doc, allow_nan=False)) == doc
