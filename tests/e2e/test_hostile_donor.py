"""A donor serving a corrupted shard is caught and banned (issue #7), with real peer processes.

Two peers hold the (single) stage; one of them serves corrupted state pieces (peer/faults.py's
``corrupt_shards``, a test-only fault). A third peer joins, pulls the stage from both, and must end
with exactly the honest state, having dropped and banned the corrupting donor; the ban shows in its
Prometheus metrics.

The honest holder's uploads are capped (8 Mbit/s, ten seconds for the stage's state) so that the
joiner's first requests to the corrupting donor are answered long before the honest one could
deliver a copy of them: an end-game copy that arrives first cancels the original request, and a
corrupting donor whose only request was cancelled was never caught (CI, on a loaded machine).
"""

from __future__ import annotations

import socket
import urllib.request

import pytest

from peer.faults import ALLOW_ENV, FAULTS_ENV
from peer.harness.local_swarm import wait_for

pytestmark = [pytest.mark.scenario, pytest.mark.timeout(420)]  # 232 s in a loaded rehearsal (the capped holder serves slowly)
ARGS = ("--num-threads", "1", "--stage", "0", "--rebalance-period", "0", "--backup-period", "0")
CORRUPTING = {ALLOW_ENV: "1", FAULTS_ENV: "corrupt_shards"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_a_joiner_drops_and_bans_a_donor_serving_corrupted_pieces(local_swarm):
    local_swarm.start_bootstrap("--num-stages", "1", "--averaging-period", "5")
    honest = local_swarm.start_peer(*ARGS, "--max-upload-mbps", "8")
    wait_for(lambda: honest.events("microbatch"), 120, "the first peer to train")
    liar = local_swarm.start_peer(*ARGS, env=CORRUPTING)
    wait_for(lambda: liar.events("averaged") and honest.events("averaged"), 120,
             "the two holders to average (they then serve the same snapshot)")
    liar_id = liar.events("joined")[0]["peer_id"]
    port = free_port()
    joiner = local_swarm.start_peer(*ARGS, "--ban-strikes", "4", "--status-port", str(port))
    wait_for(lambda: joiner.events("state_download") or not joiner.is_alive(), 150, "the joiner to pull the stage")
    download = joiner.events("state_download")[0]

    # caught and dropped, its pieces fetched from the honest donor
    assert liar_id in download["failed_donors"] and "does not match" in download["failed_donors"][liar_id]
    honest_id = honest.events("joined")[0]["peer_id"]
    assert download["bytes_by_donor"][honest_id] > 0
    # the joiner holds exactly the state both holders averaged to (the honest snapshot it pulled)
    rounds = {int(e["at"]): e["digest"] for e in honest.events("averaged")}
    assert download["version"] in rounds and download["digest"] == rounds[download["version"]]
    # banned, with a reason, and visible in /metrics
    bans = joiner.events("banned")
    assert [b["peer_id"] for b in bans] == [liar_id] and "corrupted state" in bans[0]["reason"]
    assert "banned " + liar_id[-6:] in joiner.log_path.read_text()
    wait_for(lambda: joiner.events("status"), 60, "the joiner to train")
    assert metric(port, "murmuration_bans_total") == 1.0
    assert metric(port, "murmuration_strikes_total") >= 4.0
    assert joiner.is_alive() and honest.is_alive() and liar.is_alive()
