"""Flow control on the emulated internet (swarm/flow_control.py, issue #16): a stage-0 peer's window
grows to fill a long-delay link and shrinks when that link's bandwidth dips.

Needs root, ``nft`` and ``gcc`` like tests/e2e/test_internet.py (it fails with InternetError's message
without them). One stage-0 and one stage-1 peer, each behind a 100 ms one-way link (a 400 ms round trip
between them), the bootstrap close to the core so that joining stays quick; the first round's
schedule (``delayed`` + ``periodic``), so no batch boundary bounds the window.
"""

from __future__ import annotations

import pytest

from peer.harness.internet import Internet, Link
from peer.harness.local_swarm import LocalSwarm, wait_for

pytestmark = [pytest.mark.scenario, pytest.mark.timeout(900), pytest.mark.xdist_group("one_at_a_time")]
MAX_IN_FLIGHT = 12
GROWN = 5  # the window a 400 ms round trip asks for at a few microbatches/s of compute (it starts at 2)
DIPPED_RATE_MBIT = 4  # a 0.5 MB activation then takes a second each way: 2 or 3 in flight fill the path
SHRUNK = 4


def windows(peer) -> list[int]:
    return [e["window"] for e in peer.events("flow_window")]


def test_the_window_grows_on_a_long_delay_link_and_shrinks_when_its_bandwidth_dips(tmp_path):
    internet = Internet(seed=16)
    try:
        server = internet.add_host("bootstrap", Link(rate_mbit=100, delay_ms=2))
        first, last = (internet.add_host(name, Link(rate_mbit=100, delay_ms=100)) for name in ("first", "last"))
        internet.start()
        swarm = LocalSwarm(tmp_path / "swarm")
        try:
            swarm.start_bootstrap("--num-stages", "2", "--pipeline-schedule", "delayed", "--replica-sync", "periodic",
                                  host=server.address, command_prefix=server.command_prefix)
            peers = [swarm.start_peer("--stage", str(stage), "--num-threads", "1", "--max-in-flight", str(MAX_IN_FLIGHT),
                                      host=host.address, command_prefix=host.command_prefix)
                     for stage, host in enumerate((first, last))]
            sender = peers[0]
            wait_for(lambda: max(windows(sender), default=0) >= GROWN or not all(p.is_alive() for p in peers), 300,
                     f"the stage-0 window to grow to {GROWN}")
            assert all(p.is_alive() for p in peers), swarm.logs()
            grown = windows(sender)[-1]
            assert max(windows(sender)) <= MAX_IN_FLIGHT
            sent_before = len(sender.events("microbatch"))

            internet.set_rate(last, DIPPED_RATE_MBIT)
            changes = len(windows(sender))
            wait_for(lambda: any(w <= SHRUNK for w in windows(sender)[changes:]) or not all(p.is_alive() for p in peers),
                     120, f"the window to shrink to {SHRUNK} after the dip")
            assert all(p.is_alive() for p in peers), swarm.logs()
            dipped = [e for e in sender.events("flow_window")[changes:] if e["window"] <= SHRUNK][0]
            print(f"window grew to {grown} (estimate before the dip: {sender.events('flow_window')[changes - 1]}), "
                  f"shrank to {dipped['window']} at {DIPPED_RATE_MBIT} Mbit/s: {dipped}")
            # it kept training through the dip
            wait_for(lambda: len(sender.events("microbatch")) > sent_before + 5 or not sender.is_alive(), 120,
                     "microbatches through the dipped link")
            swarm.shutdown()
            for peer in peers:
                assert peer.process.returncode == 0, peer.log_tail()
            for process in swarm.all_processes():
                assert "Traceback" not in process.log_path.read_text(), process.log_tail(80)
            # every microbatch stage 0 got back was counted at stage 1, once
            counted = [e["mb_id"] for e in peers[1].events("microbatch")]
            assert len(counted) == len(set(counted)), "a microbatch was counted twice"
            assert {e["mb_id"] for e in sender.events("microbatch")} <= set(counted)
        finally:
            swarm.shutdown(timeout=20)
    finally:
        internet.shutdown()
