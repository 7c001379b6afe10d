"""Holding the garbage collector off while tests parse our own sources (the import rule, no pickle).

CPython 3.11 (gh-106905; 3.11.7 here) loses count of its AST recursion depth when an error is
raised while it builds the tree. A garbage collection at that moment can run a finalizer that
raises, e.g. hivemind's ``ControlClient.__del__`` left over from an earlier test on the same pytest
worker (CI rehearsal, 2026-11-26). ``ast.parse`` then fails with "SystemError: AST constructor
recursion depth mismatch" on a file that is fine. So those tests collect first and hold the
collector off while they parse: each imports :func:`no_collection_while_parsing`, autouse.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def collector_held() -> Iterator[None]:
    """Collect garbage once, then no collection inside (for a loop that parses many files)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@pytest.fixture(autouse=True)
def no_collection_while_parsing() -> Iterator[None]:
    """Every test of a module that imports this fixture runs with the collector held."""
    with collector_held():
        yield
