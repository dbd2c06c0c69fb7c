"""Whether this rank's KVCR is up, and when to try to bring it back.

A linker fault never takes serving down: when the KVCR fails (its owner thread
died, or kvcr asked for a restart) the linker goes DOWN, serves every request by
recompute and tries to start a new KVCR after a backoff that starts at
``BACKOFF_FIRST_S`` and doubles per failed attempt up to ``BACKOFF_MAX_S``.
``Recovery`` holds that state and the counts the stats line reports; the linker
(linker_lifecycle) decides what going down and coming back do.
"""

from __future__ import annotations

import dataclasses
import enum

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0


class LinkState(enum.Enum):
    UP = "up"
    DOWN = "down"  # KVCR is gone: lookups miss, offloads fail, restarts pending


@dataclasses.dataclass(slots=True)
class Recovery:
    """One rank's KVCR state, its restart schedule and counts."""

    state: LinkState = LinkState.UP
    down_since: float = 0.0  # monotonic time it went down
    attempts: int = 0  # restart attempts that failed since it went down
    next_attempt: float = 0.0  # monotonic time of the next restart attempt
    failures: int = 0  # times KVCR went down (kvcr_failures)
    restarts: int = 0  # restarts that brought it back (kvcr_restarts)
    cause: str = ""  # why it went down last

    @property
    def down(self) -> bool:
        return self.state is LinkState.DOWN

    def went_down(self, now: float, cause: str) -> None:
        self.state, self.down_since, self.cause = LinkState.DOWN, now, cause
        self.attempts = 0
        self.next_attempt = now + BACKOFF_FIRST_S
        self.failures += 1

    def due(self, now: float) -> bool:
        """Whether a restart may be tried now."""
        return self.down and now >= self.next_attempt

    def attempt_failed(self, now: float) -> float:
        """A restart did not bring it back: the seconds until the next try."""
        self.attempts += 1
        backoff = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2.0**self.attempts)
        self.next_attempt = now + backoff
        return backoff

    def came_up(self, restarted: bool) -> None:
        """A new KVCR runs (``restarted``: by a restart, not by a flush)."""
        self.state, self.attempts = LinkState.UP, 0
        if restarted:
            self.restarts += 1
