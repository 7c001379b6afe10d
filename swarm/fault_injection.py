"""Test-only fault injection: make a peer a Byzantine replica on purpose, to test the defences.

``run_peer.py --fault-inject SPEC`` (not listed in ``--help``) is refused unless the environment has
``MURMURATION_ALLOW_FAULT_INJECTION=1``, so no volunteer turns it on by accident. SPEC is a
comma-separated list of:

- ``scale_updates=F``: every optimizer step moves the parameters ``F`` times as far as it should
  (what ``F``-times gradients do under SGD; AdamW would normalise the gradients themselves away).
  The peer's state drifts ``F`` times as far as an honest replica's between averaging rounds, and
  that state is what it contributes: robust averaging must out-vote it.
- ``nan_updates``: every optimizer step leaves the parameters NaN, so the peer contributes NaN to
  averaging and (on a stage before the last) sends NaN activations: both must be refused.

The faults hook into the stage's optimizer through torch's step hooks; nothing else changes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)
ALLOW_ENV = "MURMURATION_ALLOW_FAULT_INJECTION"


@dataclass(frozen=True, kw_only=True)
class FaultInjection:
    """The faults a test asked this peer to commit.

    Attributes:
        scale_updates: factor on every optimizer step's parameter change (1: honest).
        nan_updates: every optimizer step leaves NaN parameters.
    """

    scale_updates: float = 1.0
    nan_updates: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale_updates) and self.scale_updates > 0):
            raise ValueError("--fault-inject scale_updates must be a positive number")

    def attach(self, stage: Any) -> None:
        """Hook the faults into ``stage.optimizer`` (a :class:`swarm.stage.Stage`)."""
        import torch  # here, so that run_peer.py parses its arguments without loading torch

        params = list(stage.model.parameters())
        before: list[torch.Tensor] = []

        def save(optimizer: Any, args: Any, kwargs: Any) -> None:
            before[:] = [p.detach().clone() for p in params]

        def corrupt(optimizer: Any, args: Any, kwargs: Any) -> None:
            with torch.no_grad():
                for param, old in zip(params, before, strict=True):
                    if self.nan_updates:
                        param.fill_(math.nan)
                    else:
                        param.copy_(old + self.scale_updates * (param - old))

        stage.optimizer.register_step_pre_hook(save)
        stage.optimizer.register_step_post_hook(corrupt)
        logger.warning(f"FAULT INJECTION (test only) on stage {stage.index}: {self}")


def parse_fault_injection(text: str, env: Mapping[str, str]) -> FaultInjection:
    """``scale_updates=100`` or ``nan_updates`` (comma-separated) → :class:`FaultInjection`.

    Raises:
        ValueError: fault injection not allowed by ``env``, or a malformed SPEC.
    """
    if env.get(ALLOW_ENV) != "1":
        raise ValueError(f"--fault-inject is for tests only; set {ALLOW_ENV}=1 to allow it")
    fields: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name == "scale_updates" and value:
            try:
                fields[name] = float(value)
            except ValueError:
                raise ValueError(f"--fault-inject scale_updates needs a number, got {value!r}") from None
        elif name == "nan_updates" and not value:
            fields[name] = True
        else:
            raise ValueError(f"--fault-inject: unknown fault {item!r} (scale_updates=F or nan_updates)")
    if not fields:
        raise ValueError("--fault-inject needs at least one fault (scale_updates=F or nan_updates)")
    return FaultInjection(**fields)
