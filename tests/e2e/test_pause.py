"""--pause-file: creating the file pauses a training peer without leaving, deleting it resumes training."""

from __future__ import annotations

import pytest

from peer.harness.local_swarm import wait_for

pytestmark = [pytest.mark.scenario, pytest.mark.timeout(120)]


def test_pause_file_pauses_and_resumes_without_leaving(local_swarm, tmp_path):
    pause_file = tmp_path / "pause"
    local_swarm.start_bootstrap("--num-stages", "1", "--num-layers", "2", "--d-model", "64")
    peer = local_swarm.start_peer("--status-period", "1", "--settle-delay", "0", "--pause-file", str(pause_file))
    wait_for(lambda: peer.events("status") or not peer.is_alive(), 60, "the peer to train")
    assert peer.is_alive(), peer.log_tail()

    pause_file.touch()
    wait_for(lambda: peer.events("paused"), 10, "the peer to pause")
    paused = peer.events("paused")[0]
    # no microbatch starts after the pause: those that end later were in flight (at most --max-in-flight)
    wait_for(lambda: len([e for e in peer.events("status") if e["t"] > paused["t"] + 2]) >= 2, 15, "two status lines while paused")
    late = [e for e in peer.events("microbatch") if e["t"] > paused["t"]]
    assert len(late) <= 4, f"{len(late)} microbatches ended after the pause"
    steps = {e["step"] for e in peer.events("status") if e["t"] > paused["t"] + 2}
    assert len(steps) == 1  # the step stands still while paused

    pause_file.unlink()
    wait_for(lambda: peer.events("resumed"), 10, "the peer to resume")
    wait_for(lambda: any(e["step"] > max(steps) for e in peer.events("status")), 30, "training to go on")
    assert peer.is_alive() and not peer.events("leave_announced")
    assert "paused: taking no new work" in peer.log_path.read_text()
