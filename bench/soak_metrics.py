"""The pure parts of bench/soak.py: which peers the churn spares, and RSS growth from samples.

Nothing here reads /proc, a clock or the global RNG (tests/unit/test_soak_metrics.py runs it on
hand-made samples); bench/proc_table.py reads /proc and bench/soak.py runs the swarm.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

# One RSS sample of a peer: (unix time, {process kind: KiB}), kinds "peer" (the run_peer.py process),
# "p2pd" and "children" (every other descendant: the hivemind DHT process forked by the peer).
RssSample = tuple[float, dict[str, int]]


def choose_protected(training: Sequence[tuple[str, int]], num_protected: int) -> list[str]:
    """The peers no crash or leave may hit, from the initial peers' (name, stage) pairs in start order:
    the first peer of each stage (lowest stage first), then the next peers in start order, until
    ``num_protected`` are chosen (or every peer is). Holding one peer of every stage keeps each stage
    alive whatever the trace draws, so a victim's stage always keeps another training peer and every
    peer outside the protected ones stays eligible."""
    if num_protected < 0:
        raise ValueError(f"num_protected must be >= 0, got {num_protected}")
    chosen: list[str] = []
    for stage in sorted({stage for _, stage in training}):
        if len(chosen) < num_protected:
            chosen.append(next(name for name, s in training if s == stage))
    for name, _ in training:
        if len(chosen) >= num_protected:
            break
        if name not in chosen:
            chosen.append(name)
    return chosen


def median_between(samples: Sequence[tuple[float, float]], start: float, end: float) -> float | None:
    """Median of the values sampled in [start, end]; None if none was."""
    values = [v for t, v in samples if start <= t <= end]
    return statistics.median(values) if values else None


def rss_growth(samples: Sequence[tuple[float, float]], *, start: float, end: float, fraction: float = 0.1) -> float | None:
    """(median over the last ``fraction`` of [start, end]) / (median over its first ``fraction``) - 1.

    ``start`` is the end of the warm-up, not the peer's start (see bench/soak.py for why). Medians,
    not means or single samples: a state download served to a rejoiner or an averaging round
    allocates buffers for seconds, and one such sample must not read as growth. None where either
    part holds no sample or the first median is 0.
    """
    if not (0 < fraction <= 0.5 and end > start):
        raise ValueError(f"need 0 < fraction <= 0.5 and end > start, got {fraction}, [{start}, {end}]")
    span = (end - start) * fraction
    first, last = median_between(samples, start, start + span), median_between(samples, end - span, end)
    if first is None or last is None or first <= 0:
        return None
    return last / first - 1


def peer_growth(samples: Sequence[RssSample], *, start: float, end: float, fraction: float = 0.1) -> dict:
    """One peer's growth of its whole tree (``growth``) and of each kind of process, with the tree's
    median MiB over the first and the last ``fraction`` of the window."""
    total = [(t, sum(kinds.values())) for t, kinds in samples]
    span = (end - start) * fraction
    kinds = sorted({kind for _, by_kind in samples for kind in by_kind})
    by_kind = {kind: rss_growth([(t, k.get(kind, 0)) for t, k in samples], start=start, end=end, fraction=fraction)
               for kind in kinds}
    first, last = median_between(total, start, start + span), median_between(total, end - span, end)
    return {"growth": rounded(rss_growth(total, start=start, end=end, fraction=fraction)),
            "mib_first": rounded(first / 1024 if first is not None else None, 1),
            "mib_last": rounded(last / 1024 if last is not None else None, 1),
            "by_process": {kind: rounded(g) for kind, g in by_kind.items()},
            "num_samples": sum(1 for t, _ in samples if start <= t <= end)}


def max_growth(per_peer: Mapping[str, dict]) -> float | None:
    """The largest ``growth`` among peers that have one."""
    present = [p["growth"] for p in per_peer.values() if p["growth"] is not None]
    return max(present) if present else None


def rounded(value: float | None, digits: int = 4) -> float | None:
    return round(value, digits) if value is not None else None
