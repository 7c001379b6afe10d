"""Model scale (issue 17): each preset's size, the memory a stage of it needs, and what a swarm of it trains.

    python bench/model_scale.py [--seconds 60] [--repeats 1] [--presets tiny,small,medium,large]
        [--measure tiny,small,medium] [--swarm tiny,small] [--max-in-flight 4]

Per preset one JSON line ``{"bench": "model_scale", "preset", "params", "microbatch_size", ...}``:

* ``stage_memory_bytes_estimated``: ``{"plain", "checkpointed"}``, the most a stage of an even
  2-stage split needs to train (peer/memory_model.py, without the fixed per-process overhead), at
  the line's ``microbatch_size``, ``max_in_flight`` microbatches in flight, a batch of that many;
  ``one_stage_bytes_estimated`` the same for the whole model in one stage.
* ``stage_memory_bytes_measured``: the same stage's measured peak of one training step, without and
  with activation checkpointing (bench/stage_memory.py: a real ``Stage`` in a fresh process, one
  torch thread, glibc's mmap threshold fixed); ``..._glibc_default`` the plain step with malloc as a
  peer has it. Measured for the presets in ``--measure`` where the estimate fits in half of this
  machine's available memory; null elsewhere.
* ``single_tokens_per_s``: one process trains the whole model (plain torch loop, AdamW, the same
  microbatches and batch), the faster of 1 torch thread and all cores; ``swarm_tokens_per_s``:
  run_bootstrap.py ``--preset`` + two run_peer.py (one per stage, ``--num-threads 1``) on
  loopback, tokens/s counted at stage 0 from the peers' metrics files (bench/pipeline_overhead.py's
  method); ``ratio`` = swarm / single. For the presets in ``--swarm``; null elsewhere. With
  ``--repeats N`` the two alternate N times and the medians are reported (other work on the
  machine moves both; alternating spreads it over both).

The microbatch is the preset's (``MICROBATCH_SIZES``: 16 sequences of tiny, as the demo; fewer of the
larger ones, so that a step takes seconds, not minutes, on two cores). Then one line
``{"bench": "peer_memory", ...}``: the PSS of every process of each running ``tiny`` peer (the
peer itself, torch_shm_manager, hivemind's DHT process and its p2pd, the averager process), read
from /proc/<pid>/smaps_rollup mid-window; PSS splits a shared page among the processes mapping it,
so the processes' figures add up. Every line carries the load average before and after.

Left out: GPUs (none here); data loading (the single process trains on random tokens: its speed
does not depend on them; the swarm reads its corpus); networks slower than loopback; more than one
peer per stage; large's measurement (a step takes many minutes on two cores).
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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WARMUP_SECONDS = 8.0  # as bench/pipeline_overhead.py
MICROBATCH_SIZES = {"tiny": 16, "small": 4, "medium": 1, "large": 1}
NUM_STAGES = 2


def loadavg() -> str:
    """The 1-, 5- and 15-minute load averages (other work on the machine slows every figure here)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_spec(name: str, *, num_stages: int, microbatch_size: int, max_in_flight: int):
    from dht.layouts import even_stage_layers
    from dht.records import RunSpec
    from swarm.presets import preset

    model = preset(name)
    return RunSpec(run_id="scale", model=model, stage_layers=even_stage_layers(model.num_layers, num_stages),
                   microbatch_size=microbatch_size, target_batch_size=microbatch_size * max_in_flight)


def memory_figures(name: str, *, microbatch_size: int, max_in_flight: int, measure: bool) -> dict:
    """The line's memory fields: estimates, and measurements where asked and they fit."""
    import torch

    from bench.stage_memory import measure_step_peak
    from peer.memory_model import FIXED_OVERHEAD_BYTES, memory_table, stage_memory
    from peer.profiler import available_memory_bytes
    from swarm.presets import preset

    spec = run_spec(name, num_stages=NUM_STAGES, microbatch_size=microbatch_size, max_in_flight=max_in_flight)
    table = memory_table(preset(name), num_stages=NUM_STAGES, microbatch_size=microbatch_size, max_in_flight=max_in_flight)
    estimated, measured = {}, {}
    stage = max(range(NUM_STAGES), key=lambda k: stage_memory(spec, k, max_in_flight=max_in_flight).peak_bytes)
    room = available_memory_bytes(torch.device("cpu")) / 2
    for key, checkpointing in (("plain", False), ("checkpointed", True)):
        estimated[key] = table[f"split_bytes{'_checkpointed' * checkpointing}"] - FIXED_OVERHEAD_BYTES
        fits = stage_memory(spec, stage, max_in_flight=max_in_flight, checkpoint_activations=checkpointing).peak_bytes < room
        measured[key] = measure_step_peak(spec.to_wire(), stage, max_in_flight=max_in_flight,
                                          checkpoint_activations=checkpointing)["peak_bytes"] if measure and fits else None
    glibc = None
    if measure and measured["plain"] is not None:
        glibc = measure_step_peak(spec.to_wire(), stage, max_in_flight=max_in_flight, checkpoint_activations=False,
                                  glibc_defaults=True)["peak_bytes"]
    return {"params": table["params"], "num_stages": NUM_STAGES, "measured_stage": stage,
            "stage_memory_bytes_estimated": estimated, "stage_memory_bytes_measured": measured,
            "stage_memory_bytes_measured_glibc_default": glibc,
            "one_stage_bytes_estimated": {"plain": table["one_stage_bytes"] - FIXED_OVERHEAD_BYTES,
                                          "checkpointed": table["one_stage_bytes_checkpointed"] - FIXED_OVERHEAD_BYTES},
            "fixed_overhead_bytes": FIXED_OVERHEAD_BYTES}


def single_tokens_per_s(name: str, seconds: float, *, num_threads: int, microbatch_size: int, max_in_flight: int) -> float:
    """Train the whole model in this process for ``seconds`` after a warm-up; tokens/s."""
    import torch

    from bench.pipeline_overhead import timed_training
    from swarm.model import StageModel

    torch.set_num_threads(num_threads)
    spec = run_spec(name, num_stages=1, microbatch_size=microbatch_size, max_in_flight=max_in_flight)
    model = StageModel(spec, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    generator = torch.Generator().manual_seed(0)
    shape, vocab = (microbatch_size, spec.model.seq_len + 1), spec.model.vocab_size

    def draw() -> tuple[torch.Tensor, torch.Tensor]:
        sequence = torch.randint(0, vocab, shape, generator=generator)
        return sequence[:, :-1], sequence[:, 1:]

    return timed_training(model, optimizer, draw, per_step=max_in_flight,
                          tokens_per_step=max_in_flight * microbatch_size * spec.model.seq_len, seconds=seconds)


def single_by_threads(name: str, seconds: float, *, microbatch_size: int, max_in_flight: int) -> dict[str, float]:
    """:func:`single_tokens_per_s` in a fresh process, with 1 thread and with all cores, by threads."""
    out = subprocess.run([sys.executable, __file__, "--single-worker", name, "--seconds", str(seconds),
                          "--max-in-flight", str(max_in_flight), "--microbatch-size", str(microbatch_size)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def peer_processes(peer) -> list[dict]:
    """Every process of one running peer, with its PSS and RSS: the peer, and below it by the parent
    chain torch_shm_manager, the hivemind DHT process (the python child whose child is p2pd), p2pd,
    and any other python child (hivemind's averager process)."""
    from bench.proc_table import descendants, process_table, read_pss_kib, read_rss_kib

    table = process_table()
    pids = [peer.pid, *descendants(peer.pid, table)]
    parents_of_p2pd = {table[pid].ppid for pid in pids if table[pid].comm == "p2pd"}
    rows = []
    for pid in pids:
        stat = table[pid]
        kind = ("peer" if pid == peer.pid else "p2pd" if stat.comm == "p2pd" else
                "hivemind DHT" if pid in parents_of_p2pd else
                "torch_shm_manager" if stat.comm.startswith("torch_shm") else "averager" if stat.comm.startswith("python")
                else stat.comm)
        pss, rss = read_pss_kib(pid), read_rss_kib(pid)
        if pss is not None:
            rows.append({"kind": kind, "pid": pid, "pss_bytes": pss * 1024, "rss_bytes": (rss or 0) * 1024})
    return rows


def swarm_run(name: str, seconds: float, workdir: Path, *, microbatch_size: int, max_in_flight: int,
              sample_processes: bool) -> tuple[float, list[dict]]:
    """A bootstrap and two peers (one per stage) of preset ``name`` as processes; tokens/s through
    stage 0, and (``sample_processes``) every peer's processes mid-window."""
    from peer.harness.local_swarm import LocalSwarm, wait_for

    samples = []
    with LocalSwarm(workdir) as swarm:
        swarm.start_bootstrap("--num-stages", str(NUM_STAGES), "--preset", name, "--microbatch-size", str(microbatch_size),
                              "--target-batch-size", str(microbatch_size * max_in_flight))
        peers = [swarm.start_peer("--num-threads", "1", "--max-in-flight", str(max_in_flight)) for _ in range(NUM_STAGES)]
        try:
            wait_for(lambda: all(p.events("status") for p in peers), 300, "both peers to train")
        except TimeoutError:
            print(swarm.logs(), file=sys.stderr)
            raise
        start = time.time() + WARMUP_SECONDS
        time.sleep(WARMUP_SECONDS + seconds / 2)
        if sample_processes:
            for peer in peers:
                stage = next((e.get("stage") for e in peer.events("joined")), None)
                processes = peer_processes(peer)
                samples.append({"stage": stage, "processes": processes,
                                "total_pss_bytes": sum(p["pss_bytes"] for p in processes)})
        time.sleep(max(0.0, start + seconds + 1.0 - time.time()))
        end = start + seconds
        tokens = sum(e["tokens"] for p in peers for e in p.events("microbatch") if e["stage"] == 0 and start <= e["t"] < end)
    return tokens / seconds, samples


def throughput(name: str, args: argparse.Namespace, workdir: Path, **flags: int) -> tuple[dict, list[dict]]:
    """Single and swarm tokens/s, alternated ``--repeats`` times (medians); the tiny peers' processes."""
    singles, swarms, samples = [], [], []
    for repeat in range(args.repeats):
        singles.append(single_by_threads(name, args.seconds, **flags))
        swarm, sampled = swarm_run(name, args.seconds, workdir / f"{name}{repeat}",
                                   sample_processes=name == "tiny" and repeat == 0, **flags)
        swarms.append(swarm)
        samples += sampled
    single, swarm = statistics.median(max(r.values()) for r in singles), statistics.median(swarms)
    return {"single_tokens_per_s": round(single, 1), "swarm_tokens_per_s": round(swarm, 1),
            "ratio": round(swarm / single, 3), "repeats": args.repeats, "swarm_runs": [round(x, 1) for x in swarms],
            "single_runs_by_threads": [{k: round(v, 1) for k, v in r.items()} for r in singles]}, samples


def preset_line(name: str, args: argparse.Namespace, workdir: Path) -> tuple[dict, list[dict]]:
    before = loadavg()
    microbatch_size = MICROBATCH_SIZES[name]
    flags = {"microbatch_size": microbatch_size, "max_in_flight": args.max_in_flight}
    line = {"bench": "model_scale", "preset": name, **flags,
            **memory_figures(name, measure=name in args.measure, **flags)}
    speed, samples = {"single_tokens_per_s": None, "swarm_tokens_per_s": None, "ratio": None}, []
    if name in args.swarm:
        speed, samples = throughput(name, args, workdir, **flags)
    line |= speed | {"seconds": args.seconds, "cores": os.cpu_count(), "loadavg_before": before,
                     "loadavg_after": loadavg()}
    return line, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds of each throughput run (default 60)")
    parser.add_argument("--presets", default="tiny,small,medium,large", help="presets to report (default all)")
    parser.add_argument("--measure", default="tiny,small,medium", help="presets whose stage memory is measured")
    parser.add_argument("--swarm", default="tiny,small", help="presets whose tokens/s are measured, single and swarm")
    parser.add_argument("--max-in-flight", type=int, default=4, help="microbatches in flight, and in a batch (default 4)")
    parser.add_argument("--repeats", type=int, default=1, help="alternating single/swarm repetitions; medians (default 1)")
    parser.add_argument("--microbatch-size", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--single-worker", metavar="PRESET", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single_worker:
        flags = {"microbatch_size": args.microbatch_size, "max_in_flight": args.max_in_flight}
        print(json.dumps({str(n): single_tokens_per_s(args.single_worker, args.seconds, num_threads=n, **flags)
                          for n in sorted({1, os.cpu_count() or 1})}))
        return
    args.measure, args.swarm = args.measure.split(","), args.swarm.split(",")
    with tempfile.TemporaryDirectory(prefix="model-scale-") as tmp:
        for name in args.presets.split(","):
            line, samples = preset_line(name, args, Path(tmp))
            print(json.dumps(line), flush=True)
            if samples:
                print(json.dumps({"bench": "peer_memory", "preset": name, "peers": samples, "loadavg": loadavg()}), flush=True)


if __name__ == "__main__":
    main()
