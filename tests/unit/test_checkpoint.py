"""Stage checkpoints: round trip through a real stage, refusals, and atomic replacement."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dht.records import RunSpec
from peer.checkpoint import CheckpointError, WriteProgress, checkpoint_path, load_checkpoint, save_checkpoint
from swarm.stage import Stage

SPEC = RunSpec(run_id="ckpt")


def trained_stage(index: int) -> Stage:
    stage = Stage(SPEC, index, device=torch.device("cpu"))
    with torch.no_grad():
        for param in stage.model.parameters():
            param.add_(0.25)  # not the seed's init
    stage.counters.num_steps = 17
    return stage


def test_a_stage_round_trips_bit_identical(tmp_path):
    stage = trained_stage(1)
    path = checkpoint_path(tmp_path, SPEC.run_id, 1)
    progress = WriteProgress()
    save_checkpoint(path, stage.state_tensors(), spec=SPEC, stage=1, version=stage.version, progress=progress)
    assert progress.finished and progress.done_bytes == progress.total_bytes == path.stat().st_size
    version, state = load_checkpoint(path, spec=SPEC, stage=1)  # read back by the safetensors library
    assert version == 17
    fresh = Stage(SPEC, 1, device=torch.device("cpu"))
    fresh.load_state_tensors(state)
    assert fresh.version == 17
    for (name, a), (_, b) in zip(stage.model.state_dict().items(), fresh.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert not list(tmp_path.glob(".*tmp"))  # no temporary file left behind
    stage.shutdown()
    fresh.shutdown()


@pytest.mark.parametrize("what", ["run", "stage", "model"])
def test_a_checkpoint_of_something_else_is_refused_with_what_to_do(tmp_path, what):
    stage = trained_stage(0)
    path = checkpoint_path(tmp_path, SPEC.run_id, 0)
    save_checkpoint(path, stage.state_tensors(), spec=SPEC, stage=0, version=3)
    other = {"run": dataclasses.replace(SPEC, run_id="other"), "stage": SPEC,
             "model": dataclasses.replace(SPEC, stage_layers=((0, 1), (1, 4)))}[what]
    with pytest.raises(CheckpointError, match="--checkpoint-dir"):
        load_checkpoint(path, spec=other, stage=1 if what == "stage" else 0)
    stage.shutdown()


@pytest.mark.parametrize("what, reason", [
    ("wrong shape", "'model.blocks.0.fc.weight' is float32[513, 128] in it, float32[512, 128]"),
    ("wrong dtype", "'optim.blocks.0.fc.weight.step' is float64[] in it, float32[]"),
    ("extra tensor", "it has tensor 'model.extra'"),
    ("missing tensor", "it lacks tensor 'counters.num_steps'"),
])
def test_a_checkpoint_whose_tensors_are_not_the_spec_layout_is_refused_before_they_are_read(
        tmp_path, monkeypatch, what, reason):
    stage = trained_stage(0)
    state = stage.state_tensors()
    stage.shutdown()
    if what == "wrong shape":
        state["model.blocks.0.fc.weight"] = torch.zeros(513, 128)
    elif what == "wrong dtype":
        state["optim.blocks.0.fc.weight.step"] = torch.tensor(1.0, dtype=torch.float64)
    elif what == "extra tensor":
        state["model.extra"] = torch.zeros(1 << 20)
    else:
        del state["counters.num_steps"]
    path = checkpoint_path(tmp_path, SPEC.run_id, 0)
    save_checkpoint(path, state, spec=SPEC, stage=0, version=3)  # its header names this run, stage and model
    read: list[Path] = []
    monkeypatch.setattr("peer.checkpoint.load_file", lambda p: read.append(p) or {})
    with pytest.raises(CheckpointError, match="not the state the run spec implies for stage 0") as refused:
        load_checkpoint(path, spec=SPEC, stage=0)
    assert reason in str(refused.value) and "--checkpoint-dir" in str(refused.value)
    assert read == [], "the tensors were read before the table was checked"


def test_the_learning_rate_may_change_between_stop_and_resume(tmp_path):
    stage = trained_stage(0)
    path = checkpoint_path(tmp_path, SPEC.run_id, 0)
    save_checkpoint(path, stage.state_tensors(), spec=SPEC, stage=0, version=3)
    assert load_checkpoint(path, spec=dataclasses.replace(SPEC, lr=SPEC.lr / 10), stage=0)[0] == 3
    stage.shutdown()


def test_garbage_is_refused_and_a_missing_file_is_not_an_error(tmp_path):
    path = checkpoint_path(tmp_path, SPEC.run_id, 0)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(path, spec=SPEC, stage=0)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(CheckpointError):
        load_checkpoint(path, spec=SPEC, stage=0)
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a safetensors"):
        load_checkpoint(path, spec=SPEC, stage=0)


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path):
    stage = trained_stage(0)
    path = checkpoint_path(tmp_path, SPEC.run_id, 0)
    save_checkpoint(path, stage.state_tensors(), spec=SPEC, stage=0, version=5)
    before = path.read_bytes()
    with pytest.raises(TypeError):
        save_checkpoint(path, {"bad": "not a tensor"}, spec=SPEC, stage=0, version=6)  # type: ignore[dict-item]
    assert path.read_bytes() == before
    assert load_checkpoint(path, spec=SPEC, stage=0)[0] == 5
    assert not list(tmp_path.glob(".*tmp"))
    stage.shutdown()


def test_what_we_write_is_what_the_safetensors_library_writes(tmp_path):
    from safetensors.torch import load_file, save_file

    state = {"b": torch.arange(5, dtype=torch.int64), "a": torch.randn(3, 4), "c": torch.tensor(True),
             "d": torch.randn(7, dtype=torch.float64).to(torch.bfloat16)}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    save_checkpoint(ours, state, spec=SPEC, stage=0, version=1)
    save_file(state, theirs)
    for loaded in (load_file(ours), load_file(theirs)):
        assert sorted(loaded) == sorted(state)
        assert all(torch.equal(loaded[name], state[name]) for name in state)


def test_a_swarm_restarting_after_a_replan_resumes_under_the_newest_layout_it_checkpointed(tmp_path):
    from peer.checkpoint import newest_checkpoint_layout

    base = RunSpec(run_id="ckpt", stage_layers=((0, 1), (1, 3), (3, 4)))
    assert newest_checkpoint_layout(tmp_path, base) == base, "an empty folder: the published layout"
    for version, layers in ((1, ((0, 3), (3, 4))), (2, ((0, 4),))):
        spec = base.with_layout(version, layers)
        stage = Stage(spec, 0, device=torch.device("cpu"))
        save_checkpoint(checkpoint_path(tmp_path, spec.namespace, 0), stage.state_tensors(), spec=spec, stage=0, version=3)
        stage.shutdown()
    (tmp_path / "ckpt@L9-stage0.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    other = RunSpec(run_id="other", stage_layers=base.stage_layers)
    assert newest_checkpoint_layout(tmp_path, other) == other, "another run's files do not count"
    newest = newest_checkpoint_layout(tmp_path, base)
    assert (newest.layout_version, newest.stage_layers) == (2, ((0, 4),)), "the newest readable one"
    version, state = load_checkpoint(checkpoint_path(tmp_path, newest.namespace, 0), spec=newest, stage=0)
    assert version == 3 and "model.blocks.3.fc.weight" in state
