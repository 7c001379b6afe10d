"""Errors that end a peer with one sentence for the user and a non-zero exit code."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix (unreachable bootstrap, unknown run, not enough memory).

    The message is one sentence saying what is wrong and what to do; the entry script prints it
    without a traceback and exits with ``exit_code``.
    """

    def __init__(self, message: str, *, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
