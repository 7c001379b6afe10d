"""Regression tests for bugs found in swarm/stage.py by review (all fixed).

1. Single-stage runs cannot train: ``Stage.forward_loss_backward`` calls
   ``inputs.requires_grad_(True)`` on the int64 token ids of a stage that is both first and last
   (``RunSpec(stage_layers=((0, 4),))``, allowed by RunSpec and by ``--num-stages 1``), raising
   ``RuntimeError: only Tensors of floating point dtype can require gradients``. The trainer calls
   exactly this for ``router is None`` (swarm/trainer.py).
2. ``Stage.forward`` checks ``mb_id in self._graphs`` before awaiting; the graph is stored later on
   the compute thread. Two concurrent forwards with the same ``mb_id`` both pass: the second graph
   overwrites the first, ``_num_pending`` is 2 with one graph held, and after the single possible
   backward ``paused()`` (and with it every optimizer step and averaging round) waits forever.
3. ``load_state_tensors`` identifies a stage only by parameter names and shapes: in a run whose
   middle stages hold the same number of blocks, stage 2's state loads into stage 1 silently
   (both are ``blocks.0.*``), giving the replica the wrong layers' weights.
4. ``load_state_tensors`` is not atomic: it loads the model parameters, then rejects optimizer
   entries naming unknown parameters with ValueError, leaving the stage with the rejected
   state's parameters.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.unit.test_stage import MICROBATCH, batch, make_spec, open_stages, run


def test_single_stage_run_trains():
    spec = make_spec(((0, 4),), target_batch_size=MICROBATCH)

    async def main():
        with open_stages(spec, 0) as (stage,):
            inputs, targets = batch(0)
            loss, _ = await stage.forward_loss_backward(inputs, targets)
            stage.record_microbatch(MICROBATCH, loss)
            await stage.wait_step_done()
            return loss, stage.counters.num_steps

    loss, num_steps = run(main)
    assert loss > 0 and num_steps == 1


def test_concurrent_forwards_of_one_microbatch_id_are_rejected():
    spec = make_spec()

    async def main():
        with open_stages(spec, 0) as (stage,):
            inputs, _ = batch(0)
            results = await asyncio.gather(stage.forward("same", inputs), stage.forward("same", inputs),
                                           return_exceptions=True)
            assert sum(isinstance(r, ValueError) for r in results) == 1
            await stage.drop("same")
            async with asyncio.timeout(5):
                async with stage.paused():  # must not wait forever on a leaked pending slot
                    pass

    run(main)


def test_state_of_another_middle_stage_is_rejected():
    spec = make_spec(((0, 1), (1, 2), (2, 3), (3, 4)))

    async def main():
        with open_stages(spec, 1, 2) as (one, two):
            state = await two.run(two.state_tensors)
            with pytest.raises(ValueError):
                await one.run(one.load_state_tensors, state)

    run(main)


def test_rejected_state_leaves_parameters_untouched():
    spec, other_seed = make_spec(), make_spec(seed=99)

    async def main():
        with open_stages(spec, 0) as (stage,), open_stages(other_seed, 0) as (other,):
            digest = await stage.run(stage.params_digest)
            state = {**(await other.run(other.state_tensors)), "optim.no_such_param.exp_avg": torch.zeros(1)}
            with pytest.raises(ValueError):
                await stage.run(stage.load_state_tensors, state)
            assert await stage.run(stage.params_digest) == digest

    run(main)
