"""Host a bootstrap node: start the swarm's DHT, publish the run spec, print the multiaddrs to share."""

from __future__ import annotations

import asyncio
import logging
import sys

from peer.cli import config_parser, load_config
from peer.config import BootstrapConfig
from peer.entry import run_until_signalled
from peer.logs import configure_logging

logger = logging.getLogger("run_bootstrap")


def main(argv: list[str] | None = None) -> int:
    parser = config_parser(BootstrapConfig)
    try:
        config, _args = load_config(parser, BootstrapConfig, argv)
    except ValueError as e:
        parser.error(str(e))
    from peer.bootstrap import BootstrapNode, open_bootstrap_status, prepare_run  # heavy imports after parsing: --help stays fast

    configure_logging(config.log_level, lambda: "[bootstrap] ")
    try:
        prepared = prepare_run(config)  # the model, data and tokenizer settings, checked before anything starts
    except ValueError as e:  # DataError and TokenizerError are ValueErrors too
        parser.error(str(e))

    async def serve(stop: asyncio.Event) -> None:
        with BootstrapNode(config, prepared) as node:
            maddrs = await asyncio.to_thread(node.start)
            await node.find_owner()
            logger.info(node.spec.describe())
            keeps = ("another bootstrap's" if not node.publishes else f"kept in {config.identity_path}.rsa"
                     if config.identity_path else "new at every start: give --identity-path to keep the run across restarts")
            logger.info(f"run '{config.run_id}' is owned by key {node.owner} ({keeps})")
            print("Bootstrap node is up. Peers join with:", flush=True)
            for maddr in maddrs:
                print(f"  python run_peer.py --bootstrap {maddr} --run-id {config.run_id} --run-owner {node.owner}",
                      flush=True)
            status, samples = open_bootstrap_status(node)
            async with status:  # --status-port: the swarm's health page and metrics
                sampling = asyncio.create_task(samples.run(stop, lambda: node.spec)) if samples else None
                await node.serve(stop)
                if sampling is not None:
                    sampling.cancel()
                    await asyncio.gather(sampling, return_exceptions=True)

    return run_until_signalled(serve)


if __name__ == "__main__":
    sys.exit(main())
