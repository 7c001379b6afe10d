"""Typed records that Murmuration keeps in the DHT, and their wire form (plain msgpack-able dicts).

Every ``from_wire`` treats its input as hostile: it checks types, ranges and sizes and raises
``ValueError`` with the reason. Keys:

    murmuration.runs            dictionary; subkey "<run_id>" + owner key → RunSpec (the registry)
    <run_id>.spec               dictionary; subkey = publisher's public key → RunSpec
    <run_id>.peers              dictionary; subkey = the peer's public key → PeerRecord (heartbeat)

Subkeys carry the owner's RSA public key, so hivemind's ``RSASignatureValidator`` signs each record
and refuses a write under somebody else's key.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from dht.layouts import MAX_STAGES, Assignment, assignment_from_wire, check_stage_layers
from dht.link_figures import MAX_LINK_FIGURES, LinkFigure, links_from_wire
from planner.reachability import REACHABILITIES

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
RUNS_KEY = "murmuration.runs"
# 2: peer records carry a binding to the libp2p identity (docs/records.md); 3: a step is the swarm's batch
# (RunSpec.pipeline_schedule, replica_sync; microbatches carry their batch, stages exchange gradients)
PROTOCOL_VERSION = 3
ROLES = ("reliable", "unreliable")
PEER_STATES = ("joining", "syncing", "training", "paused", "standby", "leaving")
MAX_ADDRS = 16
MAX_BINDING_BYTES = 1024  # peer_key (a libp2p RSA-4096 key is ~550 bytes) and peer_signature
SOFTWARE_VERSION_PATTERN = re.compile(r"^[0-9A-Za-z.+_-]{0,32}$")


def spec_key(run_id: str) -> str:
    return f"{run_id}.spec"


def peers_key(run_id: str) -> str:
    return f"{run_id}.peers"


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
        raise ValueError(f"run id must be 1-64 letters, digits, '_' or '-', got {run_id!r}")
    return run_id


MODEL_FAMILIES = ("gpt", "llama")
# ModelSpec fields newer than the GPT family, left off the wire at these values: a GPT run's spec (and
# its checkpoints' spec digest, peer/checkpoint.py) reads as before they existed
MODEL_WIRE_DEFAULTS = {"family": "gpt", "num_kv_heads": 0, "ffn_dim": 0, "boundary_subspace": 0}
TOKENIZER_PATTERN = r"bytes|bpe:[0-9a-f]{64}"  # a run spec's tokenizer (swarm.tokenizer)
PRECISIONS = ("fp32", "bf16")  # how a run's stages compute (RunSpec.precision)
BOUNDARY_CODECS = ("none", "bf16", "fp16", "int8")  # what crosses a stage boundary (swarm.boundary_codec)
PIPELINE_SCHEDULES = ("flush", "delayed")
REPLICA_SYNCS = ("gradients", "periodic")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer: tokens in, next-token logits out (swarm/model.py builds it).

    Attributes:
        family: ``"gpt"`` (GPT-2 style: LayerNorm, learned positions, GELU MLP, biases) or
            ``"llama"`` (Llama style: RMSNorm, rotary positions, SwiGLU MLP, grouped-query
            attention, no biases). Both have an untied output head, so stages share no parameters.
        vocab_size: tokens in the vocabulary (256 for bytes).
        d_model: width of the residual stream.
        num_layers: transformer blocks in the whole model.
        num_heads: attention heads per block; must divide ``d_model``.
        seq_len: tokens per training sequence.
        num_kv_heads: key/value heads (``llama``; grouped-query attention); 0: ``num_heads``. Must
            divide ``num_heads``.
        ffn_dim: the MLP's hidden width; 0: the family's default (:attr:`ffn_width`).
        boundary_subspace: ``k`` > 0: up to the last stage, the residual stream is its initial
            embedding plus a vector in a fixed ``k``-dimensional subspace, so a stage boundary carries
            ``k`` numbers per token instead of ``d_model`` (node0's scheme, ``swarm.subspace``); 0: off.
    """

    family: str = "gpt"
    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    seq_len: int = 64
    num_kv_heads: int = 0
    ffn_dim: int = 0
    boundary_subspace: int = 0

    def __post_init__(self) -> None:
        if self.family not in MODEL_FAMILIES:
            raise ValueError(f"model family must be one of {', '.join(MODEL_FAMILIES)}, got {self.family!r}")
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 20:
                raise ValueError(f"model {name} must be an integer in [1, 2**20], got {value!r}")
        for name in ("num_kv_heads", "ffn_dim", "boundary_subspace"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 1 << 20:
                raise ValueError(f"model {name} must be an integer in [0, 2**20], got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads {self.num_heads} must divide d_model {self.d_model}")
        if self.boundary_subspace >= self.d_model:
            raise ValueError(f"boundary_subspace {self.boundary_subspace} must be below d_model {self.d_model}")
        if self.family == "gpt" and (self.num_kv_heads not in (0, self.num_heads)):
            raise ValueError("num_kv_heads (grouped-query attention) needs the llama family")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}")
        if self.family == "llama" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head width, got d_model/num_heads = {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``num_kv_heads``, or ``num_heads`` when 0."""
        return self.num_kv_heads or self.num_heads

    @property
    def ffn_width(self) -> int:
        """The MLP's hidden width: ``ffn_dim``, else 4 × d_model (gpt) or 8/3 × d_model rounded up to
        a multiple of 32 (llama, whose SwiGLU has three matrices instead of two)."""
        if self.ffn_dim:
            return self.ffn_dim
        return 4 * self.d_model if self.family == "gpt" else -(-8 * self.d_model // 3 // 32) * 32


def check_step_semantics(pipeline_schedule: str, replica_sync: str, *, flags: bool = False) -> None:
    """``ValueError`` unless both are known and compatible (``flags``: name them as command-line flags)."""
    schedule, sync = ("--pipeline-schedule", "--replica-sync") if flags else ("pipeline_schedule", "replica_sync")
    if pipeline_schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"{schedule} must be one of {', '.join(PIPELINE_SCHEDULES)}, got {pipeline_schedule!r}")
    if replica_sync not in REPLICA_SYNCS:
        raise ValueError(f"{sync} must be one of {', '.join(REPLICA_SYNCS)}, got {replica_sync!r}")
    if replica_sync == "gradients" and pipeline_schedule != "flush":
        raise ValueError(f"{sync} gradients needs {schedule} flush (a batch must end before the next starts); "
                         f"give {sync} periodic with delayed")


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Everything peers must agree on to train one model together.

    Attributes:
        run_id: the run's name; peers join a run by it.
        model: the architecture.
        stage_layers: per stage, the half-open range ``[start, end)`` of transformer blocks it holds.
            Stage 0 also holds the embedding; the last stage the final norm and the output head.
        optimizer: ``"adamw"``, the only one so far.
        lr: learning rate of every stage's optimizer.
        weight_decay: AdamW weight decay.
        microbatch_size: sequences per microbatch (the unit that flows through the pipeline).
        target_batch_size: samples a stage replica accumulates before each optimizer step.
        pipeline_schedule: what a step means along the pipeline (``PIPELINE_SCHEDULES``, see
            docs/convergence.md): ``"flush"`` (the default) injects one batch, waits for all its
            gradients and steps, so every gradient is on the current weights (GPipe); ``"delayed"``
            keeps microbatches in flight across steps (seed 000): faster, one step stale.
        replica_sync: how a stage's replicas learn together (``REPLICA_SYNCS``): ``"gradients"``
            (the default; needs ``flush``): ``target_batch_size`` is the whole swarm's batch, and
            the replicas add up their gradients before each step (swarm/gradient_sync.py);
            ``"periodic"``: each steps on its own batch, and averaging rounds bring them together.
        averaging_period: seconds between in-stage averaging rounds.
        dataset: ``"builtin:pydoc"`` (Python's own documentation, shipped with every CPython) or
            ``"files:<sha256>"`` for the user's own text files, identified by their content hash.
        tokenizer: ``"bytes"`` (every byte a token; the default) or ``"bpe:<sha256>"``, a BPE
            ``tokenizer.json`` named by its hash (``swarm.tokenizer``): peers obtain the file from
            the swarm and refuse any other. Left out of the wire form when it is bytes.
        precision: how every replica computes (``PRECISIONS``): ``"fp32"`` (the default), or
            ``"bf16"``: forwards and backwards under bf16 autocast on any device, fp32 master weights
            and AdamW moments, activations and their gradients sent in bf16 (half the bytes). A run
            property, not a peer's choice: spot checks compare replicas' outputs strictly, and a bf16
            replica's differ from an fp32 one's by far more than float reassociation. Left out of
            the wire form when it is fp32.
        boundary_codec: how activations and their gradients cross a stage boundary
            (``BOUNDARY_CODECS``, ``swarm.boundary_codec``; in a subspace model, of the subspace's
            coordinates): ``"none"`` (the default: as computed), ``"bf16"``, ``"fp16"`` or ``"int8"``.
            A run property. Left out of the wire form when it is none.
        gradient_codec: how a replica's gradient sum of a batch crosses to its co-replicas
            (``replica_sync = "gradients"``, ``swarm.gradient_sync``), with the same codecs
            (``BOUNDARY_CODECS``); int8 keeps each replica's rounding error and adds it to its next
            batch (error feedback). Left out of the wire form when it is none.
        seed: the seed of deterministic initialisation and of data order.
        protocol_version: bumped when the wire protocol changes incompatibly.
        layout_version: 0 in the published spec. A peer that trains under a layout re-planned after a
            stage vanished (``planner.replanning``) holds a copy with the new ``stage_layers`` and
            this version (:meth:`with_layout`); its pipeline, averaging and state transfers are
            namespaced by it (:attr:`namespace`), so peers of two layouts never mix tensors.
    """

    run_id: str
    model: ModelSpec = field(default_factory=ModelSpec)
    stage_layers: tuple[tuple[int, int], ...] = ((0, 2), (2, 4))
    optimizer: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.0
    microbatch_size: int = 16
    target_batch_size: int = 64
    pipeline_schedule: str = "flush"
    replica_sync: str = "gradients"
    averaging_period: float = 15.0
    dataset: str = "builtin:pydoc"
    tokenizer: str = "bytes"
    precision: str = "fp32"
    boundary_codec: str = "none"
    gradient_codec: str = "none"
    seed: int = 0
    protocol_version: int = PROTOCOL_VERSION
    layout_version: int = 0

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_stage_layers(self.stage_layers, self.model.num_layers)
        if self.optimizer != "adamw":
            raise ValueError(f"optimizer must be 'adamw', got {self.optimizer!r}")
        _check_float("lr", self.lr, 0.0, 10.0, open_low=True)
        _check_float("weight_decay", self.weight_decay, 0.0, 10.0)
        _check_float("averaging_period", self.averaging_period, 1.0, 86400.0)
        check_step_semantics(self.pipeline_schedule, self.replica_sync)
        for name in ("microbatch_size", "target_batch_size", "seed", "protocol_version", "layout_version"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 31:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.microbatch_size < 1 or self.target_batch_size < self.microbatch_size:
            raise ValueError("need 1 <= microbatch_size <= target_batch_size")
        if not isinstance(self.dataset, str) or not re.fullmatch(r"builtin:pydoc|files:[0-9a-f]{64}", self.dataset):
            raise ValueError(f"dataset must be 'builtin:pydoc' or 'files:<sha256>', got {self.dataset!r}")
        if not isinstance(self.tokenizer, str) or not re.fullmatch(TOKENIZER_PATTERN, self.tokenizer):
            raise ValueError(f"tokenizer must be 'bytes' or 'bpe:<sha256>', got {self.tokenizer!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.boundary_codec not in BOUNDARY_CODECS:
            raise ValueError(f"boundary_codec must be one of {', '.join(BOUNDARY_CODECS)}, got {self.boundary_codec!r:.40}")
        if self.gradient_codec not in BOUNDARY_CODECS:
            raise ValueError(f"gradient_codec must be one of {', '.join(BOUNDARY_CODECS)}, got {self.gradient_codec!r:.40}")

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    @property
    def namespace(self) -> str:
        """The name of this layout's RPC handlers and averaging keys: the run id under the published
        layout, ``<run_id>@L<version>`` under a re-planned one ('@' is not allowed in a run id, so no
        other run can own the name; hivemind refuses a '.' in an averaging prefix)."""
        return self.run_id if self.layout_version == 0 else f"{self.run_id}@L{self.layout_version}"

    def with_layout(self, version: int, stage_layers: tuple[tuple[int, int], ...]) -> RunSpec:
        """This spec under layout ``version`` (its ``stage_layers``; checked like the published ones)."""
        return dataclasses.replace(self, layout_version=version, stage_layers=tuple(tuple(r) for r in stage_layers))

    def to_wire(self) -> dict[str, Any]:
        wire = asdict(self)
        wire["stage_layers"] = [list(r) for r in self.stage_layers]
        for key, default in MODEL_WIRE_DEFAULTS.items():
            if wire["model"][key] == default:
                del wire["model"][key]
        for key, default in (("tokenizer", "bytes"), ("precision", "fp32"), ("boundary_codec", "none"),
                             ("gradient_codec", "none")):  # the first round's wire form and hashes
            if wire[key] == default:
                del wire[key]
        return wire

    @classmethod
    def from_wire(cls, wire: Any) -> RunSpec:
        if not isinstance(wire, dict):
            raise ValueError(f"run spec must be a map, got {type(wire).__name__}")
        fields = dict(wire)
        model = fields.pop("model", None)
        if not isinstance(model, dict):
            raise ValueError("run spec has no model map")
        layers = fields.pop("stage_layers", None)
        if not isinstance(layers, (list, tuple)) or len(layers) > MAX_STAGES:
            raise ValueError("run spec stage_layers must be a list of at most 64 ranges")
        try:
            return cls(
                model=ModelSpec(**model),
                stage_layers=tuple(tuple(r) for r in layers),
                **fields,
            )
        except TypeError as e:  # unknown or missing field names
            raise ValueError(f"run spec has wrong fields: {e}") from None

    def describe(self) -> str:
        m = self.model
        return (
            f"run {self.run_id}: {'Llama' if m.family == 'llama' else 'GPT'} d_model={m.d_model} "
            f"layers={m.num_layers} heads={m.num_heads}{f'/{m.kv_heads} kv' if m.kv_heads != m.num_heads else ''} "
            f"seq_len={m.seq_len}, {self.num_stages} stages {list(self.stage_layers)}, "
            f"dataset {self.dataset}, {'byte' if self.tokenizer == 'bytes' else 'BPE'} tokens "
            f"(vocabulary {m.vocab_size}), {self.precision}"
            f"{f', {m.boundary_subspace}-dimensional boundary' if m.boundary_subspace else ''}"
            f"{'' if self.boundary_codec == 'none' else f', {self.boundary_codec} at stage boundaries'}"
            f"{'' if self.gradient_codec == 'none' else f', {self.gradient_codec} gradients between replicas'}, seed {self.seed}"
        )


@dataclass(frozen=True, kw_only=True)
class PeerRecord:
    """A peer's heartbeat: who it is, where it trains, how fast, how far it got.

    Attributes:
        peer_id: the libp2p peer id (base58).
        role: "reliable" (committed; hosts averaging) or "unreliable" (may vanish; client mode).
        state: "joining" (has announced intent), "syncing" (downloading state), "training",
            "paused" (holds its stage and state but takes no work until resumed), "standby" (the
            global plan leaves it idle: it holds no stage until a plan names one; peer.standby),
            "leaving".
        stage: the stage it serves, or -1 while joining or standing by.
        flops: measured compute, FLOP/s (what the planner uses to place joiners).
        samples_per_s: samples/s it actually processed recently (0 until it has trained).
        num_samples: samples it has processed since it joined.
        version: its local optimizer step count.
        loss: its most recent loss (last stage) or the loss it was sent back (stage 0), else NaN.
        val_loss: its most recent held-out loss, measured through the pipeline (stage 0), else NaN.
        announced_at: DHT time at which it announced itself; orders concurrent joiners.
        maddrs: multiaddrs where it listens.
        params_digest: hash of its stage parameters after its latest averaging round ("" if none).
        averaged_at: scheduled DHT time of that round (0 if none).
        software_version: the Murmuration version it runs ("" from peers older than this field).
        bytes_sent: bytes of pipeline and state messages it has sent since it started.
        bytes_received: likewise, received.
        backup_stage: the stage whose backup it keeps for the swarm (``planner.backup_plan``), -1 if none.
        backup_version: the version of that backup (0 if none).
        layout_version: the version of the stage layout it trains under (0: the run spec's own;
            each layer-wise re-plan after a stage vanished adds one, ``planner.replanning``).
        stage_layers: that layout's block ranges per stage; empty means the run spec's own.
        layout_map: per stage of the layout before it, the stage that took its place (-1: it
            vanished); empty under the run spec's own layout, and after a global plan's re-split.
        layout_assignment: from the proposer of a global plan's layout (``dht.layouts``):
            the stage each planned peer takes in it; empty otherwise.
        memory_bytes: the memory it may use for a stage (``--max-memory-mb``, or what its device had
            free when it started), so a re-plan gives it no more layers than it can hold; 0: not said.
        links: what it measured of its links to a few peers it talks to (round-trip time, goodput;
            ``dht.link_figures``), at most 8; empty until it has measured any.
        reachability: whether others can dial it (``planner.reachability``): "direct", "relayed"
            (through a relay slot on a public peer, and hole punching) or "unreachable" (a client of
            stage 0). Left off the wire when "direct", so records of peers older than the field read
            as what they were taken for.
        pinned: it was started with ``--stage`` and never moves: no rescue or rebalance names it
            (issue #15). Left off the wire when false.
        peer_key: the libp2p public key its peer id hashes (RSA identities; empty when the peer id
            inlines the key, as Ed25519 ones do).
        peer_signature: the binding: the identity key's signature of the run id and the record key
            this record is stored under (``dht.identity``). A reader drops a record without a valid one.

    Fields added later have defaults, so records of peers that do not send them still parse.
    """

    peer_id: str
    role: str
    state: str
    stage: int
    flops: float
    samples_per_s: float = 0.0
    num_samples: int = 0
    version: int = 0
    loss: float = math.nan
    val_loss: float = math.nan
    announced_at: float = 0.0
    maddrs: tuple[str, ...] = ()
    params_digest: str = ""
    averaged_at: float = 0.0
    software_version: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0
    backup_stage: int = -1
    backup_version: int = 0
    layout_version: int = 0
    stage_layers: tuple[tuple[int, int], ...] = ()
    layout_map: tuple[int, ...] = ()
    layout_assignment: Assignment = ()
    memory_bytes: int = 0
    links: tuple[LinkFigure, ...] = ()
    reachability: str = "direct"
    pinned: bool = False
    peer_key: bytes = b""
    peer_signature: bytes = b""

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, str) or not 1 <= len(self.peer_id) <= 128:
            raise ValueError("peer_id must be a string of 1-128 characters")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.state not in PEER_STATES:
            raise ValueError(f"state must be one of {PEER_STATES}, got {self.state!r}")
        if not isinstance(self.stage, int) or isinstance(self.stage, bool) or not -1 <= self.stage < MAX_STAGES:
            raise ValueError(f"stage must be an integer in [-1, {MAX_STAGES}), got {self.stage!r}")
        if not isinstance(self.backup_stage, int) or isinstance(self.backup_stage, bool) or not -1 <= self.backup_stage < MAX_STAGES:
            raise ValueError(f"backup_stage must be an integer in [-1, {MAX_STAGES}), got {self.backup_stage!r}")
        _check_float("flops", self.flops, 0.0, 1e18)
        _check_float("samples_per_s", self.samples_per_s, 0.0, 1e9)
        _check_float("announced_at", self.announced_at, 0.0, 1e11)
        _check_float("averaged_at", self.averaged_at, 0.0, 1e11)
        for name in ("loss", "val_loss"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isinf(value):
                raise ValueError(f"{name} must be a finite number or NaN (none yet)")
        for name in ("num_samples", "version", "bytes_sent", "bytes_received", "backup_version", "layout_version",
                     "memory_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 62:
                raise ValueError(f"{name} must be a non-negative integer")
        if self.stage_layers:
            check_stage_layers(self.stage_layers, None)
        if (not isinstance(self.layout_map, tuple) or len(self.layout_map) > MAX_STAGES or not all(
                isinstance(k, int) and not isinstance(k, bool) and -1 <= k < MAX_STAGES for k in self.layout_map)):
            raise ValueError(f"layout_map must be at most {MAX_STAGES} stage indices (or -1)")
        if assignment_from_wire(self.layout_assignment, max_stages=MAX_STAGES) != self.layout_assignment:
            raise ValueError("layout_assignment must be a tuple of (tag, stage) tuples")
        if not isinstance(self.links, tuple) or links_from_wire(self.links) != self.links:
            raise ValueError(f"links must be a tuple of at most {MAX_LINK_FIGURES} link figures")
        if self.reachability not in REACHABILITIES:
            raise ValueError(f"reachability must be one of {REACHABILITIES}, got {self.reachability!r:.40}")
        if not isinstance(self.pinned, bool):
            raise ValueError("pinned must be true or false")
        if len(self.maddrs) > MAX_ADDRS or not all(isinstance(a, str) and len(a) < 256 for a in self.maddrs):
            raise ValueError("maddrs must be at most 16 strings")
        if not isinstance(self.params_digest, str) or len(self.params_digest) > 128:
            raise ValueError("params_digest must be a short string")
        if not isinstance(self.software_version, str) or not SOFTWARE_VERSION_PATTERN.fullmatch(self.software_version):
            raise ValueError("software_version must be up to 32 letters, digits or '.+_-'")
        for name in ("peer_key", "peer_signature"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) > MAX_BINDING_BYTES:
                raise ValueError(f"{name} must be at most {MAX_BINDING_BYTES} bytes")

    def to_wire(self, *, with_binding: bool = True) -> dict[str, Any]:
        """The record as stored; ``with_binding=False`` leaves out the binding's bytes (for JSON logs)."""
        wire = asdict(self)
        wire["maddrs"] = list(self.maddrs)
        wire["stage_layers"] = [list(r) for r in self.stage_layers]
        wire["layout_map"] = list(self.layout_map)
        wire["links"] = [figure.to_wire() for figure in self.links]
        wire["layout_assignment"] = [list(pair) for pair in self.layout_assignment]
        for key, default in (("links", []), ("reachability", "direct"), ("pinned", False), ("layout_assignment", [])):
            if wire[key] == default:  # the default, and what records of peers older than the field read as
                del wire[key]
        if math.isnan(self.val_loss):
            del wire["val_loss"]  # none yet (every peer but stage 0's): read back as the default NaN
        if not with_binding:
            del wire["peer_key"], wire["peer_signature"]
        return wire

    @classmethod
    def from_wire(cls, wire: Any) -> PeerRecord:
        if not isinstance(wire, dict):
            raise ValueError(f"peer record must be a map, got {type(wire).__name__}")
        fields = dict(wire)
        maddrs = fields.get("maddrs", ())
        if not isinstance(maddrs, (list, tuple)):
            raise ValueError(f"peer record maddrs must be a list, got {type(maddrs).__name__}")
        fields["maddrs"] = tuple(maddrs)
        layers = fields.get("stage_layers", ())
        if not isinstance(layers, (list, tuple)) or len(layers) > MAX_STAGES:
            raise ValueError("peer record stage_layers must be a list of at most 64 ranges")
        fields["stage_layers"] = tuple(tuple(r) if isinstance(r, (list, tuple)) else r for r in layers)
        layout_map = fields.get("layout_map", ())
        if not isinstance(layout_map, (list, tuple)):
            raise ValueError("peer record layout_map must be a list")
        fields["layout_map"] = tuple(layout_map)
        fields["links"] = links_from_wire(fields.get("links", ()))
        fields["layout_assignment"] = assignment_from_wire(fields.get("layout_assignment", ()), max_stages=MAX_STAGES)
        try:
            return cls(**fields)
        except TypeError as e:
            raise ValueError(f"peer record has wrong fields: {e}") from None


def _check_float(name: str, value: Any, low: float, high: float, *, open_low: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or value > high or (open_low and value == low):
        raise ValueError(f"{name} must be in {'(' if open_low else '['}{low}, {high}], got {value!r}")
