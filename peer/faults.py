"""Test-only fault injection: make this peer misbehave on purpose, so tests can check it is caught.

Not a user option, and not in ``--help``. A peer started with ``MURMURATION_INJECT_FAULTS`` (faults
separated by commas or spaces) misbehaves as named, and only if ``MURMURATION_ALLOW_FAULT_INJECTION=1``
is set too; otherwise it refuses to start. Faults:

* ``corrupt_shards``: its replication server answers every second request for state pieces with one
  byte of each piece flipped (replication/), the first included, the others correctly: a joiner must
  catch it by the digests, drop it, re-fetch its pieces from other donors and strike it. The first
  is corrupted because a joiner that measures this donor slow may ask it only once.
* ``wrong_outputs``: its stage's forwards return the outputs negated (swarm/stage.py): spot checks
  (swarm/spot_check.py) must catch it.
* ``scale_updates=F``: every optimizer step moves the parameters ``F`` times as far as it should
  (what ``F``-times gradients do under SGD; AdamW would normalise the gradients themselves away), so
  the state it contributes to averaging drifts ``F`` times as far: robust averaging must out-vote it.
* ``nan_updates``: every optimizer step leaves the parameters NaN, so the peer contributes NaN to
  averaging and (on a stage before the last) sends NaN activations: both must be refused.
* ``slow_device``: its record says it is a weak device on a poor link: a thousandth of the compute
  it measured, and of each link's goodput (50 kbit/s where it measured none), and ten times each
  round trip (it computes and sends as fast as it can all the same). Every global plan leaves such
  a peer idle, so a test can count on a peer standing by whatever the others measure.

Every fault is applied here, in one place, by replacing one override point of the object it breaks.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
from collections.abc import Mapping
from typing import Any

from peer.errors import UserError

ALLOW_ENV = "MURMURATION_ALLOW_FAULT_INJECTION"
FAULTS_ENV = "MURMURATION_INJECT_FAULTS"
FAULTS = ("corrupt_shards", "wrong_outputs", "scale_updates", "nan_updates", "slow_device")
SLOW_DEVICE_FACTOR = 1000.0  # slow_device: its compute and goodputs divided by this, its round trips times 10
VALUED = ("scale_updates",)  # faults written name=value; the others take no value
logger = logging.getLogger(__name__)


def is_allowed(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(ALLOW_ENV, "") == "1"


def read_faults(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The faults ``MURMURATION_INJECT_FAULTS`` asks for, name → value ("" for a fault without one).

    Raises:
        UserError: faults asked for without ``MURMURATION_ALLOW_FAULT_INJECTION=1``, unknown ones, or
            a malformed value.
    """
    env = os.environ if env is None else env
    faults = dict(item.partition("=")[::2] for item in re.split(r"[,\s]+", env.get(FAULTS_ENV, "")) if item)
    if not faults:
        return faults
    if not is_allowed(env):
        raise UserError(f"{FAULTS_ENV} makes this peer misbehave on purpose and is for tests only; "
                        f"unset it (or set {ALLOW_ENV}=1 in a test).")
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise UserError(f"{FAULTS_ENV} names unknown faults {', '.join(unknown)}; known: {', '.join(FAULTS)}.")
    for name, value in faults.items():
        if name not in VALUED and value:
            raise UserError(f"{FAULTS_ENV}: {name} takes no value, got {name}={value}.")
    if "scale_updates" in faults and not _positive(faults["scale_updates"]):
        raise UserError(f"{FAULTS_ENV}: scale_updates needs a positive number, got {faults['scale_updates']!r}.")
    return faults


def _positive(text: str) -> bool:
    try:
        return math.isfinite(float(text)) and float(text) > 0
    except ValueError:
        return False


def inject_wrong_outputs(stage: Any) -> None:
    """``stage`` (a swarm.stage.Stage) returns its forwards' outputs negated from now on."""
    _require_allowed()
    stage.output_fault = lambda outputs: -outputs


def inject_corrupt_shards(server: Any) -> None:
    """``server`` (a replication.server.ReplicationServer) corrupts every second request it serves,
    starting with the first: how many requests a joiner sends a donor depends on the rates it
    measures, and one that asked only once must still meet the corruption."""
    _require_allowed()
    honest_load = server.load_shard
    served = itertools.count()

    async def load_shard(version: int, shard_bytes: int, index: int, count: int = 1, **kwargs: Any):
        data = await honest_load(version, shard_bytes, index, count, **kwargs)
        if next(served) % 2 == 1:
            return data
        data = bytearray(data)
        for offset in range(0, len(data), shard_bytes):  # one byte in the middle of each piece
            data[offset + min(shard_bytes, len(data) - offset) // 2] ^= 0x40
        return data

    server.load_shard = load_shard


def inject_bad_updates(stage: Any, *, scale: float = 1.0, nan: bool = False) -> None:
    """``stage``'s optimizer steps (a swarm.stage.Stage) move the parameters ``scale`` times as far
    from now on, or leave them NaN."""
    _require_allowed()
    import torch  # here: run_peer.py reads its faults before it loads torch

    params = list(stage.model.parameters())
    before: list[torch.Tensor] = []

    def save(optimizer: Any, args: Any, kwargs: Any) -> None:
        before[:] = [p.detach().clone() for p in params]

    def corrupt(optimizer: Any, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for param, old in zip(params, before, strict=True):
                if nan:
                    param.fill_(math.nan)
                else:
                    param.copy_(old + scale * (param - old))

    stage.optimizer.register_step_pre_hook(save)
    stage.optimizer.register_step_post_hook(corrupt)
    logger.warning(f"FAULT INJECTION (test only) on stage {stage.index}: updates x{scale}{', NaN' if nan else ''}")


def inject_slow_device(peer: Any) -> None:
    """``peer`` (a peer.lifecycle.Peer whose context exists) says it is slow from now on: its
    ``flops`` and the link figures its record carries (``swarm.links.LinkMeter.summary``)."""
    _require_allowed()
    from dht.link_figures import LinkFigure  # here: run_peer.py reads its faults before it loads the rest

    peer.flops /= SLOW_DEVICE_FACTOR
    honest_summary = peer.ctx.links.summary

    def summary(*args: Any, **kwargs: Any) -> tuple:
        return tuple(LinkFigure.capped(f.peer_id, rtt_ms=10 * f.rtt_ms,
                                       mbit_per_s=0.05 if f.mbit_per_s is None else f.mbit_per_s / SLOW_DEVICE_FACTOR)
                     for f in honest_summary(*args, **kwargs))

    peer.ctx.links.summary = summary
    logger.warning(f"FAULT INJECTION (test only): this peer reports {peer.flops / 1e9:.4f} GFLOP/s and slow links")


def _require_allowed() -> None:
    if not is_allowed():
        raise UserError(f"fault injection is for tests only: set {ALLOW_ENV}=1 to allow it.")
