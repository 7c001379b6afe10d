"""How far AdamW can move a stage's weights: a sanity check on state a peer did not compute itself.

Per step, AdamW moves each parameter by ``lr · (m̂ / (√v̂ + ε) + weight_decay · θ)``. Cauchy–Schwarz
on the moment sums bounds the first term for any gradients: ``|m_t| ≤ (1 − β1) · √(Σ_k (β1²/β2)^k) ·
√(v_t / (1 − β2))``, so ``|m̂ / √v̂| ≤ R = (1 − β1) / √((1 − β2) · (1 − β1²/β2))`` (7.27 for torch's
β = (0.9, 0.999); the bias corrections only shrink it before the sums fill). A state whose weights
stand farther from the run seed's initialisation than ``steps`` such moves, on any coordinate, was
not trained by AdamW at the run's learning rate: it was pushed (``peer/faults.py``'s
``scale_updates=100`` is caught at its first step, 100 > 7.27). Averages of honest states pass too:
each lies within the bound of the most steps among them.

What it does not catch: a state pushed less than that bound (after 100 steps at lr 3e-3 it allows
2.2 per coordinate, far more than honest training ever moves), and a donor that claims more optimizer
steps than it took (the step count is read from the state it serves). It is a floor under the robust
averaging's majority, for the moments when there is no honest majority to ask: a stage's first
holder serving a joiner, a round of two (docs/security.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from dht.records import RunSpec
from swarm.model import StageModel

BETAS = (0.9, 0.999)  # torch.optim.AdamW's defaults, which swarm/stage.py uses
SLACK_STEPS = 2  # steps granted beyond the state's own count (a round's members may be a step or two ahead)


def adamw_step_bound(beta1: float = BETAS[0], beta2: float = BETAS[1]) -> float:
    """R: the most ``|m̂ / (√v̂ + ε)|`` can be, for any gradients (see the module docstring)."""
    ratio = beta1 * beta1 / beta2
    if not (0 <= beta1 < 1 and 0 < beta2 < 1 and ratio < 1):
        raise ValueError(f"no bound for betas ({beta1}, {beta2}): need beta1^2 < beta2")
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - ratio))


def initial_parameters(spec: RunSpec, stage: int) -> dict[str, torch.Tensor]:
    """The stage's parameters as the run seed initialises them (on the CPU)."""
    return {f"model.{k}": v.detach() for k, v in StageModel(spec, stage).state_dict().items()}


def optimizer_steps(state: Mapping[str, torch.Tensor]) -> int:
    """The most optimizer steps any parameter of ``state`` records (``optim.<name>.step``), 0 if none."""
    steps = [float(v) for k, v in state.items() if k.startswith("optim.") and k.endswith(".step") and v.numel() == 1]
    finite = [s for s in steps if math.isfinite(s) and s >= 0]
    return int(max(finite, default=0.0))


def drift(state: Mapping[str, torch.Tensor], initial: Mapping[str, torch.Tensor], *, lr: float,
          weight_decay: float, steps: int) -> tuple[float, str]:
    """The largest ``|θ − θ0|`` of ``state``'s parameters as a fraction of what ``steps`` + SLACK_STEPS
    AdamW steps allow (> 1: implausible; non-finite weights: inf), and the tensor where it is."""
    bound_steps, bound = max(steps, 0) + SLACK_STEPS, adamw_step_bound()
    worst, where = 0.0, ""
    for name, start in initial.items():
        value = state.get(name)
        if value is None or value.shape != start.shape:
            continue  # the layout is checked elsewhere (replication/layout.py)
        value = value.detach().to(torch.float64)
        if value.numel() == 0:
            continue
        if not bool(torch.isfinite(value).all()):
            return math.inf, name
        per_step = lr * (bound + weight_decay * float(value.abs().max()))
        moved = float((value - start.to(torch.float64)).abs().max())
        fraction = moved / (per_step * bound_steps) if per_step > 0 else (math.inf if moved else 0.0)
        if fraction > worst:
            worst, where = fraction, name
    return worst, where


def state_drift(state: Mapping[str, torch.Tensor], spec: RunSpec, stage: int) -> float:
    """:func:`drift` of ``state`` (named like ``Stage.state_tensors``) for its own step count: the
    smaller, the less the state moved per step (honest training: well below 1)."""
    return drift(state, initial_parameters(spec, stage), lr=spec.lr, weight_decay=spec.weight_decay,
                 steps=optimizer_steps(state))[0]


def implausible(state: Mapping[str, torch.Tensor], spec: RunSpec, stage: int, *, steps: int | None = None) -> str:
    """Why ``state`` (named like ``Stage.state_tensors``) cannot come from AdamW training of ``stage``
    from the run seed, or "" if it can. ``steps``: the optimizer steps to allow (default: the state's own)."""
    steps = optimizer_steps(state) if steps is None else steps
    fraction, where = drift(state, initial_parameters(spec, stage), lr=spec.lr, weight_decay=spec.weight_decay,
                            steps=steps)
    if fraction <= 1.0:
        return ""
    if math.isinf(fraction):
        return f"{where} is not finite"
    return (f"{where} stands {fraction:.0f}x farther from the run seed's initialisation than "
            f"{steps} AdamW steps at lr {spec.lr:g} can move it")
