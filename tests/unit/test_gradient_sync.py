"""The swarm-wide batch's pure parts: who injects what, the order contributions are added in, and
when a stage replica closes a batch or jumps to a later one (swarm/gradient_sync.py, swarm/stage.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest
import torch

from dht.records import ModelSpec, RunSpec
from swarm.gradient_sync import add_in_order, batch_slots, choose_source
from swarm.stage import Stage

SPEC = RunSpec(run_id="g", model=ModelSpec(d_model=16, num_layers=2, num_heads=2, seq_len=8),
               stage_layers=((0, 1), (1, 2)), microbatch_size=2, target_batch_size=4)
CPU = torch.device("cpu")


@pytest.mark.parametrize("members, shares", [(1, [4]), (2, [2, 2]), (3, [2, 1, 1]), (5, [1, 1, 1, 1, 0])])
def test_shares_cover_the_batch_once(members, shares):
    ids = [f"peer{i}" for i in range(members)]
    slots = [batch_slots(4, ids, p) for p in ids]
    assert [len(s) for s in slots] == shares
    assert sorted(k for s in slots for k in s) == [0, 1, 2, 3]


def test_a_replica_missing_from_its_own_view_still_takes_a_share():
    assert batch_slots(4, ["b"], "a") == [0, 2] and batch_slots(4, ["a"], "b") == [1, 3]


def test_contributions_add_up_to_the_same_bits_in_any_arrival_order():
    values = [torch.randn(1000, dtype=torch.float32) * 10 ** k for k in range(-3, 4)]
    parts = {f"p{i}": (v, i) for i, v in enumerate(values)}
    results = []
    for order in itertools.islice(itertools.permutations(parts), 20):
        total, count = add_in_order({name: parts[name] for name in order})
        results.append(total)
        assert count == sum(range(len(values)))
    assert all(torch.equal(results[0], r) for r in results)
    assert all(torch.equal(parts[f"p{i}"][0], v) for i, v in enumerate(values))  # inputs untouched


def run_on_stage(index: int, coro_fn):
    async def main():
        stage = Stage(SPEC, index, device=CPU)
        try:
            return await asyncio.wait_for(coro_fn(stage), 20)
        finally:
            stage.shutdown()
    return asyncio.run(main())


def test_a_later_stage_closes_a_batch_a_co_replica_closed_and_steps_on_the_sum():
    seen = []

    async def body(stage: Stage):
        async def combine(batch, gradients, count, weights):
            seen.append((batch, count, weights == stage.params_digest()))
            return gradients + 1.0, count + 2  # a co-replica's contribution: two microbatches of ones
        stage.combine = combine
        before = [p.detach().clone() for p in stage.model.parameters()]
        stage.note_batch(0, from_replica=True)
        await stage.wait_step_done()
        after = [p.detach().clone() for p in stage.model.parameters()]
        return before, after, stage.version

    before, after, version = run_on_stage(1, body)
    assert seen == [(0, 0, True)] and version == 1  # the digest of the weights the batch was computed on
    assert all(not torch.equal(a, b) for a, b in zip(after, before))  # every parameter got the co-replica's gradient


def test_stage_zero_waits_for_its_trainer_to_close_and_jumps_to_newer_batches():
    async def body(stage: Stage):
        stage.combine = lambda batch, gradients, count, weights: asyncio.sleep(0, (gradients, count))
        stage.note_batch(0, from_replica=True)
        assert stage._step_task is None and stage.version == 0  # stage 0 closes when its share is back
        stage.note_batch(5, from_replica=True)
        assert stage.version == 5  # a joiner behind its co-replicas jumps to their batch
        stage.note_batch(3, from_replica=True)
        assert stage.version == 5  # never back
        await stage.close_batch()
        return stage.version

    assert run_on_stage(0, body) == 6


def test_a_microbatch_of_a_later_batch_closes_the_current_one_first():
    closed = []

    async def body(stage: Stage):
        async def combine(batch, gradients, count, weights):
            closed.append(batch)
            return gradients, count
        stage.combine = combine
        await stage.wait_current_weights(1)
        assert closed == [0] and stage.version == 1
        await stage.wait_current_weights(9)  # far behind: jump to batch 8, close it, compute on 9
        return stage.version

    assert run_on_stage(1, body) == 9
    assert closed == [0, 8]


def test_periodic_replicas_ignore_batch_numbers():
    import dataclasses

    spec = dataclasses.replace(SPEC, replica_sync="periodic")

    async def main():
        stage = Stage(spec, 1, device=CPU)
        try:
            stage.note_batch(4, from_replica=True)
            await stage.wait_current_weights(7)
            return stage.version, stage._step_task
        finally:
            stage.shutdown()

    assert asyncio.run(main()) == (0, None)


def test_three_contributions_out_vote_a_garbage_one_and_two_are_added_as_they_are():
    from swarm.gradient_sync import combine_contributions

    g = torch.Generator().manual_seed(0)
    honest = [torch.randn(500, generator=g) * 0.1 + 1.0 for _ in range(2)]
    garbage = torch.randn(500, generator=g) * 100.0
    parts = {"a": (honest[0] * 2, 2), "b": (honest[1] * 2, 2), "z": (garbage * 2, 2)}
    total, count, outvoted = combine_contributions(parts, "centered_clip")
    assert count == 6 and outvoted == ["z"]
    torch.testing.assert_close(total / count, (honest[0] + honest[1]) / 2, rtol=1e-4, atol=1e-4)
    plain, _, none = combine_contributions(parts, "mean")
    assert none == [] and not torch.allclose(plain / 6, (honest[0] + honest[1]) / 2, atol=1.0)
    pair = {"a": parts["a"], "z": parts["z"]}
    assert torch.equal(combine_contributions(pair, "centered_clip")[0], add_in_order(pair)[0])


def test_the_wait_for_co_replicas_follows_recent_exchanges_within_bounds():
    from swarm.gradient_sync import MIN_WAIT, WAIT_FACTOR, wait_limit

    assert wait_limit(None, 10.0) == 10.0  # nothing measured yet: the whole timeout
    assert wait_limit(0.01, 10.0) == MIN_WAIT  # a fast swarm still forgives a hiccup
    assert wait_limit(2.0, 10.0) == WAIT_FACTOR * 2.0
    assert wait_limit(5.0, 10.0) == 10.0  # never beyond the timeout
    assert MIN_WAIT < WAIT_FACTOR * 2.0 < 10.0


def test_the_source_is_the_majority_s_weights_else_the_replica_with_most_steps():
    assert choose_source({"a": ("w1", 5), "b": ("w1", 5)}) is None  # all computed on the same weights
    assert choose_source({"a": ("w1", 5)}) is None
    assert choose_source({"a": ("old", 3), "b": ("new", 5)}) == "b"  # a joiner's pulled state is older
    assert choose_source({"a": ("x", 5), "b": ("y", 5)}) == "a"  # a tie: the lowest peer id
    # a majority wins even against a replica claiming more steps (a minority cannot impose its state)
    assert choose_source({"a": ("w", 5), "b": ("w", 5), "c": ("liar", 10**6)}) == "a"
    assert choose_source({"c": ("w", 5), "b": ("w", 5), "a": ("odd", 1)}) == "b"
    assert choose_source({"a": ("x", 1), "b": ("y", 2), "c": ("z", 3)}) == "c"  # no majority: most steps


def test_a_replica_that_loads_another_s_flat_state_holds_the_same_state():
    async def main():
        ahead, behind = Stage(SPEC, 1, device=CPU), Stage(SPEC, 1, device=CPU)
        try:
            ahead.combine = lambda batch, gradients, count, weights: asyncio.sleep(0, (gradients + 1.0, 1))
            await ahead.close_batch()  # one step ahead of the seed: other weights, other moments
            assert await ahead.run(ahead.params_digest) != await behind.run(behind.params_digest)
            state = await ahead.run(ahead.flat_state)
            await behind.run(behind.load_flat_state, state)
            assert await ahead.run(ahead.params_digest) == await behind.run(behind.params_digest)
            assert behind.optimizer_steps == ahead.optimizer_steps == 1
            assert torch.equal(await behind.run(behind.flat_state), state)
        finally:
            ahead.shutdown()
            behind.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8"])
def test_a_compressed_contribution_is_what_co_replicas_decode_and_error_feedback_loses_nothing(codec):
    """The contribution a replica adds itself is the one its co-replicas decode (so all step on the
    same sum), and what a lossy codec rounds off comes back in the next batch: over many batches the
    decoded sums trail the true ones by the last batch's rounding only."""
    from dht.wire import ProtocolError
    from swarm.gradient_sync import GradientSync
    from swarm.view import SwarmView

    from dht.records import PeerRecord

    spec = dataclasses.replace(SPEC, gradient_codec=codec)
    view = SwarmView(None, "g")
    view.records = [PeerRecord(peer_id=p, role="reliable", state="training", stage=0, flops=1e9) for p in "ab"]
    sync = GradientSync(None, view, Stage(spec, 0, device=CPU), peer_id="a", timeout=1.0, max_payload_bytes=1 << 20)
    generator = torch.Generator().manual_seed(0)
    true_sum, sent_sum, first_error = torch.zeros(sync.num_params), torch.zeros(sync.num_params), None
    for _ in range(50):
        gradients = torch.randn(sync.num_params, generator=generator) * 1e-3
        decoded, wire = sync.encode(gradients)
        assert torch.equal(sync.codec.decode(wire, shape=(sync.num_params,), dtype=torch.float32), decoded)
        assert sum(t.numel() * t.element_size() for t in wire) < 4 * sync.num_params / 1.9  # fewer bytes
        first_error = first_error if first_error is not None else float((decoded - gradients).abs().max())
        true_sum += gradients
        sent_sum += decoded
    assert first_error > 0  # the codec does round
    assert float((true_sum - sent_sum - sync._residual).abs().max()) < 1e-6  # the residual is all that is missing
    assert float((true_sum - sent_sum).abs().max()) <= 2 * first_error + 1e-7  # one batch's rounding, not fifty
    with pytest.raises(ProtocolError):
        sync._receive("b", {"batch": 0, "count": 1}, [torch.zeros(sync.num_params)])  # a co-replica's fp32: refused
    assert sync._receive("b", {"batch": 0, "count": 1}, wire)["ok"]  # its encoded contribution: taken
    assert torch.equal(sync._received[0]["b"][0], decoded)
