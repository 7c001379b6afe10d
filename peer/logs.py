"""Log set-up for the entry scripts: one handler, a per-peer prefix that follows the peer's state."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable

FORMAT = "%(asctime)s %(levelname).1s %(prefix)s%(message)s"


class _PrefixFilter(logging.Filter):
    def __init__(self, prefix: Callable[[], str]) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        record.prefix = self.prefix()
        return True


class _AveragerRaceFilter(logging.Filter):
    """hivemind 1.1.12's ``DecentralizedAverager._step`` sets the result of a step its caller has
    cancelled (a round given up when a peer leaves its stage or the swarm), and asyncio reports
    the resulting ``InvalidStateError`` as an error. It is harmless: the round was abandoned on
    purpose. Shown only at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "asyncio" or not record.exc_info or record.exc_info[1] is None:
            return True
        error = record.exc_info[1]
        harmless = type(error).__name__ == "InvalidStateError" and "CANCELLED" in str(error) and (
            "DecentralizedAverager._step" in record.getMessage())
        # a round cut short (the peer leaves, a partner vanished): hivemind's all-reduce leaves a
        # cancelled future nobody awaits, and asyncio reports it when it is collected
        harmless = harmless or (isinstance(error, asyncio.CancelledError)
                                and record.getMessage().startswith("Future exception was never retrieved"))
        return not harmless or logging.getLogger().isEnabledFor(logging.DEBUG)


class _FailedRoundFilter(logging.Filter):
    """hivemind's ``DecentralizedAverager._step`` (and ``_aggregate_with_group`` under it) logs the
    traceback of a round it gives up (no group found, a partner gone, a stream broken, a reducer
    whose part did not arrive), then hands the same error to its caller, which logs the
    failed round in one line (swarm/averaging.py). On a slow link that happens every few rounds; a
    volunteer should read one sentence, not a traceback. Shown only at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.funcName not in ("_step", "_aggregate_with_group") or not record.exc_info:
            return True
        return logging.getLogger().isEnabledFor(logging.DEBUG)


class _ResetStreamFilter(logging.Filter):
    """hivemind's ``P2P._handle_stream`` logs the traceback of a request stream whose other side
    reset it (a peer that left or crashed mid-call, an averaging partner gone: seen as a peer left
    a 20 Mbit/s swarm, ci40 2026-11-27); the caller's side reports what it cost. One line without
    the traceback; the traceback at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if (record.funcName == "_handle_stream" and isinstance(error, (ConnectionError, asyncio.IncompleteReadError))
                and not logging.getLogger().isEnabledFor(logging.DEBUG)):
            record.msg, record.args = f"{record.getMessage()} {type(error).__name__}: {error}", ()
            record.exc_info, record.exc_text = None, None
        return True


class _MatchmakingRaceFilter(logging.Filter):
    """hivemind 1.1.12's matchmaking can assemble a group as a leader while a request to join another
    leader is still under way; that request then fails ``assert not self.assembled_group.done()``
    and ``await_cancelled`` logs its traceback at ERROR. The round goes on with the group it has, or
    fails with "could not find a group", which the averager reports in one line (seen on a loaded
    2-core host in a 20 Mbit/s swarm, 2026-11-28). One line without the traceback; the traceback at
    DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if (record.funcName == "await_cancelled" and isinstance(error, AssertionError)
                and "Matchmaking." in record.getMessage() and not logging.getLogger().isEnabledFor(logging.DEBUG)):
            _as_warning(record, "hivemind matchmaking: a join request overtaken by the group it was in (AssertionError)")
        return True


class _CollectedStreamTaskFilter(logging.Filter):
    """When a peer's connection drops (a partner killed mid-stream), the p2p daemon closes the unix
    socket of a stream hivemind's ``ControlClient._handler`` was still reading; asyncio then drops
    its reference to the handler's task, the garbage collector collects it while it is pending, and
    asyncio reports "Task was destroyed but it is pending!" for it and its helpers, and
    "cannot reuse already awaited coroutine" for the stream's callback (seen on the CI host when a
    last-stage replica was killed -9, 2026-11-29). Likewise "Task exception was never retrieved" for
    a hivemind stream task whose other side reset the connection (a 20 Mbit/s swarm, 2026-11-29), and
    for an all-reduce helper whose partner failed the round ("sent INTERNAL_ERROR", "sent 22 parts,
    but we expected 47": the demo in a CI rehearsal, 2026-12-01), which gets a warning of its own.
    The stream was already lost; the caller's side reports what it cost. One warning line; the full
    report at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "asyncio" or logging.getLogger().isEnabledFor(logging.DEBUG):
            return True
        message = record.getMessage()
        error = record.exc_info[1] if record.exc_info else None
        collected = message.startswith("Task was destroyed but it is pending!") and "/hivemind/" in message
        collected = collected or (message.startswith("Task exception was never retrieved") and "/hivemind/" in message
                                  and isinstance(error, ConnectionError))
        reused = (message.startswith("Unhandled exception in client_connected_cb") and isinstance(error, RuntimeError)
                  and "cannot reuse already awaited coroutine" in str(error))
        if (message.startswith("Task exception was never retrieved") and "/hivemind/averaging/" in message
                and _is_allreduce_failure(error)):
            # an all-reduce whose partner failed it: hivemind fails the round (our averager logs that
            # round as failed) but leaves this helper's exception unretrieved
            _as_warning(record, f"hivemind: a part of a failed averaging round: {error}")
        elif collected or reused:
            what = "a task" if collected else "a stream callback"
            _as_warning(record, f"hivemind: {what} of a closed p2p daemon stream was collected (harmless)")
        return True


def _as_warning(record: logging.LogRecord, message: str) -> None:
    """Rewrite ``record`` as one warning line saying ``message`` (no traceback)."""
    record.msg, record.args = message, ()
    record.levelno, record.levelname = logging.WARNING, "WARNING"
    record.exc_info, record.exc_text = None, None


def _is_allreduce_failure(error: BaseException | None) -> bool:
    """Whether ``error`` is hivemind's ``AllreduceException`` (by name: importing hivemind here would
    slow ``run_peer.py --help``, which imports this module before anything heavy)."""
    return error is not None and any(
        cls.__name__ == "AllreduceException" and cls.__module__.startswith("hivemind.") for cls in type(error).__mro__)


def configure_logging(level: str, prefix: Callable[[], str] = lambda: "") -> None:
    """Send our logs to stderr as ``time L [peer 3fa9c1 stage 1 step 40] message``.

    hivemind's own handler is kept for its modules but turned down to warnings, so the peer's
    state transitions stand out.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_PrefixFilter(prefix))
    handler.addFilter(_AveragerRaceFilter())
    handler.addFilter(_CollectedStreamTaskFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    averager = logging.getLogger("hivemind.averaging.averager")
    if not any(isinstance(f, _FailedRoundFilter) for f in averager.filters):
        averager.addFilter(_FailedRoundFilter())
    streams = logging.getLogger("hivemind.p2p.p2p_daemon")
    if not any(isinstance(f, _ResetStreamFilter) for f in streams.filters):
        streams.addFilter(_ResetStreamFilter())
    tasks = logging.getLogger("hivemind.utils.asyncio")
    if not any(isinstance(f, _MatchmakingRaceFilter) for f in tasks.filters):
        tasks.addFilter(_MatchmakingRaceFilter())
