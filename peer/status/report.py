"""``python -m peer.status.report <metrics.jsonl ...> --out DIR``: plots of a peer's or a swarm's event logs.

Reads the JSON lines that peers write with ``--metrics-file`` (:mod:`peer.event_log`), one file per
peer, and draws three PNGs into ``DIR``:

- ``loss.png``: the loss of every microbatch that reported one, per peer, with a moving average;
- ``throughput.png``: tokens/s per peer from its status lines, and the swarm's pipeline throughput
  (the sum over stage-0 peers: every sample enters the pipeline at stage 0 exactly once);
- ``stage_balance.png``: peers per stage and tokens/s per stage over time.

Time is seconds since the earliest event of all the logs. The data steps (:func:`read_events`,
:func:`loss_series`, :func:`throughput_series`, :func:`stage_series`) are pure and tested apart
from the drawing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLOTS = ("loss.png", "throughput.png", "stage_balance.png")
SMOOTHING = 20  # microbatches in the loss's moving average
BUCKET_SECONDS = 5.0  # status lines are grouped into buckets of this length for per-stage sums


@dataclass
class PeerLog:
    """One peer's events, in file order; ``name`` labels it in the plots."""

    name: str
    events: list[dict[str, Any]] = field(default_factory=list)
    num_malformed: int = 0


def read_events(path: str | Path) -> PeerLog:
    """Parse a metrics file; lines that are not JSON objects with a time and an event are counted, not fatal.

    Raises:
        ValueError: the file cannot be read.
    """
    path = Path(path)
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from e
    log = PeerLog(name=path.stem)
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            log.num_malformed += 1
            continue
        if isinstance(event, dict) and isinstance(event.get("t"), int | float) and isinstance(event.get("event"), str):
            log.events.append(event)
        else:
            log.num_malformed += 1
    return log


def start_time(logs: list[PeerLog]) -> float:
    times = [e["t"] for log in logs for e in log.events]
    if not times:
        raise ValueError("the logs hold no events; give the files peers wrote with --metrics-file")
    return min(times)


def loss_series(log: PeerLog, t0: float) -> tuple[list[float], list[float]]:
    """(seconds since ``t0``, loss) of every microbatch with a finite loss."""
    points = [(e["t"] - t0, e["loss"]) for e in log.events
              if e["event"] == "microbatch" and _is_number(e.get("loss"))]
    return [t for t, _ in points], [loss for _, loss in points]


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def throughput_series(log: PeerLog, t0: float) -> tuple[list[float], list[float], list[int]]:
    """(seconds since ``t0``, tokens/s, stage) of the peer's status lines."""
    rows = [(e["t"] - t0, float(e["tokens_per_s"]), int(e.get("stage", -1))) for e in log.events
            if e["event"] == "status" and _is_number(e.get("tokens_per_s"))]
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def stage_series(logs: list[PeerLog], t0: float, *, bucket: float = BUCKET_SECONDS) -> dict[str, Any]:
    """Per time bucket: peers per stage (the latest view any peer reported) and tokens/s per stage.

    Returns:
        ``{"t": [bucket starts], "peers": {stage: [count per bucket]}, "tokens_per_s": {stage: [...]},
        "swarm_tokens_per_s": [stage-0 sum per bucket]}``; a peer counts once per bucket (its latest line).
    """
    latest: dict[int, dict[str, dict]] = defaultdict(dict)  # bucket → peer → its latest status line
    for log in logs:
        for e in log.events:
            if e["event"] == "status" and _is_number(e.get("tokens_per_s")):
                slot = int((e["t"] - t0) // bucket)
                if log.name not in latest[slot] or latest[slot][log.name]["t"] <= e["t"]:
                    latest[slot][log.name] = e
    slots = sorted(latest)
    stages = sorted({int(e.get("stage", -1)) for lines in latest.values() for e in lines.values()} - {-1})
    num_view_stages = max((len(e.get("peers_per_stage") or []) for lines in latest.values() for e in lines.values()), default=0)
    peers = {k: [] for k in range(max(num_view_stages, max(stages, default=-1) + 1))}
    tokens = {k: [] for k in peers}
    for slot in slots:
        lines = sorted(latest[slot].values(), key=lambda e: e["t"])
        view = lines[-1].get("peers_per_stage") or []
        for k in peers:
            peers[k].append(int(view[k]) if k < len(view) else sum(1 for e in lines if e.get("stage") == k))
            tokens[k].append(sum(float(e["tokens_per_s"]) for e in lines if e.get("stage") == k))
    return {"t": [slot * bucket for slot in slots], "peers": peers, "tokens_per_s": tokens,
            "swarm_tokens_per_s": list(tokens.get(0, [0.0] * len(slots)))}


def write_report(logs: list[PeerLog], out_dir: str | Path) -> list[Path]:
    """Draw the three plots into ``out_dir`` (created if missing); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    t0 = start_time(logs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / name for name in PLOTS]
    for path, draw in zip(paths, (_draw_loss, _draw_throughput, _draw_stages), strict=True):
        fig = draw(plt, logs, t0)
        fig.savefig(path, dpi=100)
        plt.close(fig)
    return paths


def _draw_loss(plt: Any, logs: list[PeerLog], t0: float) -> Any:
    fig, ax = plt.subplots(figsize=(9, 4.5), layout="constrained")
    for log in logs:
        times, losses = loss_series(log, t0)
        if times:
            line, = ax.plot(times, moving_average(losses, SMOOTHING), label=f"{log.name} (mean of {SMOOTHING})")
            ax.scatter(times, losses, s=3, alpha=0.25, color=line.get_color())
    _finish(ax, "Loss per microbatch", "loss (nats/token)", "no microbatch reported a loss")
    return fig


def _draw_throughput(plt: Any, logs: list[PeerLog], t0: float) -> Any:
    fig, ax = plt.subplots(figsize=(9, 4.5), layout="constrained")
    for log in logs:
        times, tokens, stages = throughput_series(log, t0)
        if times:
            ax.plot(times, tokens, label=f"{log.name} (stage {stages[-1]})", linewidth=1)
    swarm = stage_series(logs, t0)
    if swarm["t"]:
        ax.step(swarm["t"], swarm["swarm_tokens_per_s"], where="post", color="black", linewidth=2,
                label="swarm (sum over stage 0)")
    _finish(ax, "Throughput", "tokens/s", "no status lines with throughput")
    return fig


def _draw_stages(plt: Any, logs: list[PeerLog], t0: float) -> Any:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, layout="constrained")
    series = stage_series(logs, t0)
    for k, counts in series["peers"].items():
        top.step(series["t"], counts, where="post", label=f"stage {k}")
        bottom.step(series["t"], series["tokens_per_s"][k], where="post", label=f"stage {k}")
    top.yaxis.get_major_locator().set_params(integer=True)
    _finish(top, "Stage balance", "peers", "no status lines", xlabel=False)
    _finish(bottom, "", "tokens/s per stage", "")
    return fig


def _finish(ax: Any, title: str, ylabel: str, empty_note: str, *, xlabel: bool = True) -> None:
    if title:
        ax.set_title(title)
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel("seconds since the first event")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc="best")
    elif empty_note:
        ax.text(0.5, 0.5, empty_note, transform=ax.transAxes, ha="center", va="center", color="gray")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m peer.status.report", description=(
        "Turn peers' event logs (run_peer.py --metrics-file) into PNG plots: loss, throughput, stage balance."))
    parser.add_argument("logs", nargs="+", help="metrics files, one per peer")
    parser.add_argument("--out", required=True, help="folder to write the PNGs into (created if missing)")
    args = parser.parse_args(argv)
    try:
        logs = [read_events(path) for path in args.logs]
        paths = write_report(logs, args.out)
    except (ValueError, OSError) as e:  # unreadable logs, no events, an --out that is not a folder
        print(f"error: {e}", file=sys.stderr)
        return 2
    skipped = sum(log.num_malformed for log in logs)
    events = sum(len(log.events) for log in logs)
    print(f"read {events} events from {len(logs)} log(s)" + (f", skipped {skipped} malformed line(s)" if skipped else ""))
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
