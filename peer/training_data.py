"""What a peer trains on: the run's data as its tokenizer's ids, and where the tokenizer comes from.

The run spec names the tokenizer, the swarm serves it.
A byte-token run needs nothing. A BPE run names its ``tokenizer.json`` by hash; the peer takes
``--tokenizer FILE`` if given (refused with one sentence if its hash is not the run's), and
otherwise asks the swarm (``replication.run_files``): the peers that already train first, in a
random order, so joiners spread over the swarm, and the bootstrap nodes last. Every copy is checked
against the hash before it is used; once it holds the file, the peer serves it too. With
``--checkpoint-dir`` the file is written beside the stage checkpoints, so an export of that folder
carries the tokenizer the weights were trained with.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Iterable

from hivemind.p2p import P2P

from dht.records import RunSpec
from peer.config import PeerConfig
from peer.errors import UserError
from peer.join import bootstrap_peer_ids
from replication.run_files import RunFileError, RunFileServer, fetch_run_file
from swarm.data import Corpus, DataError, Tokens, load_corpus
from swarm.tokenizer import BYTES, BpeTokenizer, Tokenizer, TokenizerError, load_tokenizer, read_tokenizer_file, tokenizer_id
from swarm.view import SwarmView

logger = logging.getLogger(__name__)
TOKENIZER_FILE = "tokenizer.json"  # its name in a checkpoint folder and in an exported model
FETCH_RETRY = 2.0  # seconds between rounds of asking every peer known


def load_run_corpus(spec: RunSpec, config: PeerConfig) -> Corpus:
    """The run's data (``--data`` or the built-in corpus); ``UserError`` if they cannot be the run's."""
    try:
        return load_corpus(spec.dataset, config.data)
    except DataError as e:
        raise UserError(f"Cannot load the training data: {e}.") from e


class TrainingData:
    """The run's tokenizer, the corpus as its ids, and the server of the tokenizer file (a BPE run's)."""

    def __init__(self, tokenizer: Tokenizer, tokens: Tokens, file_server: RunFileServer | None) -> None:
        self.tokenizer, self.tokens, self.file_server = tokenizer, tokens, file_server

    @classmethod
    async def open(cls, p2p: P2P, spec: RunSpec, view: SwarmView, corpus: Corpus, *, config: PeerConfig,
                   peer_id: str) -> TrainingData:
        tokenizer = await obtain_tokenizer(p2p, spec, view, peer_id=peer_id, own_file=config.tokenizer,
                                           bootstraps=bootstrap_peer_ids(config.bootstrap),
                                           timeout=config.join_timeout, checkpoint_dir=config.checkpoint_dir)
        try:
            tokens = await asyncio.to_thread(corpus.encode, tokenizer)
        except DataError as e:
            raise UserError(f"Cannot use the training data: {e}.") from e
        server = None
        if isinstance(tokenizer, BpeTokenizer):
            server = RunFileServer(p2p, spec.run_id, {tokenizer.id: tokenizer.blob})
            await server.start()
        return cls(tokenizer, tokens, server)

    async def shutdown(self) -> None:
        if self.file_server is not None:
            await self.file_server.shutdown()


async def obtain_tokenizer(p2p: P2P, spec: RunSpec, view: SwarmView, *, peer_id: str, own_file: str | None,
                           bootstraps: Iterable[str], timeout: float, checkpoint_dir: str | None = None) -> Tokenizer:
    """The run's tokenizer, checked against ``spec``; ``UserError`` for a wrong ``own_file``,
    ``RuntimeError`` if no peer served it within ``timeout`` seconds."""
    if spec.tokenizer == BYTES:
        return load_tokenizer(BYTES)
    try:
        if own_file:
            tokenizer = load_tokenizer(spec.tokenizer, read_tokenizer_file(own_file))
        else:
            tokenizer = load_tokenizer(spec.tokenizer, await _fetch(p2p, spec, view, set(bootstraps) | {peer_id}, timeout, peer_id))
    except TokenizerError as e:
        raise UserError(f"Cannot use the tokenizer: {e}.") from e
    if tokenizer.vocab_size > spec.model.vocab_size:
        raise UserError(f"The run's tokenizer has {tokenizer.vocab_size} tokens, more than its model's vocabulary of "
                        f"{spec.model.vocab_size}: the run was published inconsistently; tell its owner.")
    if checkpoint_dir:
        save_tokenizer(checkpoint_dir, tokenizer.blob)
    return tokenizer


def save_tokenizer(folder: str, blob: bytes) -> None:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, TOKENIZER_FILE)
    with open(path + ".tmp", "wb") as f:
        f.write(blob)
    os.replace(path + ".tmp", path)


async def _fetch(p2p: P2P, spec: RunSpec, view: SwarmView, skip: set[str], timeout: float, peer_id: str) -> bytes:
    deadline, started = time.monotonic() + timeout, time.monotonic()
    while True:
        peers = [r.peer_id for r in view.all_records if r.peer_id not in skip]
        random.shuffle(peers)
        try:
            blob = await fetch_run_file(p2p, spec.run_id, spec.tokenizer, peers + sorted(skip - {peer_id}),
                                        verify=lambda b: tokenizer_id(b) == spec.tokenizer)
        except RunFileError as e:
            if time.monotonic() + FETCH_RETRY > deadline:
                raise RuntimeError(f"could not obtain the run's tokenizer from the swarm: {e}") from e
            logger.info(f"waiting for a peer to serve the run's tokenizer ({e})")
            await asyncio.sleep(FETCH_RETRY)
            await view.refresh()
            continue
        logger.info(f"obtained the run's tokenizer ({len(blob):,} bytes) from the swarm in {time.monotonic() - started:.1f}s")
        return blob
