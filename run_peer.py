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
    parser.add_argument("--dry-run", action="store_true", help="join, measure, say which stage this peer would "
                        "take, whether it fits in memory and what it would add to the swarm's throughput, then leave")
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
        if args.dry_run:
            from peer.dry_run import dry_run

            print(await dry_run(config), flush=True)
            return
        await peer.run(stop)

    return run_until_signalled(serve)


if __name__ == "__main__":
    sys.exit(main())
