"""The stage memory estimate (peer/memory_model.py) against measured training steps, and activation
checkpointing (swarm/model.py).

The measured peak of one training step of one stage (bench/stage_memory.py: one batch through a real
:class:`swarm.stage.Stage` in a fresh process, VmHWM above the resident size before the stage was
built) must be within 15 % of the estimate for two presets: ``tiny`` at the peer's defaults
(microbatches of 16, four in flight) and ``small`` at microbatches of 2 (a step of a few seconds on
two cores); stage 0 and the last stage of a 2-stage split, with and without checkpointing, in float32
(the default), and both of tiny's stages in bf16 (small in bf16 took 76 s of the fixture's 155 s on an
AMD host without AVX-512, where bf16 matmuls are emulated). The ten measurements run two at a time in
one fixture: about 40 s on two idle cores.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from bench.stage_memory import measure_step_peak
from dht.layouts import even_stage_layers
from dht.records import ModelSpec, RunSpec
from peer.memory_model import (FIXED_OVERHEAD_BYTES, memory_table, stage_bound_bytes, stage_memory,
                               stage_memory_bytes)
from swarm.presets import PRESETS, preset
from swarm.stage import Stage

# one worker runs the module, so its module-scoped measurement runs once (split over two workers, it
# ran on both: 83 s each in a CI rehearsal)
pytestmark = pytest.mark.xdist_group("memory_estimate")
# the two tests of the measured peaks are a measurement (the fixture alone is 40-300 s): the scenario tier
MEASUREMENT = pytest.mark.scenario
TOLERANCE = 0.15
MEASURED = [(name, microbatch_size, stage, checkpointing, "fp32") for name, microbatch_size in (("tiny", 16), ("small", 2))
            for stage in (0, 1) for checkpointing in (False, True)] + [("tiny", 16, 0, True, "bf16"), ("tiny", 16, 1, False, "bf16")]


def two_stage_spec(model: ModelSpec, *, microbatch_size: int, max_in_flight: int = 4, **fields) -> RunSpec:
    return RunSpec(run_id="mem", model=model, stage_layers=even_stage_layers(model.num_layers, 2),
                   microbatch_size=microbatch_size, target_batch_size=microbatch_size * max_in_flight, **fields)


@pytest.fixture(scope="module")
def measured_peaks() -> dict[tuple, int]:
    def measure(case: tuple) -> int:
        name, microbatch_size, stage, checkpointing, precision = case
        spec = two_stage_spec(preset(name), microbatch_size=microbatch_size, precision=precision)
        return measure_step_peak(spec.to_wire(), stage, max_in_flight=4, checkpoint_activations=checkpointing,
                                 timeout=120)["peak_bytes"]

    with ThreadPoolExecutor(2) as pool:  # each worker is one process on one thread: two cores, two at a time
        return dict(zip(MEASURED, pool.map(measure, MEASURED), strict=True))


# the first test also measures (the module's fixture): 77 s in a CI rehearsal, over 300 s beside the
# Byzantine test's two swarms at once (ten CPU-bound processes on two cores, 2026-11-28); each of the
# ten measurements is bounded at 120 s, two at a time
@MEASUREMENT
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", MEASURED, ids=lambda c: f"{c[0]}-mb{c[1]}-stage{c[2]}{'-checkpointed' * c[3]}-{c[4]}")
def test_the_estimate_is_within_15_percent_of_a_measured_step(measured_peaks, case):
    name, microbatch_size, stage, checkpointing, precision = case
    spec = two_stage_spec(preset(name), microbatch_size=microbatch_size, precision=precision)
    estimate = stage_memory_bytes(spec, stage, max_in_flight=4, checkpoint_activations=checkpointing)
    estimate -= FIXED_OVERHEAD_BYTES  # the process the step ran in held that before the stage was built
    measured = measured_peaks[case]
    assert abs(estimate - measured) <= TOLERANCE * measured, f"estimated {estimate / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB"


@MEASUREMENT
def test_checkpointing_is_what_cuts_the_memory_of_held_microbatches(measured_peaks):
    for name, microbatch_size in (("tiny", 16), ("small", 2)):
        plain, checkpointed = (measured_peaks[(name, microbatch_size, 0, c, "fp32")] for c in (False, True))
        assert checkpointed < 0.7 * plain


def run_both(spec: RunSpec, stage_index: int, inputs: list[torch.Tensor], extra: list[torch.Tensor]) -> list[dict]:
    """Per checkpointing off/on: the input gradients, losses, accumulated gradients and weights after a
    step, for one batch of ``inputs`` through ``stage_index`` (``extra``: output gradients or targets)."""
    async def one(checkpointing: bool) -> dict:
        stage = Stage(spec, stage_index, device=torch.device("cpu"), checkpoint_activations=checkpointing)
        try:
            results = {}
            if stage.is_last:
                for k, (x, y) in enumerate(zip(inputs, extra, strict=True)):
                    results[f"loss{k}"], results[f"grad{k}"] = await stage.forward_loss_backward(x, y)
            else:
                for k, x in enumerate(inputs):
                    results[f"out{k}"] = await stage.forward(f"mb{k}", x)
                for k, grad in enumerate(extra):
                    results[f"grad{k}"] = await stage.backward(f"mb{k}", grad)
            results.update(stage.accumulated_gradients())
            for _ in inputs:
                stage.record_microbatch(spec.microbatch_size)
            await stage.wait_step_done()
            return results | {f"stepped.{n}": p.detach().clone() for n, p in stage.model.named_parameters()}
        finally:
            stage.shutdown()

    return [asyncio.run(one(False)), asyncio.run(one(True))]


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_checkpointed_training_gives_the_same_gradients(family):
    model = ModelSpec(family=family, d_model=64, num_layers=4, num_heads=4, num_kv_heads=2 if family == "llama" else 0,
                      seq_len=32)
    spec = two_stage_spec(model, microbatch_size=2, max_in_flight=2)
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 256, (2, 32), generator=gen) for _ in range(2)]
    hidden = [torch.randn(2, 32, 64, generator=gen) for _ in range(2)]
    grads = [torch.randn(2, 32, 64, generator=gen) * 1e-2 for _ in range(2)]
    for stage, inputs, extra in ((0, tokens, grads), (1, hidden, tokens)):
        plain, checkpointed = run_both(spec, stage, inputs, extra)
        assert plain.keys() == checkpointed.keys() and len(plain) > 8
        for key, value in plain.items():
            if value is None:  # stage 0's input gradient (token ids)
                assert checkpointed[key] is None
                continue
            torch.testing.assert_close(checkpointed[key], value, rtol=0, atol=1e-6, msg=f"{key} differs")


def test_checkpointing_saves_memory_where_graphs_are_held_and_the_replanner_bound_holds():
    for name, model in PRESETS.items():
        for num_stages in (1, 2, 4):
            for schedule, sync, precision in (("flush", "gradients", "fp32"), ("delayed", "periodic", "bf16")):
                spec = dataclasses.replace(two_stage_spec(model, microbatch_size=4), pipeline_schedule=schedule,
                                           replica_sync=sync, precision=precision,
                                           stage_layers=even_stage_layers(model.num_layers, num_stages))
                for stage in range(num_stages):
                    plain, light = (stage_memory_bytes(spec, stage, max_in_flight=4, checkpoint_activations=c)
                                    for c in (False, True))
                    if stage < num_stages - 1:  # it holds several graphs: checkpointing shrinks each
                        assert light < plain, (name, num_stages, stage)
                    else:  # one graph at a time: the recompute can cost about what it saves
                        assert light < 1.1 * plain, (name, num_stages, stage)
                    for checkpointing in (False, True):
                        flags = {"max_in_flight": 4, "checkpoint_activations": checkpointing}
                        assert stage_memory_bytes(spec, stage, **flags) <= stage_bound_bytes(spec, stage, **flags)


def test_the_parts_of_a_stage_and_the_preset_table():
    spec = two_stage_spec(preset("small"), microbatch_size=16)
    first, last = stage_memory(spec, 0, max_in_flight=4), stage_memory(spec, 1, max_in_flight=4)
    assert (first.num_held, last.num_held) == (4, 1), "the last stage runs one microbatch's graph at a time"
    assert first.static_bytes == 4 * first.gradient_bytes and first.recompute_bytes == 0
    checkpointed = stage_memory(spec, 0, max_in_flight=4, checkpoint_activations=True)
    assert checkpointed.recompute_bytes > 0 and checkpointed.held_bytes < first.held_bytes / 10
    row = memory_table(preset("medium"), num_stages=2, microbatch_size=16, max_in_flight=4)
    assert 170e6 < row["params"] < 190e6
    assert row["split_bytes_checkpointed"] < row["one_stage_bytes_checkpointed"] < row["one_stage_bytes"]
    # stage 0 of a pipeline holds four microbatches' graphs, one process trains one microbatch at a time
    assert row["split_bytes_checkpointed"] < row["one_stage_bytes"] < row["split_bytes"]
