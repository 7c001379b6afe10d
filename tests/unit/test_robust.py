"""Robust aggregates: one x100 or NaN row cannot move the result far from the honest mean."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.robust import AGGREGATIONS, RobustConfig, aggregate, centered_clip, coordinate_median, num_trimmed

ROBUST = ("centered_clip", "trimmed_mean")
SIZE = 4096


def honest_rows(num_rows: int, *, seed: int = 0, spread: float = 0.01) -> torch.Tensor:
    """Replicas of one state that drifted apart by a few steps: a common point plus small noise."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(SIZE, generator=generator, dtype=torch.float64)
    return base + spread * torch.randn(num_rows, SIZE, generator=generator, dtype=torch.float64)


def byzantine_scaled(rows: torch.Tensor, factor: float = 100.0) -> torch.Tensor:
    """A replica whose drift from the honest mean is ``factor`` times an honest replica's."""
    mean = rows.mean(dim=0)
    return mean + factor * (rows[0] - mean)


def spread_of(rows: torch.Tensor) -> float:
    """The honest replicas' typical distance from their mean."""
    return float(torch.linalg.vector_norm(rows - rows.mean(dim=0), dim=1).mean())


@pytest.mark.parametrize("method", ROBUST)
@pytest.mark.parametrize("num_honest", [2, 3, 5, 8])
def test_one_x100_row_stays_within_the_honest_spread(method, num_honest):
    honest = honest_rows(num_honest, seed=num_honest)
    rows = torch.cat([honest, byzantine_scaled(honest)[None]])
    result = aggregate(rows, method)
    error = float(torch.linalg.vector_norm(result.value - honest.mean(dim=0)))
    plain_error = float(torch.linalg.vector_norm(rows.mean(dim=0) - honest.mean(dim=0)))
    # worst case, two honest rows and an attacker on the line through one of them: the fixed point
    # lies tau / 2 = tau_scale * spread from the honest mean (1.5 spreads with the defaults)
    assert error < 1.05 * RobustConfig().tau_scale * spread_of(honest), (error, spread_of(honest))
    assert error < plain_error / 10  # the mean is dragged ~100/n spreads away
    assert result.outliers == (num_honest,) and result.refused == ()


@pytest.mark.parametrize("method", AGGREGATIONS)
@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_a_non_finite_row_is_refused_in_every_method(method, poison):
    honest = honest_rows(3)
    bad = honest[1].clone()
    bad[17] = poison
    rows = torch.stack([honest[0], bad, honest[1], honest[2]])
    result = aggregate(rows, method)
    assert result.refused == (1,)
    assert torch.isfinite(result.value).all()
    assert torch.equal(result.value, aggregate(honest, method).value)  # as if the row had not been sent


def test_with_all_rows_honest_centered_clip_is_the_mean_and_trimmed_mean_is_close():
    honest = honest_rows(5)
    mean = honest.mean(dim=0)
    torch.testing.assert_close(aggregate(honest, "mean").value, mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(aggregate(honest, "centered_clip").value, mean, rtol=0, atol=1e-12)
    trimmed = aggregate(honest, "trimmed_mean").value
    assert float(torch.linalg.vector_norm(trimmed - mean)) < 0.5 * spread_of(honest)
    for method in AGGREGATIONS:
        assert aggregate(honest, method).outliers == ()


@pytest.mark.parametrize("method", AGGREGATIONS)
def test_two_rows_give_their_mean(method):
    rows = honest_rows(2)
    torch.testing.assert_close(aggregate(rows, method).value, rows.mean(dim=0), rtol=0, atol=1e-15)


@pytest.mark.parametrize("method", AGGREGATIONS)
def test_deterministic_and_order_invariant(method):
    honest = honest_rows(4, seed=7)
    rows = torch.cat([honest, byzantine_scaled(honest, 50.0)[None]])
    first, again = aggregate(rows, method), aggregate(rows.clone(), method)
    assert torch.equal(first.value, again.value)
    for permutation in ([4, 3, 2, 1, 0], [2, 0, 4, 1, 3]):
        shuffled = aggregate(rows[permutation], method)
        if method == "trimmed_mean":
            assert torch.equal(shuffled.value, first.value)  # sorting per coordinate: exactly the same
        else:
            torch.testing.assert_close(shuffled.value, first.value, rtol=0, atol=1e-12)
        assert sorted(permutation[i] for i in shuffled.outliers) == list(first.outliers)


def test_identical_rows_with_one_outlier_give_the_identical_rows():
    row = honest_rows(1)[0]
    rows = torch.stack([row, row, row * 100])
    for method in ROBUST:
        assert torch.equal(aggregate(rows, method).value, row)


def test_centered_clip_moves_at_most_tau_per_iteration():
    rows = torch.tensor([[0.0], [0.0], [1e6]], dtype=torch.float64)
    value = centered_clip(rows, start=torch.zeros(1, dtype=torch.float64), tau=1.0, num_iters=3)
    assert 0 < float(value) <= 3 * 1.0 / 3 + 1e-12


def test_coordinate_median_and_trim_counts():
    rows = torch.tensor([[1.0, 9.0], [3.0, 2.0], [2.0, 5.0], [8.0, 0.0]], dtype=torch.float64)
    assert coordinate_median(rows).tolist() == [2.5, 3.5]
    assert coordinate_median(rows[:3]).tolist() == [2.0, 5.0]
    assert [num_trimmed(n, 0.2) for n in (1, 2, 3, 4, 5, 10, 11, 20)] == [0, 0, 1, 1, 1, 2, 2, 4]
    assert num_trimmed(4, 0.49) == 1


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(honest_rows(3), "median")
    with pytest.raises(ValueError, match="no finite row"):
        aggregate(torch.full((3, 4), math.nan, dtype=torch.float64), "centered_clip")
    with pytest.raises(ValueError, match="matrix"):
        aggregate(torch.zeros(4), "mean")
    for bad in ({"tau_scale": 0.0}, {"num_iters": 0}, {"trim_fraction": 0.5}, {"outlier_scale": math.nan}):
        with pytest.raises(ValueError):
            RobustConfig(**bad)
