"""Pure planning algorithms: cost models, stage choice, backups, re-planning.

Imports no torch, no hivemind, no asyncio, no sockets, no clock and no global RNG (DESIGN §2):
every function takes the snapshot, the config, ``now`` and an ``rng`` it needs as arguments, so
peers that see the same snapshot make the same decision.

The package holds two kinds of planner, one per place:

* ``planner/`` itself: the modules the live peer runs (imported, directly or through each other,
  by ``peer/``, ``swarm/`` and the ``run_*.py`` scripts):

  - ``stage_choice``: the join decision (the stage of largest throughput deficit, concurrent
    joiners placed in announce order) and rebalancing with hysteresis (``choose_move``);
  - ``reachability``: a dial-back check's verdict (direct, relayed, unreachable) and what a relayed
    peer adds to a stage it must be dialled for;
  - ``backup_plan``: who keeps the backup of a lone holder's stage and who rescues a lost stage;
  - ``claims``: bounds on the figures peers claim about themselves (FLOP/s, samples/s, backup
    versions) by the other peers' figures, so one liar cannot steer those decisions;
  - ``link_view``: one estimate per pair of peers from the link figures they publish (the worse of
    both ends' figures; one end's, bounded by the swarm's), for the router's path and the planner's
    link matrices;
  - ``replanning``: re-splitting the layers over the stages left after a stage is lost (seed 001 §3.4);
  - ``global_plan``: the global plan of issue #18 (stage count, layer split, who serves what) from a
    snapshot of the swarm: seed 000's construction on the whole swarm and on device pools, the
    baselines and the literature's planners as rivals, scored by the cost model and checked in the
    simulator, deterministic and invariant to renaming (``peer.plan_watch`` computes it live);
  - ``adoption``: whether the swarm should move to a global plan: a clear gain whose moves (state
    pulled over the measured links) pay back within a horizon;
  - what ``global_plan`` runs: ``partition`` (seed 000 §3.3.3: clustering → stage order → clients →
    layers → roles, then local search) with its parts ``clustering``, ``ordering``, ``evaluation`` and
    ``refinement``; ``baselines`` (GPipe's even split, Petals, SWARM); ``asteroid`` (seed 001) and
    ``spantrain`` (seed 002); ``simulator`` (discrete-event simulation of a plan); ``canonical`` (a
    relabelling-free device order);
  - ``layer_split``, ``assembly``, ``costs``, ``plan``, ``snapshot``, ``runtime``: what the planners
    build on (the one cost model the planners and the simulator share, the bottleneck DP over layer
    boundaries, ``Plan``, ``SwarmSnapshot`` and the runtime's settings it carries).

* ``planner/offline/``: what only ``bench/`` and the tests run: the brute-force oracle, the offline
  rebalance model, synthetic scenarios and the internet-scale lifetime simulator. The live peer
  imports none of them (``tests/unit/test_import_rule.py`` checks it).
"""
