"""The peer's log set-up: hivemind's tracebacks of a failed averaging round become our one line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from hivemind.averaging.partition import AllreduceException

from peer.logs import configure_logging


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _captured(logger: logging.Logger) -> Iterator[_Capture]:
    """What ``logger`` passes on, while ``configure_logging`` may run; the root's set-up restored after."""
    capture, root = _Capture(), logging.getLogger()
    handlers, level = list(root.handlers), root.level
    logger.addHandler(capture)
    try:
        yield capture
    finally:
        logger.removeHandler(capture)
        root.handlers[:], root.level = handlers, level


def _step(logger: logging.Logger) -> None:  # named as hivemind's DecentralizedAverager._step
    try:
        raise RuntimeError("Averaging step failed: could not find a group")
    except RuntimeError as e:
        logger.exception(e)


def _aggregate_with_group(logger: logging.Logger) -> None:  # the all-reduce under _step
    try:
        raise RuntimeError("a reducer failed: 128 of 1288731 averaged values did not arrive")
    except RuntimeError as e:
        logger.exception(e)


def test_a_failed_rounds_traceback_from_the_averager_is_dropped_unless_debugging():
    averager = logging.getLogger("hivemind.averaging.averager")
    with _captured(averager) as capture:
        configure_logging("INFO")
        configure_logging("INFO")  # a second set-up adds no second filter
        _step(averager)
        _aggregate_with_group(averager)
        averager.warning("a warning of the averager's own")
        assert [r.getMessage() for r in capture.records] == ["a warning of the averager's own"]
        configure_logging("DEBUG")
        _step(averager)
        assert len(capture.records) == 2 and capture.records[-1].exc_info
        assert sum(type(f).__name__ == "_FailedRoundFilter" for f in averager.filters) == 1


def test_a_cancelled_rounds_unretrieved_future_is_not_an_error_for_the_volunteer(capsys):
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        configure_logging("INFO")
        try:
            raise asyncio.CancelledError()
        except asyncio.CancelledError:
            logging.getLogger("asyncio").error("Future exception was never retrieved\nfuture: <Future>", exc_info=True)
        try:
            raise RuntimeError("a real error")
        except RuntimeError:
            logging.getLogger("asyncio").error("Future exception was never retrieved\nfuture: <Future>", exc_info=True)
        shown = capsys.readouterr().err
        assert "CancelledError" not in shown and "a real error" in shown
    finally:
        root.handlers[:], root.level = handlers, level


def _handle_stream(logger: logging.Logger, error: Exception) -> None:  # named as hivemind's P2P._handle_stream
    try:
        raise error
    except Exception:
        logger.warning("Exception while receiving requests:", exc_info=True)


def test_a_stream_the_other_side_reset_is_one_line_without_its_traceback_unless_debugging():
    streams = logging.getLogger("hivemind.p2p.p2p_daemon")
    with _captured(streams) as capture:
        configure_logging("INFO")
        configure_logging("INFO")  # a second set-up adds no second filter
        _handle_stream(streams, ConnectionResetError(104, "Connection reset by peer"))
        _handle_stream(streams, ValueError("a bug of ours"))  # anything else keeps its traceback
        assert capture.records[0].exc_info is None
        assert capture.records[0].getMessage() == ("Exception while receiving requests: "
                                                   "ConnectionResetError: [Errno 104] Connection reset by peer")
        assert capture.records[1].exc_info is not None
        configure_logging("DEBUG")
        _handle_stream(streams, ConnectionResetError(104, "Connection reset by peer"))
        assert capture.records[2].exc_info is not None
        assert sum(type(f).__name__ == "_ResetStreamFilter" for f in streams.filters) == 1


def await_cancelled(logger: logging.Logger, error: BaseException, task: str) -> None:  # as hivemind's
    try:
        raise error
    except BaseException:
        logger.exception(f"Exception in {task}:")


def test_hivemind_s_matchmaking_race_is_one_warning_without_its_traceback_unless_debugging():
    tasks = logging.getLogger("hivemind.utils.asyncio")
    race = "<Task finished name='Task-806' coro=<Matchmaking._request_join_potential_leaders() done> exception=AssertionError()>"
    with _captured(tasks) as capture:
        configure_logging("INFO")
        configure_logging("INFO")  # a second set-up adds no second filter
        await_cancelled(tasks, AssertionError(), race)
        await_cancelled(tasks, AssertionError(), "<Task finished coro=<Something.else()>>")  # keeps its traceback
        await_cancelled(tasks, ValueError("a bug"), race)  # another error keeps its traceback
        assert capture.records[0].exc_info is None and capture.records[0].levelno == logging.WARNING
        assert "matchmaking" in capture.records[0].getMessage()
        assert capture.records[1].exc_info is not None and capture.records[2].exc_info is not None
        configure_logging("DEBUG")
        await_cancelled(tasks, AssertionError(), race)
        assert capture.records[3].exc_info is not None and capture.records[3].levelno == logging.ERROR
        assert sum(type(f).__name__ == "_MatchmakingRaceFilter" for f in tasks.filters) == 1


def test_a_collected_hivemind_stream_task_is_one_warning_unless_debugging(capsys):
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    pending = ("Task was destroyed but it is pending!\ntask: <Task pending name='Task-129' coro=<ControlClient._handler() "
               "running at /x/site-packages/hivemind/p2p/p2p_daemon_bindings/control.py:154>>")
    try:
        configure_logging("INFO")
        logging.getLogger("asyncio").error(pending)
        try:
            raise RuntimeError("cannot reuse already awaited coroutine")
        except RuntimeError:
            logging.getLogger("asyncio").error("Unhandled exception in client_connected_cb\ntransport: <T>", exc_info=True)
        reset = ("Task exception was never retrieved\nfuture: <Task finished coro=<P2P._iterate_protobuf_stream_handler"
                 ".<locals>._write_to_stream() done, defined at /x/site-packages/hivemind/p2p/p2p_daemon.py:491>>")
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError:
            logging.getLogger("asyncio").error(reset, exc_info=True)
        logging.getLogger("asyncio").error("Task was destroyed but it is pending!\ntask: <Task coro=<ours() at /x/peer/a.py:1>>")
        try:
            raise ValueError("a bug in hivemind's task")
        except ValueError:
            logging.getLogger("asyncio").error(reset, exc_info=True)
        shown = capsys.readouterr().err.splitlines()
        failed_part = ("Task exception was never retrieved\nfuture: <Task finished name='Task-724' coro=<AllReduceRunner."
                       "_communicate_with_peer() done, defined at /x/site-packages/hivemind/averaging/allreduce.py:201>>")
        try:
            raise AllreduceException("12D3KooWSYFV sent INTERNAL_ERROR")
        except AllreduceException:
            logging.getLogger("asyncio").error(failed_part, exc_info=True)
        part = capsys.readouterr().err
        assert part.startswith(part.split(" ", 1)[0] + " W ") and "failed averaging round" in part
        assert "INTERNAL_ERROR" in part and "Traceback" not in part and part.count("\n") == 1
        assert [line.split(" ", 2)[1] for line in shown[:3]] == ["W", "W", "W"]
        assert "collected (harmless)" in shown[0] and "Traceback" not in "\n".join(shown[:3])
        assert " E " in shown[3] and "ours()" in shown[4]  # a task of ours destroyed pending stays an error
        assert any(" E " in line and "never retrieved" in line for line in shown[5:])  # another error keeps it
        assert "a bug in hivemind's task" in "\n".join(shown[5:])
        configure_logging("DEBUG")
        logging.getLogger("asyncio").error(pending)
        assert " E " in capsys.readouterr().err
    finally:
        root.handlers[:], root.level = handlers, level
