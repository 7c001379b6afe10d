"""Tokens/s of a 2-stage swarm on loopback against single-process training of the same model.

    python bench/pipeline_overhead.py [--seconds 60] [--repeats 1] [--with-delayed]

Both sides train the default run spec (GPT d_model=128, 4 layers, seq_len 64, microbatch 16, AdamW,
step every 64 samples) on the default corpus, on this machine, in one run:

* single: one process trains the whole model; measured with 1 torch thread and with all cores as
          threads, and the faster of the two is the baseline (small matrices often run faster on
          one thread than split across two);
* swarm:  run_bootstrap.py + one run_peer.py per stage (negotiated), one torch thread each, so the
          swarm uses the same cores; tokens/s counted at stage 0 from the peers' metrics files.

``--with-delayed`` also measures the swarm under the first round's training semantics
(``--pipeline-schedule delayed --replica-sync periodic``: microbatches keep flowing across steps on
one-step-stale weights) right after the default one, so the two schedules' tokens/s are compared
side by side: what the default's learning per sample (docs/convergence.md) costs in speed.

Each measurement skips a warm-up and then counts over ``--seconds``. With ``--repeats N`` the sides are
alternated (single, swarm[, delayed], single, swarm, ...) and the medians are reported. Prints one JSON
line: ``{"bench": "pipeline_overhead", "swarm_tokens_per_s", "single_tokens_per_s", "ratio", ...}``
(with ``--with-delayed`` also ``delayed_tokens_per_s``, ``delayed_ratio`` and ``swarm_vs_delayed``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WARMUP_SECONDS = 8.0


def single_tokens_per_s(seconds: float, num_threads: int) -> float:
    """Train the whole model in this process for ``seconds`` after a warm-up; tokens/s."""
    import torch

    from dht.records import RunSpec
    from swarm.data import TokenSampler, load_corpus
    from swarm.model import StageModel

    torch.set_num_threads(num_threads)
    spec = RunSpec(run_id="bench", stage_layers=((0, 4),))
    model = StageModel(spec, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    sampler = TokenSampler(load_corpus(spec.dataset).text(), seq_len=spec.model.seq_len, seed=0)
    per_step = spec.target_batch_size // spec.microbatch_size
    return timed_training(model, optimizer, lambda: sampler.sample(spec.microbatch_size), per_step=per_step,
                          tokens_per_step=spec.target_batch_size * spec.model.seq_len, seconds=seconds)


def timed_training(model, optimizer, draw, *, per_step: int, tokens_per_step: int, seconds: float) -> float:
    """Steps of one process (``per_step`` microbatches from ``draw()``, clipped, AdamW) over and over;
    tokens/s over ``seconds`` after ``WARMUP_SECONDS``. Shared with bench/model_scale.py."""
    import torch

    from swarm.model import next_token_loss

    tokens, started, counting_since = 0, time.monotonic(), None
    while True:
        for _ in range(per_step):
            inputs, targets = draw()
            (next_token_loss(model(inputs), targets) / per_step).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        now = time.monotonic()
        if counting_since is None:
            if now - started >= WARMUP_SECONDS:
                counting_since = now
            continue
        tokens += tokens_per_step
        if now - counting_since >= seconds:
            return tokens / (now - counting_since)


DELAYED = ("--pipeline-schedule", "delayed", "--replica-sync", "periodic")  # the first round's semantics


def swarm_tokens_per_s(seconds: float, workdir: Path, bootstrap_args: tuple[str, ...] = ()) -> float:
    """A bootstrap and two peers (one per stage) as processes; tokens/s through stage 0."""
    from peer.harness.local_swarm import LocalSwarm, wait_for

    with LocalSwarm(workdir) as swarm:
        swarm.start_bootstrap("--num-stages", "2", *bootstrap_args)
        peers = [swarm.start_peer("--num-threads", "1") for _ in range(2)]
        wait_for(lambda: all(p.events("status") for p in peers), 120, "both peers to train")
        start = time.time() + WARMUP_SECONDS
        time.sleep(WARMUP_SECONDS + seconds + 1.0)
        end = start + seconds
        tokens = sum(e["tokens"] for p in peers for e in p.events("microbatch")
                     if e["stage"] == 0 and start <= e["t"] < end)
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds per side (default 60)")
    parser.add_argument("--repeats", type=int, default=1, help="alternating repetitions (default 1)")
    parser.add_argument("--with-delayed", action="store_true", help="also measure the swarm under " + " ".join(DELAYED))
    parser.add_argument("--single-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    if args.single_worker:
        threads = sorted({1, cores})
        print(json.dumps({str(n): single_tokens_per_s(args.seconds, n) for n in threads}))
        return
    singles, swarms, delayed, single_by_threads = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="pipeline-overhead-") as tmp:
        for repeat in range(args.repeats):
            out = subprocess.run([sys.executable, __file__, "--single-worker", "--seconds", str(args.seconds)],
                                 capture_output=True, text=True, check=True)
            by_threads = json.loads(out.stdout.strip().splitlines()[-1])
            singles.append(max(by_threads.values()))
            single_by_threads.append(by_threads)
            swarms.append(swarm_tokens_per_s(args.seconds, Path(tmp) / f"swarm{repeat}"))
            if args.with_delayed:
                delayed.append(swarm_tokens_per_s(args.seconds, Path(tmp) / f"delayed{repeat}", DELAYED))
    single, swarm = statistics.median(singles), statistics.median(swarms)
    compared = {} if not delayed else {
        "delayed_tokens_per_s": round(statistics.median(delayed), 1),
        "delayed_ratio": round(statistics.median(delayed) / single, 3),
        "swarm_vs_delayed": round(swarm / statistics.median(delayed), 3), "delayed_runs": [round(x, 1) for x in delayed]}
    print(json.dumps({
        "bench": "pipeline_overhead", "swarm_tokens_per_s": round(swarm, 1), "single_tokens_per_s": round(single, 1),
        "ratio": round(swarm / single, 3), "seconds": args.seconds, "repeats": args.repeats, "cores": cores,
        "swarm_runs": [round(x, 1) for x in swarms],
        "single_runs_by_threads": [{k: round(v, 1) for k, v in r.items()} for r in single_by_threads], **compared,
    }))


if __name__ == "__main__":
    main()
