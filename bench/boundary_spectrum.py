"""How low-rank is what crosses a stage boundary? The case for (or against) a low-rank boundary codec.

    python bench/boundary_spectrum.py [--steps 600] [--report 1,200,600] [--ranks 8,16,32]

Trains the default run spec's model (2 stages of 2 blocks, microbatch 16 × 64 tokens, d_model 128,
AdamW lr 3e-3, one microbatch a step) in this process on the built-in corpus, and at the reported
steps takes the boundary's activations (stage 0's outputs) and their gradient (what stage 1 sends
back), each as a 1024 × 128 matrix with its column mean removed (a codec can send the mean at d
numbers' cost), and prints one JSON line per step: for every rank r, the relative L2 error of the
best rank-r approximation, sqrt(sum of the squared singular values beyond r / all of them)
(Eckart–Young: no rank-r codec of that matrix does better). A per-microbatch rank-r codec sends
r × (1024 + 128) numbers instead of 1024 × 128 (7.1× fewer at r = 16, before quantizing the factors).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def tail_errors(matrix, ranks: Sequence[int]) -> dict[int, float]:
    """Per rank r, the relative L2 error of the best rank-r approximation of ``matrix`` (column means removed)."""
    import torch

    centered = matrix - matrix.mean(dim=0)
    squares = torch.linalg.svdvals(centered.double()) ** 2
    kept = squares.cumsum(0) / squares.sum()
    return {r: round(float((1 - kept[r - 1]).clamp(min=0).sqrt()), 4) for r in ranks}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--report", default="1,200,600", help="steps to report at")
    parser.add_argument("--ranks", default="8,16,32")
    args = parser.parse_args(argv)
    report, ranks = {int(s) for s in args.report.split(",")}, [int(r) for r in args.ranks.split(",")]

    import torch

    from dht.records import RunSpec
    from swarm.data import TokenSampler, load_corpus
    from swarm.model import StageModel, next_token_loss

    torch.manual_seed(0)
    torch.set_num_threads(1)
    spec = RunSpec(run_id="spectrum")
    first, last = StageModel(spec, 0), StageModel(spec, 1)
    optimizer = torch.optim.AdamW([*first.parameters(), *last.parameters()], lr=spec.lr)
    sampler = TokenSampler(load_corpus(spec.dataset).text(), seq_len=spec.model.seq_len, seed=spec.seed)
    for step in range(1, args.steps + 1):
        inputs, targets = sampler.sample(spec.microbatch_size)
        hidden = first(inputs)
        hidden.retain_grad()
        loss = next_token_loss(last(hidden), targets)
        optimizer.zero_grad()
        loss.backward()
        if step in report:
            width = spec.model.d_model
            print(json.dumps({"bench": "boundary_spectrum", "step": step, "loss": round(loss.item(), 4),
                              "activations": tail_errors(hidden.detach().reshape(-1, width), ranks),
                              "gradients": tail_errors(hidden.grad.reshape(-1, width), ranks)}), flush=True)
        optimizer.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
