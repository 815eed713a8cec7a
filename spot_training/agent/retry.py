"""Bounded, jittered retries with an explicit rule for what is retryable, and per-step deadlines.

Two layers, as in cloud-init and the AWS SDKs:

1. botocore's own retries (:func:`client_config`: ``Config(retries={"mode": "standard"})``) retry
   throttling, 5xx and connection errors inside every single API call.
2. :func:`call_with_retry` retries *whole operations* on EC2 conditions that clear with time and that
   botocore does not retry: ``VolumeInUse`` (the previous instance is still detaching the volume),
   ``IncorrectState`` (a volume or snapshot is between states), plus ``RequestLimitExceeded`` /
   ``Throttling`` once botocore's own attempts are used up. Everything else is raised at once.

Delays use "full jitter" (a uniform random delay in ``[0, min(max_delay, base * 2**attempt)]``,
AWS Architecture Blog, "Exponential Backoff And Jitter") so that agents booting together spread out.
When the attempts or the step's deadline run out, :class:`~spot_training.agent.errors.TemporaryError` (exit 75)
is raised, chained to the last error, so systemd tries again later.

Hand-rolled because botocore's retry handler cannot be told to retry ``VolumeInUse`` for one call
and not another, and the boto3 waiters only poll Describe* calls.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from botocore.config import Config
from botocore.exceptions import ClientError, ConnectionError as BotocoreConnectionError, ReadTimeoutError

from spot_training.agent.errors import TemporaryError
from spot_training.contract import check_seconds

T = TypeVar("T")

#: EC2 error codes that mean "try again later" (the condition clears without us changing anything).
RETRYABLE_ERROR_CODES = frozenset({
    "VolumeInUse",            # AttachVolume/DeleteVolume while the old instance still detaches it
    "IncorrectState",         # resource between states (snapshot pending, volume creating/deleting)
    "IncorrectInstanceState",  # instance still pending
    "RequestLimitExceeded",   # EC2 API throttling
    "Throttling",
    "ThrottlingException",
    "InternalError",
    "ServiceUnavailable",
    "Unavailable",
})


def client_config(**overrides: object) -> Config:
    """botocore ``Config`` for the agent's clients: standard retry mode (up to 3 attempts per call,
    throttling and 5xx retried with backoff), 5 s connect and 30 s read timeouts."""
    settings: dict[str, object] = {"retries": {"mode": "standard"}, "connect_timeout": 5, "read_timeout": 30}
    settings.update(overrides)
    return Config(**settings)


def error_code(error: BaseException) -> str | None:
    """The AWS error code of a botocore ``ClientError`` (``"VolumeInUse"``), else ``None``."""
    if isinstance(error, ClientError):
        return error.response.get("Error", {}).get("Code")
    return None


def is_retryable(error: BaseException) -> bool:
    """True for :data:`RETRYABLE_ERROR_CODES` and for connection errors and read timeouts."""
    if isinstance(error, (BotocoreConnectionError, ReadTimeoutError)):
        return True
    return error_code(error) in RETRYABLE_ERROR_CODES


class Deadline:
    """A point in time (``clock()`` seconds, default ``time.monotonic``) after which a step gives up.

    Args:
        seconds: time allowed from now (> 0).
        step: the step's name, used in the error message.
        clock: monotonic clock in seconds (injectable).
    """

    def __init__(self, seconds: float, step: str, clock: Callable[[], float] = time.monotonic) -> None:
        check_seconds(f"deadline for step {step!r}", seconds)
        self.seconds = seconds
        self.step = step
        self._clock = clock
        self._end = clock() + seconds

    def remaining(self) -> float:
        """Seconds left (never negative)."""
        return max(0.0, self._end - self._clock())

    def expired(self) -> bool:
        """True once the deadline has passed."""
        return self.remaining() <= 0

    def check(self) -> None:
        """Raise :class:`TemporaryError` if the deadline has passed."""
        if self.expired():
            raise TemporaryError(f"step {self.step!r} did not finish within its deadline of {self.seconds:g} s")

    def waiter_config(self, delay: float) -> dict[str, int]:
        """``WaiterConfig`` for a boto3 waiter polling every ``delay`` seconds until this deadline."""
        delay = max(1, int(delay))
        return {"Delay": delay, "MaxAttempts": max(1, int(self.remaining() // delay) + 1)}


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry one operation.

    Attributes:
        max_attempts: total attempts including the first (default 8, >= 1).
        base_delay: seconds; the jitter window doubles from here each attempt (default 1.0).
        max_delay: seconds; cap of the jitter window (default 20.0).
    """

    max_attempts: int = 8
    base_delay: float = 1.0
    max_delay: float = 20.0

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        if self.base_delay < 0 or self.max_delay < self.base_delay:
            raise ValueError(f"need 0 <= base_delay <= max_delay, got base_delay={self.base_delay!r}, "
                             f"max_delay={self.max_delay!r}")

    def delay(self, attempt: int, rng: Callable[[], float] = random.random) -> float:
        """Full-jitter delay in seconds before attempt ``attempt + 1`` (``attempt`` counts from 0).

        Source: AWS Architecture Blog, "Exponential Backoff And Jitter" (full jitter).

        Args:
            attempt: attempts made so far, from 0.
            rng: uniform random numbers in [0, 1) (default ``random.random``).

        Returns:
            seconds to wait, uniform in ``[0, min(max_delay, base_delay * 2**attempt))``.
        """
        return rng() * min(self.max_delay, self.base_delay * (2 ** attempt))


def call_with_retry(
    operation: Callable[[], T],
    *,
    what: str,
    policy: RetryPolicy = RetryPolicy(),
    deadline: Deadline | None = None,
    retryable: Callable[[BaseException], bool] = is_retryable,
    sleep: Callable[[float], None] = time.sleep,
    rng: Callable[[], float] = random.random,
    log: logging.Logger | None = None,
) -> T:
    """Call ``operation()`` until it returns, retrying what ``retryable`` accepts.

    Args:
        operation: the call (no arguments; use a lambda).
        what: a short description for logs and errors (``"AttachVolume vol-1 to i-2"``).
        policy: attempts and delays (:class:`RetryPolicy`).
        deadline: stop retrying (never sleep) past it; default: only the attempt limit.
        retryable: the rule; default :func:`is_retryable`.
        sleep: sleeps the given seconds (default ``time.sleep``; tests pass their own).
        rng: jitter source, uniform in [0, 1) (default ``random.random``).
        log: where retries are logged (event ``retry``).

    Returns:
        what ``operation`` returns.

    Raises:
        TemporaryError: attempts or deadline exhausted on a retryable error (chained to it).
        Exception: a non-retryable error from ``operation``, unchanged.
    """
    attempt = 0
    while True:
        try:
            return operation()
        except Exception as error:  # noqa: BLE001 - classified right below, re-raised if not retryable
            if not retryable(error):
                raise
            attempt += 1
            pause = policy.delay(attempt - 1, rng)
            out_of_time = deadline is not None and deadline.remaining() < pause
            if attempt >= policy.max_attempts or out_of_time:
                reason = f"{attempt} attempts" if attempt >= policy.max_attempts else f"its {deadline.seconds:g} s deadline"
                raise TemporaryError(f"{what} still failing after {reason}: {error}") from error
            if log is not None:
                log.warning("retrying after a temporary error", extra={
                    "event": "retry", "operation": what, "attempt": attempt,
                    "error_code": error_code(error) or type(error).__name__, "delay_s": round(pause, 3)})
            sleep(pause)
