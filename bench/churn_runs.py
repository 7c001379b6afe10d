"""A churn run kept on disk: what the peers' events files do not say, for ``bench/churn.py --reanalyze``.

``run.json`` in a mode's folder holds the measured window, the applied trace, the run's settings and
how each peer ended (when it went, crashed or drained); each peer's events stay in its own events
file beside it, which :func:`load_run` reads back.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace


def save_run(run: dict, path: Path) -> None:
    """Writes ``run`` (window, applied trace, settings, tracked peers) as ``path``."""
    peers = [{"name": p.name, "events_file": p.proc.metrics_path.name, "gone_at": p.gone_at, "crashed": p.crashed,
              "drained": p.drained} for p in run["peers"]]
    path.write_text(json.dumps({"window": run["window"], "applied": run["applied"], "settings": run["settings"],
                                "peers": peers}))


def load_run(path: Path) -> dict:
    """The run :func:`save_run` wrote, each peer with the events of its file (a torn last line skipped)."""
    saved = json.loads(path.read_text())
    peers = []
    for p in saved["peers"]:
        events = []
        for line in (path.parent / p.pop("events_file")).read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # the last line of a killed peer
        peers.append(SimpleNamespace(events=events, **p))
    return {**saved, "window": tuple(saved["window"]), "peers": peers}
