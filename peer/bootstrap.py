"""The bootstrap node: starts the swarm's first DHT node and publishes the run spec, signed."""

from __future__ import annotations

import asyncio
import logging
import os

from dht.node import DHTNodeConfig, open_dht, visible_maddrs
from dht.records import ModelSpec, RunSpec, even_stage_layers
from dht.registry import declare_run_spec, fetch_run_specs, owner_fingerprint
from peer.config import BootstrapConfig
from peer.relayout import newest_layout_records
from peer.status.service import StatusService, StatusSource
from swarm.data import BUILTIN_PYDOC, files_dataset_id, load_corpus
from swarm.view import SwarmView

logger = logging.getLogger(__name__)


def build_run_spec(config: BootstrapConfig) -> RunSpec:
    """The run spec the bootstrap publishes; ``ValueError`` or ``DataError`` on bad settings."""
    dataset = files_dataset_id(config.data) if config.data else BUILTIN_PYDOC
    load_corpus(dataset, config.data)  # fail here, not on every peer, if the files are unusable
    model = ModelSpec(d_model=config.d_model, num_layers=config.num_layers, num_heads=config.num_heads,
                      seq_len=config.seq_len)
    return RunSpec(
        run_id=config.run_id, model=model, stage_layers=even_stage_layers(config.num_layers, config.num_stages),
        lr=config.lr, weight_decay=config.weight_decay, microbatch_size=config.microbatch_size,
        target_batch_size=config.target_batch_size, pipeline_schedule=config.pipeline_schedule,
        replica_sync=config.replica_sync,
        averaging_period=config.averaging_period,
        dataset=dataset, seed=config.seed,
    )


class BootstrapNode:
    """Owns the DHT node; :meth:`serve` keeps the run spec published until ``stop`` is set."""

    def __init__(self, config: BootstrapConfig) -> None:
        self.config = config
        self.spec = build_run_spec(config)
        self.dht = None
        self.validator = None
        self.owner = ""  # owner_fingerprint of the record key the spec is signed with, once started
        self.publishes = True  # false for a second bootstrap of another key's run (find_owner)

    def start(self) -> list[str]:
        """Start the DHT node; returns the multiaddrs peers should use (also written to a file if asked)."""
        node_config = DHTNodeConfig(initial_peers=self.config.initial_peers, host_maddrs=self.config.host_maddrs,
                                    announce_maddrs=self.config.announce_maddrs, identity_path=self.config.identity_path)
        self.dht, self.validator = open_dht(node_config)
        self.owner = owner_fingerprint(self.validator.local_public_key)
        maddrs = visible_maddrs(self.dht)
        if self.config.maddrs_file:
            tmp = self.config.maddrs_file + ".tmp"
            with open(tmp, "w") as f:
                f.write("\n".join(maddrs) + "\n")
            os.replace(tmp, self.config.maddrs_file)  # readers never see a half-written file
        return maddrs

    async def serve(self, stop: asyncio.Event) -> None:
        if not self.publishes:
            await stop.wait()  # a DHT entry point of another owner's run: it publishes nothing
            return
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


def open_bootstrap_status(node: BootstrapNode) -> StatusService:
    """The bootstrap's status service: the health page and metrics of the whole swarm on
    ``--status-port``, from a swarm view of its own (nothing at all with port 0)."""
    config = node.config
    view = SwarmView(node.dht, config.run_id) if config.status_port else None
    # after a layer-wise re-plan, the stages and peers of the layout the swarm trains under (peer.relayout)
    source = StatusSource(run_id=config.run_id, spec=lambda: newest_layout_records(view, node.spec)[0] if view else node.spec,
                          records=lambda: newest_layout_records(view, node.spec)[1] if view is not None else [],
                          owned_view=view)
    return StatusService(source, host=config.status_host, port=config.status_port)
