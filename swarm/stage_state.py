"""A stage replica's whole training state as named tensors: what checkpoints, state transfers and
backups carry (:meth:`swarm.stage.Stage.state_tensors` and :meth:`~swarm.stage.Stage.load_state_tensors`).

Keys: ``model.<name>`` (parameters and buffers), ``optim.<parameter>.<entry>`` (AdamW's ``exp_avg``,
``exp_avg_sq``, ``step``), ``counters.num_steps`` (the replica's step count or batch number) and
``stage.layers`` (``[stage, first block, end block]``: the identity a loaded state must match).
What a holder serves to joiners and backup keepers is that less ``counters.num_steps``
(:meth:`~swarm.stage.Stage.keep_snapshot`); :func:`state_template` and :func:`served_state_template`
give the layout of both from the run spec alone, so that a puller checks what it is offered
before it allocates anything (replication/layout.py).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from dht.records import RunSpec
from swarm.model import StageModel

STEP_COUNTER_KEY = "counters.num_steps"  # local bookkeeping: replicas differ here, so it is not served


@dataclass
class StageCounters:
    """What the stage has done since the peer started (read by heartbeats and the dashboard)."""

    num_samples: int = 0
    num_microbatches: int = 0
    num_steps: int = 0
    last_loss: float = math.nan
    samples_per_s: float = 0.0
    _window_start: float = 0.0
    _window_samples: int = 0

    def add_samples(self, count: int, now: float) -> None:
        self.num_samples += count
        self.num_microbatches += 1
        if self._window_start == 0.0:
            self._window_start = now
        self._window_samples += count
        elapsed = now - self._window_start
        if elapsed >= 5.0:  # refresh the rate every 5 s of wall time
            self.samples_per_s = self._window_samples / elapsed
            self._window_start, self._window_samples = now, 0


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, num_steps: int,
                  identity: torch.Tensor) -> dict[str, torch.Tensor]:
    """Parameters, optimizer state, step count and identity as named CPU tensors (copies)."""
    state = {f"model.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                state[f"optim.{names[id(param)]}.{key}"] = torch.as_tensor(value).detach().cpu().clone()
    state["counters.num_steps"] = torch.tensor(num_steps, dtype=torch.int64)
    state["stage.layers"] = identity
    return state


def state_template(spec: RunSpec, stage: int) -> dict[str, torch.Tensor]:
    """What :func:`state_tensors` gives for ``stage`` of ``spec`` (as :class:`~swarm.stage.Stage` sets
    its optimizer up), as meta tensors: every name, dtype and shape, and no memory.

    Raises:
        ValueError: ``stage`` is not one of the spec's stages.
    """
    with torch.device("meta"):  # its seeded initialisation runs on meta tensors too: nothing is allocated
        model = StageModel(spec, stage)
        template = {f"model.{k}": v for k, v in model.state_dict().items()}
        for name, param in model.named_parameters():
            template[f"optim.{name}.exp_avg"] = torch.empty_like(param)
            template[f"optim.{name}.exp_avg_sq"] = torch.empty_like(param)
            template[f"optim.{name}.step"] = torch.empty(())  # as Stage._init_optimizer_state's torch.tensor(0.0)
        template[STEP_COUNTER_KEY] = torch.empty((), dtype=torch.int64)
        template["stage.layers"] = torch.empty(3, dtype=torch.int64)
    return template


def served_state_template(spec: RunSpec, stage: int) -> dict[str, torch.Tensor]:
    """:func:`state_template` less the step counter: the layout a holder (or a backup's keeper) serves."""
    template = state_template(spec, stage)
    del template[STEP_COUNTER_KEY]
    return template


def load_state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, torch.Tensor], *,
                       identity: torch.Tensor, device: torch.device) -> int:
    """Inverse of :func:`state_tensors`; returns the step count. Checks everything first, then loads:
    on ``ValueError`` the model and optimizer are unchanged."""
    if "stage.layers" not in state or not torch.equal(state["stage.layers"], identity):
        raise ValueError(f"the state is not of stage {int(identity[0])} (layers {identity[1:].tolist()})")
    model_state = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    expected = model.state_dict()
    if set(model_state) != set(expected):
        raise ValueError("downloaded state does not have this stage's parameters")
    for name, value in model_state.items():
        if value.shape != expected[name].shape or value.dtype != expected[name].dtype:
            raise ValueError(f"downloaded {name} is {value.dtype}{list(value.shape)}, expected {list(expected[name].shape)}")
    optim_state = _parse_optimizer_state(model, state)
    steps = state.get("counters.num_steps", torch.tensor(0))
    if steps.dim() != 0 or steps.dtype != torch.int64 or int(steps) < 0:
        raise ValueError("downloaded step counter is not a non-negative integer")
    model.load_state_dict(model_state)
    params = dict(model.named_parameters())
    for name, entries in optim_state.items():
        optimizer.state[params[name]] = {k: v.clone() if k == "step" else v.to(device) for k, v in entries.items()}
    return int(steps)


def params_digest(model: torch.nn.Module) -> str:
    """A short hash of the parameters' bytes."""
    digest = hashlib.blake2b(digest_size=12)
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _parse_optimizer_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    params = dict(model.named_parameters())
    optim_state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key.startswith("optim."):
            param_name, entry = key[len("optim."):].rsplit(".", 1)
            if param_name not in params:
                raise ValueError(f"downloaded optimizer state names an unknown parameter {param_name!r}")
            if entry != "step" and value.shape != params[param_name].shape:
                raise ValueError(f"downloaded optimizer state {key} has shape {list(value.shape)}")
            optim_state.setdefault(param_name, {})[entry] = value
    return optim_state


def flat_gradients(model: torch.nn.Module, gradients: dict[str, torch.Tensor]) -> torch.Tensor:
    """``gradients`` (by parameter name) as one flat float32 CPU vector in parameter order; zeros for a
    parameter without one (the wire form of swarm/gradient_sync.py)."""
    return torch.cat([gradients[n].reshape(-1).cpu() if n in gradients else torch.zeros(p.numel())
                      for n, p in model.named_parameters()])


def flat_state(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` (``Stage.averaged_tensors``: parameters, then the AdamW moments and step counts) as
    one flat float32 CPU vector (the wire form of a replica's whole state, swarm/gradient_sync.py)."""
    return torch.cat([t.detach().reshape(-1).to(torch.float32).cpu() for t in tensors])


def load_flat_state(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Inverse of :func:`flat_state`: copies each tensor's slice of ``flat`` into it, in place."""
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def set_gradients(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Inverse of :func:`flat_gradients`: each parameter's ``.grad`` from its slice of ``flat``."""
    offset = 0
    for param in model.parameters():
        param.grad = flat[offset:offset + param.numel()].view_as(param).to(param.device)
        offset += param.numel()


def accumulate_gradients(buffer: dict[str, torch.Tensor], outputs: torch.Tensor, grad_outputs: torch.Tensor | None,
                         inputs: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Backward through one graph: add the weight gradients to ``buffer`` (by parameter name), return
    the input gradient (None for token-id inputs).

    Raises:
        ValueError: the gradients are not finite (nothing is added).
    """
    names = list(weights)
    wrt = [weights[n] for n in names] + ([inputs] if inputs.requires_grad else [])
    grads = torch.autograd.grad(outputs, wrt, grad_outputs, allow_unused=True)
    present = [g for g in grads if g is not None]
    if present and not torch.isfinite(torch.stack([g.detach().abs().sum() for g in present]).sum()):
        # a finite but huge input can still overflow: nothing of it reaches the batch (fuzzing found
        # that one such microbatch made a stage's weights NaN for good)
        raise ValueError("the microbatch gives non-finite gradients; refused")
    for name, grad in zip(names, grads):
        if grad is not None:
            if name in buffer:
                buffer[name].add_(grad)
            else:
                buffer[name] = grad.detach().clone()
    return grads[-1].detach().cpu() if inputs.requires_grad else None


def input_gradient(outputs: torch.Tensor, grad_outputs: torch.Tensor | None, inputs: torch.Tensor) -> torch.Tensor | None:
    """The gradient w.r.t. the inputs alone (nothing accumulated); None for token-id inputs."""
    if not inputs.requires_grad:
        return None
    (grad,) = torch.autograd.grad(outputs, [inputs], grad_outputs)
    return grad.detach().cpu()
