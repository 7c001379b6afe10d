"""The robust part reducer inside hivemind's all-reduce, driven directly (no network)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hivemind.averaging.partition import AllreduceException

from swarm.robust_allreduce import RobustPartReducer

SHAPES = (torch.Size([64]), torch.Size([32]))
SENDERS = ("peerA", "peerB", "peerC")


def parts_of(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = [torch.linspace(-1, 1, shape.numel(), dtype=torch.float64) for shape in SHAPES]
    return [b + scale * 0.01 * torch.randn(b.shape, generator=generator, dtype=torch.float64) for b in base]


async def reduce_all(reducer: RobustPartReducer, inputs: list[list[torch.Tensor]], order=(0, 1, 2)) -> list[list[torch.Tensor]]:
    async def sender(index: int) -> list[torch.Tensor]:
        return [await reducer.accumulate_part(index, part, tensor) for part, tensor in enumerate(inputs[index])]

    results = await asyncio.gather(*(sender(i) for i in order))
    return [results[order.index(i)] for i in range(len(order))]


def new_reducer(method: str, reports: list, own_index: int | None = None) -> RobustPartReducer:
    return RobustPartReducer(SHAPES, len(SENDERS), method=method, sender_ids=SENDERS, on_report=reports.append,
                             own_index=own_index)


@pytest.mark.parametrize("method", ["centered_clip", "trimmed_mean", "mean"])
def test_every_sender_gets_the_same_float32_representable_result_and_nan_is_refused(method):
    reports: list = []
    inputs = [parts_of(1), parts_of(2), parts_of(3)]
    inputs[2][1][5] = math.nan  # sender C's second part

    async def main():
        reducer = new_reducer(method, reports)
        results = await reduce_all(reducer, inputs, order=(2, 0, 1))
        reducer.finalize()
        return results

    results = asyncio.run(main())
    for part in range(len(SHAPES)):
        assert torch.equal(results[0][part], results[1][part]) and torch.equal(results[0][part], results[2][part])
        assert torch.equal(results[0][part], results[0][part].to(torch.float32).to(torch.float64))
    # the part with the NaN: the mean of the two finite copies
    expected = ((inputs[0][1] + inputs[1][1]) / 2).to(torch.float32).to(torch.float64)
    assert torch.equal(results[0][1], expected)
    assert set(reports[0].pop("max_spread")) == set(SENDERS)
    # a copy that arrived with a NaN marks its sender as the faulty one: the part is not "short"
    assert reports == [{"aggregation": method, "num_parts": 2, "short_parts": 0, "refused": {"peerC": 1}, "outvoted": {}}]


def test_an_x100_sender_is_out_voted_and_reported():
    reports: list = []
    honest = [parts_of(1), parts_of(2)]
    mean = [(a + b) / 2 for a, b in zip(*honest)]
    byzantine = [m + 100 * (a - m) for m, a in zip(mean, honest[0])]

    async def main():
        reducer = new_reducer("centered_clip", reports)
        results = await reduce_all(reducer, [*honest, byzantine])
        reducer.finalize()
        return results

    results = asyncio.run(main())
    for part, m in enumerate(mean):
        spread = float(torch.linalg.vector_norm(honest[0][part] - m))
        assert float(torch.linalg.vector_norm(results[0][part] - m)) < 1.6 * spread
    spreads = reports[0].pop("max_spread")
    assert spreads["peerC"] > 40 and spreads["peerA"] < 3 and spreads["peerB"] < 3, spreads
    assert reports == [{"aggregation": "centered_clip", "num_parts": 2, "short_parts": 0, "refused": {},
                        "outvoted": {"peerC": 2}}]


def test_a_part_of_the_wrong_shape_raises_and_a_part_with_no_finite_copy_fails_the_round():
    async def wrong_shape():
        reducer = new_reducer("centered_clip", [])
        with pytest.raises(AllreduceException, match="shape"):
            await reducer.accumulate_part(0, 0, torch.zeros(3, dtype=torch.float64))
        reducer.finalize()

    asyncio.run(wrong_shape())

    async def all_nan():
        reducer = RobustPartReducer(SHAPES[:1], 2, method="mean", sender_ids=SENDERS[:2], on_report=lambda r: None)
        nan = torch.full(SHAPES[0], math.nan, dtype=torch.float64)
        outcomes = await asyncio.gather(*(reducer.accumulate_part(i, 0, nan) for i in range(2)), return_exceptions=True)
        reducer.finalize()
        return outcomes

    outcomes = asyncio.run(all_nan())
    assert all(isinstance(o, AllreduceException) and "no finite row" in str(o) for o in outcomes)


def drop_third_sender_after_first_part(method: str, own_index: int | None, reports: list):
    """Three senders; sender C is banned after its first part, so only A and B deliver the second."""
    inputs = [parts_of(1), parts_of(2), parts_of(3)]

    async def main():
        reducer = new_reducer(method, reports, own_index)
        results = await asyncio.gather(*(reducer.accumulate_part(i, 0, inputs[i][0]) for i in range(3)))
        reducer.on_sender_failed(2)
        second = await asyncio.gather(*(reducer.accumulate_part(i, 1, inputs[i][1]) for i in range(2)),
                                      return_exceptions=True)
        reducer.finalize()
        return results, second

    return inputs, *asyncio.run(main())


def test_a_sender_that_fails_is_left_out_and_a_robust_reducer_keeps_its_own_copy_of_a_part_left_short():
    # two copies cannot out-vote each other: their mean would give a Byzantine one half the say
    reports: list = []
    inputs, first, second = drop_third_sender_after_first_part("centered_clip", 0, reports)
    assert torch.equal(first[0], first[2])  # the first part, all three delivered: reduced as usual
    expected = inputs[0][1].to(torch.float32).to(torch.float64)  # the reducer is sender A
    assert torch.equal(second[0], expected) and torch.equal(second[1], expected)
    assert reports[0]["short_parts"] == 1 and reports[0]["refused"] == {}


def test_a_part_left_short_is_the_plain_mean_under_mean_and_fails_on_a_reducer_without_a_copy():
    inputs, _, second = drop_third_sender_after_first_part("mean", None, [])
    assert torch.equal(second[0], ((inputs[0][1] + inputs[1][1]) / 2).to(torch.float32).to(torch.float64))
    reports: list = []
    _, _, second = drop_third_sender_after_first_part("trimmed_mean", None, reports)  # an aux reducer
    assert all(isinstance(o, AllreduceException) and "2 of 3 senders delivered" in str(o) for o in second), second
    assert reports[0]["short_parts"] == 1
