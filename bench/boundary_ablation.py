"""Where a subspace boundary's loss goes, in one process: the default model's two stages chained as
the swarm splits them, with the boundary as the wire carries it or not.

    python bench/boundary_ablation.py [--dims 0] [--codec none] [--backward projected]
                                      [--writer-lr-scale 1.0] [--samples 20000] [--every 5000]

Trains the default run spec (GPT d_model 128, 4 layers, 2 stages of 2 blocks, AdamW lr 3e-3,
microbatch 16, a step every 64 samples, each stage clipped to norm 1.0 and stepped on its own as a
replica does) on the swarm's data order (``TokenSampler.sample_slot``), one torch thread, and prints
a JSON line of the held-out loss (the convergence bench's 256 held-out windows) every ``--every``
samples: ``{"bench": "boundary_ablation", "dims", "codec", "backward", "writer_lr_scale", "samples",
"val_loss", "seconds"}``.

* ``--dims k`` (> 0): ``ModelSpec.boundary_subspace = k``; stage 0's writers are projected after every
  step (``swarm.subspace``), the forward crosses as ``c = Uᵀ(x − base)`` through ``--codec``;
* ``--backward projected`` sends back ``Uᵀ g`` through the codec, as the swarm does; ``full`` hands
  stage 0 the whole gradient (what no wire of k numbers can carry: the ablation);
* ``--writer-lr-scale s``: stage 0's residual writers and embeddings (the parameters a subspace run
  projects) step with ``s`` × the run's learning rate, whether or not ``--dims`` is set.

Left out: the swarm itself (processes, replicas, averaging); bench/convergence.py measures that.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, default=0)
    parser.add_argument("--codec", default="none")
    parser.add_argument("--backward", choices=("projected", "full"), default="projected")
    parser.add_argument("--writer-lr-scale", type=float, default=1.0)
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--every", type=int, default=5000)
    for line in train(parser.parse_args(argv)):
        print(json.dumps(line), flush=True)
    return 0


def train(args: argparse.Namespace) -> Iterator[dict]:
    """Train as the module docstring says; yield a result line every ``args.every`` samples."""
    import torch

    from dht.records import ModelSpec, RunSpec
    from swarm.boundary_codec import boundary_codec
    from swarm.data import TokenSampler, load_corpus
    from swarm.model import RESIDUAL_PROJECTIONS, StageModel, next_token_loss
    from swarm.subspace import subspace_of

    torch.set_num_threads(1)
    spec = RunSpec(run_id="bench", model=ModelSpec(boundary_subspace=args.dims))
    models, subspace, codec = [StageModel(spec, 0), StageModel(spec, 1)], subspace_of(spec), boundary_codec(args.codec)
    if subspace is not None:
        subspace.project(models[0])
    writers = [p for n, p in models[0].named_parameters()
               if n.startswith(("tok_emb", "pos_emb")) or n.rsplit(".", 2)[-2] in RESIDUAL_PROJECTIONS["gpt"]]
    others = [p for p in models[0].parameters() if all(p is not w for w in writers)]
    optimizers = [torch.optim.AdamW([{"params": others}, {"params": writers, "lr": spec.lr * args.writer_lr_scale}],
                                    lr=spec.lr, weight_decay=spec.weight_decay),
                  torch.optim.AdamW(models[1].parameters(), lr=spec.lr, weight_decay=spec.weight_decay)]
    sampler = TokenSampler(load_corpus(spec.dataset).text(), seq_len=spec.model.seq_len, seed=spec.seed)
    heldout = sampler.heldout_batches(256, spec.microbatch_size)
    wire = lambda t: codec.decode(codec.encode(t), shape=tuple(t.shape), dtype=torch.float32)  # noqa: E731
    per_step = spec.target_batch_size // spec.microbatch_size
    samples, step, next_report, started = 0, 0, args.every, time.monotonic()
    while samples < args.samples:
        for slot in range(per_step):
            inputs, targets = sampler.sample_slot(spec.microbatch_size, seed=spec.seed, batch=step, slot=slot, slots=per_step)
            hidden = models[0](inputs)
            crossed = wire(hidden.detach()) if subspace is None else subspace.lift(wire(subspace.coordinates(hidden, inputs)), inputs)
            crossed.requires_grad_(True)
            (next_token_loss(models[1](crossed), targets) / per_step).backward()
            grad = crossed.grad
            projected = subspace is not None and args.backward == "projected"
            hidden.backward(subspace.lift(wire(subspace.reduce(grad))) if projected else wire(grad))
            samples += spec.microbatch_size
        for model, optimizer in zip(models, optimizers):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if subspace is not None:
            subspace.project(models[0])
        step += 1
        if samples >= next_report:
            next_report += args.every
            with torch.no_grad():
                total = sum(next_token_loss(models[1](models[0](x)), y).item() * y.numel() for x, y in heldout)
            yield {"bench": "boundary_ablation", "dims": args.dims, "codec": args.codec, "backward": args.backward,
                   "writer_lr_scale": args.writer_lr_scale, "samples": samples,
                   "val_loss": round(total / sum(y.numel() for _, y in heldout), 4),
                   "seconds": round(time.monotonic() - started, 1)}


if __name__ == "__main__":
    raise SystemExit(main())
