"""Local swarms for the demo, the benchmarks and the tests: not part of a running peer.

- ``local_swarm``: ``LocalSwarm`` starts ``run_bootstrap.py`` and ``run_peer.py`` processes on
  127.0.0.1, waits on their event logs, and stops them by PID.
- ``demo``: ``python -m peer.harness.demo`` (the README's first command, ``scripts/demo.sh``).

The peer's runtime never imports this package (``tests/unit/test_import_rule.py``).
"""
