"""The peer's log set-up: hivemind's tracebacks of a failed averaging round become our one line."""

from __future__ import annotations

import asyncio
import logging

from peer.logs import configure_logging


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


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
    capture = _Capture()
    averager.addHandler(capture)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
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
    finally:
        averager.removeHandler(capture)
        root.handlers[:], root.level = handlers, level


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
