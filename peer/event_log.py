"""The peer's event log: one JSON line per event, for the demo, the benchmarks and later reports."""

from __future__ import annotations

import json
import math
import time
from typing import IO, Any


class EventLog:
    """Appends ``{"t": unix time, "event": name, ...}`` lines to a file; a no-op without a path."""

    def __init__(self, path: str | None) -> None:
        self._file: IO[str] | None = open(path, "a", buffering=1) if path else None

    def write(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"t": time.time(), "event": event, **{k: _jsonable(v) for k, v in fields.items()}}
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
