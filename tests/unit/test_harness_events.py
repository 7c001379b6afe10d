"""The harness reads a peer's metrics file on from where it stopped, whole lines only."""

from __future__ import annotations

import json
import subprocess
import sys

from peer.harness.local_swarm import LocalProcess


def test_events_are_read_on_from_where_the_last_call_stopped(tmp_path):
    path = tmp_path / "peer0.jsonl"
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    peer = LocalProcess("peer0", process, tmp_path / "peer0.log", metrics_path=path)
    assert peer.events() == []  # no file yet

    path.write_text(json.dumps({"event": "joined", "t": 1}) + "\n" + '{"event": "microba')  # a line being written
    assert peer.events() == [{"event": "joined", "t": 1}]
    with open(path, "a") as f:
        f.write('tch", "loss": 2.5}\n' + "not json\n" + json.dumps({"event": "microbatch", "loss": 2.0}) + "\n")
    assert [e["loss"] for e in peer.events("microbatch")] == [2.5, 2.0]  # the torn line once whole; garbage skipped
    assert len(peer.events()) == 3 and peer.events("averaged") == []

    path.write_text(json.dumps({"event": "joined", "t": 2}) + "\n")  # replaced by a shorter file: read afresh
    assert peer.events() == [{"event": "joined", "t": 2}]
