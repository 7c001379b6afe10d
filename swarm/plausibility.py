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

A round of two has a tighter check where the partner's state came from this replica: a state this
replica served it, or a round both kept (:class:`PairAnchors`). Both then moved from one common state
by their own steps since, so the round may shift this replica's parameters by at most half of
(its steps + the partner's) AdamW moves (:func:`pair_shift`), however long they trained before. That
is what catches a Byzantine replica that joined second: it downloads the honest replica's trained
state, so its pushes stay far within the seed bound of the honest step count.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

import torch

from dht.records import RunSpec
from swarm.model import StageModel

BETAS = (0.9, 0.999)  # torch.optim.AdamW's defaults, which swarm/stage.py uses
SLACK_STEPS = 2  # steps granted beyond the state's own count (a round's members may be a step or two ahead)
PARTNER_SPEEDUP = 4  # a pair partner is granted at most this many times this replica's steps since their anchor
MAX_SERVED_VERSIONS = 64  # served versions whose step counts a replica remembers


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
    return _largest_move(state, initial, lambda value, _start: lr * (bound + weight_decay * float(value.abs().max())) * bound_steps)


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


def pair_shift(result: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor], *, lr: float, weight_decay: float,
               own_steps: float, partner_steps: float) -> tuple[float, str]:
    """How far a pair round's ``result`` moves this replica's parameters ``own``, as a fraction of what
    an honest partner that started from this replica's state ``own_steps`` steps ago and took
    ``partner_steps`` since allows: the pair's mean is half their difference, and each moved at most
    ``lr · (R + wd · |θ|)`` per step (> 1: the partner pushed; non-finite: inf)."""
    steps = max(own_steps, 0.0) + max(partner_steps, 0.0) + 2 * SLACK_STEPS
    bound = adamw_step_bound()
    return _largest_move(result, own, lambda value, mine: lr * (bound + weight_decay * max(
        float(value.abs().max()), float(mine.abs().max()))) * steps / 2)


def _largest_move(state: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                  allowed: Callable[[torch.Tensor, torch.Tensor], float]) -> tuple[float, str]:
    """The largest ``max |state − reference|`` over ``allowed(state tensor, reference tensor)`` (both
    float64) among the tensors both name with one shape, and the tensor where it is; a non-finite
    state tensor: inf. Tensors missing or reshaped are skipped: the layout is checked elsewhere
    (replication/layout.py)."""
    worst, where = 0.0, ""
    for name, start in reference.items():
        value = state.get(name)
        if value is None or value.shape != start.shape or value.numel() == 0:
            continue
        value, start = value.detach().to("cpu", torch.float64), start.detach().to("cpu", torch.float64)
        if not bool(torch.isfinite(value).all()):
            return math.inf, name
        limit, moved = allowed(value, start), float((value - start).abs().max())
        fraction = moved / limit if limit > 0 else (math.inf if moved else 0.0)
        if fraction > worst:
            worst, where = fraction, name
    return worst, where


def partner_steps_since(anchor: float, own_steps: float, result_steps: float) -> float:
    """The steps a pair partner took since the anchor, read from the round's averaged step count (the
    mean of the two: ``2 · result − own``), capped at ``PARTNER_SPEEDUP`` times this replica's own
    since then: a partner cannot loosen the check by claiming steps it did not take."""
    own_since = max(own_steps - anchor, 0.0)
    claimed = 2 * result_steps - own_steps - anchor
    cap = PARTNER_SPEEDUP * own_since + SLACK_STEPS
    return min(max(claimed, 0.0), cap) if math.isfinite(claimed) else cap


class PairAnchors:
    """Where this replica's state and each partner's last were one: this replica's optimizer step
    count at the last state it served that partner or averaged with it in a kept round. A partner
    with no anchor (its state came from elsewhere: another holder, the seed, a backup) gets the seed
    bound only (:func:`drift`)."""

    def __init__(self, max_versions: int = MAX_SERVED_VERSIONS) -> None:
        self.max_versions = max_versions
        self._served: OrderedDict[int, float] = OrderedDict()  # version served -> its optimizer steps
        self._anchors: dict[str, float] = {}  # partner -> this replica's steps at their common state

    def serving(self, version: int, steps: float) -> None:
        """This replica serves ``version`` of its state, at ``steps`` optimizer steps."""
        self._served[version] = steps
        self._served.move_to_end(version)
        while len(self._served) > self.max_versions:
            self._served.popitem(last=False)

    def served(self, peer_id: str, version: int) -> None:
        """``peer_id`` downloaded ``version`` of this replica's state (a version not remembered is ignored)."""
        steps = self._served.get(version)
        if steps is not None:
            self._anchors[peer_id] = steps

    def averaged(self, peer_ids: Iterable[str], steps: float) -> None:
        """A round this replica kept, with ``peer_ids``, left every member this state at ``steps``."""
        for peer_id in peer_ids:
            self._anchors[peer_id] = steps

    def forget(self, peer_id: str) -> None:
        self._anchors.pop(peer_id, None)

    def anchor(self, peer_id: str) -> float | None:
        """This replica's steps at its last common state with ``peer_id``, or None if it has none."""
        return self._anchors.get(peer_id)
