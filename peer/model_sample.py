"""A sample people can read: now and then, the newest whole model continues a fixed prompt, and the
health page and the terminal view show it, so a volunteer sees the model learn in words.

The bootstrap (and a peer, for its own windows) gathers every stage's newest state from the swarm
(``peer.gather``; a peer takes its own stage as it holds it), writes ``SAMPLE_TOKENS`` tokens after
``SAMPLE_PROMPT`` in a worker thread (``swarm.generation``: top-k at a fixed seed, so two samples
differ because the weights did), and keeps the newest. Gathering costs the holders one state
transfer per stage, so a model larger than ``MAX_SAMPLE_BYTES`` is not sampled (said once in the
log; ``python -m peer.export`` gathers it on demand instead); ``--sample-period 0`` turns samples off.
A round that fails (a stage with no holder yet) is logged and retried at the next period.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dht.records import RunSpec
from peer.errors import UserError
from peer.gather import GatheredModel, OwnStage, gather_model
from swarm.generation import SAMPLE_PROMPT, continue_text, stage_models
from swarm.model import layer_num_params

logger = logging.getLogger(__name__)
MAX_SAMPLE_BYTES = 256 << 20  # fp32 parameters gathered per sample: 64 M parameters
FIRST_SAMPLE_DELAY = 10.0  # seconds: let the stages find holders before the first gather


@dataclass(frozen=True)
class ModelSample:
    prompt: str
    text: str
    step: int  # the lowest optimizer step among the stages it was written from
    at: float  # wall-clock seconds


def too_large_to_sample(spec: RunSpec) -> bool:
    return sum(layer_num_params(spec)) * 4 > MAX_SAMPLE_BYTES


class SampleLoop:
    """Writes a :class:`ModelSample` every ``period`` seconds from what ``gather`` returns."""

    def __init__(self, gather: Callable[[], Awaitable[GatheredModel]], *, period: float,
                 prompt: str = SAMPLE_PROMPT, clock: Callable[[], float] = time.time) -> None:
        self.gather, self.period, self.prompt, self.clock = gather, period, prompt, clock
        self.latest: ModelSample | None = None
        self.num_failed = 0

    async def sample_once(self) -> ModelSample:
        model = await self.gather()
        text = await asyncio.to_thread(_write, model, self.prompt)
        self.latest = ModelSample(prompt=self.prompt, text=text, step=min(model.steps.values()), at=self.clock())
        logger.info(f"sample at step {self.latest.step}: {self.prompt!r} → {text!r}")
        return self.latest

    async def run(self, stop: asyncio.Event, spec: Callable[[], RunSpec | None]) -> None:
        """Sample until ``stop`` while ``spec()`` is not None (nothing at all with a period of 0, or
        while the model is too large to gather for it)."""
        if self.period <= 0:
            return
        delay = FIRST_SAMPLE_DELAY
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
                return
            except asyncio.TimeoutError:
                pass
            delay = self.period * random.uniform(0.9, 1.1)
            current = spec()
            if current is None:
                continue
            if too_large_to_sample(current):
                logger.info(f"the model is larger than {MAX_SAMPLE_BYTES >> 20} MiB: no samples of its text here "
                            f"(python -m peer.export gathers it on demand)")
                return
            try:
                await self.sample_once()
            except UserError as e:
                self.num_failed += 1
                logger.info(f"no sample this time: {e}")
            except Exception as e:  # a sample must never take the peer or the bootstrap down
                self.num_failed += 1
                logger.warning(f"writing a sample failed: {e!r}")

    def document(self) -> dict[str, Any] | None:
        """What ``/status.json`` carries under ``"sample"`` (None before the first)."""
        if self.latest is None:
            return None
        return {"prompt": self.latest.prompt, "text": self.latest.text, "step": self.latest.step,
                "age_s": max(0.0, self.clock() - self.latest.at)}


async def gather_for_peer(peer: Any) -> GatheredModel:
    """The whole model as a training peer (``peer.lifecycle.Peer``) samples it: its own stage as it
    holds it, every other stage pulled from its holders."""
    stage = peer.stage
    state = await stage.run(stage.state_tensors)
    own = OwnStage(layout_version=stage.spec.layout_version, index=stage.index, version=stage.version, state=state)
    return await gather_model(peer.p2p, peer.base_spec, peer.view, config=peer.config, peer_id=peer.peer_id, own=own,
                              tokenizer=peer.data.tokenizer)


def _write(model: GatheredModel, prompt: str) -> str:
    return continue_text(stage_models(model.spec, model.parameters), model.tokenizer, seq_len=model.spec.model.seq_len,
                         prompt=prompt)
