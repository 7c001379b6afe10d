"""What both entry scripts share: an event loop, SIGINT/SIGTERM as a clean stop, user errors as one line.

SIGTERM is turned into the same orderly stop as Ctrl+C, because a process that owns a
``hivemind.DHT`` and dies on SIGTERM orphans its DHT child and p2pd (FIELD-NOTES).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable

import uvloop

from peer.errors import UserError

logger = logging.getLogger(__name__)


def run_until_signalled(serve: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run ``serve(stop)`` until it returns; the first SIGINT/SIGTERM sets ``stop``, a second one aborts.

    Returns:
        the process exit code: 0, the UserError's code, or 1 on an unexpected failure.
    """

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()

        def on_signal() -> None:
            if stop.is_set():
                task.cancel()  # second signal: stop waiting for a graceful leave
            stop.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal)
        await serve(stop)

    try:
        uvloop.run(main())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except asyncio.CancelledError:
        return 130
    except Exception:
        logger.exception("stopped by an unexpected error")
        return 1
    return 0
