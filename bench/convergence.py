"""Sample for sample, does the swarm learn what one process learns? Held-out loss at fixed sample counts.

    python bench/convergence.py [--modes single,pipeline,replicas,swarm,swarm_churn,swarm_int8] [--marks 10000,20000,30000,50000]
                                [--eval-every 1024] [--eval-sequences 256] [--max-seconds 1200]
                                [--bootstrap-args "--pipeline-schedule delayed"] [--plot docs/convergence.png]

Every mode trains the default run spec (GPT d_model 128, 4 layers, seq_len 64, byte tokens, AdamW lr
3e-3, microbatch 16, an optimizer step every 64 samples, grad-norm clip 1.0) on the built-in corpus:

* single:   this process trains the whole model (the loop of bench/pipeline_overhead.py);
* pipeline: run_bootstrap.py with 2 stages and 2 run_peer.py processes (one per stage);
* replicas: 1 stage and 2 peers (data parallel, weights averaged every 10 s);
* swarm:    2 stages and 4 peers (the demo's 2 × 2);
* swarm_churn: the same swarm under the churn benchmark's seeded trace (bench/convergence_churn.py):
            a crash, a graceful leave or a rejoin every 30 s (``--churn-period``), 3 to 5 peers, no
            stage emptied. The trace runs on wall time, so a faster run sees fewer events per sample.
* swarm_<codec> (swarm_bf16, swarm_fp16, swarm_int8): the swarm with ``--boundary-codec <codec>``:
            activations and their gradients cross the stage boundary compressed (docs/compression.md);
  swarm_subspace<k>_int8: with ``--boundary-subspace k`` too (k numbers per token, swarm/subspace.py).

Peers run with one torch thread each and evaluate the held-out set themselves (``--eval-every``
samples of their own stage 0, an ``eval`` event in their metrics file). Every mode evaluates the same
held-out set (``TokenSampler.heldout_batches``: the first ``--eval-sequences`` windows of the held-out
slice), as the token-weighted mean next-token loss. A process mode runs until the swarm has counted the
largest mark's samples and evaluated past it (or ``--max-seconds``), then every process is stopped.

Samples are counted where they enter the model: the swarm's samples at time t are the samples of
every stage-0 microbatch event written by then, summed over peers. For each mode and mark:

* ``val_loss``: held-out loss linearly interpolated between the two evaluations around the mark,
  each placed at the swarm's samples when its event was written (null if none lies past the mark);
* ``loss``: mean training loss of the microbatches in the 2,000 samples before the mark (the last
  stage's microbatches, ordered by time, counted cumulatively);
* ``loss_gap_vs_single``: (val_loss − single's) / single's;
* ``tokens_per_s``: stage-0 tokens over the wall time from the first to the last stage-0 microbatch;
* ``compression_ratio`` (modes with a stage boundary): float32 bytes over the codec's bytes on the
  wire for one microbatch's activations (and, the same shape, their gradients), exactly, from the
  codec (``BoundaryCodec.wire_bytes``, checked by the unit tests against what it sends) for the default
  spec's 16 × 64 × 128; ``compression_ratio_with_ids``: the same for a microbatch's both ways with
  the token ids its request carries (16 × 64 int64, or 16 × 65 int32 in a subspace run); headers left out;
* ``loss_gap_vs_uncompressed`` (swarm_<codec>): (val_loss − swarm's) / swarm's, at the same mark.

Prints one JSON line per mode and mark, then a markdown table for BENCHMARKS.md with the command,
date, load average and nproc. Logs and metrics files stay under ``--workdir``.

Data order: under the default ``replica_sync = "gradients"`` every mode draws position ``k`` of batch
``b`` from the run seed alone (``TokenSampler.sample_slot``), so single (``--seed 0``, the run's seed)
and every process mode train on the same samples in the same batches, and a gap measures the
swarm's mechanics, not a different data order. ``--seed 1`` gives single another data order: the
spread that order alone makes (under ``--bootstrap-args "--replica-sync periodic"`` each peer draws
its own samples, as before).

Left out: one run per mode (no spread over repeats); ``--bootstrap-args`` changes the process modes only,
single always trains the default spec; peers' stage choice and averaging timing are the run's.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.convergence_churn import PERIOD as CHURN_PERIOD, ChurnDriver  # noqa: E402
from dht.records import BOUNDARY_CODECS, RunSpec  # noqa: E402
from peer.harness.local_swarm import LocalSwarm, wait_for  # noqa: E402  (needs ROOT on sys.path when run as a script)

# mode -> (--boundary-codec, --boundary-subspace)
CODEC_MODES = {**{f"swarm_{codec}": (codec, 0) for codec in BOUNDARY_CODECS if codec != "none"},
               "swarm_subspace8_int8": ("int8", 8), "swarm_subspace12_int8": ("int8", 12)}
MODES: dict[str, tuple[int, int]] = {"pipeline": (2, 2), "replicas": (1, 2), "swarm": (2, 4),  # (stages, peers)
                                     "swarm_churn": (2, 4), **{mode: (2, 4) for mode in CODEC_MODES}}
ALL_MODES = ("single", *MODES)
DEFAULT_MODES = tuple(m for m in ALL_MODES if m not in CODEC_MODES)  # the codec modes run when asked for
WINDOW_SAMPLES = 2000  # training loss at a mark: the mean over this many samples before it
SMOOTHING = 50  # microbatches in the plotted training loss's moving average
POLL_PERIOD = 5.0  # seconds between reads of the peers' metrics files
PROGRESS_PERIOD = 30.0  # seconds between progress lines on stderr
JOIN_TIMEOUT = 120.0  # seconds for every peer to start training


@dataclass(frozen=True)
class Curve:
    """One mode's run, in swarm samples: held-out evaluations and training losses."""

    mode: str
    eval_samples: list[float]  # ascending, distinct
    val_losses: list[float]
    loss_samples: list[float]  # ascending (cumulative samples after each microbatch)
    losses: list[float]
    tokens_per_s: float | None
    wall_s: float


# ---- pure parts: plain lists in, numbers out ------------------------------------------------------

def cumulative_samples_at(event_times: Sequence[float], event_samples: Sequence[int],
                          query_times: Sequence[float]) -> list[int]:
    """Per query time t, the sum of ``event_samples`` over the events with time <= t."""
    order = sorted(range(len(event_times)), key=lambda i: event_times[i])
    times = [event_times[i] for i in order]
    totals = [0]
    for i in order:
        totals.append(totals[-1] + event_samples[i])
    return [totals[bisect.bisect_right(times, t)] for t in query_times]


def merge_points(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    """The points sorted by x; the ys of equal xs averaged into one point (two replicas evaluated at once)."""
    grouped: dict[float, list[float]] = {}
    for x, y in zip(xs, ys, strict=True):
        grouped.setdefault(x, []).append(y)
    merged_xs = sorted(grouped)
    return merged_xs, [sum(grouped[x]) / len(grouped[x]) for x in merged_xs]


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """y at ``x`` on the polyline through (xs, ys) (xs ascending, distinct); None outside [xs[0], xs[-1]]."""
    if not xs or not xs[0] <= x <= xs[-1]:
        return None
    i = bisect.bisect_left(xs, x)
    if xs[i] == x:
        return ys[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def window_mean(positions: Sequence[float], values: Sequence[float], *, end: float,
                width: float = WINDOW_SAMPLES) -> float | None:
    """Mean of the values whose position p has end − width < p <= end; None if the run never reached
    ``end`` (the window would be cut short) or none falls in it."""
    if not positions or max(positions) < end:
        return None
    inside = [v for p, v in zip(positions, values, strict=True) if end - width < p <= end]
    return sum(inside) / len(inside) if inside else None


def relative_gap(value: float | None, reference: float | None) -> float | None:
    """(value − reference) / reference; None if either is missing."""
    if value is None or reference is None:
        return None
    return (value - reference) / reference


def throughput(times: Sequence[float], amounts: Sequence[float]) -> float | None:
    """Amount per second between the first and the last event (the first event's amount was done
    before the clock started); None with fewer than two distinct times."""
    if len(times) < 2 or max(times) == min(times):
        return None
    first = min(range(len(times)), key=lambda i: times[i])
    return (sum(amounts) - amounts[first]) / (max(times) - min(times))


def curve_from_events(mode: str, microbatches: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]],
                      *, last_stage: int, wall_s: float) -> Curve:
    """A mode's curve from its peers' ``microbatch`` and ``eval`` events (all peers' lists joined)."""
    first = [e for e in microbatches if e["stage"] == 0]
    stage0_evals = [e for e in evals if e.get("stage", 0) == 0]
    positions = cumulative_samples_at([e["t"] for e in first], [e["samples"] for e in first],
                                      [e["t"] for e in stage0_evals])
    eval_samples, val_losses = merge_points(positions, [e["val_loss"] for e in stage0_evals])
    last = sorted((e for e in microbatches if e["stage"] == last_stage and e.get("loss") is not None),
                  key=lambda e: e["t"])
    loss_samples, total = [], 0
    for e in last:
        total += e["samples"]
        loss_samples.append(total)
    return Curve(mode=mode, eval_samples=eval_samples, val_losses=val_losses, loss_samples=loss_samples,
                 losses=[e["loss"] for e in last], wall_s=wall_s,
                 tokens_per_s=throughput([e["t"] for e in first], [e["tokens"] for e in first]))


def is_run_done(microbatches: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]], target: int) -> bool:
    """The swarm counted ``target`` samples and some evaluation lies at or past them."""
    first = [e for e in microbatches if e["stage"] == 0]
    if sum(e["samples"] for e in first) < target:
        return False
    positions = cumulative_samples_at([e["t"] for e in first], [e["samples"] for e in first],
                                      [e["t"] for e in evals if e.get("stage", 0) == 0])
    return any(p >= target for p in positions)


def result_rows(curves: Sequence[Curve], marks: Sequence[int], *,
                ratios: Mapping[str, tuple[float | None, float | None]] | None = None) -> list[dict[str, Any]]:
    """One JSON-ready row per mode and mark; gaps against the ``single`` curve if there is one, and
    a codec mode's against the uncompressed ``swarm`` curve; ``ratios``: mode -> compression ratio."""
    single = next((c for c in curves if c.mode == "single"), None)
    swarm = next((c for c in curves if c.mode == "swarm"), None)
    rows = []
    for curve in curves:
        for mark in marks:
            val_loss = interpolate(curve.eval_samples, curve.val_losses, mark)
            reference = interpolate(single.eval_samples, single.val_losses, mark) if single else None
            uncompressed = interpolate(swarm.eval_samples, swarm.val_losses, mark) if swarm else None
            row = {"bench": "convergence", "mode": curve.mode, "samples": mark,
                   "loss": _rounded(window_mean(curve.loss_samples, curve.losses, end=mark), 4),
                   "val_loss": _rounded(val_loss, 4),
                   "loss_gap_vs_single": _rounded(relative_gap(val_loss, reference), 4),
                   "tokens_per_s": _rounded(curve.tokens_per_s, 1), "wall_s": round(curve.wall_s, 1),
                   **dict(zip(("compression_ratio", "compression_ratio_with_ids"),
                              (_rounded(r, 2) for r in (ratios or {}).get(curve.mode, (None, None)))))}
            if curve.mode in CODEC_MODES:
                row["loss_gap_vs_uncompressed"] = _rounded(relative_gap(val_loss, uncompressed), 4)
            rows.append(row)
    return rows


def boundary_ratio(mode: str) -> tuple[float | None, float | None]:
    """float32 bytes over wire bytes per microbatch at the mode's stage boundary, exactly, from the
    codec, for the default spec's fp32 activations: (activations alone, both ways with the ids)."""
    if mode == "single" or MODES[mode][0] < 2:
        return None, None
    from dht.records import ModelSpec
    from swarm.subspace import microbatch_ratios

    codec, dims = CODEC_MODES.get(mode, ("none", 0))
    return microbatch_ratios(RunSpec(run_id="bench", model=ModelSpec(boundary_subspace=dims), boundary_codec=codec))


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows: marks; columns: modes; cells ``val_loss (gap)``; a last row with each mode's tokens/s."""
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    marks = list(dict.fromkeys(r["samples"] for r in rows))
    cell = {(r["mode"], r["samples"]): r for r in rows}
    lines = ["| samples | " + " | ".join(modes) + " |", "|---:|" + "---:|" * len(modes)]
    for mark in marks:
        lines.append(f"| {mark:,} | " + " | ".join(_format_cell(cell[m, mark]) for m in modes) + " |")
    speeds = [next(r["tokens_per_s"] for r in rows if r["mode"] == m) for m in modes]
    lines.append("| tokens/s | " + " | ".join("—" if s is None else f"{s:,.0f}" for s in speeds) + " |")
    ratios = [next(r.get("compression_ratio") for r in rows if r["mode"] == m) for m in modes]
    if any(ratio is not None for ratio in ratios):
        lines.append("| bytes ÷ fp32 | " + " | ".join("—" if x is None else f"1/{x:.2f}" for x in ratios) + " |")
    return "\n".join(lines)


def _format_cell(row: Mapping[str, Any]) -> str:
    if row["val_loss"] is None:
        return "—"
    gap = row["loss_gap_vs_single"]
    return f"{row['val_loss']:.3f}" + ("" if gap is None or row["mode"] == "single" else f" ({gap:+.1%})")


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)

# ---- single: the whole model in this process ------------------------------------------------------

def train_single(*, max_samples: int, eval_every: int, eval_sequences: int, seed: int = 0,
                 progress: Callable[[str], None] = lambda line: None) -> Curve:
    """Train the default spec's whole model until ``max_samples`` samples and an evaluation at or past
    them; evaluate at 0 and every ``eval_every`` samples. Writes events shaped as the peers' are."""
    import torch

    from dht.records import RunSpec
    from swarm.data import TokenSampler, load_corpus
    from swarm.model import StageModel, next_token_loss

    spec = RunSpec(run_id="bench", stage_layers=((0, 4),))
    model = StageModel(spec, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    sampler = TokenSampler(load_corpus(spec.dataset).text(), seq_len=spec.model.seq_len, seed=seed)
    heldout = sampler.heldout_batches(eval_sequences, spec.microbatch_size)
    per_step = spec.target_batch_size // spec.microbatch_size
    microbatches: list[dict[str, Any]] = []
    evals = [{"t": time.time(), "stage": 0, "samples": 0, "val_loss": heldout_loss(model, heldout)}]
    started, samples, next_eval, optimizer_steps = time.monotonic(), 0, eval_every, 0
    while samples < max_samples:
        for slot in range(per_step):  # the batch's positions, drawn as the swarm's stage-0 replicas draw them
            inputs, targets = sampler.sample_slot(spec.microbatch_size, seed=seed, batch=optimizer_steps, slot=slot,
                                                  slots=per_step)
            loss = next_token_loss(model(inputs), targets)
            (loss / per_step).backward()
            samples += spec.microbatch_size
            microbatches.append({"t": time.time(), "stage": 0, "samples": spec.microbatch_size,
                                 "loss": loss.item(), "tokens": spec.microbatch_size * spec.model.seq_len})
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        optimizer_steps += 1
        if samples >= next_eval or samples >= max_samples:
            evals.append({"t": time.time(), "stage": 0, "samples": samples, "val_loss": heldout_loss(model, heldout)})
            next_eval = (samples // eval_every + 1) * eval_every
            progress(f"[single] {samples} samples, val_loss {evals[-1]['val_loss']:.3f}, "
                     f"{time.monotonic() - started:.0f}s")
    return curve_from_events("single", microbatches, evals, last_stage=0, wall_s=time.monotonic() - started)


def heldout_loss(model: Any, batches: Iterable[tuple[Any, Any]]) -> float:
    """Token-weighted mean next-token loss of ``model`` (the whole model) over ``batches``."""
    import torch

    from swarm.model import next_token_loss

    total, tokens = 0.0, 0
    with torch.no_grad():
        for inputs, targets in batches:
            total += next_token_loss(model(inputs), targets).item() * targets.numel()
            tokens += targets.numel()
    return total / tokens


# ---- process modes: a real swarm on this machine --------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class SwarmSettings:
    """What every process mode shares (from the command line)."""

    max_samples: int  # train until the swarm counted this many samples (the largest mark)
    eval_every: int  # samples of a stage-0 peer between its held-out evaluations
    eval_sequences: int  # held-out sequences per evaluation
    max_seconds: float  # give up waiting after this long (the mode's results then stop where it got)
    bootstrap_args: tuple[str, ...] = ()  # extra run_bootstrap.py flags (run-spec settings to try)
    churn_seed: int = 0  # swarm_churn: the churn trace's seed (bench/churn.py's)
    churn_period: float = CHURN_PERIOD  # swarm_churn: seconds between the trace's events


def run_swarm_mode(mode: str, settings: SwarmSettings, workdir: Path, *,
                   progress: Callable[[str], None] = lambda line: None) -> Curve:
    """Start the mode's bootstrap and peers, train until done (or the deadline), stop them all."""
    num_stages, num_peers = MODES[mode]
    started = time.monotonic()
    flags = ("--num-threads", "1", "--eval-every", str(settings.eval_every), "--eval-sequences", str(settings.eval_sequences))
    with LocalSwarm(workdir / mode) as swarm:
        try:
            codec_name, dims = CODEC_MODES.get(mode, ("none", 0))
            codec = ("--boundary-codec", codec_name, *(("--boundary-subspace", str(dims)) if dims else ()))
            swarm.start_bootstrap("--num-stages", str(num_stages), "--averaging-period", "10",
                                  *settings.bootstrap_args, *codec)
            for _ in range(num_peers):
                swarm.start_peer(*flags)
                time.sleep(1.0)  # staggered, as in the demo
            wait_for(lambda: all(p.events("status") or not p.is_alive() for p in swarm.peers), JOIN_TIMEOUT,
                     "every peer to train")
            churn = None
            if mode == "swarm_churn":
                churn = ChurnDriver(swarm.peers, lambda: swarm.start_peer(*flags), seed=settings.churn_seed,
                                    period=settings.churn_period, duration=settings.max_seconds)
            _wait_until_done(swarm, settings, started, mode=mode, progress=progress,
                             died=churn.poll if churn else lambda: [p.name for p in swarm.peers if not p.is_alive()])
            if churn is not None:
                progress(f"[{mode}] {churn.summary()}")
        except (TimeoutError, RuntimeError):
            print(swarm.logs(), file=sys.stderr)
            raise
        wall_s = time.monotonic() - started
        microbatches, evals = _swarm_events(swarm)
    return curve_from_events(mode, microbatches, evals, last_stage=num_stages - 1, wall_s=wall_s)


def _wait_until_done(swarm: LocalSwarm, settings: SwarmSettings, started: float, *, mode: str,
                     progress: Callable[[str], None], died: Callable[[], list[str]]) -> None:
    """Poll the metrics files until the run is done; at the deadline, warn and return (partial results).
    ``died``: the peers that exited unasked (polled every round; it also applies a churn trace)."""
    last_report = started
    while True:
        dead = died()
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited during the {mode} run")
        microbatches, evals = _swarm_events(swarm)
        if is_run_done(microbatches, evals, settings.max_samples):
            return
        elapsed = time.monotonic() - started
        samples = sum(e["samples"] for e in microbatches if e["stage"] == 0)
        if elapsed > settings.max_seconds:
            progress(f"[{mode}] --max-seconds {settings.max_seconds:.0f} passed at {samples} samples; "
                     "marks past them are null")
            return
        if time.monotonic() - last_report >= PROGRESS_PERIOD:
            progress(f"[{mode}] {samples} samples, {len(evals)} evaluations, {elapsed:.0f}s")
            last_report = time.monotonic()
        time.sleep(POLL_PERIOD)


def _swarm_events(swarm: LocalSwarm) -> tuple[list[dict], list[dict]]:
    """Every peer's microbatch and eval events, joined."""
    microbatches, evals = [], []
    for peer in swarm.peers:
        for event in peer.events():
            if event.get("event") == "microbatch":
                microbatches.append(event)
            elif event.get("event") == "eval":
                evals.append(event)
    return microbatches, evals


# ---- plot and report ------------------------------------------------------------------------------

def write_plot(curves: Sequence[Curve], marks: Sequence[int], path: Path) -> None:
    """Held-out loss and smoothed training loss against samples, every mode on both panels."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    from peer.status.report import moving_average

    fig, (held, train) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True, layout="constrained")
    for curve in curves:
        line, = held.plot(curve.eval_samples, curve.val_losses, marker=".", label=curve.mode)
        train.plot(curve.loss_samples, moving_average(curve.losses, SMOOTHING), color=line.get_color(),
                   label=curve.mode, linewidth=1)
    for ax, title in ((held, "Held-out loss"), (train, f"Training loss (mean of {SMOOTHING} microbatches)")):
        for mark in marks:
            ax.axvline(mark, color="gray", linestyle=":", linewidth=0.8)
        ax.set_title(title)
        ax.set_xlabel("samples (swarm total)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    held.set_ylabel("loss (nats/token)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine_line(argv: Sequence[str], load_start: tuple[float, ...], load_end: tuple[float, ...]) -> str:
    """The command, the date, the load average (1/5/15 min) at start and end, and nproc."""
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    start, end = ("/".join(f"{x:.2f}" for x in load) for load in (load_start, load_end))
    return (f"`{shlex.join(['python', *argv])}` on {datetime.date.today().isoformat()}; "
            f"load average {start} at start, {end} at end; nproc {nproc}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated, of {', '.join(ALL_MODES)} (default: {','.join(DEFAULT_MODES)})")
    parser.add_argument("--marks", default="10000,20000,30000,50000", help="sample counts to report at")
    parser.add_argument("--eval-every", type=int, default=1024, help="samples between evaluations (default 1024)")
    parser.add_argument("--eval-sequences", type=int, default=256, help="held-out sequences (default 256)")
    parser.add_argument("--max-seconds", type=float, default=1200.0, help="per process mode (default 1200)")
    parser.add_argument("--single-threads", type=int, default=2, help="torch threads of single (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="data order of single (0: the run seed, the swarm's order), and swarm_churn's trace (default 0)")
    parser.add_argument("--churn-period", type=float, default=CHURN_PERIOD,
                        help=f"swarm_churn: seconds between churn events (default {CHURN_PERIOD:.0f})")
    parser.add_argument("--bootstrap-args", default="", help="extra run_bootstrap.py flags, one string (shlex)")
    parser.add_argument("--workdir", default=f"runs/convergence-{time.strftime('%Y%m%d-%H%M%S')}",
                        help="logs and metrics of the process modes")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of the curves here")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.marks = sorted(int(m) for m in args.marks.split(","))
    if not args.modes or any(m not in ALL_MODES for m in args.modes):
        parser.error(f"--modes takes a comma-separated list of {', '.join(ALL_MODES)}")
    if args.marks[0] < 1 or args.eval_every < 1 or args.eval_sequences < 1 or args.churn_period <= 0:
        parser.error("marks, --eval-every, --eval-sequences and --churn-period must be positive")
    return args


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    load_start = os.getloadavg()
    settings = SwarmSettings(max_samples=args.marks[-1], eval_every=args.eval_every,
                             eval_sequences=args.eval_sequences, max_seconds=args.max_seconds,
                             bootstrap_args=tuple(shlex.split(args.bootstrap_args)), churn_seed=args.seed,
                             churn_period=args.churn_period)
    curves, failed = [], []
    for mode in args.modes:
        if mode == "single":
            import torch

            torch.set_num_threads(args.single_threads)
            curves.append(train_single(max_samples=args.marks[-1], eval_every=args.eval_every,
                                       eval_sequences=args.eval_sequences, seed=args.seed, progress=_to_stderr))
            continue
        try:
            curves.append(run_swarm_mode(mode, settings, Path(args.workdir), progress=_to_stderr))
        except (TimeoutError, RuntimeError) as e:
            print(f"{mode} failed: {e}", file=sys.stderr)
            failed.append(mode)
    rows = result_rows(curves, args.marks, ratios={curve.mode: boundary_ratio(curve.mode) for curve in curves})
    for row in rows:
        print(json.dumps(row))
    if args.plot is not None and curves:
        write_plot(curves, args.marks, args.plot)
    print()
    print(markdown_table(rows) if rows else "(no mode finished)")
    print()
    print("val_loss: held-out loss (nats/token) at the swarm's sample count; (gap): relative to single; "
          "bytes ÷ fp32: a microbatch's activations (or gradients) on the wire.")
    print(machine_line(sys.argv if argv is None else ["bench/convergence.py", *argv], load_start, os.getloadavg()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
