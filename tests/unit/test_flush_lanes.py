"""The flush schedule's lanes (swarm.trainer): a batch ends only when every microbatch of it came back,
its replays included, whatever the flow window did meanwhile."""

from __future__ import annotations

import asyncio
import contextlib

import torch

from dht.records import ModelSpec, RunSpec
from swarm.data import TokenSampler, load_corpus
from swarm.flow_control import FlowWindow
from swarm.router import NoPeerAvailableError
from swarm.stage import Stage
from swarm.trainer import Trainer

SPEC = RunSpec(run_id="lanes", model=ModelSpec(d_model=16, num_layers=2, num_heads=2, seq_len=8),
               stage_layers=((0, 1), (1, 2)), microbatch_size=2, target_batch_size=8)  # a batch: 4 microbatches


class ScriptedRouter:
    """Stage 1 as the test scripts it: the first three calls are answered at once; the fourth waits
    until the other three microbatches are back (so, before the fix, their lanes had left the batch)
    and fails once; its replay is answered."""

    num_timeouts = 0

    def __init__(self, trainer_of) -> None:
        self.trainer_of, self.calls, self.num_failures = trainer_of, [], 0

    def plan_path(self, flops):
        return []

    @contextlib.contextmanager
    def reserved_path(self, path):
        yield

    async def forward(self, header, tensors):
        self.calls.append(header["mb_id"])
        if len(self.calls) == 4:
            trainer = self.trainer_of()
            while len(trainer.in_flight) > 1:  # the other three are back and their lanes have looked again
                await asyncio.sleep(0)
            for _ in range(20):
                await asyncio.sleep(0)
            self.num_failures += 1
            raise NoPeerAvailableError("scripted: the stage-1 peer went away")
        return {"ok": True, "loss": 1.0, "route": [*header["route"], ["s1", 1, 0]]}, [torch.zeros_like(tensors[0])]


def test_a_replay_beyond_a_shrunken_window_still_ends_the_batch():
    """Lane 3's call fails after lanes 0-2 brought theirs back; the loss halves the window to 2, so lane
    3 may not replay it. The batch must still end: a lane stays while anything of the batch is out
    (ci33, 2026-11-27: lanes 0-2 had left, and the batch waited until the peer left)."""

    async def main():
        stage = Stage(SPEC, 0, device=torch.device("cpu"))
        events, stop = [], asyncio.Event()
        trainer = None
        router = ScriptedRouter(lambda: trainer)
        trainer = Trainer(stage, TokenSampler(load_corpus(SPEC.dataset).text(), seq_len=8, seed=1), router,
                          peer_id="peer-lanes", max_in_flight=4, flow=FlowWindow(max_window=4, initial_window=4),
                          on_event=lambda event, **fields: (events.append((event, fields)),
                                                            event == "batch_done" and stop.set()))
        trainer.pool.base_backoff = 0.0
        try:
            await asyncio.wait_for(trainer.run(stop), timeout=60)  # bounds the failure only: a deadlock never ends
        finally:
            stage.shutdown()
        assert trainer.flow.window < 4  # the loss shrank it
        assert len(router.calls) == 5 and router.calls[4] == router.calls[3]  # the failed one, replayed
        done = [fields for event, fields in events if event == "batch_done"]
        assert done and done[0]["microbatches"] == 4 and stage.counters.num_steps == 1

    asyncio.run(main())
