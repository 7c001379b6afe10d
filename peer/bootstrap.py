"""The bootstrap node: starts the swarm's first DHT node and publishes the run spec, signed."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time

from dht.node import DHTNodeConfig, open_dht, visible_maddrs
from dht.layouts import even_stage_layers
from dht.records import ModelSpec, RunSpec
from dht.registry import declare_run_spec, fetch_run_specs, owner_fingerprint
from peer.config import BootstrapConfig, PeerConfig
from peer.gather import GatheredModel, gather_model
from peer.model_sample import SampleLoop
from peer.profiler import stage_memory_bytes
from peer.reachability import is_loopback_only, open_public_services
from peer.relayout import newest_layout_records
from peer.status.service import StatusService, StatusSource
from replication.run_files import RunFileServer
from swarm.data import BUILTIN_PYDOC, Corpus, DataError, files_dataset_id, load_corpus
from swarm.presets import preset
from swarm.tokenizer import BpeTokenizer, ByteTokenizer, Tokenizer, read_tokenizer_file, train_bpe
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
DEFAULT_MAX_IN_FLIGHT = PeerConfig.__dataclass_fields__["max_in_flight"].default  # what a peer keeps in flight


def build_run_spec(config: BootstrapConfig) -> RunSpec:
    """The run spec the bootstrap publishes; ``ValueError`` or ``DataError`` on bad settings."""
    return prepare_run(config)[0]


def prepare_run(config: BootstrapConfig) -> tuple[RunSpec, Tokenizer]:
    """The run spec the bootstrap publishes and the tokenizer it names (trained on the corpus or
    read from ``--tokenizer``); ``ValueError``, ``DataError`` or ``TokenizerError`` on bad settings."""
    dataset = files_dataset_id(config.data) if config.data else BUILTIN_PYDOC
    corpus = load_corpus(dataset, config.data)  # fail here, not on every peer, if the files are unusable
    tokenizer = run_tokenizer(config, corpus)
    corpus.encode(tokenizer)  # token shards of another tokenizer: refused here, once
    if config.preset:
        model = preset(config.preset)
    else:
        model = ModelSpec(family=config.model_family, d_model=config.d_model, num_layers=config.num_layers,
                          num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, ffn_dim=config.ffn_dim,
                          seq_len=config.seq_len)
    if tokenizer.id != "bytes":
        model = dataclasses.replace(model, vocab_size=tokenizer.vocab_size)
    if config.boundary_subspace >= model.d_model:
        raise ValueError(f"--boundary-subspace must be below the model's d_model ({model.d_model}), got {config.boundary_subspace}")
    model = dataclasses.replace(model, boundary_subspace=config.boundary_subspace)
    if config.num_stages > model.num_layers:
        raise ValueError(f"--num-stages must be between 1 and the model's {model.num_layers} layers, or 0 to choose")
    spec = RunSpec(
        run_id=config.run_id, model=model, stage_layers=even_stage_layers(model.num_layers, config.num_stages or 1),
        lr=config.lr, weight_decay=config.weight_decay, microbatch_size=config.microbatch_size,
        target_batch_size=config.target_batch_size, pipeline_schedule=config.pipeline_schedule,
        replica_sync=config.replica_sync,
        averaging_period=config.averaging_period,
        dataset=dataset, tokenizer=tokenizer.id, precision=config.precision,
        boundary_codec=config.boundary_codec, gradient_codec=config.gradient_codec, seed=config.seed,
    )
    if config.num_stages == 0:
        num_stages, _ = stages_to_fit(spec, config.stage_memory_gb * 2**30)
        spec = dataclasses.replace(spec, stage_layers=even_stage_layers(model.num_layers, num_stages))
    return spec, tokenizer


def run_tokenizer(config: BootstrapConfig, corpus: Corpus) -> Tokenizer:
    """``--tokenizer``: bytes, a BPE tokenizer trained on ``corpus`` (offline), or a tokenizer.json."""
    if config.tokenizer == "bytes":
        return ByteTokenizer()
    if config.tokenizer != "bpe":
        return BpeTokenizer(read_tokenizer_file(config.tokenizer))
    if corpus.tokens is not None:
        raise DataError("--tokenizer bpe trains on text, and these data are token shards: give the tokenizer.json "
                        "they were prepared with (--tokenizer FILE)")
    started = time.monotonic()
    tokenizer = BpeTokenizer(train_bpe(corpus.documents, config.vocab_size))
    logger.info(f"trained a BPE tokenizer of {tokenizer.vocab_size} tokens on the corpus in "
                f"{time.monotonic() - started:.1f}s ({tokenizer.id[:16]}…)")
    return tokenizer


def stages_to_fit(spec: RunSpec, memory_bytes: float, *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> tuple[int, int]:
    """The fewest even stages of ``spec``'s model whose every stage needs at most ``memory_bytes`` to
    train (``peer.profiler.stage_memory_bytes``), and the most one of them needs. ``ValueError`` if
    even one layer per stage needs more."""
    layers = spec.model.num_layers
    for num_stages in range(1, layers + 1):
        cut = dataclasses.replace(spec, stage_layers=even_stage_layers(layers, num_stages))
        need = max(stage_memory_bytes(cut, k, max_in_flight=max_in_flight) for k in range(num_stages))
        if need <= memory_bytes:
            return num_stages, need
    raise ValueError(f"even one layer per stage needs {need / 2**30:.1f} GiB, more than --stage-memory-gb "
                     f"{memory_bytes / 2**30:g}: raise it, or lower --microbatch-size")


class BootstrapNode:
    """Owns the DHT node; :meth:`serve` keeps the run spec published until ``stop`` is set."""

    def __init__(self, config: BootstrapConfig, prepared: tuple[RunSpec, Tokenizer] | None = None) -> None:
        self.config = config
        self.spec, self.tokenizer = prepared or prepare_run(config)
        self.file_server: RunFileServer | None = None  # serves the tokenizer.json, if the run has one
        if config.num_stages == 0:
            _, need = stages_to_fit(self.spec, config.stage_memory_gb * 2**30)
            logger.info(f"{self.spec.num_stages} stages, so that training one needs at most {need / 2**30:.1f} GiB "
                        f"(--stage-memory-gb {config.stage_memory_gb:g}; --num-stages sets it)")
        self.dht = None
        self.validator = None
        self.owner = ""  # owner_fingerprint of the record key the spec is signed with, once started
        self.publishes = True  # false for a second bootstrap of another key's run (find_owner)

    def start(self) -> list[str]:
        """Start the DHT node; returns the multiaddrs peers should use (:meth:`serve` writes them to
        ``--maddrs-file`` once it answers the peers' dial-back checks)."""
        local = is_loopback_only(self.config.host_maddrs)  # else its relay is pinned (peer.reachability)
        node_config = DHTNodeConfig(initial_peers=self.config.initial_peers, host_maddrs=self.config.host_maddrs,
                                    announce_maddrs=self.config.announce_maddrs, identity_path=self.config.identity_path,
                                    daemon_reachability=None if local else "private",
                                    reuse_port=False)  # others dial it at its own address (dht.node)
        self.dht, self.validator = open_dht(node_config)
        self.owner = owner_fingerprint(self.validator.local_public_key)
        return visible_maddrs(self.dht)

    def _write_maddrs_file(self) -> None:
        if self.config.maddrs_file:
            tmp = self.config.maddrs_file + ".tmp"
            with open(tmp, "w") as f:
                f.write("\n".join(visible_maddrs(self.dht)) + "\n")
            os.replace(tmp, self.config.maddrs_file)  # readers never see a half-written file

    async def serve(self, stop: asyncio.Event) -> None:
        """Publish the run spec until ``stop``; meanwhile dial peers back that ask whether others can
        reach them, and relay for up to ``--relay-slots`` of those behind NATs (``peer.reachability``)."""
        p2p = await self.dht.replicate_p2p()
        slots = 0 if is_loopback_only(self.config.host_maddrs) else self.config.relay_slots
        services = await open_public_services(p2p, relay_slots=slots)
        self._write_maddrs_file()  # the harness's "up": peers that start now find the checks answered
        try:
            if not self.publishes:
                await stop.wait()  # a DHT entry point of another owner's run: it publishes nothing
                return
            if isinstance(self.tokenizer, BpeTokenizer):
                self.file_server = RunFileServer(p2p, self.spec.run_id, {self.tokenizer.id: self.tokenizer.blob})
                await self.file_server.start()
            await self._publish(stop)
        finally:
            if self.file_server is not None:
                await self.file_server.shutdown()
            for service in services:
                await service.shutdown()

    async def _publish(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                if not await declare_run_spec(self.dht, self.validator, self.spec):
                    logger.warning("the DHT did not accept the run spec; retrying")
            except Exception as e:  # keep serving: the next refresh retries
                logger.warning(f"publishing the run spec failed: {e!r}")
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.config.spec_refresh_period)
            except asyncio.TimeoutError:
                pass

    async def find_owner(self) -> None:
        """A second bootstrap (``--initial-peers``) of a run another key already publishes takes that
        key as the run's owner and only serves the DHT (``publishes`` false); call after :meth:`start`."""
        if not self.config.initial_peers:
            return
        others = [p for p in await fetch_run_specs(self.dht, self.spec.run_id) if p.owner != self.owner]
        if others:
            self.spec, self.owner, self.publishes = others[0].spec, others[0].owner, False
            logger.info(f"run '{self.spec.run_id}' is already published by key {self.owner}: this node serves "
                        f"the DHT and publishes no spec of its own")

    def shutdown(self) -> None:
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None

    def __enter__(self) -> BootstrapNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def open_bootstrap_status(node: BootstrapNode) -> tuple[StatusService, SampleLoop | None]:
    """The bootstrap's status service: the health page and metrics of the whole swarm on
    ``--status-port``, from a swarm view of its own (nothing at all with port 0); and, with a page and
    ``--sample-period``, the loop that writes the page's samples of the model's text (the caller runs
    it: ``SampleLoop.run``)."""
    config = node.config
    view = SwarmView(node.dht, config.run_id) if config.status_port else None
    samples = None
    if view is not None and config.sample_period > 0:
        samples = SampleLoop(lambda: _gather(node, view), period=config.sample_period)
    # after a layer-wise re-plan, the stages and peers of the layout the swarm trains under (peer.relayout)
    source = StatusSource(run_id=config.run_id, spec=lambda: newest_layout_records(view, node.spec)[0] if view else node.spec,
                          records=lambda: newest_layout_records(view, node.spec)[1] if view is not None else [],
                          owned_view=view, sample=samples.document if samples is not None else lambda: None)
    return StatusService(source, host=config.status_host, port=config.status_port), samples


async def _gather(node: BootstrapNode, view: SwarmView) -> GatheredModel:
    """The whole model from the swarm, for a sample; the bootstrap's own tokenizer if it published the run."""
    config = PeerConfig(bootstrap=tuple(visible_maddrs(node.dht)), run_id=node.spec.run_id)  # transfer settings
    return await gather_model(await node.dht.replicate_p2p(), node.spec, view, config=config,
                              peer_id=node.dht.peer_id.to_base58(), tokenizer=node.tokenizer if node.publishes else None)
