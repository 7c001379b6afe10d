"""A finite but huge microbatch must not poison a stage (found by tests/fuzz)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dht.records import ModelSpec, RunSpec
from swarm.stage import Stage

SPEC = RunSpec(run_id="poison", model=ModelSpec(d_model=32, num_layers=2, num_heads=2, seq_len=16),
               stage_layers=((0, 1), (1, 2)), microbatch_size=2, target_batch_size=4)


def test_a_huge_finite_microbatch_is_refused_and_the_weights_stay_finite():
    async def main():
        stage = Stage(SPEC, 1, device=torch.device("cpu"))
        targets = torch.randint(0, SPEC.model.vocab_size, (2, SPEC.model.seq_len))
        acts = torch.randn(2, SPEC.model.seq_len, SPEC.model.d_model)
        with pytest.raises(ValueError, match="non-finite"):
            await stage.forward_loss_backward(acts * 1e20, targets)
        assert stage._accumulated_microbatches == 0 and not stage._grad_buffer  # nothing of it was kept
        for _ in range(2):
            await stage.forward_loss_backward(acts, targets)
        await stage.run(stage._step_sync)
        assert stage.version == 1
        assert all(torch.isfinite(p).all() for p in stage.model.parameters())

        # a huge gradient coming back to a middle hop is refused the same way
        first = Stage(SPEC, 0, device=torch.device("cpu"))
        outputs = await first.forward("m", torch.randint(0, SPEC.model.vocab_size, (2, SPEC.model.seq_len)))
        with pytest.raises(ValueError, match="non-finite"):
            await first.backward("m", torch.full_like(outputs, 3e38))
        assert not first._grad_buffer

    asyncio.run(main())
