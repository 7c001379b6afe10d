"""The llama family trains in a real swarm: a bootstrap publishing a Llama-style run (RMSNorm, rotary
positions, SwiGLU, grouped-query attention) and two run_peer.py processes, one per stage; the loss falls."""

from __future__ import annotations

import statistics

import pytest

from peer.harness.local_swarm import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
LOSS_WINDOW = 20
MICROBATCHES = 150


def test_a_llama_run_trains_across_two_stages_and_its_loss_falls(local_swarm):
    local_swarm.start_bootstrap("--model-family", "llama", "--num-heads", "4", "--num-kv-heads", "2")
    peers = [local_swarm.start_peer("--num-threads", "1", "--stage", str(stage), "--rebalance-period", "0")
             for stage in (0, 1)]
    last = peers[1]

    def losses() -> list[float]:
        return [e["loss"] for e in last.events("microbatch") if e.get("loss") is not None]

    wait_for(lambda: len(losses()) >= MICROBATCHES or not all(p.is_alive() for p in peers), 180,
             f"{MICROBATCHES} microbatches through the llama pipeline")
    assert all(p.is_alive() for p in peers), local_swarm.logs()
    log = last.log_path.read_text()
    assert "run spec: run demo: Llama d_model=128 layers=4 heads=4/2 kv" in log, log[:2000]
    seen = losses()
    first, final = statistics.mean(seen[:LOSS_WINDOW]), statistics.mean(seen[-LOSS_WINDOW:])
    print(f"llama 1 + 1: loss {first:.3f} -> {final:.3f} over {len(seen)} microbatches")
    assert final < first - 0.5, f"loss {first:.3f} -> {final:.3f}"
