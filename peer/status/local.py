"""A peer's own status as plain JSON-able data.

One function, :func:`local_status`, turns the peer's newest :class:`~peer.status.snapshot.PeerSnapshot`
into what every window onto a running peer shows: the health page and ``/status.json``, the
Prometheus collector, the terminal view and the py-libp2p status protocol.

Rates are over a recent window (:class:`StatusHistory`, sampled about once a second by the peer),
not since start, so a peer that stalls shows it within seconds.
"""

from __future__ import annotations

import importlib.metadata
import math
import time
import tomllib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peer.status.snapshot import PeerSnapshot

RATE_WINDOW = 10.0  # seconds of samples the recent rates are computed over
MAX_HISTORY_POINTS = 720  # one point per sample period: an hour at 5 s


def _software_version() -> str:
    """The installed package's version, or pyproject's when run from a checkout that is not installed."""
    try:
        return importlib.metadata.version("murmuration")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        with open(Path(__file__).resolve().parents[2] / "pyproject.toml", "rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


SOFTWARE_VERSION = _software_version()


@dataclass(frozen=True)
class StatusSample:
    """The peer's cumulative counters at one moment (``t``: unix time)."""

    t: float
    num_samples: int
    num_microbatches: int
    loss: float
    bytes_sent: int
    bytes_received: int


class StatusHistory:
    """Samples of a peer's counters: recent rates, and the loss/throughput series the plots draw.

    Args:
        seq_len: tokens per sample, to turn samples/s into tokens/s.
        window: seconds of samples the recent rates are computed over.
        max_points: samples kept for the plots (the oldest are dropped).
    """

    def __init__(self, *, seq_len: int, window: float = RATE_WINDOW, max_points: int = MAX_HISTORY_POINTS) -> None:
        self.seq_len = seq_len
        self.window = window
        self._samples: deque[StatusSample] = deque(maxlen=max_points)

    def record(self, sample: StatusSample) -> None:
        if self._samples and sample.t <= self._samples[-1].t:
            return  # a clock step back or a double call: keep the series monotonic
        self._samples.append(sample)

    @property
    def latest(self) -> StatusSample | None:
        return self._samples[-1] if self._samples else None

    def rates(self) -> dict[str, float]:
        """Per-second rates over the last ``window`` seconds (0 with fewer than two samples)."""
        if len(self._samples) < 2:
            return {"samples_per_s": 0.0, "tokens_per_s": 0.0, "microbatches_per_s": 0.0,
                    "bytes_sent_per_s": 0.0, "bytes_received_per_s": 0.0}
        last = self._samples[-1]
        first = next(s for s in self._samples if s.t >= last.t - self.window or s is last)
        if first is last:
            first = self._samples[-2]
        return _rates_between(first, last, self.seq_len)

    def series(self) -> list[dict[str, Any]]:
        """One point per sample after the first: ``{"t", "loss", "tokens_per_s"}`` (loss None if unknown)."""
        points = []
        samples = list(self._samples)
        for before, after in zip(samples, samples[1:]):
            rates = _rates_between(before, after, self.seq_len)
            points.append({"t": round(after.t, 3), "loss": _finite_or_none(after.loss),
                           "tokens_per_s": round(rates["tokens_per_s"], 1)})
        return points


def _rates_between(first: StatusSample, last: StatusSample, seq_len: int) -> dict[str, float]:
    elapsed = last.t - first.t
    if elapsed <= 0:
        return {"samples_per_s": 0.0, "tokens_per_s": 0.0, "microbatches_per_s": 0.0,
                "bytes_sent_per_s": 0.0, "bytes_received_per_s": 0.0}
    samples_per_s = max(0, last.num_samples - first.num_samples) / elapsed
    return {
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * seq_len,
        "microbatches_per_s": max(0, last.num_microbatches - first.num_microbatches) / elapsed,
        "bytes_sent_per_s": max(0, last.bytes_sent - first.bytes_sent) / elapsed,
        "bytes_received_per_s": max(0, last.bytes_received - first.bytes_received) / elapsed,
    }


class SyncProgress:
    """How far the download of a stage's state got, estimated from the bytes received since it began.

    The transfer itself reports only when done; the bytes the peer's wire reads meanwhile are almost
    all shards, so they make a fair progress bar. ``done_bytes`` never passes ``total_bytes``.
    """

    def __init__(self, *, total_bytes: int, traffic: Any) -> None:
        self.total_bytes = total_bytes
        self.traffic = traffic
        self.started_at = time.time()
        self._received_at_start = traffic.bytes_received
        self.finished = False
        self.received_bytes: int | None = None  # what actually arrived, once finished: checks the estimate

    @property
    def done_bytes(self) -> int:
        if self.finished:
            return self.total_bytes
        return min(self.total_bytes, self.traffic.bytes_received - self._received_at_start)

    def finish(self) -> None:
        self.received_bytes = self.traffic.bytes_received - self._received_at_start
        self.finished = True

    def as_dict(self, now: float | None = None) -> dict[str, Any]:
        """``{"done_bytes", "total_bytes", "started_at", "eta_s", "finished", "received_bytes"}``; eta_s is
        None until bytes arrive; received_bytes (all bytes read during the download) None until finished."""
        now = time.time() if now is None else now
        done, elapsed = self.done_bytes, now - self.started_at
        eta = (self.total_bytes - done) * elapsed / done if done > 0 and elapsed > 0 else None
        return {"done_bytes": done, "total_bytes": self.total_bytes, "started_at": round(self.started_at, 3),
                "eta_s": round(eta, 1) if eta is not None else None, "finished": self.finished,
                "received_bytes": self.received_bytes}


def sample_of(snapshot: PeerSnapshot) -> StatusSample:
    """The cumulative counters of ``snapshot`` (zeros before the peer holds a stage)."""
    return StatusSample(t=snapshot.time, num_samples=snapshot.num_samples, num_microbatches=snapshot.num_microbatches,
                        loss=snapshot.loss, bytes_sent=snapshot.bytes_sent or 0, bytes_received=snapshot.bytes_received or 0)


def local_status(snapshot: PeerSnapshot, history: StatusHistory | None = None) -> dict[str, Any]:
    """The peer's own status, JSON-able (NaN and unknowns are ``None``): ``snapshot`` with the recent
    rates of ``history``.

    Keys (stable; new ones may be added, none removed or renamed):
        peer_id, run_id, role ("reliable"/"unreliable"), client_mode (bool), stage (-1 before one is
        chosen), num_stages (None before the spec is known), state ("joining"/"syncing"/"training"/
        "paused"/"leaving"), activity (what it does now, in words: "training stage 1", "waiting: stage
        1 has no holder", ...), software_version, step (optimizer steps of its stage replica),
        tokens_per_s, samples_per_s, microbatches_per_s, bytes_sent_per_s, bytes_received_per_s
        (recent window), loss (most recent, None if none yet), val_loss (most recent held-out loss,
        None if none), bytes_sent, bytes_received (payload bytes of its pipeline and state traffic,
        None if not counted), uptime_s, num_samples (samples it has contributed), num_microbatches,
        flops (measured FLOP/s), time (unix seconds of this status), sync (state download progress:
        ``{"done_bytes", "total_bytes", "started_at", "eta_s", "finished", "received_bytes"}``, or None
        if it downloaded nothing), checkpoint (the last checkpoint write's progress, or None).
    """
    rates = history.rates() if history is not None else {}
    return {
        "peer_id": snapshot.peer_id or None,
        "run_id": snapshot.run_id,
        "role": snapshot.role,
        "client_mode": snapshot.client_mode,
        "stage": snapshot.stage,
        "num_stages": snapshot.num_stages,
        "state": snapshot.state.value,
        "activity": snapshot.activity,
        "software_version": SOFTWARE_VERSION,
        "step": snapshot.step,
        "tokens_per_s": round(rates.get("tokens_per_s", 0.0), 1),
        "samples_per_s": round(rates.get("samples_per_s", 0.0), 3),
        "microbatches_per_s": round(rates.get("microbatches_per_s", 0.0), 3),
        "bytes_sent_per_s": round(rates.get("bytes_sent_per_s", 0.0), 1),
        "bytes_received_per_s": round(rates.get("bytes_received_per_s", 0.0), 1),
        "loss": _finite_or_none(snapshot.loss),
        "val_loss": _finite_or_none(snapshot.val_loss),
        "bytes_sent": snapshot.bytes_sent,
        "bytes_received": snapshot.bytes_received,
        "uptime_s": round(snapshot.uptime_s, 3) if snapshot.uptime_s is not None else None,
        "num_samples": snapshot.num_samples,
        "num_microbatches": snapshot.num_microbatches,
        "flops": float(snapshot.flops),
        "time": round(snapshot.time, 3),
        "sync": dict(snapshot.sync) if snapshot.sync is not None else None,
        "checkpoint": dict(snapshot.checkpoint) if snapshot.checkpoint is not None else None,
    }


def _finite_or_none(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return float(value)

