"""Build a stage's state for a new layer layout from pieces of the old layout's stages.

Layer-wise re-planning (seed 001 §3.4): when a stage loses every holder, the surviving stages take
over its layers and the stage boundaries move. Each surviving peer then needs the state of its *new*
stage, which straddles *old* stages: its own old state, states of other old stages pulled from their
holders, and backups of the vanished stage. This module is the pure tensor bookkeeping of that step;
who is asked for which piece is the caller's business (:func:`needed_sources` says which old stages
matter).

A stage's state (:meth:`swarm.stage.Stage.state_tensors`) names blocks by their index *inside* the
stage, so the same layer has different keys under different layouts. :func:`global_layer_names`
translates keys to layout-independent ones (``model.blocks.<global layer>.…``);
:func:`compose_stage_state` picks every *part* of the new stage (each block, the embedding, the
head) whole from the first piece that holds it and renames the keys to the new stage's local
indices. A part no piece holds keeps the run seed's initialisation with zero optimizer moments
(:mod:`swarm.model` seeds every layer by its global index, so that is exactly what a fresh run's
stage would hold).

A part is never assembled from two pieces: a layer's weights and its AdamW moments must come from
the same training history. Pieces come from the network, so every tensor taken is checked against
the fresh stage's (names, shapes, dtypes, finiteness) and a bad piece raises
:class:`BadPieceError`, which names the piece so the caller can drop it and compose again.

Cost: one pass over the taken tensors to check them and one copy of the new stage's state (the
result never aliases a piece: the new optimizer updates its moments in place, and a piece may be a
backup that this peer goes on serving).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dht.records import RunSpec

EMBEDDING_PART = "embedding"
HEAD_PART = "head"
SEED_SOURCE = "seed"
EMBEDDING_MODULES = ("tok_emb", "pos_emb")
HEAD_MODULES = ("ln_f", "head")
LOCAL_KEYS = ("stage.layers", "counters.num_steps")  # a stage's own bookkeeping, not layer state
_BLOCK_KEY = re.compile(r"(model|optim)\.blocks\.(0|[1-9][0-9]*)\.(.+)")


class BadPieceError(ValueError):
    """A piece does not fit the new stage (wrong keys, shapes, dtypes, non-finite values)."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"state piece from {source}: {reason}")
        self.source = source


# eq=False: the generated __eq__ would compare dicts of tensors, whose truth value is an error.
@dataclass(frozen=True, eq=False)
class StatePiece:
    """The state (or a backup of it) of one stage of the *old* layout.

    Attributes:
        spec: the old layout's run spec.
        stage: the old stage index the state belongs to.
        state: :meth:`Stage.state_tensors` of that stage, ``counters.num_steps`` optional.
        source: where it came from, for provenance and errors: ``"own"``, ``"holder:<peer>"``,
            ``"backup:<peer>"``.
    """

    spec: RunSpec
    stage: int
    state: Mapping[str, Tensor]
    source: str

    def __post_init__(self) -> None:
        _stage_range(self.spec, self.stage)


def global_layer_names(spec: RunSpec, stage: int, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` of ``stage`` under ``spec`` with layout-independent keys.

    ``model.blocks.<i>.x`` becomes ``model.blocks.<start + i>.x`` (likewise ``optim.``), embedding and
    head keys keep their names, ``stage.layers`` and ``counters.num_steps`` are dropped.

    Raises:
        ValueError: a key the stage cannot hold (a block outside its range, an embedding off stage 0,
            a head off the last stage, anything that is not a model or optimizer entry), or a
            ``stage.layers`` that is not this stage's.
    """
    start, end = _stage_range(spec, stage)
    identity = state.get("stage.layers")
    if identity is not None and not _is_identity(identity, stage, start, end):
        raise ValueError(f"the state says it is not stage {stage} (layers [{start}, {end}))")
    renamed: dict[str, Tensor] = {}
    for key, value in state.items():
        if key not in LOCAL_KEYS:
            renamed[_global_key(key, spec, stage)] = value
    return renamed


def needed_sources(old_spec: RunSpec, new_spec: RunSpec, new_stage: int) -> tuple[int, ...]:
    """The old stages whose parts ``new_stage`` of ``new_spec`` holds, sorted: those whose blocks
    overlap its range, old stage 0 for the embedding, the old last stage for the head."""
    _check_same_model(old_spec, new_spec)
    start, end = _stage_range(new_spec, new_stage)
    needed = {old for old, (a, b) in enumerate(old_spec.stage_layers) if a < end and start < b}
    if new_stage == 0:
        needed.add(0)
    if new_stage == new_spec.num_stages - 1:
        needed.add(old_spec.num_stages - 1)
    return tuple(sorted(needed))


def compose_stage_state(
    new_spec: RunSpec,
    new_stage: int,
    pieces: Sequence[StatePiece],
    *,
    base: Mapping[str, Tensor],
    num_steps: int,
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The state of ``new_stage`` of ``new_spec``, each part taken whole from the first piece that holds it.

    Args:
        new_spec: the new layout's run spec.
        new_stage: the stage of the new layout to build.
        pieces: states of old stages, in order of preference (the caller's own first).
        base: :meth:`Stage.state_tensors` of a fresh ``Stage(new_spec, new_stage)``: the seed's
            weights and zero moments, used for parts no piece holds and as the reference of names,
            shapes and dtypes.
        num_steps: the composed state's ``counters.num_steps``.

    Returns:
        The state, ready for :meth:`Stage.load_state_tensors` of the new stage (fresh tensors), and
        the provenance of each part (``"embedding"``, ``"layer <g>"`` by global layer, ``"head"``):
        the ``source`` of the piece it came from, or ``"seed"``.

    Raises:
        BadPieceError: a piece chosen for a part lacks some of its tensors, has extra ones, or has
            one of the wrong shape, dtype or with non-finite values; or a piece's keys do not fit
            its own old stage. Keys of parts the new stage does not hold are ignored.
        ValueError: ``base`` is not the new stage's, a piece is of another model, or ``num_steps``
            is not a non-negative integer.
    """
    start, end = _stage_range(new_spec, new_stage)
    if "stage.layers" not in base:
        raise ValueError("base has no stage.layers: pass state_tensors() of a fresh stage of the new layout")
    if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 0:
        raise ValueError(f"num_steps must be a non-negative integer, got {num_steps!r}")
    wanted = _by_part(global_layer_names(new_spec, new_stage, base))
    offered = [(piece, _piece_parts(piece, new_spec)) for piece in pieces]
    composed: dict[str, Tensor] = {}
    provenance: dict[str, str] = {}
    for part, expected in wanted.items():
        tensors, provenance[part] = _take_part(part, expected, offered)
        composed.update((_local_key(key, start), value.detach().clone()) for key, value in tensors.items())
    composed["counters.num_steps"] = torch.tensor(num_steps, dtype=torch.int64)
    composed["stage.layers"] = torch.tensor([new_stage, start, end], dtype=torch.int64)
    return composed, provenance


def part_of(global_key: str) -> str:
    """The part a layout-independent key belongs to: ``"layer <g>"``, ``"embedding"`` or ``"head"``."""
    match = _BLOCK_KEY.fullmatch(global_key)
    if match:
        return f"layer {match.group(2)}"
    kind, _, name = global_key.partition(".")
    module, dot, _ = name.partition(".")
    if kind in ("model", "optim") and dot:
        if module in EMBEDDING_MODULES:
            return EMBEDDING_PART
        if module in HEAD_MODULES:
            return HEAD_PART
    raise ValueError(f"{global_key!r} is not a model or optimizer entry of any layer")


def _global_key(key: str, spec: RunSpec, stage: int) -> str:
    if not isinstance(key, str):
        raise ValueError(f"state key {key!r} is not a string")
    start, end = spec.stage_layers[stage]
    match = _BLOCK_KEY.fullmatch(key)
    if match:
        kind, local, tail = match.group(1), int(match.group(2)), match.group(3)
        if local >= end - start:
            raise ValueError(f"{key!r} names block {local}, but stage {stage} holds {end - start} blocks")
        return f"{kind}.blocks.{start + local}.{tail}"
    part = part_of(key)
    if part == EMBEDDING_PART and stage != 0 or part == HEAD_PART and stage != spec.num_stages - 1:
        raise ValueError(f"{key!r} is not held by stage {stage} of {spec.num_stages}")
    return key


def _local_key(global_key: str, start: int) -> str:
    match = _BLOCK_KEY.fullmatch(global_key)
    if not match:
        return global_key
    return f"{match.group(1)}.blocks.{int(match.group(2)) - start}.{match.group(3)}"


def _piece_parts(piece: StatePiece, new_spec: RunSpec) -> dict[str, dict[str, Tensor]]:
    _check_same_model(piece.spec, new_spec)
    try:
        return _by_part(global_layer_names(piece.spec, piece.stage, piece.state))
    except ValueError as error:
        raise BadPieceError(piece.source, str(error)) from error


def _by_part(state: Mapping[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    parts: dict[str, dict[str, Tensor]] = {}
    for key, value in state.items():
        parts.setdefault(part_of(key), {})[key] = value
    return parts


def _take_part(
    part: str, expected: Mapping[str, Tensor], offered: Sequence[tuple[StatePiece, dict[str, dict[str, Tensor]]]]
) -> tuple[Mapping[str, Tensor], str]:
    """The tensors of ``part`` from the first piece whose old stage holds it, and that piece's source;
    the seed's (``expected``) when none does."""
    for piece, parts in offered:
        if _holds(piece, part):
            return _checked_part(piece.source, part, parts.get(part, {}), expected), piece.source
    return expected, SEED_SOURCE


def _holds(piece: StatePiece, part: str) -> bool:
    """Whether the piece's old stage holds ``part`` by its layout (then it must supply all of it)."""
    if part == EMBEDDING_PART:
        return piece.stage == 0
    if part == HEAD_PART:
        return piece.stage == piece.spec.num_stages - 1
    start, end = piece.spec.stage_layers[piece.stage]
    return start <= int(part.removeprefix("layer ")) < end


def _checked_part(source: str, part: str, tensors: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise BadPieceError(source, f"{part}: missing {missing[:3]}, unexpected {extra[:3]}")
    for key, value in tensors.items():
        reference = expected[key]
        if not isinstance(value, Tensor):
            raise BadPieceError(source, f"{key} is a {type(value).__name__}, not a tensor")
        if value.shape != reference.shape or value.dtype != reference.dtype:
            raise BadPieceError(
                source, f"{key} is {value.dtype}{list(value.shape)}, expected {reference.dtype}{list(reference.shape)}"
            )
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise BadPieceError(source, f"{key} has non-finite values")
    return tensors


def _stage_range(spec: RunSpec, stage: int) -> tuple[int, int]:
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < spec.num_stages:
        raise ValueError(f"stage {stage!r} is not one of the layout's {spec.num_stages} stages")
    return spec.stage_layers[stage]


def _is_identity(value: Tensor, stage: int, start: int, end: int) -> bool:
    expected = torch.tensor([stage, start, end], dtype=torch.int64)
    return isinstance(value, Tensor) and value.dtype == torch.int64 and torch.equal(value.cpu(), expected)


def _check_same_model(spec: RunSpec, new_spec: RunSpec) -> None:
    if spec.model != new_spec.model:
        raise ValueError(f"layouts of different models: {spec.model} and {new_spec.model}")
