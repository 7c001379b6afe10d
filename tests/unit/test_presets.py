"""Model presets (swarm.presets) and the bootstrap's choice of stage count for a memory target."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dht.layouts import even_stage_layers
from dht.records import RunSpec
from peer.bootstrap import build_run_spec, stages_to_fit
from peer.config import BootstrapConfig
from peer.profiler import stage_memory_bytes
from swarm.model import StageModel, layer_num_params, new_block
from swarm.presets import PRESETS, preset


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_is_a_llama_model_whose_block_has_the_counted_parameters(name):
    model = PRESETS[name]
    assert model.family == "llama" and model.kv_heads < model.num_heads  # grouped-query attention
    with torch.device("meta"):  # nothing allocated, even for the billion-parameter one
        block = new_block(model)
    spec = RunSpec(run_id="p", model=model, stage_layers=((0, model.num_layers),))
    middle = layer_num_params(spec)[1]  # a block with neither the embedding nor the head
    assert sum(p.numel() for p in block.parameters()) == middle


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_one_stage_at_a_time_with_the_same_weights_whatever_the_partition(name):
    """The first and last layers, the embedding and the head, built in stages of one layer and in
    stages of two under another cut: the same tensors (each layer is seeded by its index alone)."""
    model, layers = PRESETS[name], PRESETS[name].num_layers
    other = ((0, 2), (2, layers - 2), (layers - 2, layers)) if layers > 4 else ((0, 2), (2, layers))
    cuts = [RunSpec(run_id="p", model=model, stage_layers=((0, 1), (1, layers - 1), (layers - 1, layers))),
            RunSpec(run_id="p", model=model, stage_layers=other)]
    with torch.no_grad():
        firsts = [StageModel(cut, 0) for cut in cuts]
        assert torch.equal(firsts[0].tok_emb.weight, firsts[1].tok_emb.weight)
        assert all(torch.equal(a, b) for a, b in zip(firsts[0].blocks[0].state_dict().values(),
                                                      firsts[1].blocks[0].state_dict().values()))
        del firsts
        lasts = [StageModel(cut, cut.num_stages - 1) for cut in cuts]
        assert torch.equal(lasts[0].head.weight, lasts[1].head.weight)
        assert all(torch.equal(a, b) for a, b in zip(lasts[0].blocks[0].state_dict().values(),
                                                      lasts[1].blocks[-1].state_dict().values()))
        assert not torch.equal(lasts[1].blocks[0].mlp.up_proj.weight, lasts[1].blocks[-1].mlp.up_proj.weight)


def test_the_presets_span_the_demo_scale_to_about_a_billion_parameters():
    total = {name: sum(layer_num_params(RunSpec(run_id="p", model=m, stage_layers=((0, m.num_layers),))))
             for name, m in PRESETS.items()}
    assert total["tiny"] < 1e6 and 0.8e9 < total["large"] < 1.2e9
    assert list(total.values()) == sorted(total.values())


def test_a_preset_replaces_the_model_flags_and_refuses_them_beside_it():
    spec = build_run_spec(BootstrapConfig(preset="tiny"))
    assert spec.model == preset("tiny") and spec.num_stages == 2
    with pytest.raises(ValueError, match="either --preset or the model flags"):
        BootstrapConfig(preset="tiny", d_model=64)
    with pytest.raises(ValueError, match="--preset must be one of tiny, small, medium, large"):
        build_run_spec(BootstrapConfig(preset="huge"))


def test_num_stages_0_takes_the_fewest_even_stages_that_fit_the_memory_target():
    base = RunSpec(run_id="p", model=preset("medium"), stage_layers=((0, 16),))
    target = 8 * 2**30
    num_stages, need = stages_to_fit(base, target)
    assert need <= target

    def largest(n: int) -> int:
        cut = dataclasses.replace(base, stage_layers=even_stage_layers(16, n))
        return max(stage_memory_bytes(cut, k, max_in_flight=4) for k in range(n))

    assert largest(num_stages) == need and largest(num_stages - 1) > target  # one fewer would not fit
    spec = build_run_spec(BootstrapConfig(preset="medium", num_stages=0, stage_memory_gb=8.0))
    assert spec.num_stages == num_stages
    with pytest.raises(ValueError, match="even one layer per stage needs .* more than --stage-memory-gb"):
        build_run_spec(BootstrapConfig(preset="large", num_stages=0, stage_memory_gb=1.0))
