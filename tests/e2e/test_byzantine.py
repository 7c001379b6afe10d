"""A Byzantine replica among three: its x100 updates are out-voted and the loss stays within 5% of a clean run's.

Two real swarms of run_peer.py processes, one after the other, with the same run spec and seed: a
single stage held by three replicas that average every few seconds. In the second, one replica is
Byzantine (``--fault-inject scale_updates=100``, test-only): each of its optimizer steps moves its
parameters a hundred times too far, and that state is what it brings to every averaging round. A
plain mean would hand every replica a third of it (docs/robust-averaging.md has the measurement).
"""

from __future__ import annotations

import statistics

import pytest

from peer.local_swarm import LocalSwarm, wait_for
from swarm.fault_injection import ALLOW_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BOOTSTRAP = ("--num-stages", "1", "--num-layers", "2", "--d-model", "64", "--num-heads", "2", "--seq-len", "32",
             "--microbatch-size", "8", "--target-batch-size", "16", "--averaging-period", "4", "--seed", "3")
PEER = ("--stage", "0", "--num-threads", "1", "--rebalance-period", "0", "--backup-period", "0")
NUM_MICROBATCHES = 400  # per honest replica; the loss has flattened out by then
WINDOW = 100  # the last microbatches of each honest replica that make up the compared loss


def losses(peer) -> list[float]:
    return [e["loss"] for e in peer.events("microbatch") if e.get("loss") is not None]


def train(swarm: LocalSwarm, *, byzantine: bool) -> tuple[float, list, object | None]:
    """Three replicas (one Byzantine if asked) until each honest one ran NUM_MICROBATCHES; returns the
    mean loss of their last WINDOW microbatches, the honest peers and the Byzantine one."""
    swarm.start_bootstrap(*BOOTSTRAP)
    honest = [swarm.start_peer(*PEER) for _ in range(2)]
    bad = swarm.start_peer(*PEER, "--fault-inject", "scale_updates=100") if byzantine else swarm.start_peer(*PEER)
    peers = honest + [bad]
    wait_for(lambda: all(len(losses(p)) >= NUM_MICROBATCHES for p in honest) or not all(p.is_alive() for p in peers),
             150, f"{NUM_MICROBATCHES} microbatches on each honest replica")
    assert all(p.is_alive() for p in peers), swarm.logs()
    window = [loss for p in honest for loss in losses(p)[NUM_MICROBATCHES - WINDOW:NUM_MICROBATCHES]]
    return statistics.mean(window), honest, bad if byzantine else None


def same_digest_after_every_common_round(peers) -> int:
    rounds: dict[float, dict[str, str]] = {}
    for peer in peers:
        for event in peer.events("averaged"):
            rounds.setdefault(event["at"], {})[peer.name] = event["digest"]
    common = {at: set(d.values()) for at, d in rounds.items() if len(d) == len(peers)}
    for at, digests in common.items():
        assert len(digests) == 1, f"replicas differ after the round at {at}: {digests}"
    return len(common)


def test_a_byzantine_replica_is_out_voted_and_the_loss_stays_within_5_percent(local_swarm, tmp_path, monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")  # inherited by the peers; only the one given --fault-inject misbehaves
    with LocalSwarm(tmp_path / "clean") as clean_swarm:
        clean_loss, clean_peers, _ = train(clean_swarm, byzantine=False)
        clean_swarm.shutdown(timeout=20)
    byzantine_loss, honest, bad = train(local_swarm, byzantine=True)
    bad_id = bad.events("joined")[0]["peer_id"]
    print(f"clean {clean_loss:.4f}, with a Byzantine replica {byzantine_loss:.4f}, "
          f"Byzantine replica's own {statistics.mean(losses(bad)[-WINDOW:]):.4f}")
    assert abs(byzantine_loss - clean_loss) <= 0.05 * clean_loss, (clean_loss, byzantine_loss)

    # the honest reducers out-voted the Byzantine replica, round after round, and nobody else
    reports = [e for p in honest for e in p.events("averaging_outliers")]
    outvoted = [e for e in reports if bad_id in e["outvoted"]]
    assert len(outvoted) >= 3, reports
    assert all(set(e["outvoted"]) == {bad_id} and not e["refused"] for e in reports), reports
    assert not [e for p in clean_peers for e in p.events("averaging_outliers")]
    # every member, the Byzantine one too, ends a round with the same bytes
    assert same_digest_after_every_common_round([*honest, bad]) >= 3
    assert same_digest_after_every_common_round(clean_peers) >= 3
    local_swarm.shutdown(timeout=30)
    assert [p.process.returncode for p in [*honest, bad]] == [0, 0, 0]
