"""One pipeline stage's parameters, optimizer and compute: forward, backward, step.

All torch work of a stage runs on one dedicated thread, so the event loop stays free for network
I/O and compute never interleaves with itself. A microbatch's forward keeps its autograd graph
until the gradient of its output comes back (the "backward retraces the route").

Weight versions (PipeDream-2BW). The optimizer owns the *master* parameters (``self.model``'s).
Forwards never touch them: each runs ``torch.func.functional_call`` on the current *version*, a
detached copy of the master taken after every optimizer step or averaging round, so a step never
modifies a tensor an in-flight graph saved. Gradients of every backward are accumulated in a buffer by
parameter name; at a step the stage divides by the number of microbatches, clips, sets the master's
``.grad`` and steps (a subspace run then projects it, ``swarm.subspace``). Memory cost: one extra copy
of the stage's parameters (two while old graphs live).

What a step means is the run spec's (docs/convergence.md):

- ``pipeline_schedule = "flush"`` (default): a microbatch of the next batch waits for the step that
  is due (:meth:`Stage.wait_current_weights`), so every gradient is computed on the current weights.
  ``"delayed"`` (seed 000 §3.2's delayed parameter updates): microbatches in flight across a step were
  computed on the previous version and count toward the next step (a one-step delay), and nothing
  waits.
- ``replica_sync = "gradients"`` (default): a step ends one batch of the whole swarm; microbatches
  carry their batch number, the stage closes a batch when its trainer (stage 0), a microbatch of the
  next batch or a co-replica says it is over, and adds its co-replicas' gradients before it steps
  (``combine``, wired by :class:`swarm.gradient_sync.GradientSync`; ``version`` is then the batch
  number). ``"periodic"``: the stage steps on its own ``target_batch_size`` samples.

:meth:`Stage.paused` excludes optimizer steps (forwards and backwards go on): in-stage averaging
(:mod:`swarm.averaging`) uses it so that no local step falls between copying the state out and the
average back in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import torch

from dht.clock import SYSTEM_CLOCK
from dht.records import RunSpec
from dht.rpc import Declined
from swarm.model import StageModel, next_token_loss, stage_forward
from swarm import stage_state
from swarm.stage_state import StageCounters
from swarm.spot_check import output_fingerprint
from swarm.subspace import subspace_of

logger = logging.getLogger(__name__)
T = TypeVar("T")
GRAD_CLIP_NORM = 1.0
OPTIMIZER_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


class StageClosedError(Declined):
    """The stage was shut down (the peer is leaving); no more compute is accepted."""


class Stage:
    """A stage replica: master parameters, optimizer, the current weight version and held graphs."""

    def __init__(self, spec: RunSpec, stage: int, *, device: torch.device, checkpoint_activations: bool = False,
                 clock: Callable[[], float] = SYSTEM_CLOCK) -> None:
        self.spec, self.index, self.device, self.clock = spec, stage, device, clock
        # checkpoint_activations: keep only block inputs per held graph, recompute in the backward (swarm.model)
        self.model = StageModel(spec, stage, checkpoint_activations=checkpoint_activations).to(device)
        self.subspace = subspace_of(spec)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay,
                                           fused=device.type == "cuda")  # one kernel per step on a GPU
        self._init_optimizer_state()
        self.snapshot: tuple[int, dict[str, torch.Tensor]] | None = None  # state frozen at the last averaging round
        self.loaded_from: tuple[str, ...] = ()  # peers whose state it loaded: StageAverager.loaded_from
        self.snapshot_tag = ""  # the weights' tag of that snapshot (see weights_tag)
        self.counters = StageCounters()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}")
        self._weights: dict[str, torch.Tensor] = {}
        # Names the weights forwards use, the same on every replica that holds bit-identical ones (the
        # seed's initialisation, an averaging round with no local step since); "" when they are this
        # replica's own. Spot checks (swarm/spot_check.py) compare strictly only under equal tags.
        self.weights_tag = ""
        self._publish_weights()
        self.weights_tag = f"seed{spec.seed}"
        self.output_fault: Callable[[torch.Tensor], torch.Tensor] | None = None  # test-only: peer/faults.py
        self._grad_buffer: dict[str, torch.Tensor] = {}
        self._graphs: dict[str, tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = {}
        self._in_flight: set[str] = set()  # ids between forward() and backward()/drop()
        self._step_lock = asyncio.Lock()
        self._accumulated_microbatches = 0
        self._accumulated_samples = 0
        self._step_task: asyncio.Task | None = None
        self._closed = False
        # replica_sync "gradients": adds this replica's gradient sum of a batch to its co-replicas'
        # (swarm.gradient_sync.GradientSync.combine); None: alone, the local sum is the batch's
        self.combine: Callable[[int, torch.Tensor, int, str], Awaitable[tuple[torch.Tensor, int]]] | None = None
        # ...and, after the step, makes this replica's state its co-replicas' again if the weights the
        # batch was computed on differed (GradientSync.reconcile); None: nothing to reconcile
        self.reconcile: Callable[[int], Awaitable[None]] | None = None
        self._closing_batch: int | None = None
        self.num_queued = 0  # jobs on the compute thread, running or waiting (a stage server reports it upstream)

    @property
    def is_first(self) -> bool:
        return self.model.is_first

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    @property
    def version(self) -> int:
        """Optimizer steps taken: the weight version each microbatch records for this hop."""
        return self.counters.num_steps

    def input_shape(self, batch_size: int) -> tuple[int, ...]:
        seq_len = self.spec.model.seq_len
        return (batch_size, seq_len) if self.is_first else (batch_size, seq_len, self.spec.model.d_model)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the stage's compute thread; :class:`StageClosedError` after :meth:`shutdown`."""
        if self._closed:
            raise StageClosedError(f"stage {self.index} is shut down")
        self.num_queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self.num_queued -= 1

    @property
    def num_held_graphs(self) -> int:
        """Microbatches whose forward ran here and whose backward has not (or was dropped)."""
        return len(self._in_flight)

    @property
    def syncs_gradients(self) -> bool:
        return self.spec.replica_sync == "gradients"

    @property
    def exchanges_gradients(self) -> bool:
        """Under ``gradients`` with an exchange wired (``combine``): batches end when closed, not on a count."""
        return self.syncs_gradients and self.combine is not None

    async def wait_current_weights(self, batch: int | None = None) -> None:
        """Under the ``flush`` schedule, wait for a step that is due or running: a microbatch that
        arrives after a batch completed belongs to the next batch and must see the stepped weights
        (its batch was injected only after every gradient of the last one came back). Under
        ``delayed`` it computes on the current version at once. Under ``replica_sync = "gradients"``
        a microbatch of a later ``batch`` than this replica's first closes the batches before it
        (a replica more than one batch behind jumps to the one before ``batch``)."""
        if self.spec.pipeline_schedule == "flush":
            await self.wait_step_done()
        if batch is None or not self.syncs_gradients:
            return
        if batch > self.version + 1 and self._step_task is None:
            self.counters.num_steps = batch - 1
        while self.version < batch:
            before = self.version
            await self.close_batch()
            if self.version == before:  # the step failed or the stage shut down
                return

    def note_batch(self, batch: int, *, from_replica: bool) -> None:
        """A co-replica speaks of ``batch`` (``swarm.gradient_sync``): a replica behind jumps to it; a
        later stage closes it (the co-replica closed it, so stage 0 finished it)."""
        if not self.syncs_gradients:
            return
        if batch > self.version and self._step_task is None:
            self.counters.num_steps = batch
        if from_replica and not self.is_first and batch == self.version:
            self.request_close()

    def is_closing(self, batch: int) -> bool:
        """Whether this replica is adding up its co-replicas' contributions to ``batch`` right now."""
        return self._closing_batch == batch

    def request_close(self) -> None:
        """Start the step that ends the current batch, unless one is due or running."""
        if self._step_task is None and not self._closed:
            self._step_task = asyncio.create_task(self._step())

    async def close_batch(self) -> None:
        """End the current batch: add the co-replicas' gradients (``combine``) and step."""
        self.request_close()
        await self.wait_step_done()

    async def forward(self, mb_id: str, inputs: torch.Tensor, *, batch: int | None = None) -> torch.Tensor:
        """Forward of a first or middle stage; keeps the graph until :meth:`backward` or :meth:`drop`."""
        return await self._held_forward(self._forward_sync, mb_id, inputs, batch)

    async def forward_fingerprinted(self, mb_id: str, inputs: torch.Tensor, *,
                                    batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor, str]:
        """:meth:`forward`, plus the fingerprint of its outputs and the tag of the weights it used."""
        return await self._held_forward(self._forward_fingerprinted_sync, mb_id, inputs, batch)

    async def _held_forward(self, forward_sync: Callable[..., T], mb_id: str, inputs: torch.Tensor, batch: int | None) -> T:
        if mb_id in self._in_flight:
            raise ValueError(f"microbatch {mb_id} is already in flight here")
        self._in_flight.add(mb_id)  # reserved before the first await: a concurrent duplicate is refused
        try:
            await self.wait_current_weights(batch)
            return await self.run(forward_sync, mb_id, inputs)
        except BaseException:
            self._in_flight.discard(mb_id)
            self._graphs.pop(mb_id, None)
            raise

    async def check_forward(self, inputs: torch.Tensor, *, weights_tag: str = "") -> tuple[torch.Tensor, str]:
        """A spot check's recompute: the forward alone, no graph kept, nothing counted; the fingerprint
        of its outputs (the logits on the last stage) and the tag of the weights it used. Those are the
        current weights, or the averaging snapshot's if ``weights_tag`` names that snapshot (the
        replica being checked computed on it and this one has stepped since)."""
        return await self.run(self._check_forward_sync, inputs, weights_tag)

    async def backward(self, mb_id: str, grad_outputs: torch.Tensor, *, accumulate: bool = True) -> torch.Tensor | None:
        """Backward of a held graph; returns the gradient w.r.t. the inputs (None on stage 0).
        ``accumulate=False`` (a re-delivery of a microbatch already counted here) computes the input
        gradient only and adds nothing to the batch."""
        if mb_id not in self._graphs:
            raise ValueError(f"no graph held for microbatch {mb_id}")
        try:
            return await self.run(self._backward_sync, mb_id, grad_outputs, accumulate)
        finally:
            self._in_flight.discard(mb_id)

    async def drop(self, mb_id: str) -> None:
        """Release a held graph whose microbatch will not come back (its gradient is discarded)."""
        self._in_flight.discard(mb_id)
        self._graphs.pop(mb_id, None)

    async def forward_loss_backward(
        self, inputs: torch.Tensor, targets: torch.Tensor, *, accumulate: bool = True, batch: int | None = None,
    ) -> tuple[float, torch.Tensor | None]:
        """Last stage: forward, loss, backward in one go; returns the loss and the input gradient
        (``accumulate`` as in :meth:`backward`)."""
        await self.wait_current_weights(batch)
        loss, grad, _, _ = await self.run(self._forward_loss_backward_sync, inputs, targets, accumulate)
        return loss, grad

    async def forward_loss_backward_fingerprinted(
        self, inputs: torch.Tensor, targets: torch.Tensor, *, accumulate: bool = True, batch: int | None = None,
    ) -> tuple[float, torch.Tensor | None, torch.Tensor, str]:
        """:meth:`forward_loss_backward`, plus the fingerprint of the logits and the weights' tag."""
        await self.wait_current_weights(batch)
        return await self.run(self._forward_loss_backward_sync, inputs, targets, accumulate, True)

    async def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor | float:
        """A held-out forward on the current weights, no graph kept, nothing counted: this stage's
        outputs, or on the last stage (``targets`` given) the mean next-token loss."""
        await self.wait_current_weights()
        return await self.run(self._evaluate_sync, inputs, targets)

    def record_microbatch(self, batch_size: int, loss: float | None = None) -> None:
        """Count a finished microbatch; start an optimizer step once the batch is complete."""
        self.counters.add_samples(batch_size, self.clock())
        if loss is not None:
            self.counters.last_loss = loss
        if self._accumulated_samples < self.spec.target_batch_size or self._step_task is not None:
            return
        if not self.exchanges_gradients or not self.is_first:
            # per-replica batches; or alone (no gradient exchange wired: the local sum is the batch); or
            # a later stage the whole swarm batch came through: nobody else has any of it
            self.request_close()  # (a wired stage 0's trainer closes its batches itself)

    async def wait_step_done(self) -> None:
        if self._step_task is not None:
            await asyncio.shield(self._step_task)

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """No optimizer step runs inside; forwards and backwards go on (on the old weight version)."""
        async with self._step_lock:
            yield

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters, optimizer state and the stage's identity as named CPU tensors (compute thread)."""
        return stage_state.state_tensors(self.model, self.optimizer, num_steps=self.counters.num_steps,
                                         identity=self._identity())

    def load_state_tensors(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`state_tensors` (compute thread). Checks everything first, then loads:
        on ``ValueError`` the stage is unchanged."""
        self.counters.num_steps = stage_state.load_state_tensors(self.model, self.optimizer, state,
                                                                 identity=self._identity(), device=self.device)
        self._publish_weights()
        self.weights_tag = ""  # whether others hold the same weights now is not known here

    def _identity(self) -> torch.Tensor:
        return torch.tensor([self.index, *self.spec.stage_layers[self.index]], dtype=torch.int64)

    def accumulated_gradients(self) -> dict[str, torch.Tensor]:
        """Gradients summed over the microbatches since the last step, by parameter name (a copy)."""
        return {name: grad.clone() for name, grad in self._grad_buffer.items()}

    def averaged_tensors(self) -> list[torch.Tensor]:
        """The live tensors in-stage averaging agrees on, in a fixed order: parameters, then each
        parameter's AdamW ``exp_avg``, ``exp_avg_sq`` and ``step``. Averaging the moments too makes every
        replica's whole training state identical after a round, which is what lets several replicas
        serve one consistent snapshot to a joiner (replication/)."""
        params = list(self.model.parameters())
        moments = [self.optimizer.state[p][key] for key in OPTIMIZER_STATE_KEYS for p in params]
        return params + moments

    def publish_averaged(self, version: int) -> str:
        """After the master state was overwritten by an averaging round (compute thread): forwards move
        to the new weights, and the state is frozen as the snapshot replicas serve to joiners.
        Returns the parameters' digest, which is part of the weights' tag: should a round split into
        two groups at the same time, their members do not take each other's weights for their own."""
        self._publish_weights()
        digest = self.params_digest()
        self.weights_tag = self.snapshot_tag = f"avg{version}:{digest}"
        self.keep_snapshot(version)
        return digest

    def keep_snapshot(self, version: int) -> None:
        """Freeze the current state as the one replicas serve to joiners (call on the compute thread)."""
        state = self.state_tensors()
        del state["counters.num_steps"]  # local bookkeeping, not shared state: replicas differ here
        self.snapshot = (version, state)

    def params_digest(self) -> str:
        """A short hash of the parameters' bytes (call on the compute thread)."""
        return stage_state.params_digest(self.model)

    def shutdown(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _init_optimizer_state(self) -> None:
        # AdamW creates its state lazily at the first step; averaging needs the tensors from the start.
        for param in self.model.parameters():
            self.optimizer.state[param] = {"step": torch.tensor(0.0), **{
                key: torch.zeros_like(param, memory_format=torch.preserve_format) for key in ("exp_avg", "exp_avg_sq")}}

    async def _step(self) -> None:
        try:
            if self.exchanges_gradients:
                await self._step_with_replicas()
                return
            async with self._step_lock:
                await self.run(self._step_sync)
        except StageClosedError:
            logger.debug("step skipped: the stage is shut down")
        except Exception:
            logger.exception("optimizer step failed")
        finally:
            self._step_task = None

    async def _step_with_replicas(self) -> None:
        """``replica_sync = "gradients"``: this replica's gradients of the batch, plus its
        co-replicas' (outside the step lock, so an averaging round cannot wait on the exchange),
        then the step."""
        batch = self._closing_batch = self.version
        try:
            gradients, count, weights = await self.run(self._take_gradients)
            if self.combine is not None:
                gradients, count = await self.combine(batch, gradients, count, weights)
            async with self._step_lock:
                await self.run(self._apply_gradients_sync, gradients, count)
        finally:
            self._closing_batch = None
        if self.reconcile is not None:
            await self.reconcile(batch)

    def _take_gradients(self) -> tuple[torch.Tensor, int, str]:
        """The batch's gradient sum, flat, its microbatch count, and the digest of the weights it was
        computed on (the master's, before this step); the buffer starts empty again."""
        flat, count = stage_state.flat_gradients(self.model, self._grad_buffer), self._accumulated_microbatches
        self._grad_buffer = {}
        self._accumulated_microbatches = self._accumulated_samples = 0
        return flat, count, self.params_digest()

    @property
    def optimizer_steps(self) -> int:
        """AdamW steps this replica's state has taken (its optimizer's own count; 0 before the first)."""
        first = next(iter(self.model.parameters()))
        return int(self.optimizer.state[first].get("step", 0))

    def flat_state(self) -> torch.Tensor:
        """Parameters, AdamW moments and step counts as one flat vector (compute thread)."""
        return stage_state.flat_state(self.averaged_tensors())

    def load_flat_state(self, flat: torch.Tensor) -> None:
        """Inverse of :meth:`flat_state` (compute thread): forwards move to the loaded weights."""
        stage_state.load_flat_state(self.averaged_tensors(), flat)
        self._publish_weights()
        self.weights_tag = ""  # another replica's weights, now this one's own

    def _apply_gradients_sync(self, gradients: torch.Tensor, count: int) -> None:
        """Step on the swarm's gradient sum of the batch, divided by its number of microbatches; the
        batch number passes even if nobody computed anything of it (the weights then stay)."""
        self.counters.num_steps += 1
        if count:
            stage_state.set_gradients(self.model, gradients / count)
            self._clip_and_step()

    def _clip_and_step(self) -> bool:
        """Clip the master's ``.grad`` and step (never on a non-finite norm: a last line of defence);
        forwards move to the new weights. Returns whether it stepped."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP_NORM)
        stepped = bool(torch.isfinite(norm))
        if stepped:
            self.optimizer.step()
        else:
            logger.warning(f"stage {self.index}: skipped a step with a non-finite gradient norm")
        self.optimizer.zero_grad(set_to_none=True)
        if stepped:
            self._publish_weights()
            self.weights_tag = ""  # a local step: weights of this replica's own until the next averaging round
        return stepped

    def _publish_weights(self) -> None:
        """A new weight version: detached copies of the (projected) master that forwards use from now on."""
        if self.subspace is not None:
            self.subspace.project(self.model)
        self._weights = {n: p.detach().clone().requires_grad_(True) for n, p in self.model.named_parameters()}

    def _outputs(self, weights: dict[str, torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
        outputs = stage_forward(self.model, weights, inputs, precision=self.spec.precision)
        return outputs if self.output_fault is None else self.output_fault(outputs)

    def _forward_sync(self, mb_id: str, inputs: torch.Tensor) -> torch.Tensor:
        inputs = inputs.to(self.device)
        if inputs.is_floating_point():
            inputs.requires_grad_(True)
        weights = self._weights
        outputs = self._outputs(weights, inputs)
        self._graphs[mb_id] = (inputs, outputs, weights)
        return outputs.detach().cpu()

    def _forward_fingerprinted_sync(self, mb_id: str, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
        tag = self.weights_tag  # read with the weights, on the compute thread where steps change both
        outputs = self._forward_sync(mb_id, inputs)
        return outputs, output_fingerprint(outputs), tag

    def _check_forward_sync(self, inputs: torch.Tensor, wanted_tag: str = "") -> tuple[torch.Tensor, str]:
        tag, weights = self.weights_tag, self._weights
        if wanted_tag and wanted_tag != tag and self.snapshot is not None and wanted_tag == self.snapshot_tag:
            state = self.snapshot[1]
            tag, weights = wanted_tag, {name: state[f"model.{name}"].to(self.device) for name in weights}
        with torch.no_grad():
            outputs = self._outputs(weights, inputs.to(self.device))
        return output_fingerprint(outputs), tag

    def _evaluate_sync(self, inputs: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | float:
        with torch.no_grad():
            outputs = stage_forward(self.model, self._weights, inputs.to(self.device), precision=self.spec.precision)
            if targets is None:
                return outputs.cpu()
            return float(next_token_loss(outputs, targets.to(self.device)))

    def _backward_sync(self, mb_id: str, grad_outputs: torch.Tensor, accumulate: bool = True) -> torch.Tensor | None:
        inputs, outputs, weights = self._graphs.pop(mb_id)
        grad_outputs = grad_outputs.to(self.device, outputs.dtype)
        if not accumulate:
            return stage_state.input_gradient(outputs, grad_outputs, inputs)
        grad_inputs = self._accumulate(outputs, grad_outputs, inputs, weights)
        self._count_accumulated(inputs.shape[0])
        return grad_inputs

    def _forward_loss_backward_sync(
        self, inputs: torch.Tensor, targets: torch.Tensor, accumulate: bool = True, fingerprint: bool = False,
    ) -> tuple[float, torch.Tensor | None, torch.Tensor | None, str]:
        """(loss, input gradient, the logits' fingerprint if asked, the weights' tag)."""
        inputs = inputs.to(self.device)
        if inputs.is_floating_point():  # token ids of a single-stage run need no gradient
            inputs.requires_grad_(True)
        tag, weights = self.weights_tag, self._weights
        logits = self._outputs(weights, inputs)
        prints = output_fingerprint(logits) if fingerprint else None
        loss = next_token_loss(logits, targets.to(self.device))
        if not accumulate:
            return float(loss.detach()), stage_state.input_gradient(loss, None, inputs), prints, tag
        grad_inputs = self._accumulate(loss, None, inputs, weights)
        self._count_accumulated(inputs.shape[0])
        return float(loss.detach()), grad_inputs, prints, tag

    def _accumulate(
        self, outputs: torch.Tensor, grad_outputs: torch.Tensor | None, inputs: torch.Tensor, weights: dict[str, torch.Tensor]
    ) -> torch.Tensor | None:
        return stage_state.accumulate_gradients(self._grad_buffer, outputs, grad_outputs, inputs, weights)

    def _count_accumulated(self, batch_size: int) -> None:
        # on the compute thread, where the gradients accumulate: the step's divisor is exact
        self._accumulated_microbatches += 1
        self._accumulated_samples += batch_size

    def _step_sync(self) -> None:
        if self._accumulated_microbatches == 0:
            return
        for name, param in self.model.named_parameters():
            grad = self._grad_buffer.get(name)
            param.grad = grad.div_(self._accumulated_microbatches) if grad is not None else None
        self._grad_buffer = {}
        self._accumulated_microbatches = self._accumulated_samples = 0
        if self._clip_and_step():
            self.counters.num_steps += 1

