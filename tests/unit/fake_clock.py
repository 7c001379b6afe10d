"""A clock a test moves by hand, for the components that take ``clock`` (``time.monotonic`` by default)."""

from __future__ import annotations


class FakeClock:
    """Monotonic seconds that pass only when the test says so: ``clock()`` reads ``now``.

    Pass it as ``clock=`` to ``BackupKeeper``, ``RescueWatch``, ``Router``, ``StageConfirmation`` or
    ``LayoutWatch``, then :meth:`advance` it between steps instead of sleeping.
    """

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move ``seconds`` forward (a monotonic clock never goes back).

        Raises:
            ValueError: ``seconds`` is negative.
        """
        if seconds < 0:
            raise ValueError(f"a monotonic clock does not go back ({seconds} s)")
        self.now += seconds
