"""Configuration of a peer and of a bootstrap node: frozen dataclasses that validate themselves.

The command lines of ``run_peer.py`` and ``run_bootstrap.py`` are derived from these fields
(:mod:`peer.cli`), so the help text below is the ``--help`` text.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from dht.records import BOUNDARY_CODECS, check_run_id, check_step_semantics

RECOVERY_MODES = ("replay", "restart")  # see swarm/task_pool.py
FLOW_CONTROLS = ("auto", "fixed")  # see swarm/flow_control.py
STRIPE_CALLS = ("auto", "off")  # see dht/striping.py
AGGREGATIONS = ("mean", "centered_clip", "trimmed_mean")  # swarm/robust.py's (not imported: it loads torch)

DEFAULT_HOST_MADDR = "/ip4/0.0.0.0/tcp/0"


def _help(text: str) -> dict[str, str]:
    return {"help": text}


def check_status_port(port: int) -> None:
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"--status-port must be 0 (off) or a TCP port up to 65535, got {port!r}")


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """Volunteer peer: join a run through a bootstrap node and train one stage of its model."""

    bootstrap: tuple[str, ...] = field(default=(), metadata=_help("multiaddr(s) of bootstrap or any live peer; give several for redundancy"))
    run_id: str = field(default="demo", metadata=_help("name of the run to join"))
    run_owner: str | None = field(default=None, metadata=_help("the 32 hex digits of the run owner's key, as the bootstrap's join line prints them: only that key's run spec is trusted (default: the key of the bootstrap dialled)"))
    role: str = field(default="auto", metadata=_help("reliable (committed, hosts averaging), unreliable (may vanish; averages in client mode) or auto (reliable unless --client-mode)"))
    client_mode: bool = field(default=False, metadata=_help("accept no incoming DHT/averaging connections (behind NAT without relay)"))
    host_maddrs: tuple[str, ...] = field(default=(DEFAULT_HOST_MADDR,), metadata=_help("addresses to listen on"))
    announce_maddrs: tuple[str, ...] = field(default=(), metadata=_help("addresses to announce, if others must reach you at a different address (port forwarding)"))
    reachability: str = field(default="auto", metadata=_help("auto: at start a few peers dial this peer back to learn whether others can reach it; behind a NAT it then takes a relay slot on a public peer, or, with none, trains as a client of stage 0 (docs/nat.md; skipped on loopback); direct: skip the check, others can dial --host-maddrs/--announce-maddrs (a port forward)"))
    relay_slots: int = field(default=8, metadata=_help("peers behind NATs this peer relays for at most, when others can dial it (0: none); each costs at most 0.28 Mbit/s of upload (the relay carries only the DHT's requests and hole punching's messages), and at most a quarter of --max-upload-mbps goes to relaying"))
    identity_path: str | None = field(default=None, metadata=_help("file keeping this peer's identity across restarts (created if missing)"))
    stage: int = field(default=-1, metadata=_help("serve this stage instead of negotiating one, pinned: no rescue or rebalance moves this peer (-1: negotiate)"))
    first_stage: int = field(default=-1, metadata=_help("start on this stage instead of negotiating one, but, unlike --stage, stay movable: a rescue or a rebalance may move this peer (-1: negotiate)"))
    device: str = field(default="auto", metadata=_help("torch device: auto (CUDA if present), cpu, cuda, cuda:N"))
    num_threads: int = field(default=0, metadata=_help("CPU threads for torch (0: torch's default)"))
    data: tuple[str, ...] = field(default=(), metadata=_help("the data files to train on, when the run was published with --data"))
    tokenizer: str | None = field(default=None, metadata=_help("the run's tokenizer.json, if you have it (default: obtained from the swarm; either way checked against the run's hash)"))
    sample_period: float = field(default=0.0, metadata=_help("seconds between samples of what the model writes after a fixed prompt, shown in the terminal view and on the status page; each pulls every other stage's newest state from the swarm, so 0 (none) is the default: the bootstrap's health page has them"))
    max_memory_mb: float = field(default=0.0, metadata=_help("memory this peer may use for its stage, MiB (0: what the machine has available)"))
    max_in_flight: int = field(default=8, metadata=_help("most microbatches a stage-0 peer keeps in the pipeline at once: the memory check sizes the stage for this many (each holds its graph at every stage it crossed), and the flow-control window stays at or below it; under the flush schedule a batch's share bounds it too"))
    flow_control: str = field(default="auto", metadata=_help("auto: the in-flight window follows the path's measured bandwidth x delay between 1 and --max-in-flight, backing off when round trips grow (queueing) or calls time out (docs/network.md); fixed: always --max-in-flight (for comparisons)"))
    stripe_calls: str = field(default="auto", metadata=_help("auto: a forward call to a peer whose measured round trip is 10 ms or more is cut into pieces of 128 KiB, each on its own stream, all at once (a stream carries one window per round trip: 1.04 s against 0.43 s for an activation at 20 Mbit/s + 40 ms; docs/network.md); off: one stream per call (for comparisons)"))
    activation_checkpointing: bool = field(default=False, metadata=_help("keep only each block's input for the backward and recompute the rest when the gradient comes back: the in-flight microbatches take a small fraction of the memory, for one more forward of each block (up to a third more compute; run_peer.py --dry-run says what the stage needs either way)"))
    eval_every: int = field(default=4096, metadata=_help("samples a stage-0 peer trains between evaluations of the held-out loss through the pipeline (0: never)"))
    eval_sequences: int = field(default=128, metadata=_help("held-out sequences per evaluation (the same fixed set on every peer; more is steadier and slower)"))
    join_timeout: float = field(default=30.0, metadata=_help("seconds to reach the swarm and find the run before giving up"))
    settle_delay: float = field(default=1.5, metadata=_help("seconds a joiner waits for other joiners' intents before choosing a stage"))
    heartbeat_period: float = field(default=1.0, metadata=_help("seconds between heartbeats in the DHT"))
    heartbeat_ttl: float = field(default=6.0, metadata=_help("seconds a heartbeat stays valid; a silent peer is dropped after this"))
    request_timeout: float = field(default=60.0, metadata=_help("deadline of one pipeline request, seconds"))
    max_payload_mb: float = field(default=512.0, metadata=_help("largest message this peer accepts, MiB"))
    run_for: float = field(default=0.0, metadata=_help("leave after this many seconds of training (0: until Ctrl+C)"))
    state_cache: str | None = field(default=None, metadata=_help("folder keeping downloaded state shards, so an interrupted join resumes instead of starting over"))
    metrics_file: str | None = field(default=None, metadata=_help("append one JSON line per event (microbatch, averaging round, status) to this file"))
    status_period: float = field(default=5.0, metadata=_help("seconds between status lines in the log"))
    log_level: str = field(default="INFO", metadata=_help("DEBUG, INFO, WARNING"))
    status_port: int = field(default=0, metadata=_help("serve the swarm health page (/), /status.json and Prometheus /metrics on this TCP port (0: off)"))
    status_host: str = field(default="127.0.0.1", metadata=_help("address the status port listens on; 0.0.0.0 to let other machines see it"))
    terminal_view: str = field(default="auto", metadata=_help("redraw a live view of this peer and the swarm every --status-period seconds: on, off, or auto (on when stdout is a terminal)"))
    quiet: bool = field(default=False, metadata=_help("print only warnings and errors (for services): no terminal view, log level WARNING"))
    verbose: bool = field(default=False, metadata=_help("debug logging (log level DEBUG)"))
    pause_file: str | None = field(default=None, metadata=_help("creating this file pauses the peer without leaving the swarm, deleting it resumes (SIGUSR1 toggles pause too)"))
    recovery: str = field(default="replay", metadata=_help("what a broken microbatch route costs: replay (re-send it at the failed hop, replay it from stage 0 with the same id and path, nothing counted twice) or restart (the SWARM baseline: start it over from stage 0, no de-duplication; for benchmarks)"))
    ban_strikes: int = field(default=8, metadata=_help("misbehaviours (malformed requests, failed calls) within 30 s that get a peer banned (0: never ban)"))
    ban_seconds: float = field(default=120.0, metadata=_help("how long a ban lasts, seconds"))
    spot_check_fraction: float = field(default=0.01, metadata=_help("fraction of the microbatches this peer sends to the next stage that another replica there recomputes (forward only, nothing counted twice) and compares; a mismatch is a strike against the replicas (0: no spot checks)"))
    spot_check_tolerance: float = field(default=0.0, metadata=_help("relative distance allowed between two replicas' outputs computed on different weights (0: compare only outputs computed on the same weights; see docs/spot-checks.md before raising it)"))
    max_forwards_per_peer: float = field(default=200.0, metadata=_help("forward requests per second one peer of the previous stage may send this peer (0: no limit); requests from peers not in the previous stage are refused whatever this is"))
    max_upload_mbps: float = field(default=0.0, metadata=_help("cap on what this peer uploads (activations, gradients, state shards), Mbit/s (0: no cap); hivemind's DHT and averaging traffic is not counted"))
    checkpoint_dir: str | None = field(default=None, metadata=_help("write this peer's stage to <dir>/<run>-stage<k>.safetensors every --checkpoint-period seconds and on leave; the first peer of a stage with no live holder and no backup in the swarm resumes from it"))
    checkpoint_period: float = field(default=300.0, metadata=_help("seconds between checkpoints when --checkpoint-dir is given"))
    rebalance_period: float = field(default=60.0, metadata=_help("seconds between checks whether moving this peer to the bottleneck stage would speed the swarm up; a peer is not moved in its first two periods at a stage, nor with --stage (0: never move)"))
    rebalance_min_gain: float = field(default=0.2, metadata=_help("move only if the pipeline's bottleneck throughput rises by at least this fraction (0.2 = 20%%); FLOP/s measured on a busy machine are noisy"))
    aggregation: str = field(default="centered_clip", metadata=_help("how the replicas of a stage combine their states in an averaging round: centered_clip (robust: a replica far from the others is clipped, so one Byzantine replica cannot derail the stage), trimmed_mean (robust: drops the extremes of every coordinate) or mean (the plain mean; only for a swarm whose peers you all trust). NaN/Inf contributions are refused in every mode; with two replicas every mode is the mean"))
    replan_after: float = field(default=30.0, metadata=_help("seconds a stage may stay unheld, with no peer to spare for a rescue, before the peers re-plan the layout without it: its layers go to the stages left (seed 001 §3.4; 0: wait for a new peer instead)"))
    global_plan_period: float = field(default=300.0, metadata=_help("seconds between computations of the global plan (issue 18: stage count, layer split and who serves what, from the peers' records and measured links) and of whether its gain pays back the moves; when it does, the swarm moves to it (docs/planner.md; never while a peer is pinned with --stage; 0: never compute it)"))
    global_plan_min_gain: float = field(default=0.2, metadata=_help("propose the global plan only if, under the cost model, it is faster than the swarm as it runs by more than this fraction (0.2 = 20%%)"))
    backup_period: float = field(default=30.0, metadata=_help("seconds between refreshes of the backup this peer keeps when it is the keeper of a stage held by a single peer (the lowest peer id of the next stage); the first copy is taken at once (0: keep no backups)"))

    def __post_init__(self) -> None:
        if not (math.isfinite(self.sample_period) and self.sample_period >= 0):
            raise ValueError("--sample-period must be 0 (no samples) or a positive number of seconds")
        check_status_port(self.status_port)
        if self.terminal_view not in ("auto", "on", "off"):
            raise ValueError(f"--terminal-view must be auto, on or off, got {self.terminal_view!r}")
        if self.quiet and self.verbose:
            raise ValueError("--quiet and --verbose contradict each other: give one")
        if not self.bootstrap:
            raise ValueError("give at least one --bootstrap multiaddr (printed by run_bootstrap.py)")
        check_run_id(self.run_id)
        if self.run_owner is not None and not re.fullmatch(r"[0-9a-f]{32}", self.run_owner):
            raise ValueError(f"--run-owner must be the 32 hex digits the bootstrap prints, got {self.run_owner!r:.60}")
        if self.role not in ("auto", "reliable", "unreliable"):
            raise ValueError(f"--role must be auto, reliable or unreliable, got {self.role!r}")
        if self.reachability not in ("auto", "direct"):
            raise ValueError(f"--reachability must be auto or direct, got {self.reachability!r}")
        if self.relay_slots < 0:
            raise ValueError("--relay-slots must be >= 0")
        if self.role == "reliable" and self.client_mode:
            raise ValueError("a reliable peer must accept connections: drop --client-mode or use --role unreliable")
        if self.stage < -1 or self.first_stage < -1:
            raise ValueError("--stage and --first-stage must be -1 (negotiate) or a stage index")
        if self.stage >= 0 and self.first_stage >= 0:
            raise ValueError("give --stage (pinned) or --first-stage (movable), not both")
        if self.num_threads < 0 or self.max_in_flight < 1:
            raise ValueError("--num-threads must be >= 0 and --max-in-flight >= 1")
        if self.flow_control not in FLOW_CONTROLS:
            raise ValueError(f"--flow-control must be auto or fixed, got {self.flow_control!r}")
        if self.stripe_calls not in STRIPE_CALLS:
            raise ValueError(f"--stripe-calls must be auto or off, got {self.stripe_calls!r}")
        if self.eval_every < 0 or self.eval_sequences < 1:
            raise ValueError("--eval-every must be >= 0 (0: never) and --eval-sequences >= 1")
        for name in ("join_timeout", "heartbeat_period", "heartbeat_ttl", "request_timeout", "max_payload_mb", "status_period",
                     "checkpoint_period"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number")
        if self.heartbeat_ttl <= 2 * self.heartbeat_period:
            raise ValueError("--heartbeat-ttl must exceed two heartbeat periods, or live peers would flicker")
        for name in ("max_memory_mb", "run_for", "settle_delay", "rebalance_period", "rebalance_min_gain", "max_upload_mbps",
                     "max_forwards_per_peer", "backup_period", "replan_after", "global_plan_period",
                     "global_plan_min_gain"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):  # NaN fails both
                raise ValueError(f"--{name.replace('_', '-')} must be a number >= 0")
        if self.ban_strikes < 0 or not (math.isfinite(self.ban_seconds) and self.ban_seconds > 0):
            raise ValueError("--ban-strikes must be >= 0 and --ban-seconds a positive number")
        if not 0.0 <= self.spot_check_fraction <= 1.0:  # NaN fails too
            raise ValueError(f"--spot-check-fraction must be between 0 and 1, got {self.spot_check_fraction}")
        if not (math.isfinite(self.spot_check_tolerance) and self.spot_check_tolerance >= 0):
            raise ValueError("--spot-check-tolerance must be a number >= 0")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"--aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")
        if self.recovery not in RECOVERY_MODES:
            raise ValueError(f"--recovery must be one of {', '.join(RECOVERY_MODES)}, got {self.recovery!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError("--log-level must be DEBUG, INFO, WARNING or ERROR")

    @property
    def resolved_log_level(self) -> str:
        """--quiet and --verbose override --log-level."""
        return "WARNING" if self.quiet else "DEBUG" if self.verbose else self.log_level.upper()

    @property
    def start_stage(self) -> int:
        """The stage this peer starts on without negotiating (--stage or --first-stage), else -1."""
        return self.stage if self.stage >= 0 else self.first_stage

    @property
    def resolved_role(self) -> str:
        if self.role == "auto":
            return "unreliable" if self.client_mode else "reliable"
        return self.role


# the bootstrap's model flags and their defaults: a --preset replaces them all
BOOTSTRAP_MODEL_DEFAULTS = {"model_family": "gpt", "d_model": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 0,
                            "ffn_dim": 0, "seq_len": 64}


@dataclass(frozen=True, kw_only=True)
class BootstrapConfig:
    """Bootstrap node: start a swarm, publish the run spec (signed), and serve until stopped."""

    host_maddrs: tuple[str, ...] = field(default=(DEFAULT_HOST_MADDR,), metadata=_help("addresses to listen on; fix a port to keep the multiaddr stable (e.g. /ip4/0.0.0.0/tcp/31337)"))
    announce_maddrs: tuple[str, ...] = field(default=(), metadata=_help("addresses to announce when peers reach you at a different address"))
    identity_path: str | None = field(default=None, metadata=_help("file keeping the peer id (and so the multiaddr) across restarts (created if missing)"))
    initial_peers: tuple[str, ...] = field(default=(), metadata=_help("other bootstrap nodes of the same swarm to connect to"))
    maddrs_file: str | None = field(default=None, metadata=_help("also write the multiaddrs to this file, one per line"))
    relay_slots: int = field(default=8, metadata=_help("peers behind NATs this node relays for at most (0: none); each costs at most 0.28 Mbit/s of upload (docs/nat.md)"))
    run_id: str = field(default="demo", metadata=_help("name of the run to publish"))
    preset: str = field(default="", metadata=_help("a named Llama-style model instead of the model flags: tiny (0.8 M parameters), small (24 M), medium (178 M), large (0.93 B); bytes as tokens"))
    model_family: str = field(default="gpt", metadata=_help("gpt (GPT-2 style) or llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention)"))
    d_model: int = field(default=128, metadata=_help("model width"))
    num_layers: int = field(default=4, metadata=_help("transformer blocks"))
    num_heads: int = field(default=4, metadata=_help("attention heads per block"))
    num_kv_heads: int = field(default=0, metadata=_help("key/value heads per block (llama: grouped-query attention; 0: as many as --num-heads)"))
    ffn_dim: int = field(default=0, metadata=_help("hidden width of each block's MLP (0: 4 x --d-model for gpt, 8/3 x --d-model rounded up to 32 for llama)"))
    seq_len: int = field(default=64, metadata=_help("tokens per sequence"))
    num_stages: int = field(default=2, metadata=_help("pipeline stages; blocks are split evenly (0: as few as let every stage fit --stage-memory-gb)"))
    stage_memory_gb: float = field(default=8.0, metadata=_help("with --num-stages 0: the memory a peer should need to train one stage (weights, AdamW moments, activations, overhead)"))
    lr: float = field(default=3e-3, metadata=_help("AdamW learning rate"))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW weight decay"))
    microbatch_size: int = field(default=16, metadata=_help("sequences per microbatch"))
    target_batch_size: int = field(default=64, metadata=_help("samples a stage replica accumulates per optimizer step"))
    pipeline_schedule: str = field(default="flush", metadata=_help("flush: every step drains the pipeline, so no gradient is stale (learns per sample as one process does); delayed: microbatches flow across steps on one-step-old weights (more tokens/s, far less learned per sample); see docs/convergence.md"))
    replica_sync: str = field(default="gradients", metadata=_help("gradients: --target-batch-size is the whole swarm's batch and the replicas of a stage add up their gradients before every step (needs --pipeline-schedule flush); periodic: every replica steps on its own batch and only the averaging rounds bring replicas together; see docs/convergence.md"))
    averaging_period: float = field(default=15.0, metadata=_help("seconds between in-stage averaging rounds"))
    seed: int = field(default=0, metadata=_help("seed of initialisation and data order"))
    data: tuple[str, ...] = field(default=(), metadata=_help("files to train on: text, JSON Lines (.jsonl, a \"text\" field), Parquet (.parquet, a text column) or token shards (.bin, from python -m peer.prepare_data) (default: Python's built-in documentation)"))
    tokenizer: str = field(default="bytes", metadata=_help("bytes (every byte a token), bpe (train a byte-level BPE tokenizer on the data, offline) or the path of a tokenizer.json; peers obtain it from the swarm, pinned by its hash"))
    vocab_size: int = field(default=4096, metadata=_help("with --tokenizer bpe: the vocabulary to train"))
    precision: str = field(default="fp32", metadata=_help("how every peer computes: fp32, or bf16 (autocast on any device; fp32 master weights and AdamW moments; activations and gradients sent in bf16, half the bytes): the usual choice for a swarm of GPUs"))
    boundary_codec: str = field(default="none", metadata=_help("how activations and their gradients cross a stage boundary: none (as computed: fp32, or bf16 under --precision bf16), bf16 or fp16 (half of fp32's bytes), int8 (blockwise absmax, 3.76x fewer bytes than fp32, error at most 1/254 of each block's largest value); a run property, see docs/compression.md"))
    boundary_subspace: int = field(default=0, metadata=_help("k > 0: up to the last stage the model adds to its token embeddings only within a fixed k-dimensional subspace, so a stage boundary carries k numbers per token instead of --d-model, each way, compressed further by --boundary-codec (node0's scheme; it constrains the model: see docs/compression.md); 0: off"))
    gradient_codec: str = field(default="none", metadata=_help("how a replica's gradients of a batch go to its co-replicas under --replica-sync gradients: none (fp32), bf16, fp16 or int8 (blockwise absmax with error feedback: each replica adds its rounding error to its next batch); a run property, see docs/compression.md"))
    spec_refresh_period: float = field(default=60.0, metadata=_help("seconds between re-publications of the run spec"))
    log_level: str = field(default="INFO", metadata=_help("DEBUG, INFO, WARNING"))
    status_port: int = field(default=0, metadata=_help("serve the swarm health page (/), /status.json and Prometheus /metrics on this TCP port (0: off)"))
    status_host: str = field(default="127.0.0.1", metadata=_help("address the status port listens on; 0.0.0.0 to let other machines see it"))
    sample_period: float = field(default=120.0, metadata=_help("with --status-port: seconds between the health page's samples of what the model writes after a fixed prompt; each gathers every stage's newest state from the swarm (0: none; models over 64 M parameters are never sampled)"))

    def __post_init__(self) -> None:
        check_status_port(self.status_port)
        check_run_id(self.run_id)
        if self.relay_slots < 0:
            raise ValueError("--relay-slots must be >= 0")
        if not (math.isfinite(self.sample_period) and self.sample_period >= 0):
            raise ValueError("--sample-period must be 0 (no samples) or a positive number of seconds")
        if not (math.isfinite(self.spec_refresh_period) and self.spec_refresh_period > 0):
            raise ValueError("--spec-refresh-period must be a positive number")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError("--log-level must be DEBUG, INFO, WARNING or ERROR")
        if self.preset and any(getattr(self, name) != BOOTSTRAP_MODEL_DEFAULTS[name] for name in BOOTSTRAP_MODEL_DEFAULTS):
            raise ValueError("give either --preset or the model flags (--model-family, --d-model, --num-layers, "
                             "--num-heads, --num-kv-heads, --ffn-dim, --seq-len), not both")
        if self.num_stages < 0 or (not self.preset and self.num_stages > self.num_layers):
            raise ValueError("--num-stages must be between 1 and the model's layers, or 0 to choose")
        if not (math.isfinite(self.stage_memory_gb) and self.stage_memory_gb > 0):
            raise ValueError("--stage-memory-gb must be a positive number")
        check_step_semantics(self.pipeline_schedule, self.replica_sync, flags=True)
        if self.boundary_codec not in BOUNDARY_CODECS:
            raise ValueError(f"--boundary-codec must be one of {', '.join(BOUNDARY_CODECS)}, got {self.boundary_codec!r}")
        if self.boundary_subspace < 0:
            raise ValueError("--boundary-subspace must be 0 (off) or a number of dimensions below --d-model")
        if self.gradient_codec not in BOUNDARY_CODECS:
            raise ValueError(f"--gradient-codec must be one of {', '.join(BOUNDARY_CODECS)}, got {self.gradient_codec!r}")
        if not self.tokenizer:
            raise ValueError("--tokenizer must be bytes, bpe, or the path of a tokenizer.json")
