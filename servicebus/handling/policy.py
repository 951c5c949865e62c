"""Per-handler retry policy: ``every(topic, fn, max_attempts=, backoff=, retry_on=,
dead_letter_on=)``, as dramatiq's ``max_retries``/``min_backoff`` and Celery's
``autoretry_for``. A handler without one follows the bus's options (``max_attempts``,
``retry_initial``, ``retry_max``).

With several handlers on a topic the message is one: its attempts are counted once. A run in
which some handlers failed is judged by the failed ones: the smallest ``max_attempts`` of
them, the longest backoff; an exception one of them gives up on dead-letters the message at
once (the handlers after it do not run for it; a replay runs them all again)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..model.delivery import backoff as default_backoff

__all__ = ["Policy", "make_policy", "Backoff"]

MAX_DELAY = 30 * 86400.0  # seconds: the longest retry delay a backoff function gets
log = logging.getLogger("servicebus")

# (initial, cap) seconds, doubled per attempt with the bus's jitter; or attempt -> seconds.
Backoff = tuple[float, float] | Callable[[int], float]


@dataclass(frozen=True)
class Policy:
    max_attempts: int | None = None
    backoff: Backoff | None = None
    retry_on: tuple[type[BaseException], ...] | None = None  # None: every exception retries
    dead_letter_on: tuple[type[BaseException], ...] = ()

    def limit(self, default: int) -> int:
        return default if self.max_attempts is None else self.max_attempts

    def delay(self, attempts: int, initial: float, cap: float) -> float:
        """Seconds before the run after ``attempts`` runs."""
        if self.backoff is None:
            return default_backoff(attempts, initial, cap)
        if callable(self.backoff):
            try:
                seconds = self.backoff(attempts)
            except Exception:  # noqa: BLE001 - the user's function: a retry must still be made
                log.exception("backoff function %r raised: the bus's backoff instead", self.backoff)
                return default_backoff(attempts, initial, cap)
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
                # A bad value from the user's function must not stall the message for ever.
                return default_backoff(attempts, initial, cap)
            return min(float(seconds), MAX_DELAY)  # inf or 1e12: a wait a thread can make
        return default_backoff(attempts, self.backoff[0], self.backoff[1])

    def gives_up_on(self, exc: BaseException) -> bool:
        """Whether ``exc`` makes a dead letter at once rather than a retry."""
        if self.dead_letter_on and isinstance(exc, self.dead_letter_on):
            return True
        return self.retry_on is not None and not isinstance(exc, self.retry_on)


def _classes(value: Any, name: str) -> tuple[type[BaseException], ...]:
    classes = value if isinstance(value, tuple) else (value,)
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise TypeError(f"{name} must be an exception class or a tuple of them, not {value!r}")
    return classes


def make_policy(max_attempts: int | None = None, backoff: Backoff | None = None,
                retry_on: Any = None, dead_letter_on: Any = None) -> Policy | None:
    """A checked ``Policy``, or None when every argument is left out (the bus's options)."""
    if max_attempts is None and backoff is None and retry_on is None and dead_letter_on is None:
        return None
    if max_attempts is not None and (isinstance(max_attempts, bool) or not isinstance(max_attempts, int)
                                     or max_attempts < 1):
        raise ValueError(f"max_attempts must be an int >= 1, not {max_attempts!r}")
    if backoff is not None and not callable(backoff):
        ok = isinstance(backoff, tuple) and len(backoff) == 2 and all(
            not isinstance(x, bool) and isinstance(x, (int, float)) and 0 < x < float("inf") for x in backoff)
        if not ok or backoff[1] < backoff[0]:
            raise ValueError(f"backoff must be (initial, cap) seconds with 0 < initial <= cap, or a "
                             f"function of the attempt number, not {backoff!r}")
    return Policy(max_attempts, backoff,
                  None if retry_on is None else _classes(retry_on, "retry_on"),
                  () if dead_letter_on is None else _classes(dead_letter_on, "dead_letter_on"))
