"""How far apart honest replicas' spot-check fingerprints drift between averaging rounds (issue 7).

    python bench/spot_check_drift.py [--steps 60]

Two replicas of each stage of the default 2-stage model (d_model 128, 4 layers, seq 64, microbatch
16, lr 3e-3, one step per 4 microbatches) start from the seed's weights and train on different data,
with no averaging in between. After some local steps, both replicas compute the same probe batch:
stage 0 on the tokens, and stage 1 on replica A's stage-0 outputs. The script prints one JSON line
with the relative fingerprint distance (swarm/spot_check.py) per number of steps. It also prints
the distance of the gross faults a loose tolerance would be meant to catch. docs/spot-checks.md
explains why the default compares only answers computed on equal weights.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from dht.records import ModelSpec, RunSpec  # noqa: E402
from swarm.data import TokenSampler, load_corpus  # noqa: E402
from swarm.spot_check import fingerprint_distance, output_fingerprint  # noqa: E402
from swarm.stage import Stage  # noqa: E402

SPEC = RunSpec(run_id="drift", model=ModelSpec(d_model=128, num_layers=4, num_heads=4, seq_len=64),
               stage_layers=((0, 2), (2, 4)), microbatch_size=16, target_batch_size=64, lr=3e-3)
REPORT_AT = (1, 2, 5, 10, 20, 40, 60, 100)


async def train_step(first: Stage, last: Stage, sampler: TokenSampler, tag: str) -> None:
    """One optimizer step of both stages: target_batch_size samples of microbatches."""
    for n in range(SPEC.target_batch_size // SPEC.microbatch_size):
        inputs, targets = sampler.sample(SPEC.microbatch_size)
        hidden = await first.forward(f"{tag}{n}", inputs)
        loss, grad = await last.forward_loss_backward(hidden, targets)
        last.record_microbatch(SPEC.microbatch_size, loss)
        await first.backward(f"{tag}{n}", grad)
        first.record_microbatch(SPEC.microbatch_size)
    await first.wait_step_done()
    await last.wait_step_done()


async def measure(num_steps: int) -> dict:
    corpus = load_corpus(SPEC.dataset).text()
    cpu = torch.device("cpu")
    replicas = [(Stage(SPEC, 0, device=cpu), Stage(SPEC, 1, device=cpu)) for _ in range(2)]
    samplers = [TokenSampler(corpus, seq_len=SPEC.model.seq_len, seed=seed) for seed in (1, 2)]
    probe, _ = TokenSampler(corpus, seq_len=SPEC.model.seq_len, seed=99).sample(SPEC.microbatch_size)
    drift = []
    for step in range(1, num_steps + 1):
        for index, (first, last) in enumerate(replicas):
            await train_step(first, last, samplers[index], f"r{index}s{step}m")
        if step in REPORT_AT:
            (a0, _), (b0, _) = [await first.check_forward(probe) for first, _ in replicas]
            hidden = await replicas[0][0].forward("probe", probe)
            await replicas[0][0].drop("probe")
            (a1, _), (b1, _) = [await last.check_forward(hidden) for _, last in replicas]
            drift.append({"steps": step, "stage0": fingerprint_distance(a0, b0), "stage1": fingerprint_distance(a1, b1)})
    reference = output_fingerprint(hidden)
    faults = {"negated": fingerprint_distance(reference, output_fingerprint(-hidden)),
              "zeroed": fingerprint_distance(reference, output_fingerprint(torch.zeros_like(hidden))),
              "random": fingerprint_distance(reference, output_fingerprint(torch.randn_like(hidden) * hidden.std())),
              "scaled_1.5": fingerprint_distance(reference, output_fingerprint(hidden * 1.5))}
    for first, last in replicas:
        first.shutdown()
        last.shutdown()
    return {"bench": "spot_check_drift", "drift": drift, "faults": faults}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(asyncio.run(measure(args.steps))))


if __name__ == "__main__":
    main()
