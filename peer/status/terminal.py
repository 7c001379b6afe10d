"""The terminal view of a running peer: plain text (ANSI colours optional), redrawn in place.

:func:`render_terminal_view` is pure: it turns the ``/status.json`` document
(:func:`peer.status.swarm.swarm_status`) into lines. :class:`TerminalView` prints it every period;
on a terminal it redraws the screen in place, elsewhere (a file, a pipe) it appends one block per
period, so a service's log stays readable.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import IO, Any

BAR_WIDTH = 24
SPARK = "▁▂▃▄▅▆▇█"
TREND_WINDOW = 60.0  # seconds of loss history the trend compares
_CLEAR = "\x1b[H\x1b[2J"
_RED, _GREEN, _BOLD, _DIM, _RESET = "\x1b[31m", "\x1b[32m", "\x1b[1m", "\x1b[2m", "\x1b[0m"


def format_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "–"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def format_bytes(count: float | None) -> str:
    if count is None:
        return "–"
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def progress_bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """``[██████░░░░]`` for ``fraction`` in [0, 1] (clipped)."""
    fraction = min(1.0, max(0.0, fraction if math.isfinite(fraction) else 0.0))
    full = round(fraction * width)
    return "[" + "█" * full + "░" * (width - full) + "]"


def sparkline(values: Sequence[float | None], width: int = 20) -> str:
    """The last ``width`` finite values as block characters, low to high."""
    finite = [v for v in values if v is not None and math.isfinite(v)][-width:]
    if not finite:
        return ""
    low, high = min(finite), max(finite)
    span = high - low or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - low) / span * len(SPARK)))] for v in finite)


def loss_trend(history: Sequence[dict[str, Any]], *, window: float = TREND_WINDOW) -> float | None:
    """Latest loss minus the loss about ``window`` seconds earlier (None with too little history)."""
    points = [(p["t"], p["loss"]) for p in history if p.get("loss") is not None]
    if len(points) < 2:
        return None
    t_last, last = points[-1]
    earlier = [loss for t, loss in points if t <= t_last - window] or [points[0][1]]
    return last - earlier[-1]


def render_terminal_view(doc: dict[str, Any], *, color: bool = False) -> str:
    """The view of the ``/status.json`` document ``doc`` as text lines (no trailing newline)."""
    paint = (lambda code, text: f"{code}{text}{_RESET}") if color else (lambda code, text: text)
    local = doc.get("local") or {}
    lines = [_title_line(doc, local, paint), _contribution_line(local)]
    lines += _training_lines(doc, local, paint)
    lines.append("")
    lines.append(paint(_BOLD, "stage map") + f"  ({doc['totals']['num_training']} of {doc['totals']['num_peers']} peers training)")
    lines += _stage_lines(doc, local, paint)
    lines += _sample_lines(doc.get("sample"), paint)
    for key, label in (("sync", "state download"), ("checkpoint", "checkpoint write")):
        work = local.get(key)
        if work and not work.get("finished") and work.get("total_bytes"):
            done, total = work["done_bytes"], work["total_bytes"]
            eta = "ETA " + format_duration(work["eta_s"]) if work.get("eta_s") is not None else "ETA –"
            lines.append("")
            lines.append(f"{label} {progress_bar(done / total)} {100 * done / total:3.0f}%  "
                         f"{format_bytes(done)} / {format_bytes(total)}  {eta}")
    return "\n".join(lines)


def _sample_lines(sample: dict[str, Any] | None, paint: Any, width: int = 100) -> list[str]:
    """The newest sample of the model's text, on one line (newlines shown as ⏎), cut to ``width``."""
    if not sample:
        return []
    text = (sample["prompt"] + sample["text"]).replace("\n", "⏎")
    return ["", paint(_BOLD, "the model writes") + f"  (step {sample['step']}, {format_duration(sample['age_s'])} ago)",
            "  " + (text if len(text) <= width else text[: width - 1] + "…")]


def _title_line(doc: dict[str, Any], local: dict[str, Any], paint: Any) -> str:
    if not local:
        return paint(_BOLD, f"Murmuration · run {doc['run_id']} · bootstrap view")
    stage = local.get("stage", -1)
    where = f"stage {stage} of {doc['num_stages']}" if stage >= 0 else "no stage yet"
    peer_id = local.get("peer_id") or "…"
    return paint(_BOLD, f"Murmuration · run {doc['run_id']} · peer …{peer_id[-6:]} · {local.get('role')} · {where} · "
                        f"{local.get('activity') or local.get('state')} · v{local.get('software_version')}")


def _contribution_line(local: dict[str, Any]) -> str:
    if not local:
        return ""
    return (f"uptime {format_duration(local.get('uptime_s'))} · contributed {local.get('num_samples', 0):,} samples "
            f"({local.get('num_microbatches', 0):,} microbatches) · step {local.get('step', 0)}")


def _training_lines(doc: dict[str, Any], local: dict[str, Any], paint: Any) -> list[str]:
    totals, history = doc["totals"], doc.get("history", [])
    loss = totals.get("loss")
    trend = loss_trend(history)
    trend_text = ""
    if trend is not None:
        arrow = "↓" if trend < 0 else "↑" if trend > 0 else "→"
        trend_text = " " + paint(_GREEN if trend < 0 else _RED, f"{arrow} {trend:+.3f} over {TREND_WINDOW:.0f} s")
    spark = sparkline([p.get("loss") for p in history])
    lines = [f"loss {loss:.3f} {spark}{trend_text}" if loss is not None else "loss – (no last-stage report yet)"]
    mine = f" (this peer {local.get('tokens_per_s', 0):,.0f})" if local else ""
    lines.append(f"tokens/s {totals.get('tokens_per_s', 0):,.0f} swarm{mine}")
    if local:
        lines.append(f"bandwidth ↑ {format_bytes(local.get('bytes_sent_per_s'))}/s ↓ {format_bytes(local.get('bytes_received_per_s'))}/s"
                     f"  (total ↑ {format_bytes(local.get('bytes_sent'))} ↓ {format_bytes(local.get('bytes_received'))})")
    return lines


def _stage_lines(doc: dict[str, Any], local: dict[str, Any], paint: Any) -> list[str]:
    stages = doc["stages"]
    top = max([s["capacity_tokens_per_s"] for s in stages] + [1.0])
    lines = []
    for s in stages:
        is_bottleneck = s["stage"] == doc.get("bottleneck")
        here = " ← this peer" if local and local.get("stage") == s["stage"] else ""
        mark = paint(_RED, "  ◀ bottleneck") if is_bottleneck else ""
        bar = progress_bar(s["capacity_tokens_per_s"] / top, width=16)
        lines.append(f"  stage {s['stage']:<2} {bar} {s['num_peers']:>2} peers {s['tokens_per_s']:>9,.0f} tok/s "
                     f"(capacity {s['capacity_tokens_per_s']:,.0f}){mark}{here}")
    return lines


class TerminalView:
    """Prints :func:`render_terminal_view` to ``stream``: redrawn in place on a terminal, appended elsewhere."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stdout
        self.is_tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def draw(self, doc: dict[str, Any]) -> None:
        text = render_terminal_view(doc, color=self.is_tty)
        if self.is_tty:
            self.stream.write(_CLEAR + text + "\n")
        else:
            self.stream.write(text + "\n\n")
        self.stream.flush()
