"""The pure parts of bench/churn.py: the seeded churn trace and the metrics read from the peers' events.

Nothing here starts a process, reads a clock or touches the global RNG: every function is a function
of its arguments (tests/unit/test_churn_metrics.py runs them on synthetic event lists). Times are
unix seconds as the peers write them in their events files (``"t"``); all peers run on one machine,
so their clocks agree.
"""

from __future__ import annotations

import random
import statistics
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

KINDS = ("crash", "leave", "rejoin")
DEFAULT_WEIGHTS = {"crash": 2.0, "leave": 1.0, "rejoin": 2.0}


# ---- the trace ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceEvent:
    """One churn event, ``at`` seconds after the measured window opened.

    ``pick`` (uniform in [0, 1)) chooses the victim of a crash or a leave among the peers eligible
    when the event fires (:func:`choose_victim`); the trace itself names no peer, because which
    process serves which stage is negotiated at run time.
    """

    at: float
    kind: str
    pick: float


def make_trace(seed: int, *, duration: float, period: float, num_peers: int, min_peers: int, max_peers: int,
               weights: dict[str, float] | None = None) -> list[TraceEvent]:
    """One event every ``period`` seconds (at period, 2 period, ... before ``duration``), its kind drawn
    with ``weights`` among those that keep the planned number of peers within [min_peers, max_peers]
    (a crash or a leave removes one, a rejoin adds one). The same arguments give the same trace."""
    weights = weights or DEFAULT_WEIGHTS
    if not 2 <= min_peers <= num_peers <= max_peers:
        raise ValueError(f"need 2 <= min_peers ({min_peers}) <= num_peers ({num_peers}) <= max_peers ({max_peers})")
    if not (period > 0 and duration > 0):
        raise ValueError("duration and period must be positive")
    rng = random.Random(seed)  # a generator of its own: the global RNG is not ours to seed
    trace, count = [], num_peers
    for k in range(1, int(duration / period) + 2):
        at = k * period
        if at >= duration:
            break
        allowed = [kind for kind in KINDS if (count < max_peers if kind == "rejoin" else count > min_peers)]
        kind = rng.choices(allowed, weights=[weights[kind] for kind in allowed])[0]
        pick = rng.random()  # drawn for every kind, so the stream does not depend on the kinds
        count += 1 if kind == "rejoin" else -1
        trace.append(TraceEvent(at=at, kind=kind, pick=pick))
    return trace


def choose_victim(pick: float, training: Sequence[tuple[str, int]], *, exclude: Collection[str] = ()) -> str | None:
    """The peer a crash or leave hits: among ``training`` (name, stage) pairs in start order, those whose
    stage keeps at least one other training peer and that ``exclude`` does not name, ordered by stage,
    then start order; ``pick`` indexes them. None if no peer qualifies. Ordering by stage first makes the
    same draw hit the same stage in every mode whenever the modes' stage maps have the same shape (which
    process lands on which stage is negotiated from FLOP/s measured at start, so it varies from run to
    run). An excluded peer still counts as the other training peer of its stage."""
    per_stage = defaultdict(int)
    for _, stage in training:
        per_stage[stage] += 1
    eligible = [name for _, _, name in sorted((stage, i, name) for i, (name, stage) in enumerate(training)
                                              if per_stage[stage] >= 2 and name not in exclude)]
    if not eligible:
        return None
    return eligible[min(int(pick * len(eligible)), len(eligible) - 1)]


# ---- what the peers did ------------------------------------------------------------------------

@dataclass
class PeerLife:
    """One peer process as the bench saw it, with its events.

    ``gone_at``: when the bench killed it (``crashed``) or sent it SIGINT during the churn (a graceful
    leave); None for a peer that stayed until the end of the run. ``drained``: whether it exited
    cleanly (status 0) after a SIGINT, during the churn or at the end of the run, so that its
    in-flight microbatches had their chance to finish.
    """

    name: str
    events: list[dict]
    gone_at: float | None = None
    crashed: bool = False
    drained: bool = False
    stage: int | None = field(init=False, default=None)
    peer_id: str | None = field(init=False, default=None)
    training_from: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        joined = [e for e in self.events if e.get("event") == "joined"]
        status = [e for e in self.events if e.get("event") == "status"]
        if joined:
            self.peer_id, self.stage = joined[0].get("peer_id"), joined[0].get("stage")
        if status:
            self.stage = status[0].get("stage", self.stage)

    def mark_training(self, status_period: float) -> None:
        """A peer trains from ``status_period`` before its first status line (the status loop sleeps
        first), but not before it joined."""
        status = [e["t"] for e in self.events if e.get("event") == "status"]
        if status:
            joined = [e["t"] for e in self.events if e.get("event") == "joined"]
            self.training_from = max(status[0] - status_period, joined[0] if joined else -float("inf"))

    def of_kind(self, kind: str) -> list[dict]:
        return [e for e in self.events if e.get("event") == kind]


# ---- capacity and goodput ------------------------------------------------------------------------

Segments = list[tuple[float, float, float]]  # (start, end, value), contiguous, piecewise constant


def stage_counts(lives: Iterable[PeerLife], start: float, end: float, num_stages: int) -> list[tuple[float, float, list[int]]]:
    """Training peers per stage over [start, end): (from, to, counts) pieces. A peer counts from
    ``training_from`` until ``gone_at`` (the bench's kill or SIGINT) or the end."""
    changes = []
    for life in lives:
        if life.training_from is None or life.stage is None or not 0 <= life.stage < num_stages:
            continue
        until = life.gone_at if life.gone_at is not None else end
        if until > life.training_from:
            changes += [(life.training_from, life.stage, +1), (until, life.stage, -1)]
    points = sorted({start, end, *(t for t, _, _ in changes if start < t < end)})
    pieces = []
    for a, b in zip(points, points[1:]):
        counts = [0] * num_stages
        for t, stage, delta in changes:
            if t <= a:
                counts[stage] += delta
        pieces.append((a, b, counts))
    return pieces


def per_peer_rates(goodput: float, counts: list[tuple[float, float, list[int]]]) -> list[float]:
    """Samples/s one training peer of each stage adds: ``goodput`` over the time-averaged number of
    training peers of that stage (every sample passes every stage, so each stage ran at ``goodput``)."""
    total = sum(b - a for a, b, _ in counts)
    num_stages = len(counts[0][2])
    mean = [sum((b - a) * c[k] for a, b, c in counts) / total for k in range(num_stages)]
    return [goodput / m if m > 0 else 0.0 for m in mean]


def capacity_segments(counts: list[tuple[float, float, list[int]]], rates: Sequence[float]) -> Segments:
    """Pipeline capacity at each instant: min over stages of (training peers x that stage's rate)."""
    return [(a, b, min(n * r for n, r in zip(c, rates))) for a, b, c in counts]


def integrate(segments: Segments, start: float, end: float) -> float:
    return sum(v * (min(b, end) - max(a, start)) for a, b, v in segments if b > start and a < end)


def completions(lives: Iterable[PeerLife]) -> list[tuple[float, int]]:
    """(time, samples) of every microbatch finished at stage 0 (its gradient back), sorted by time."""
    return sorted((e["t"], int(e.get("samples", 0))) for life in lives for e in life.of_kind("microbatch")
                  if e.get("stage") == 0)


def samples_between(done: Sequence[tuple[float, int]], start: float, end: float) -> int:
    return sum(n for t, n in done if start <= t < end)


# ---- losses and double counts ----------------------------------------------------------------------

@dataclass(frozen=True)
class Losses:
    lost: int  # injected by a peer that drained cleanly after its SIGINT, never finished, not reported unfinished
    lost_at_crashed_peers: int  # injected by a stage-0 peer the bench killed, never finished (its data died with it)
    unfinished: int  # still held (waiting for a replay) when a clean peer stopped: its "unfinished" event lists them
    pending_at_stop: int  # injected by a peer that did not drain cleanly (killed after the grace period)
    num_injected: int
    num_replayed: int


def count_losses(lives: Iterable[PeerLife]) -> Losses | None:
    """Samples of microbatches that stage 0 "injected" but never finished ("microbatch" at stage 0 with
    the same mb_id, on the same peer), split by how their peer ended; None without "injected" events.

    A peer that left gracefully during the churn counts like one that stayed to the end: a leave
    drains the in-flight work, so anything a cleanly drained peer did not finish and did not list in
    its "unfinished" event (what its trainer still held when it stopped) is lost.
    """
    lost = crashed = unfinished = pending = injected_count = replayed = 0
    seen_injected = False
    for life in lives:
        injected = {e["mb_id"]: int(e.get("samples", 0)) for e in life.of_kind("injected")}
        seen_injected |= bool(injected)
        done = {e.get("mb_id") for e in life.of_kind("microbatch") if e.get("stage") == 0}
        held = {mb_id for e in life.of_kind("unfinished") for mb_id in e.get("mb_ids", ())}
        missing = {mb_id: n for mb_id, n in injected.items() if mb_id not in done}
        injected_count += len(injected)
        replayed += len(life.of_kind("replayed"))
        if life.crashed:
            crashed += sum(missing.values())
            continue
        unfinished += sum(n for mb_id, n in missing.items() if mb_id in held)
        rest = sum(n for mb_id, n in missing.items() if mb_id not in held)
        if life.drained:
            lost += rest
        else:
            pending += rest
    if not seen_injected:
        return None
    return Losses(lost=lost, lost_at_crashed_peers=crashed, unfinished=unfinished, pending_at_stop=pending,
                  num_injected=injected_count, num_replayed=replayed)


def count_double(lives: Iterable[PeerLife], *, include_crashed: bool = True) -> int | None:
    """Per stage, over all its replicas (crashed ones up to their crash), the samples of every mb_id
    "accumulated" more than once, times the extra count, summed; None without "accumulated" events.

    With ``include_crashed=False`` only replicas that did not crash count: a crashed replica's buffer
    died with it, so a re-delivery that replaced its accumulation is not a double count in the model
    the swarm keeps (unless the crashed replica averaged it away first, which events cannot tell).
    """
    times: dict[tuple[int, str], list[int]] = defaultdict(list)
    seen = False
    for life in lives:
        accumulated = life.of_kind("accumulated")
        seen |= bool(accumulated)
        if life.crashed and not include_crashed:
            continue
        for e in accumulated:
            times[(e.get("stage"), e.get("mb_id"))].append(int(e.get("samples", 0)))
    if not seen:
        return None
    return sum(sum(samples[1:]) for samples in times.values() if len(samples) > 1)


# ---- detection and recovery -------------------------------------------------------------------

def detect_delays(crashes: Sequence[tuple[float, str | None]], lives: Iterable[PeerLife], *,
                  kinds: Sequence[str] = ("peer_down",)) -> list[float | None]:
    """For each (kill or SIGINT time, victim peer_id): the first event of ``kinds`` about the victim
    (its ``peer_id`` field) on any other peer, minus that time; None when no other peer reported it."""
    downs = defaultdict(list)
    for life in lives:
        for e in life.events:
            if e.get("event") in kinds:
                downs[e.get("peer_id")].append((e["t"], life.peer_id))
    delays = []
    for killed_at, victim in crashes:
        seen = [t for t, by in downs.get(victim, []) if t >= killed_at and by != victim] if victim else []
        delays.append(min(seen) - killed_at if seen else None)
    return delays


def false_suspicions(lives: Sequence[PeerLife]) -> list[dict]:
    """"peer_down" events not from a leave notice about a peer that was still up: the bench had neither
    killed it nor signalled its leave by then. (A re-dispatch on such a suspicion sends a microbatch a
    second time while the suspect may still finish the first.)"""
    gone = {life.peer_id: life.gone_at for life in lives if life.peer_id}
    found = []
    for life in lives:
        for e in life.of_kind("peer_down"):
            suspect, how = e.get("peer_id"), e.get("how")
            if how == "notice" or suspect not in gone:
                continue
            if gone[suspect] is None or gone[suspect] > e["t"]:
                found.append({"t": e["t"], "by": life.name, "suspect": suspect, "how": how})
    return sorted(found, key=lambda f: f["t"])


def recover_delays(crash_times: Sequence[float], done: Sequence[tuple[float, int]], capacity: Segments, *,
                   window: float, threshold: float, end: float, step: float = 0.5,
                   scales: Sequence[float] | None = None) -> list[float | None]:
    """For each crash at ``c``: the first ``s >= c`` (in ``step``s) such that stage-0 samples finished
    in [s, s + window) reach ``threshold`` x the capacity online integrated over the same window
    (times ``scales[i]`` for the i-th crash, if given); ``s - c`` is the recovery time (0: no dip
    worth the name). None if no such window ends by ``end``."""
    delays = []
    for i, c in enumerate(crash_times):
        target = threshold * (scales[i] if scales is not None else 1.0)
        found, k = None, 0
        while c + k * step + window <= end:
            s = c + k * step
            if samples_between(done, s, s + window) >= target * integrate(capacity, s, s + window):
                found = s - c
                break
            k += 1
        delays.append(found)
    return delays


def pre_crash_ratios(crash_times: Sequence[float], done: Sequence[tuple[float, int]], capacity: Segments, *,
                     before: float, start: float) -> list[float]:
    """Goodput over capacity in the ``before`` seconds ending at each crash (from ``start`` at the
    earliest): what "recovered" can mean on a machine whose speed drifts between runs, or whose peers
    share cores (then the ratio exceeds 1, and so does the bar for recovery)."""
    ratios = []
    for c in crash_times:
        a = max(start, c - before)
        expected = integrate(capacity, a, c)
        ratios.append(samples_between(done, a, c) / expected if expected > 0 else 1.0)
    return ratios


def spread(values: Sequence[float | None]) -> dict:
    """Median and max of the values that exist, and how many do not."""
    present = [v for v in values if v is not None]
    return {"median": round(statistics.median(present), 3) if present else None,
            "max": round(max(present), 3) if present else None,
            "num": len(values), "num_missing": len(values) - len(present)}


def capacity_rates(mode: str, *, lives: list[PeerLife], reference: dict | None, pre_churn: float, start: float,
                   first_event: float, num_stages: int) -> tuple[list[float], str]:
    """Per-peer rates of each stage for the capacity, and their source: the no_churn run's, else this
    run's before its first event (``pre_churn`` samples/s over its first ``first_event`` seconds from
    ``start``)."""
    if reference is not None:
        return reference["rates"], "no_churn run"
    rates = per_peer_rates(pre_churn, stage_counts(lives, start, start + first_event, num_stages))
    return rates, "this run (by construction)" if mode == "no_churn" else "this run's first event period"
