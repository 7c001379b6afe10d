"""The AdamW drift bound (swarm.plausibility): honest training of any gradients stays within it; a
state pushed x100 per step, one with NaN, or one pushed at step 0 does not. The pair bound: a partner
that pushed since the state it shared with this replica is caught however long both trained before."""

from __future__ import annotations

import pytest
import torch

from dht.records import ModelSpec, RunSpec
from swarm.model import StageModel, next_token_loss
from swarm.plausibility import (PairAnchors, adamw_step_bound, drift, implausible, initial_parameters, optimizer_steps,
                                pair_shift, partner_steps_since)
from swarm.stage_state import state_tensors

SPEC = RunSpec(run_id="p", model=ModelSpec(d_model=32, num_layers=2, num_heads=2, seq_len=16), stage_layers=((0, 2),),
               lr=3e-3, weight_decay=0.1, microbatch_size=4, target_batch_size=4)


def trained_state(steps: int, *, scale: float = 1.0, gradient_scale: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """``steps`` AdamW steps of the one-stage model on random tokens; each step's move times ``scale``."""
    torch.manual_seed(seed)
    model = StageModel(SPEC, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=SPEC.lr, weight_decay=SPEC.weight_decay)
    for _ in range(steps):
        tokens = torch.randint(0, SPEC.model.vocab_size, (4, SPEC.model.seq_len + 1))
        before = [p.detach().clone() for p in model.parameters()]
        loss = next_token_loss(model(tokens[:, :-1]), tokens[:, 1:]) * gradient_scale
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            for p, b in zip(model.parameters(), before):
                p.copy_(b + scale * (p - b))
    return state_tensors(model, optimizer, num_steps=steps, identity=torch.tensor([0, 0, 2]))


def test_the_bound_is_what_cauchy_schwarz_gives_for_torchs_betas():
    assert adamw_step_bound() == pytest.approx(7.27, abs=0.01)
    with pytest.raises(ValueError):
        adamw_step_bound(0.99, 0.9)


def test_the_worst_gradients_for_adam_stay_within_the_bound():
    # one huge gradient after many tiny ones: the largest |m̂/√v̂| Adam can produce, per coordinate
    beta1, beta2 = 0.9, 0.999
    m = v = 0.0
    worst = 0.0
    for t in range(1, 3000):
        g = 1.0 if t % 500 == 0 else (-1) ** t * 1e-6
        m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
        worst = max(worst, abs(m / (1 - beta1**t)) / (v / (1 - beta2**t)) ** 0.5)
    assert 1.0 < worst <= adamw_step_bound()


@pytest.mark.parametrize("gradient_scale", [1.0, 1e6, 1e-6])
def test_honest_training_is_plausible_whatever_the_gradients_scale(gradient_scale):
    state = trained_state(20, gradient_scale=gradient_scale)
    assert optimizer_steps(state) == 20
    assert implausible(state, SPEC, 0) == ""
    fraction, _ = drift(state, initial_parameters(SPEC, 0), lr=SPEC.lr, weight_decay=SPEC.weight_decay, steps=20)
    assert 0 < fraction < 0.5  # honest training is far inside the worst case


def test_an_average_of_honest_states_is_plausible():
    a, b = trained_state(10, seed=1), trained_state(30, seed=2)
    mean = {k: (a[k] + b[k]) / 2 if a[k].is_floating_point() else b[k] for k in a}
    assert implausible(mean, SPEC, 0) == ""


def test_updates_scaled_x100_are_caught_from_the_first_step():
    for steps in (1, 5, 20):
        reason = implausible(trained_state(steps, scale=100.0), SPEC, 0)
        assert "farther from the run seed's initialisation than" in reason and f"{steps} AdamW steps" in reason


def test_a_pushed_state_that_claims_no_steps_and_a_nan_are_caught():
    state = trained_state(0)
    assert implausible(state, SPEC, 0) == ""
    pushed = dict(state)
    name = next(k for k in state if k.startswith("model.") and k.endswith("weight"))
    pushed[name] = state[name] + 0.1  # 0.1 per coordinate: beyond 2 steps of 7.27 x 3e-3
    assert "farther from the run seed's initialisation" in implausible(pushed, SPEC, 0)
    pushed[name] = state[name].clone()
    pushed[name].view(-1)[0] = float("nan")
    assert implausible(pushed, SPEC, 0) == f"{name} is not finite"


def branch(steps: int, *, scale: float = 1.0, seed: int = 0, start: int = 30) -> tuple[dict, dict]:
    """A common state after ``start`` honest steps, and a copy trained ``steps`` more steps with each move
    times ``scale`` (on other tokens): (common, branch)."""
    torch.manual_seed(1234)
    model = StageModel(SPEC, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=SPEC.lr, weight_decay=SPEC.weight_decay)

    def train(count: int, factor: float) -> None:
        for _ in range(count):
            tokens = torch.randint(0, SPEC.model.vocab_size, (4, SPEC.model.seq_len + 1))
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.zero_grad()
            next_token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            optimizer.step()
            with torch.no_grad():
                for p, b in zip(model.parameters(), before):
                    p.copy_(b + factor * (p - b))

    train(start, 1.0)
    common = state_tensors(model, optimizer, num_steps=start, identity=torch.tensor([0, 0, 2]))
    common = {k: v.clone() for k, v in common.items()}
    torch.manual_seed(seed)
    train(steps, scale)
    return common, state_tensors(model, optimizer, num_steps=start + steps, identity=torch.tensor([0, 0, 2]))


def params(state: dict) -> dict:
    return {k: v for k, v in state.items() if k.startswith("model.")}


def pair_round(own: dict, partner: dict) -> dict:
    return {k: (own[k] + partner[k]) / 2 for k in params(own)}


def test_a_pair_round_with_an_honest_partner_from_a_shared_state_is_within_the_pair_bound():
    common, own = branch(3, seed=1)
    _, partner = branch(5, seed=2)
    fraction, _ = pair_shift(pair_round(own, partner), params(own), lr=SPEC.lr, weight_decay=SPEC.weight_decay,
                             own_steps=3, partner_steps=partner_steps_since(30, 33, (33 + 35) / 2))
    assert 0 < fraction < 0.5


def test_a_partner_that_pushed_x100_since_the_shared_state_is_caught_by_the_pair_bound_not_the_seed_bound():
    # joining second: it downloaded the honest replica's 30-step state, then pushed two steps x100
    common, own = branch(2, seed=1)
    _, pushed = branch(2, scale=100.0, seed=2)
    result = pair_round(own, pushed)
    assert implausible(result, SPEC, 0, steps=32) == ""  # the seed bound of 32 steps does not see it
    fraction, where = pair_shift(result, params(own), lr=SPEC.lr, weight_decay=SPEC.weight_decay,
                                 own_steps=2, partner_steps=partner_steps_since(30, 32, 32))
    assert fraction > 1 and where.startswith("model.")


def test_a_partner_cannot_loosen_the_pair_bound_by_claiming_steps():
    assert partner_steps_since(30, 33, 33) == 3  # as many as this replica since the anchor
    assert partner_steps_since(30, 33, 1e9) == 4 * 3 + 2  # a claimed billion: capped
    assert partner_steps_since(30, 33, float("nan")) == 4 * 3 + 2
    assert partner_steps_since(30, 33, 0) == 0  # claiming fewer only tightens it


def test_pair_anchors_come_from_a_served_version_or_a_kept_round():
    anchors = PairAnchors(max_versions=2)
    anchors.serving(7, 7.0)
    anchors.served("joiner", 7)
    assert anchors.anchor("joiner") == 7.0
    anchors.served("other", 99)  # a version this replica never served: no anchor
    assert anchors.anchor("other") is None
    anchors.serving(8, 8.0)
    anchors.serving(9, 9.0)  # version 7 is forgotten (two remembered)
    anchors.served("late", 7)
    assert anchors.anchor("late") is None
    anchors.averaged(["joiner", "late"], 12.5)
    assert anchors.anchor("joiner") == anchors.anchor("late") == 12.5
    anchors.forget("late")
    assert anchors.anchor("late") is None
