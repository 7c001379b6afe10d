"""python -m peer.status.report: generated event logs in, three valid PNGs out; the series behind them."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from peer.status.report import PLOTS, PeerLog, loss_series, main, moving_average, read_events, stage_series, throughput_series

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000.0


def write_log(path: Path, *, stage: int, num_seconds: int, seed: int, tokens_per_s: float) -> None:
    """A peer's metrics file as peer.event_log writes it: microbatches, status lines, and some noise."""
    rng = random.Random(seed)
    lines = [{"t": T0 + seed, "event": "joined", "peer_id": f"peer{seed}", "stage": stage}]
    for i in range(num_seconds * 4):
        t = T0 + seed + i / 4
        loss = 5.5 * math.exp(-i / 200) + 0.1 * rng.random() if stage == 0 else None
        lines.append({"t": t, "event": "microbatch", "stage": stage, "loss": loss, "samples": 16})
        if i % 4 == 0:
            lines.append({"t": t, "event": "status", "stage": stage, "step": i // 16, "loss": loss,
                          "tokens_per_s": tokens_per_s + rng.random(), "samples": i * 16, "peers_per_stage": [2, 1]})
    text = "\n".join(json.dumps(line) for line in lines)
    path.write_text(text + "\nnot json\n[1, 2]\n{\"t\": \"x\", \"event\": \"status\"}\n")


@pytest.fixture
def logs(tmp_path) -> list[Path]:
    paths = [tmp_path / f"peer{i}.jsonl" for i in range(3)]
    for i, (path, stage) in enumerate(zip(paths, (0, 0, 1), strict=True)):
        write_log(path, stage=stage, num_seconds=60, seed=i, tokens_per_s=1000.0 * (i + 1))
    return paths


def test_report_writes_three_valid_pngs(logs, tmp_path, capsys):
    out = tmp_path / "report" / "nested"
    assert main([*map(str, logs), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "skipped 9 malformed line(s)" in printed and "from 3 log(s)" in printed
    for name in PLOTS:
        path = out / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            width, height = image.size
            assert width >= 600 and height >= 300
            colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
            assert colours is not None and len(colours) > 50  # lines were drawn, not a blank canvas


def test_series_follow_the_events(logs):
    parsed = [read_events(path) for path in logs]
    assert [log.num_malformed for log in parsed] == [3, 3, 3]
    t0 = min(e["t"] for log in parsed for e in log.events)
    times, losses = loss_series(parsed[0], t0)
    assert len(times) == 240 and times[0] == 0.0 and losses[0] > losses[-1]
    assert loss_series(parsed[2], t0) == ([], [])  # stage 1 reports no loss
    times, tokens, stages = throughput_series(parsed[1], t0)
    assert len(times) == 60 and set(stages) == {0} and all(2000 <= x < 2001 for x in tokens)
    series = stage_series(parsed, t0, bucket=10.0)
    assert series["peers"][0][-1] == 2 and series["peers"][1][-1] == 1
    middle = len(series["t"]) // 2
    assert 3000 <= series["swarm_tokens_per_s"][middle] < 3002  # the two stage-0 peers, each counted once
    assert 3000 <= series["tokens_per_s"][1][middle] < 3001


def test_moving_average():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([], 5) == []


def test_missing_or_empty_logs_are_one_sentence(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("garbage\n")
    for args in ([str(tmp_path / "missing.jsonl")], [str(empty)]):
        result = subprocess.run([sys.executable, "-m", "peer.status.report", *args, "--out", str(tmp_path / "out")],
                                cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert not (tmp_path / "out" / "loss.png").exists()


def test_a_log_with_only_some_kinds_of_events_still_plots(tmp_path):
    log = PeerLog(name="bootstrap-only", events=[{"t": T0, "event": "joined"}])
    from peer.status.report import write_report

    paths = write_report([log], tmp_path)
    assert [p.name for p in paths] == list(PLOTS) and all(p.stat().st_size > 1000 for p in paths)
