"""Run a volunteer peer: join the swarm, choose a stage, train it, leave cleanly on Ctrl+C."""

from __future__ import annotations

import asyncio
import sys

from peer.cli import config_parser, load_config
from peer.config import PeerConfig
from peer.entry import run_until_signalled
from peer.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    parser = config_parser(PeerConfig)
    try:
        config, args = load_config(parser, PeerConfig, argv)
    except ValueError as e:
        parser.error(str(e))
    from peer.lifecycle import Peer  # heavy imports after argument parsing: --help stays fast

    peer = Peer(config)
    configure_logging(config.resolved_log_level, peer.log_prefix)
    if config.num_threads:
        import torch

        torch.set_num_threads(config.num_threads)

    async def serve(stop: asyncio.Event) -> None:
        await peer.run(stop)

    return run_until_signalled(serve)


if __name__ == "__main__":
    sys.exit(main())
