"""Robust aggregates of the replicas' contributions to one part of an averaging round.

In an open swarm anyone can join a stage, so one replica may send garbage: a NaN, or a state that
moved a hundred times too far. A plain mean passes 1/n of it to every replica. Here each reducer of
an all-reduce part (:mod:`swarm.robust_allreduce`) holds every sender's copy of its part as the rows
of a ``[num_senders, part_size]`` float64 matrix and combines them with :func:`aggregate`:

- Any row with a NaN or an infinity is refused first, in every method: it never enters a result.
- ``mean``: the plain mean of the rest (hivemind's rule; for trusted swarms).
- ``centered_clip``: CenteredClip (Karimireddy, He & Jaggi, ICML 2021, "Learning from history for
  Byzantine robust optimization"; run per all-reduce part as in Gorbunov et al. 2022, "Secure
  distributed training at scale", BTARD). From the coordinate-wise median ``v``, iterate
  ``v <- v + (1/n) sum_i clip_tau(x_i - v)`` with ``clip_tau(z) = z min(1, tau / |z|)``. A row costs
  the result at most ``tau / n`` per iteration however far away it is; rows within ``tau`` of the
  result count fully, so when nobody is far out the fixed point is the mean. A clipped row still
  moves the fixed point (by about ``tau / 2`` with three rows, the same way every round), so rows
  out-voted (farther than the outlier radius) are then dropped, and the rest, a majority, are
  combined again without them.
- ``trimmed_mean``: per coordinate, drop the ``f`` largest and ``f`` smallest values and average the
  rest (Yin et al., ICML 2018). With three replicas this is the coordinate-wise median.

``tau`` scales with the part: ``tau = tau_scale * median_i |x_i - median|``. The replicas of a stage
drift apart by a few optimizer steps between rounds, and that drift differs by orders of magnitude
between parts (weights, first moments, second moments), so a fixed ``tau`` would clip everything in
one part and nothing in another. A minority cannot move the median distance beyond the honest rows'
own distances, so it cannot widen ``tau`` either.

With fewer than three finite rows no method can tell which row is wrong: the result is their mean.

Cost: ``centered_clip`` is ``num_iters`` passes over the ``[n, d]`` matrix plus one sort for the
median; ``trimmed_mean`` is one sort. Both are far below the cost of moving the part over the network.

Determinism: the result depends only on the rows and their order; the reducer passes rows in sender
order, and one peer reduces each part, so every member receives the same bytes. ``trimmed_mean`` and
the median are exactly invariant under row order; ``centered_clip``'s sums are invariant up to
float64 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

AGGREGATIONS = ("mean", "centered_clip", "trimmed_mean")
MIN_ROBUST_ROWS = 3  # with two rows, neither can be out-voted


@dataclass(frozen=True, kw_only=True)
class RobustConfig:
    """Parameters of the robust aggregates.

    Attributes:
        tau_scale: CenteredClip's radius in units of the median distance of the rows to their
            coordinate-wise median. Lower clips honest rows too (the result drifts from the mean);
            higher lets an outlier pull further (at most ``tau / n`` per iteration).
        num_iters: CenteredClip's iterations; fixed, so every run of one input does the same work.
        trim_fraction: the share of rows trimmed from each end by ``trimmed_mean``; at least one row
            whenever there are three or more.
        outlier_scale: a row farther than ``outlier_scale * tau_scale * median distance`` from the
            result is reported as out-voted (in every method: with ``mean`` it was only noticed).
    """

    tau_scale: float = 1.5
    num_iters: int = 20
    trim_fraction: float = 0.2
    outlier_scale: float = 2.0

    def __post_init__(self) -> None:
        for name in ("tau_scale", "outlier_scale"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a positive number")
        if self.num_iters < 1:
            raise ValueError("num_iters must be at least 1")
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError("trim_fraction must be in [0, 0.5)")


@dataclass(frozen=True)
class Aggregate:
    """The result of :func:`aggregate`.

    Attributes:
        value: the aggregate, a float64 vector of the rows' length.
        refused: indices of rows refused for a non-finite value.
        outliers: indices of finite rows farther from ``value`` than the outlier radius (out-voted).
        spreads: each row's distance from ``value`` in units of the median distance to the
            coordinate-wise median (NaN for a refused row; 0 with fewer than three finite rows).
    """

    value: torch.Tensor
    refused: tuple[int, ...]
    outliers: tuple[int, ...]
    spreads: tuple[float, ...] = ()


def aggregate(rows: torch.Tensor, method: str, config: RobustConfig = RobustConfig()) -> Aggregate:
    """Combine the rows of ``rows`` (``[num_rows, size]``) by ``method`` (one of :data:`AGGREGATIONS`).

    Raises:
        ValueError: an unknown method, a matrix that is not 2-D, or no finite row at all.
    """
    if method not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {method!r}; expected one of {', '.join(AGGREGATIONS)}")
    if rows.dim() != 2:
        raise ValueError(f"expected a [num_rows, size] matrix, got shape {list(rows.shape)}")
    rows = rows.to(torch.float64)
    is_finite = torch.isfinite(rows).all(dim=1)
    refused = tuple(int(i) for i in torch.nonzero(~is_finite).flatten())
    kept_index = [i for i in range(rows.shape[0]) if i not in refused]
    if not kept_index:
        raise ValueError("no finite row to aggregate")
    kept = rows[kept_index]
    if kept.shape[0] < MIN_ROBUST_ROWS:
        return Aggregate(kept.mean(dim=0), refused, (), tuple(math.nan if i in refused else 0.0 for i in range(rows.shape[0])))
    center = coordinate_median(kept)
    spread = median_distance(kept, center)
    tau = config.tau_scale * spread
    if method == "centered_clip":
        value = centered_clip(kept, start=center, tau=tau, num_iters=config.num_iters)
    elif method == "trimmed_mean":
        value = trimmed_mean(kept, num_trimmed=num_trimmed(kept.shape[0], config.trim_fraction))
    else:
        value = kept.mean(dim=0)
    radius = config.outlier_scale * tau
    distances = torch.linalg.vector_norm(kept - value, dim=1)
    far = distances > radius
    if method == "centered_clip" and bool(far.any()) and int((~far).sum()) * 2 > kept.shape[0]:
        # a clipped row still pulls the result by up to tau / 2 (with three rows), round after round;
        # once it is out-voted, a majority of the rows is combined without it
        inliers = kept[~far]
        value = centered_clip(inliers, start=coordinate_median(inliers), tau=tau, num_iters=config.num_iters)
        distances = torch.linalg.vector_norm(kept - value, dim=1)
    outliers = tuple(kept_index[i] for i in range(kept.shape[0]) if bool(far[i]))
    spreads = [math.nan] * rows.shape[0]
    for position, row in enumerate(kept_index):
        spreads[row] = float(distances[position]) / spread if spread > 0 else (0.0 if distances[position] == 0 else math.inf)
    return Aggregate(value, refused, outliers, tuple(spreads))


def coordinate_median(rows: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median; for an even count, the mean of the two middle values."""
    ordered = rows.sort(dim=0).values
    count = rows.shape[0]
    if count % 2:
        return ordered[count // 2].clone()
    return (ordered[count // 2 - 1] + ordered[count // 2]) / 2


def median_distance(rows: torch.Tensor, center: torch.Tensor) -> float:
    """The lower median of the rows' Euclidean distances to ``center``."""
    distances = torch.linalg.vector_norm(rows - center, dim=1).sort().values
    return float(distances[(rows.shape[0] - 1) // 2])


def centered_clip(rows: torch.Tensor, *, start: torch.Tensor, tau: float, num_iters: int) -> torch.Tensor:
    """``num_iters`` iterations of ``v <- v + mean_i clip_tau(x_i - v)`` from ``start``.

    ``tau = 0`` (more than half the rows at ``start`` exactly) keeps ``start``.
    """
    value = start.clone()
    for _ in range(num_iters):
        diffs = rows - value
        norms = torch.linalg.vector_norm(diffs, dim=1)
        # where() evaluates both branches: tau / 0 is computed but never chosen (norm 0 <= tau)
        scales = torch.where(norms > tau, tau / norms, torch.ones_like(norms))
        value = value + (diffs * scales[:, None]).sum(dim=0) / rows.shape[0]
    return value


def num_trimmed(num_rows: int, trim_fraction: float) -> int:
    """Rows dropped from each end: ``floor(fraction * n)``, at least 1 from three rows on, at most
    ``(n - 1) // 2`` (one row, or two for an even count, always remain)."""
    if num_rows < MIN_ROBUST_ROWS:
        return 0
    return min(max(1, math.floor(trim_fraction * num_rows)), (num_rows - 1) // 2)


def trimmed_mean(rows: torch.Tensor, *, num_trimmed: int) -> torch.Tensor:
    """Per coordinate, the mean of the values left after dropping ``num_trimmed`` from each end."""
    ordered = rows.sort(dim=0).values
    return ordered[num_trimmed:rows.shape[0] - num_trimmed].mean(dim=0)
