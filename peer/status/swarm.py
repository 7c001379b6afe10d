"""The swarm as the health page, ``/status.json`` and the terminal view show it: pure functions of
the peer records in the DHT, plus a short history for the plots.

Throughput per stage is shown two ways. *Measured* tokens/s is what the stage's replicas report in
their heartbeats; in a steady pipeline every stage processes the same samples, so the measured
figures agree and cannot say where the pipeline is held up. *Capacity* is the planner's figure
(README, "Chooses a stage"): the sum of the members' FLOP/s over the stage's FLOPs per sample, times
the sequence length. The **bottleneck** is the stage of least capacity (ties: the lower index), the
stage a joiner would fill; a stage nobody trains is always the bottleneck.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

from dht.records import PeerRecord

MAX_HISTORY_POINTS = 720


def stage_map(records: Sequence[PeerRecord], *, stage_flops: Sequence[float], seq_len: int) -> dict[str, Any]:
    """Peers, measured throughput and capacity per stage, and the bottleneck.

    Args:
        records: live peer records (any state; only "training" ones count towards throughput).
        stage_flops: FLOPs of one sample's forward and backward, per stage.
        seq_len: tokens per sample.

    Returns:
        ``{"stages": [{"stage", "num_peers", "peer_ids", "num_training", "tokens_per_s",
        "capacity_tokens_per_s"}...], "bottleneck": stage index or None if there are no stages}``
    """
    stages = []
    for k, flops_per_sample in enumerate(stage_flops):
        members = sorted((r for r in records if r.stage == k), key=lambda r: r.peer_id)
        training = [r for r in members if r.state == "training"]
        capacity = sum(r.flops for r in training) / flops_per_sample * seq_len if flops_per_sample > 0 else 0.0
        stages.append({
            "stage": k,
            "num_peers": len(members),
            "peer_ids": [r.peer_id for r in members],
            "num_training": len(training),
            "tokens_per_s": round(sum(r.samples_per_s for r in training) * seq_len, 1),
            "capacity_tokens_per_s": round(capacity, 1),
        })
    bottleneck = min(stages, key=lambda s: (s["capacity_tokens_per_s"], s["stage"]))["stage"] if stages else None
    return {"stages": stages, "bottleneck": bottleneck}


def peer_rows(records: Sequence[PeerRecord], *, seq_len: int) -> list[dict[str, Any]]:
    """One JSON-able row per peer record, ordered by stage then peer id (joiners, stage -1, first)."""
    rows = []
    for r in sorted(records, key=lambda r: (r.stage, r.peer_id)):
        rows.append({
            "peer_id": r.peer_id, "stage": r.stage, "state": r.state, "role": r.role, "reachability": r.reachability,
            "software_version": r.software_version or None, "tokens_per_s": round(r.samples_per_s * seq_len, 1),
            "loss": _finite_or_none(r.loss), "num_samples": r.num_samples, "step": r.version,
            "flops": r.flops, "bytes_sent": r.bytes_sent, "bytes_received": r.bytes_received,
        })
    return rows


def swarm_totals(records: Sequence[PeerRecord], *, num_stages: int, seq_len: int) -> dict[str, Any]:
    """The swarm's training rate and loss, as the last stage sees them (every sample ends there).

    Returns:
        ``{"tokens_per_s", "loss" (mean over last-stage training peers that report one, or None),
        "val_loss" (mean held-out loss over the stage-0 training peers that measured one, or None),
        "num_peers", "num_training"}``
    """
    last = [r for r in records if r.stage == num_stages - 1 and r.state == "training"]
    losses = [r.loss for r in last if math.isfinite(r.loss)]
    val_losses = [r.val_loss for r in records if r.stage == 0 and r.state == "training" and math.isfinite(r.val_loss)]
    return {
        "tokens_per_s": round(sum(r.samples_per_s for r in last) * seq_len, 1),
        "loss": round(sum(losses) / len(losses), 4) if losses else None,
        "val_loss": round(sum(val_losses) / len(val_losses), 4) if val_losses else None,
        "num_peers": len(records),
        "num_training": sum(r.state == "training" for r in records),
    }


class SwarmHistory:
    """Swarm-wide loss and tokens/s (in total and per stage) over time, for the health page's plots."""

    def __init__(self, *, max_points: int = MAX_HISTORY_POINTS) -> None:
        self._points: deque[dict[str, Any]] = deque(maxlen=max_points)

    def record(self, t: float, totals: dict[str, Any], stages: Sequence[dict[str, Any]]) -> None:
        if self._points and t <= self._points[-1]["t"]:
            return
        self._points.append({"t": round(t, 3), "loss": totals["loss"], "val_loss": totals.get("val_loss"),
                             "tokens_per_s": totals["tokens_per_s"],
                             "stage_tokens_per_s": [s["tokens_per_s"] for s in stages]})

    def points(self) -> list[dict[str, Any]]:
        return list(self._points)


def swarm_status(
    *, run_id: str, records: Sequence[PeerRecord], stage_flops: Sequence[float], seq_len: int,
    history: SwarmHistory, local: dict[str, Any] | None, now: float, sample: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``/status.json`` document: what the health page draws and the terminal view prints.

    Keys: run_id, time, num_stages, local (the serving peer's :func:`peer.status.local.local_status`, or
    None on a bootstrap), totals (:func:`swarm_totals`), stages and bottleneck (:func:`stage_map`),
    peers (:func:`peer_rows`), history (:meth:`SwarmHistory.points`), sample (the newest continuation
    of a fixed prompt by the whole model, ``peer.model_sample``: prompt, text, step, age_s; or None).
    """
    mapped = stage_map(records, stage_flops=stage_flops, seq_len=seq_len)
    return {
        "run_id": run_id,
        "time": round(now, 3),
        "num_stages": len(stage_flops),
        "local": local,
        "totals": swarm_totals(records, num_stages=len(stage_flops), seq_len=seq_len),
        "stages": mapped["stages"],
        "bottleneck": mapped["bottleneck"],
        "peers": peer_rows(records, seq_len=seq_len),
        "history": history.points(),
        "sample": sample,
    }


def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None
