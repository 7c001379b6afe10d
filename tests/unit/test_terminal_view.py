"""peer.status.terminal: what a volunteer reads in the terminal."""

from __future__ import annotations

import io

from peer.status.swarm import SwarmHistory, swarm_status
from peer.status.terminal import (TerminalView, format_bytes, format_duration, loss_trend, progress_bar,
                                render_terminal_view, sparkline)
from tests.unit.test_swarm_status import record

LOCAL = {
    "peer_id": "QmLocalPeer3fa9c1", "role": "reliable", "stage": 1, "state": "training", "software_version": "0.1.0",
    "uptime_s": 3725.0, "num_samples": 12345, "num_microbatches": 772, "step": 40, "tokens_per_s": 5900.0,
    "bytes_sent_per_s": 1.5e6, "bytes_received_per_s": 2.5e5, "bytes_sent": 1.2e8, "bytes_received": 9.0e7, "sync": None,
}


def make_doc(local=LOCAL, losses=(4.0, 3.5, 3.0), last_loss=3.0):
    history = SwarmHistory()
    for t, loss in enumerate(losses):
        history.record(100.0 + 30 * t, {"loss": loss, "tokens_per_s": 1000.0}, [{"tokens_per_s": 1.0}] * 2)
    records = [record("QmA", 0, flops=4e9), record("QmB", 0, flops=4e9), record("QmLocalPeer3fa9c1", 1, loss=last_loss)]
    return swarm_status(run_id="demo", records=records, stage_flops=[1e6, 1e6], seq_len=64, history=history,
                        local=local, now=200.0)


def test_view_shows_role_stage_map_bottleneck_loss_trend_throughput_bandwidth_and_contribution():
    text = render_terminal_view(make_doc())
    assert "peer …3fa9c1 · reliable · stage 1 of 2 · training · v0.1.0" in text
    assert "uptime 1:02:05" in text and "contributed 12,345 samples" in text
    assert "loss 3.000" in text and "↓ -1.000 over 60 s" in text
    assert "tokens/s 640 swarm (this peer 5,900)" in text
    assert "bandwidth ↑ 1.5 MB/s ↓ 250.0 KB/s" in text
    stage_lines = [line for line in text.splitlines() if line.startswith("  stage")]
    assert len(stage_lines) == 2
    assert "◀ bottleneck" in stage_lines[1] and "← this peer" in stage_lines[1] and "bottleneck" not in stage_lines[0]
    assert "\x1b[" not in text  # no colour unless asked


def test_view_shows_the_state_download_with_a_progress_bar_and_eta():
    local = {**LOCAL, "state": "syncing", "sync": {"done_bytes": 25_000_000, "total_bytes": 100_000_000,
                                                   "eta_s": 75.0, "finished": False, "started_at": 0.0}}
    text = render_terminal_view(make_doc(local))
    line = next(line for line in text.splitlines() if line.startswith("state download"))
    assert "[██████░░░░░░░░░░░░░░░░░░]  25%" in line and "25.0 MB / 100.0 MB" in line and "ETA 0:01:15" in line
    done = {**local, "sync": {**local["sync"], "finished": True}}
    assert "state download" not in render_terminal_view(make_doc(done))


def test_view_shows_a_checkpoint_being_written_with_a_progress_bar_and_eta():
    local = {**LOCAL, "checkpoint": {"done_bytes": 50_000_000, "total_bytes": 100_000_000, "eta_s": 2.0,
                                     "finished": False, "started_at": 0.0}}
    line = next(line for line in render_terminal_view(make_doc(local)).splitlines() if line.startswith("checkpoint write"))
    assert "50%" in line and "50.0 MB / 100.0 MB" in line and "ETA 0:00:02" in line
    done = {**local, "checkpoint": {**local["checkpoint"], "finished": True}}
    assert "checkpoint write" not in render_terminal_view(make_doc(done))


def test_bootstrap_view_and_empty_history():
    text = render_terminal_view(make_doc(local=None, losses=(), last_loss=float("nan")))
    assert "run demo · bootstrap view" in text and "loss – (no last-stage report yet)" in text
    assert "uptime" not in text and "bandwidth" not in text and "this peer" not in text


def test_colour_on_a_terminal_only():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, plain = Tty(), io.StringIO()
    TerminalView(tty).draw(make_doc())
    TerminalView(plain).draw(make_doc())
    assert tty.getvalue().startswith("\x1b[H\x1b[2J") and "\x1b[31m" in tty.getvalue()
    assert "\x1b" not in plain.getvalue() and plain.getvalue().endswith("\n\n")


def test_small_formatters():
    assert progress_bar(0.5, width=4) == "[██░░]" and progress_bar(7.0, width=2) == "[██]"
    assert progress_bar(float("nan"), width=2) == "[░░]"
    assert sparkline([1.0, None, 2.0, 3.0]) == "▁▅█" and sparkline([]) == ""
    assert format_duration(59) == "0:00:59" and format_duration(None) == "–"
    assert format_bytes(999) == "999 B" and format_bytes(1_500_000_000) == "1.5 GB"
    assert loss_trend([{"t": 0, "loss": 5.0}]) is None
    assert loss_trend([{"t": 0, "loss": 5.0}, {"t": 30, "loss": None}, {"t": 90, "loss": 4.0}]) == -1.0


def test_the_title_says_what_the_peer_does_when_it_knows():
    waiting = {**LOCAL, "activity": "waiting: stage 0 has no holder"}
    text = render_terminal_view(make_doc(local=waiting))
    assert "stage 1 of 2 · waiting: stage 0 has no holder · v0.1.0" in text


def test_view_shows_the_newest_sample_of_the_models_text_on_one_line():
    doc = make_doc()
    assert "the model writes" not in render_terminal_view(doc)  # none yet
    doc["sample"] = {"prompt": "The ", "text": "model\nwrites " + "words " * 40, "step": 12, "age_s": 90.0}
    lines = render_terminal_view(doc).splitlines()
    heading = next(i for i, line in enumerate(lines) if line.startswith("the model writes"))
    assert lines[heading] == "the model writes  (step 12, 0:01:30 ago)"
    assert lines[heading + 1].startswith("  The model⏎writes words") and lines[heading + 1].endswith("…")
    assert len(lines[heading + 1]) == 102
