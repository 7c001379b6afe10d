"""Stage replicas: pipelined gradients equal single-model gradients; steps, drain gate, state transfer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest
import torch

from dht.records import ModelSpec, RunSpec
from swarm.model import StageModel, next_token_loss
from swarm.stage import Stage

CPU = torch.device("cpu")
MODEL = ModelSpec(d_model=32, num_layers=4, num_heads=4, seq_len=16)
MICROBATCH = 2
DEADLINE = 20.0  # backs up every await that could hang; never reached when the code is right


def make_spec(stage_layers=((0, 2), (2, 4)), *, target_batch_size: int = 4, **overrides) -> RunSpec:
    fields = dict(run_id="s", model=MODEL, stage_layers=stage_layers, seed=5, lr=1e-2,
                  microbatch_size=MICROBATCH, target_batch_size=target_batch_size)
    fields.update(overrides)
    return RunSpec(**fields)


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, 256, (MICROBATCH, MODEL.seq_len + 1), generator=g)
    return window[:, :-1], window[:, 1:]


@contextlib.contextmanager
def open_stages(spec: RunSpec, *indices: int) -> Iterator[list[Stage]]:
    stages = []
    try:
        for k in indices:
            stages.append(Stage(spec, k, device=CPU))
        yield stages
    finally:
        for stage in stages:
            stage.shutdown()


def run(coro_fn, *args):
    async def main():
        async with asyncio.timeout(DEADLINE):
            return await coro_fn(*args)

    return asyncio.run(main())


async def pipeline_microbatch(first: Stage, last: Stage, mb_id: str, seed: int, *, record: bool = True) -> float:
    inputs, targets = batch(seed)
    hidden = await first.forward(mb_id, inputs)
    loss, grad = await last.forward_loss_backward(hidden, targets)
    assert grad.shape == hidden.shape
    assert await first.backward(mb_id, grad) is None  # stage 0 has no input gradient
    if record:
        last.record_microbatch(MICROBATCH, loss)
        first.record_microbatch(MICROBATCH, loss)
    return loss


# --- gradients ----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_pipelined_gradients_equal_single_model_gradients(num_microbatches):
    spec = make_spec(target_batch_size=64)
    reference = StageModel(make_spec(((0, 4),), target_batch_size=64), 0)
    ref_losses = []
    for seed in range(num_microbatches):
        inputs, targets = batch(seed)
        loss = next_token_loss(reference(inputs), targets)
        loss.backward()
        ref_losses.append(float(loss.detach()))
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}

    async def main():
        with open_stages(spec, 0, 1) as (first, last):
            losses = [await pipeline_microbatch(first, last, f"mb{seed}", seed, record=False)
                      for seed in range(num_microbatches)]
            return losses, first, last

    losses, first, last = run(main)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    checked = 0
    for stage, offset in ((first, 0), (last, 2)):
        grads = stage.accumulated_gradients()
        for name, param in stage.model.named_parameters():
            if name.startswith("blocks."):
                _, index, rest = name.split(".", 2)
                ref_name = f"blocks.{int(index) + offset}.{rest}"
            else:
                ref_name = name
            assert name in grads and param.grad is None, name  # buffered until the step, not on the master
            torch.testing.assert_close(grads[name], ref_grads[ref_name], msg=ref_name)
            checked += 1
    assert checked == len(ref_grads)
    assert first.counters.num_steps == last.counters.num_steps == 0  # nothing recorded, no step


def test_middle_stage_returns_the_input_gradient():
    spec = make_spec(((0, 1), (1, 3), (3, 4)))
    reference = [StageModel(spec, k) for k in range(3)]
    inputs, targets = batch(3)
    h0 = reference[0](inputs).detach().requires_grad_(True)
    next_token_loss(reference[2](reference[1](h0)), targets).backward()

    async def main():
        with open_stages(spec, 1, 2) as (middle, last):
            hidden = await middle.forward("m", h0.detach())
            _, grad = await last.forward_loss_backward(hidden, targets)
            return await middle.backward("m", grad)

    torch.testing.assert_close(run(main), h0.grad)


# --- optimizer steps ----------------------------------------------------------------------------


def test_step_happens_exactly_when_the_target_batch_is_recorded():
    spec = make_spec(target_batch_size=3 * MICROBATCH)

    async def main():
        with open_stages(spec, 0, 1) as (first, last):
            before = await first.run(first.params_digest)
            for seed in range(2):
                await pipeline_microbatch(first, last, f"a{seed}", seed)
                await first.wait_step_done()
                assert first.counters.num_steps == last.counters.num_steps == 0
                assert first.counters.num_samples == (seed + 1) * MICROBATCH
            # third microbatch: gradients reach the target, but the step waits for the recording
            await pipeline_microbatch(first, last, "a2", 2, record=False)
            await first.wait_step_done()
            assert first.counters.num_steps == 0
            assert await first.run(first.params_digest) == before
            for stage in (first, last):
                stage.record_microbatch(MICROBATCH, 1.0)
                await stage.wait_step_done()
                assert stage.counters.num_steps == 1 and stage.version == 1
                assert stage.accumulated_gradients() == {}  # consumed by the step
            assert await first.run(first.params_digest) != before
            assert last.counters.last_loss == 1.0
            # the next batch starts from zero again
            for seed in range(3, 5):
                await pipeline_microbatch(first, last, f"b{seed}", seed)
                await first.wait_step_done()
                assert first.counters.num_steps == 1
            await pipeline_microbatch(first, last, "b5", 5)
            await first.wait_step_done()
            await last.wait_step_done()
            return first.counters.num_steps, last.counters.num_steps, first.counters.num_microbatches

    assert run(main) == (2, 2, 6)


def test_a_step_averages_gradients_over_microbatches_and_clips():
    """The step uses mean gradients of the batch, clipped to norm 1, then AdamW."""
    spec = make_spec(((0, 4),), target_batch_size=2 * MICROBATCH)
    reference = StageModel(spec, 0)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    for seed in range(2):
        inputs, targets = batch(seed)
        next_token_loss(reference(inputs), targets).backward()
    for p in reference.parameters():
        p.grad.div_(2)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    optimizer.step()

    async def main():
        with open_stages(spec, 0) as (stage,):
            for seed in range(2):
                inputs, targets = batch(seed)
                logits = await stage.forward(f"m{seed}", inputs)
                logits.requires_grad_(True)
                next_token_loss(logits, targets).backward()
                await stage.backward(f"m{seed}", logits.grad)
                stage.record_microbatch(MICROBATCH)
            await stage.wait_step_done()
            return stage

    stage = run(main)
    assert stage.counters.num_steps == 1
    for (name, got), (_, want) in zip(stage.model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got, want, msg=name)


# --- drain gate ---------------------------------------------------------------------------------


async def wait_until(predicate) -> None:
    """Yield to the loop until ``predicate()`` holds (bounded by the test's DEADLINE)."""
    while not predicate():
        await asyncio.sleep(0)


def test_paused_excludes_steps_but_not_forwards_and_a_step_leaves_held_graphs_intact():
    spec = make_spec(target_batch_size=MICROBATCH)
    events: list[str] = []

    async def main():
        with open_stages(spec, 0, 1) as (first, last):
            inputs, targets = batch(0)
            held = await first.forward("held", inputs)  # computed on weight version 0
            async with first.paused():
                # forwards go on while paused, and a finished batch does not step inside the pause
                await pipeline_microbatch(first, last, "during", 1)
                for _ in range(20):
                    await asyncio.sleep(0)
                events.append(f"paused steps={first.counters.num_steps}")
            await first.wait_step_done()
            events.append(f"after steps={first.counters.num_steps}")
            # the step changed the master weights; the graph held since version 0 still backpropagates
            _, grad = await last.forward_loss_backward(held, targets)
            await first.backward("held", grad)
            assert first.num_held_graphs == 0 and set(first.accumulated_gradients())

    run(main)
    assert events == ["paused steps=0", "after steps=1"]


def test_two_pausers_queue_one_behind_the_other():
    spec = make_spec()
    events: list[str] = []

    async def main():
        with open_stages(spec, 0) as (stage,):
            first_inside, release_first = asyncio.Event(), asyncio.Event()

            async def first():
                async with stage.paused():
                    events.append("first in")
                    first_inside.set()
                    await release_first.wait()
                    events.append("first out")

            async def second():
                async with stage.paused():
                    events.append("second in")

            t1 = asyncio.create_task(first())
            await first_inside.wait()
            t2 = asyncio.create_task(second())
            for _ in range(20):
                await asyncio.sleep(0)
            assert events == ["first in"]
            release_first.set()
            await asyncio.gather(t1, t2)

    run(main)
    assert events == ["first in", "first out", "second in"]


# --- microbatch bookkeeping ---------------------------------------------------------------------


def test_forward_of_a_microbatch_already_in_flight_is_rejected():
    spec = make_spec()

    async def main():
        with open_stages(spec, 0) as (stage,):
            inputs, _ = batch(0)
            hidden = await stage.forward("dup", inputs)
            with pytest.raises(ValueError, match="dup"):
                await stage.forward("dup", inputs)
            with pytest.raises(ValueError):
                await stage.backward("unknown", torch.ones_like(hidden))
            await stage.drop("unknown")  # no-op
            await stage.backward("dup", torch.ones_like(hidden))
            # the rejected forward did not leak a pending slot: pausing completes
            assert stage.num_held_graphs == 0
            # the id can be reused once its graph is gone
            await stage.forward("dup", inputs)
            await stage.drop("dup")
            assert stage.num_held_graphs == 0

    run(main)


def test_input_shape():
    spec = make_spec()

    async def main():
        with open_stages(spec, 0, 1) as (first, last):
            return first.input_shape(3), last.input_shape(3), first.is_first, last.is_last

    assert run(main) == ((3, 16), (3, 16, 32), True, True)


# --- state transfer -----------------------------------------------------------------------------


def test_state_round_trip_into_a_fresh_stage_is_bit_identical():
    spec = make_spec()

    async def main():
        with open_stages(spec, 0, 1, 1) as (first, last, fresh):
            for seed in range(2):
                await pipeline_microbatch(first, last, f"m{seed}", seed)
            await last.wait_step_done()
            assert last.counters.num_steps == 1
            state = await last.run(last.state_tensors)
            assert any(k.startswith("optim.") and k.endswith("exp_avg") for k in state)
            assert await fresh.run(fresh.params_digest) != await last.run(last.params_digest)
            await fresh.run(fresh.load_state_tensors, state)
            assert await fresh.run(fresh.params_digest) == await last.run(last.params_digest)
            assert fresh.counters.num_steps == 1
            reloaded = await fresh.run(fresh.state_tensors)
            assert reloaded.keys() == state.keys()
            for key in state:
                assert reloaded[key].dtype == state[key].dtype, key
                assert torch.equal(reloaded[key], state[key]), key
            # loaded optimizer moments are used: both replicas take the identical next step
            for stage in (last, fresh):
                for seed in (7, 8):
                    inputs, targets = batch(seed)
                    hidden = await first.forward(f"n{seed}", inputs)
                    await first.drop(f"n{seed}")
                    await stage.forward_loss_backward(hidden, targets)
                    stage.record_microbatch(MICROBATCH)
                await stage.wait_step_done()
            assert fresh.counters.num_steps == last.counters.num_steps == 2
            assert await fresh.run(fresh.params_digest) == await last.run(last.params_digest)

    run(main)


def test_load_rejects_the_state_of_another_stage_or_shape():
    spec = make_spec()
    other_width = make_spec(model=ModelSpec(d_model=16, num_layers=4, num_heads=4, seq_len=16))

    async def main():
        with open_stages(spec, 0, 1) as (first, last), open_stages(other_width, 0) as (narrow,):
            digest = await first.run(first.params_digest)
            for wrong in (await last.run(last.state_tensors), await narrow.run(narrow.state_tensors)):
                with pytest.raises(ValueError):
                    await first.run(first.load_state_tensors, wrong)
            state = await first.run(first.state_tensors)
            missing = {k: v for k, v in state.items() if k != "model.pos_emb.weight"}
            with pytest.raises(ValueError):
                await first.run(first.load_state_tensors, missing)
            retyped = {**state, "model.pos_emb.weight": state["model.pos_emb.weight"].double()}
            with pytest.raises(ValueError):
                await first.run(first.load_state_tensors, retyped)
            stray = {**state, "optim.no_such_param.exp_avg": torch.zeros(1)}
            with pytest.raises(ValueError):
                await first.run(first.load_state_tensors, stray)
            assert first.counters.num_steps == 0
            # a rejected model state leaves the parameters untouched
            assert await first.run(first.params_digest) == digest

    run(main)
