"""Composing a stage's state for a new layer layout (swarm/state_pieces.py): the model computes the same
function after the layout change, each layer keeps its optimizer history, precedence and provenance,
and bad pieces are refused."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from dht.records import ModelSpec, RunSpec
from swarm.state_pieces import (
    BadPieceError,
    StatePiece,
    compose_stage_state,
    global_layer_names,
    needed_sources,
)
from swarm.stage import Stage
from tests.unit.test_stage import open_stages

CPU = torch.device("cpu")
MODEL = ModelSpec(vocab_size=256, d_model=32, num_layers=6, num_heads=4, seq_len=16)
OLD = RunSpec(run_id="t", model=MODEL, stage_layers=((0, 2), (2, 4), (4, 6)), seed=3, lr=1e-2,
              microbatch_size=2, target_batch_size=2)
NEW = dataclasses.replace(OLD, stage_layers=((0, 3), (3, 6)))
DEADLINE = 20.0  # backs up the training steps' awaits; never reached when the code is right


def tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, MODEL.vocab_size, (OLD.microbatch_size, MODEL.seq_len + 1), generator=g)
    return window[:, :-1], window[:, 1:]


async def train_step(stages: list[Stage], seed: int) -> None:
    """One real pipelined microbatch through all stages; each takes an optimizer step on it."""
    inputs, targets = tokens(seed)
    mb_id, hidden = f"mb{seed}", inputs
    for stage in stages[:-1]:
        hidden = await stage.forward(mb_id, hidden)
    loss, grad = await stages[-1].forward_loss_backward(hidden, targets)
    stages[-1].record_microbatch(OLD.microbatch_size, loss)
    for stage in reversed(stages[:-1]):
        grad = await stage.backward(mb_id, grad)
        stage.record_microbatch(OLD.microbatch_size, loss)
    for stage in stages:
        await stage.wait_step_done()


def trained_old_states(num_steps: int = 2) -> list[dict[str, torch.Tensor]]:
    """States of the three old stages after ``num_steps`` real training steps."""
    with open_stages(OLD, 0, 1, 2) as stages:
        async def main() -> None:
            async with asyncio.timeout(DEADLINE):
                for seed in range(num_steps):
                    await train_step(stages, seed)

        asyncio.run(main())
        assert all(stage.counters.num_steps == num_steps for stage in stages)
        return [stage.state_tensors() for stage in stages]


def chain_logits(spec: RunSpec, states: list[dict[str, torch.Tensor]], inputs: torch.Tensor) -> torch.Tensor:
    """The whole model's forward through stages loaded with ``states`` (which must load cleanly)."""
    with open_stages(spec, *range(spec.num_stages)) as stages, torch.no_grad():
        x = inputs
        for stage, state in zip(stages, states):
            stage.load_state_tensors(state)
            x = stage.model(x)
        return x


def fresh_state(spec: RunSpec, stage: int) -> dict[str, torch.Tensor]:
    with open_stages(spec, stage) as (fresh,):
        return fresh.state_tensors()


def backup_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a backup or snapshot holds: the state without the local step counter."""
    return {k: v for k, v in state.items() if k != "counters.num_steps"}


@pytest.fixture(scope="module")
def old_states() -> list[dict[str, torch.Tensor]]:
    return trained_old_states()


def compose_two_stage_layout(old_states, *, with_backup: bool = True):
    """New stages 0 and 1 of ((0, 3), (3, 6)) after old stage 1 vanished (its backup as a piece)."""
    backup = [StatePiece(OLD, 1, backup_of(old_states[1]), "backup:p9")] if with_backup else []
    own0 = StatePiece(OLD, 0, old_states[0], "own")
    own2 = StatePiece(OLD, 2, old_states[2], "own")
    first = compose_stage_state(NEW, 0, [own0, *backup], base=fresh_state(NEW, 0), num_steps=2)
    last = compose_stage_state(NEW, 1, [own2, *backup], base=fresh_state(NEW, 1), num_steps=2)
    return first, last


def test_the_new_layout_computes_the_same_function(old_states):
    (first, _), (last, _) = compose_two_stage_layout(old_states)
    inputs, _ = tokens(99)
    before = chain_logits(OLD, old_states, inputs)
    after = chain_logits(NEW, [first, last], inputs)
    assert not torch.equal(before, chain_logits(OLD, [fresh_state(OLD, k) for k in range(3)], inputs))
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize("new_layers", [((0, 1), (1, 3), (3, 5), (5, 6)),  # a global plan grows the layout
                                        ((0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)),
                                        ((0, 5), (5, 6)),  # or shrinks it with no stage lost
                                        ((0, 6),), ((0, 1), (1, 4), (4, 6))])  # or re-splits it
def test_a_global_plans_layout_is_built_from_the_old_holders_with_every_layer_once_and_none_reseeded(
        old_states, new_layers):
    """issue #18: each new stage composed from the old stages it needs (``needed_sources``: what the
    peer's own old stage and the old holders serve) holds each of its layers once, from the piece
    that had it, none from the seed, and the new layout computes the old one's function exactly."""
    new = dataclasses.replace(OLD, stage_layers=new_layers)
    states, held = [], []
    for k, (start, end) in enumerate(new_layers):
        pieces = [StatePiece(OLD, old, old_states[old], f"holder:p{old}") for old in needed_sources(OLD, new, k)]
        composed, provenance = compose_stage_state(new, k, pieces, base=fresh_state(new, k), num_steps=2)
        assert "seed" not in provenance.values(), provenance
        held += [part for part in provenance if part.startswith("layer ")]
        for layer in range(start, end):  # from the old stage that held it, with its moments
            old = next(i for i, (s, e) in enumerate(OLD.stage_layers) if s <= layer < e)
            assert provenance[f"layer {layer}"] == f"holder:p{old}"
            old_name, new_name = f"blocks.{layer - OLD.stage_layers[old][0]}", f"blocks.{layer - start}"
            assert torch.equal(composed[f"optim.{new_name}.fc.weight.exp_avg"],
                               old_states[old][f"optim.{old_name}.fc.weight.exp_avg"])
        states.append(composed)
    assert sorted(held, key=lambda part: int(part.split()[1])) == [f"layer {i}" for i in range(MODEL.num_layers)]
    inputs, _ = tokens(7)
    torch.testing.assert_close(chain_logits(new, states, inputs), chain_logits(OLD, old_states, inputs), rtol=0, atol=0)


def test_moved_layers_keep_their_optimizer_history(old_states):
    (first, _), (last, _) = compose_two_stage_layout(old_states)
    moved = [(first, "blocks.2", "blocks.0"), (last, "blocks.0", "blocks.1")]  # layers 2 and 3 of old stage 1
    for composed, new_name, old_name in moved:
        for param in ("qkv.weight", "fc_proj.bias", "ln_1.weight"):
            for entry in ("exp_avg", "exp_avg_sq", "step"):
                value = composed[f"optim.{new_name}.{param}.{entry}"]
                assert torch.equal(value, old_states[1][f"optim.{old_name}.{param}.{entry}"])
            assert torch.equal(composed[f"model.{new_name}.{param}"], old_states[1][f"model.{old_name}.{param}"])
    assert float(first["optim.blocks.2.qkv.weight.step"]) == 2.0
    assert first["optim.blocks.2.qkv.weight.exp_avg"].abs().sum() > 0
    # the composed state is fresh memory: the new optimizer's in-place updates cannot reach a piece
    assert first["optim.blocks.2.qkv.weight.exp_avg"].data_ptr() != old_states[1]["optim.blocks.0.qkv.weight.exp_avg"].data_ptr()


def test_provenance_names_the_piece_of_every_part(old_states):
    (_, first), (_, last) = compose_two_stage_layout(old_states)
    assert first == {"embedding": "own", "layer 0": "own", "layer 1": "own", "layer 2": "backup:p9"}
    assert last == {"layer 3": "backup:p9", "layer 4": "own", "layer 5": "own", "head": "own"}


def test_a_layer_no_piece_holds_keeps_the_seed_weights_and_zero_moments(old_states):
    (first, first_from), (last, last_from) = compose_two_stage_layout(old_states, with_backup=False)
    assert first_from["layer 2"] == last_from["layer 3"] == "seed"
    seeded_old_stage_1 = fresh_state(OLD, 1)  # what layers 2, 3 held before any step, under the old layout
    for composed, new_name, old_name in [(first, "blocks.2", "blocks.0"), (last, "blocks.0", "blocks.1")]:
        for param in ("qkv.weight", "proj.weight", "fc.bias", "ln_2.weight"):
            assert torch.equal(composed[f"model.{new_name}.{param}"], seeded_old_stage_1[f"model.{old_name}.{param}"])
            assert not composed[f"optim.{new_name}.{param}.exp_avg"].any()
            assert not composed[f"optim.{new_name}.{param}.exp_avg_sq"].any()
            assert float(composed[f"optim.{new_name}.{param}.step"]) == 0.0
    assert torch.equal(first["model.blocks.0.qkv.weight"], old_states[0]["model.blocks.0.qkv.weight"])
    assert not torch.equal(first["model.blocks.0.qkv.weight"], seeded_old_stage_1["model.blocks.0.qkv.weight"])
    chain_logits(NEW, [first, last], tokens(1)[0])  # loads cleanly


def test_an_earlier_piece_wins_a_conflict(old_states):
    other = {k: v + 1.0 if v.is_floating_point() else v for k, v in backup_of(old_states[1]).items()}
    own = StatePiece(OLD, 1, old_states[1], "own")
    stale = StatePiece(OLD, 1, other, "holder:p2")
    base = fresh_state(NEW, 0)
    composed, provenance = compose_stage_state(NEW, 0, [own, stale], base=base, num_steps=0)
    assert provenance["layer 2"] == "own"
    assert torch.equal(composed["model.blocks.2.fc.weight"], old_states[1]["model.blocks.0.fc.weight"])
    composed, provenance = compose_stage_state(NEW, 0, [stale, own], base=base, num_steps=0)
    assert provenance["layer 2"] == "holder:p2"
    assert torch.equal(composed["model.blocks.2.fc.weight"], other["model.blocks.0.fc.weight"])
    assert torch.equal(composed["optim.blocks.2.fc.weight.exp_avg"], other["optim.blocks.0.fc.weight.exp_avg"])
    assert provenance["embedding"] == provenance["layer 0"] == "seed"  # neither piece holds them


def test_a_layer_is_never_assembled_from_two_pieces(old_states):
    partial = backup_of(old_states[1])
    del partial["optim.blocks.0.qkv.weight.exp_avg"]
    pieces = [StatePiece(OLD, 1, partial, "backup:p4"), StatePiece(OLD, 1, old_states[1], "holder:p5")]
    with pytest.raises(BadPieceError, match="missing.*optim.blocks.2.qkv.weight.exp_avg") as error:
        compose_stage_state(NEW, 0, pieces, base=fresh_state(NEW, 0), num_steps=0)
    assert error.value.source == "backup:p4"


@pytest.mark.parametrize("damage", ["shape", "dtype", "nan", "extra", "not a tensor"])
def test_a_bad_tensor_in_a_needed_layer_is_refused(old_states, damage):
    state = backup_of(old_states[1])
    key = "model.blocks.0.fc.weight"  # global layer 2, which new stage 0 takes from this piece
    if damage == "shape":
        state[key] = torch.zeros(3, 3)
    elif damage == "dtype":
        state[key] = state[key].double()
    elif damage == "nan":
        state[key] = state[key].clone()
        state[key][0, 0] = float("nan")
    elif damage == "extra":
        state["optim.blocks.0.fc.weight.max_exp_avg_sq"] = torch.zeros_like(state[key])
    else:
        state[key] = [[0.0]]
    piece = StatePiece(OLD, 1, state, "holder:p7")
    with pytest.raises(ValueError, match="holder:p7") as error:
        compose_stage_state(NEW, 0, [piece], base=fresh_state(NEW, 0), num_steps=0)
    assert isinstance(error.value, BadPieceError)


def test_keys_of_layers_the_new_stage_does_not_hold_are_ignored(old_states):
    state = backup_of(old_states[1])
    state["model.blocks.1.fc.weight"] = torch.zeros(3, 3)  # global layer 3: not new stage 0's
    del state["optim.blocks.1.qkv.weight.exp_avg"]
    own = StatePiece(OLD, 0, old_states[0], "own")
    last = StatePiece(OLD, 2, old_states[2], "holder:p3")  # nothing of it is new stage 0's
    composed, provenance = compose_stage_state(
        NEW, 0, [own, StatePiece(OLD, 1, state, "backup:p1"), last], base=fresh_state(NEW, 0), num_steps=5,
    )
    assert provenance == {"embedding": "own", "layer 0": "own", "layer 1": "own", "layer 2": "backup:p1"}
    assert not any(key.startswith(("model.head", "model.ln_f", "model.blocks.3")) for key in composed)
    assert int(composed["counters.num_steps"]) == 5


@pytest.mark.parametrize(
    ("key", "stage"),
    [("model.blocks.2.fc.weight", 1), ("model.tok_emb.weight", 1), ("model.head.weight", 0),
     ("model.blocks.01.fc.weight", 1), ("weights.blocks.0.fc.weight", 1)],
)
def test_a_key_the_old_stage_cannot_hold_is_refused(old_states, key, stage):
    state = dict(backup_of(old_states[stage]))
    state[key] = torch.zeros(1)
    with pytest.raises(BadPieceError, match="backup:p6"):
        compose_stage_state(NEW, 0, [StatePiece(OLD, stage, state, "backup:p6")], base=fresh_state(NEW, 0), num_steps=0)


def test_a_piece_labelled_as_another_stage_is_refused(old_states):
    piece = StatePiece(OLD, 1, old_states[2], "backup:p8")  # stage 2's state passed off as stage 1's
    with pytest.raises(BadPieceError, match="not stage 1"):
        compose_stage_state(NEW, 0, [piece], base=fresh_state(NEW, 0), num_steps=0)


def test_a_base_of_another_stage_or_a_bad_step_count_is_refused(old_states):
    with pytest.raises(ValueError, match="not stage 0"):
        compose_stage_state(NEW, 0, [], base=fresh_state(NEW, 1), num_steps=0)
    with pytest.raises(ValueError, match="num_steps"):
        compose_stage_state(NEW, 0, [], base=fresh_state(NEW, 0), num_steps=-1)
    other_model = dataclasses.replace(OLD, model=dataclasses.replace(MODEL, d_model=64))
    with pytest.raises(ValueError, match="different models"):
        compose_stage_state(NEW, 0, [StatePiece(other_model, 0, {}, "own")], base=fresh_state(NEW, 0), num_steps=0)


def test_the_composed_state_round_trips_through_a_stage(old_states):
    (first, _), (last, _) = compose_two_stage_layout(old_states)
    for index, composed in enumerate([first, last]):
        with open_stages(NEW, index) as (stage,):
            stage.load_state_tensors(composed)
            assert stage.counters.num_steps == 2
            loaded = stage.state_tensors()
        assert set(loaded) == set(composed)
        for key, value in composed.items():
            assert torch.equal(loaded[key], value), key


def test_global_layer_names_are_layout_independent(old_states):
    named = global_layer_names(OLD, 1, old_states[1])
    assert "model.blocks.2.qkv.weight" in named and "optim.blocks.3.fc.bias.exp_avg_sq" in named
    assert not any(key.startswith(("stage.", "counters.")) for key in named)
    assert torch.equal(named["model.blocks.3.fc.bias"], old_states[1]["model.blocks.1.fc.bias"])
    assert set(global_layer_names(OLD, 2, old_states[2])) >= {"model.ln_f.weight", "model.head.weight"}
    assert "model.tok_emb.weight" in global_layer_names(OLD, 0, old_states[0])


@pytest.mark.parametrize(
    ("old_layers", "new_layers", "new_stage", "expected"),
    [
        (((0, 2), (2, 4), (4, 6)), ((0, 3), (3, 6)), 0, (0, 1)),
        (((0, 2), (2, 4), (4, 6)), ((0, 3), (3, 6)), 1, (1, 2)),
        (((0, 2), (2, 4), (4, 6)), ((0, 6),), 0, (0, 1, 2)),
        (((0, 2), (2, 4), (4, 6)), ((0, 2), (2, 6)), 1, (1, 2)),
        (((0, 2), (2, 4), (4, 6)), ((0, 4), (4, 6)), 1, (2,)),
        (((0, 1), (1, 2), (2, 3), (3, 6)), ((0, 1), (1, 3), (3, 6)), 1, (1, 2)),
        (((0, 1), (1, 2), (2, 3), (3, 6)), ((0, 1), (1, 3), (3, 6)), 0, (0,)),
        (((0, 5), (5, 6)), ((0, 1), (1, 6)), 1, (0, 1)),  # blocks 1-4 of old 0, block 5 and head of old 1
        (((0, 1), (1, 6)), ((0, 5), (5, 6)), 0, (0, 1)),
    ],
)
def test_needed_sources(old_layers, new_layers, new_stage, expected):
    old = dataclasses.replace(OLD, stage_layers=old_layers)
    new = dataclasses.replace(OLD, stage_layers=new_layers)
    assert needed_sources(old, new, new_stage) == expected


def test_needed_sources_refuses_a_stage_outside_the_layout():
    with pytest.raises(ValueError, match="not one of"):
        needed_sources(OLD, NEW, 2)
