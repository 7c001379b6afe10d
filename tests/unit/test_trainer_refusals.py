"""swarm.trainer: a microbatch its own stage refuses (weights that give non-finite gradients) waits
for a replay; the peer does not crash (tests/e2e/test_byzantine.py in a CI rehearsal: a replica with
bad updates, alone in its stage for 20 s on a loaded machine, diverged and died with a traceback)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from dht.records import RunSpec
from swarm.data import TokenSampler, load_corpus
from swarm.router import NoPeerAvailableError
from swarm.stage import Stage
from swarm.trainer import Trainer

BASE = RunSpec(run_id="run")
SPEC = dataclasses.replace(BASE, stage_layers=((0, BASE.model.num_layers),))  # one stage: no router


def test_a_microbatch_the_stage_s_own_weights_refuse_is_put_back_and_the_trainer_goes_on():
    stage = Stage(SPEC, 0, device=torch.device("cpu"))
    sampler = TokenSampler(load_corpus(SPEC.dataset).text(), seq_len=SPEC.model.seq_len, seed=5)
    trainer = Trainer(stage, sampler, None, peer_id="me", max_in_flight=2)
    assert asyncio.run(trainer.run_microbatch()) > 0  # healthy weights: a finite loss
    with torch.no_grad():
        for param in stage.model.parameters():
            param.mul_(1e30)  # diverged
    stage._publish_weights()
    task = trainer.new_task()
    with pytest.raises(NoPeerAvailableError, match="non-finite gradients"):
        asyncio.run(trainer.run_task(task))
    assert trainer.pool.pending() == [task] and task.attempt == 1 and "non-finite" in task.last_error
    assert not trainer.in_flight and stage.counters.num_samples == SPEC.microbatch_size  # nothing counted
