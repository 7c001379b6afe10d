"""What both entry scripts share: an event loop, SIGINT/SIGTERM as a clean stop, user errors as one line.

SIGTERM is turned into the same orderly stop as Ctrl+C, because a process that owns a
``hivemind.DHT`` and dies on SIGTERM orphans its DHT child and p2pd (FIELD-NOTES).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

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


@contextlib.asynccontextmanager
async def stop_or_after(stop: asyncio.Event, seconds: float) -> AsyncIterator[asyncio.Event]:
    """An event set when ``stop`` is, or ``seconds`` after entering (0: never by time): what a peer
    serves under for ``--run-for``. Not ``stop`` itself: a Ctrl+C after the time ran out is then a
    first one (a graceful leave), not the second that aborts it."""
    leave, loop = asyncio.Event(), asyncio.get_running_loop()
    relay = loop.create_task(stop.wait())
    relay.add_done_callback(lambda _: leave.set())
    timer = loop.call_later(seconds, leave.set) if seconds > 0 else None
    try:
        yield leave
    finally:
        relay.cancel()
        if timer is not None:
            timer.cancel()
