"""A run's precision: fp32 (the default, and the first round's wire form) or bf16 autocast with fp32
masters; the stage forward rounds what it sends to bf16 and keeps the logits in fp32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dht.records import RunSpec
from peer.bootstrap import build_run_spec
from peer.config import BootstrapConfig
from swarm.model import StageModel, activation_dtype, next_token_loss, stage_forward
from swarm.presets import preset


def test_precision_is_a_run_property_left_off_the_wire_at_fp32():
    spec = RunSpec(run_id="p")
    assert spec.precision == "fp32" and "precision" not in spec.to_wire()
    bf16 = dataclasses.replace(spec, precision="bf16")
    assert bf16.to_wire()["precision"] == "bf16" and RunSpec.from_wire(bf16.to_wire()) == bf16
    assert ", bf16, seed 0" in bf16.describe()
    assert activation_dtype(bf16) == torch.bfloat16 and activation_dtype(spec) == torch.float32
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16"):
        RunSpec(run_id="p", precision="fp16")
    assert build_run_spec(BootstrapConfig(precision="bf16")).precision == "bf16"


def test_bf16_forward_rounds_activations_keeps_fp32_logits_and_fp32_master_gradients():
    spec = RunSpec(run_id="p", model=preset("tiny"), stage_layers=((0, 2), (2, 4)), precision="bf16")
    stages = [StageModel(spec, 0), StageModel(spec, 1)]
    inputs = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    hidden = stage_forward(stages[0], dict(stages[0].named_parameters()), inputs, precision="bf16")
    logits = stage_forward(stages[1], dict(stages[1].named_parameters()), hidden, precision="bf16")
    assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32
    loss = next_token_loss(logits, inputs)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for m in stages for p in m.parameters())
    with torch.no_grad():
        fp32 = next_token_loss(stages[1](stages[0](inputs)), inputs)
    assert float(loss) == pytest.approx(float(fp32), rel=2e-2)  # bf16 rounding, not another model
    assert not torch.equal(hidden.float(), stages[0](inputs).detach())  # it did round
