"""The seed planners evaluated offline by ``bench/`` (``bench/planner.py``, ``bench/simulator_check.py``).

Nothing here runs in a live peer: ``peer/``, ``swarm/``, ``replication/``, ``dht/`` and the
``run_*.py`` scripts import none of these modules (``tests/unit/test_import_rule.py`` checks it).
They score plans with the same cost model as the live planner (``planner.costs``) and may import
the live ``planner`` modules, never the other way round. docs/planner.md describes each of them.

* ``global_plan``: the global plan of issue #18: seed 000's construction on the whole swarm and on
  device pools (subsets that leave slow or badly linked devices idle), the baselines and the
  literature's planners as candidates, scored by the cost model and checked in the simulator;
  deterministic and invariant to renaming through ``canonical`` (a relabelling-free device order);
* ``partition``: seed 000 §3.3.3's global plan (clustering → stage order → unreliable devices to
  the partition of least delay → layers → roles), followed by ``refinement``'s local search;
  ``clustering`` (divisive hierarchical clustering), ``ordering`` (stage order as an open TSP),
  ``evaluation`` (memoised scoring of arrangements) and ``refinement`` are its parts;
* ``exhaustive``: the brute-force optimum for small swarms, the oracle of the tests and the bench;
* ``rebalance``: a join decision and a multi-move rebalance on a full ``Plan`` with seed 000's cost
  model (links, clients, averaging). The live peer decides both with ``planner.stage_choice``
  instead, from measured FLOP/s alone;
* ``baselines``: GPipe's even split, Petals' weakest block, SWARM-style rebalancing;
* ``asteroid`` (seed 001) and ``spantrain`` (seed 002): the literature's planners;
* ``simulator``: discrete-event simulation of a plan (pipeline, task pool, churn, averaging);
* ``scenarios``: synthetic swarms (random regions, seed 000 Case 3) for the bench and tests;
* ``internet`` and ``lifetime``: a stated internet model (regions, home links, GPUs, churn) and an
  event-level simulation of a swarm's life under it with the live join, rebalancing and
  re-planning rules, at up to 10,000 peers (``bench/global_plan.py``).
"""
