"""spot_training.agent.retry: what is retried, how long, and what is raised in the end."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from spot_training.agent.errors import TemporaryError
from spot_training.agent.retry import Deadline, RetryPolicy, call_with_retry, client_config, is_retryable


def _error(code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": f"{code} happened"}}, "AttachVolume")


class _Flaky:
    def __init__(self, errors, result="ok"):
        self.errors = list(errors)
        self.calls = 0
        self.result = result

    def __call__(self):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.result


@pytest.mark.parametrize("code", ["VolumeInUse", "IncorrectState", "RequestLimitExceeded", "Throttling"])
def test_retryable_codes_are_retried_until_success(code):
    operation = _Flaky([_error(code), _error(code)])
    slept = []
    assert call_with_retry(operation, what="op", sleep=slept.append, rng=lambda: 1.0) == "ok"
    assert operation.calls == 3
    assert slept == [1.0, 2.0]  # full jitter window doubles: rng()*min(max, base*2**n)


def test_connection_errors_are_retryable():
    assert is_retryable(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))


@pytest.mark.parametrize("code", ["InvalidVolume.NotFound", "UnauthorizedOperation", "InvalidParameterValue"])
def test_other_errors_are_raised_at_once(code):
    operation = _Flaky([_error(code)])
    with pytest.raises(ClientError, match=code):
        call_with_retry(operation, what="op", sleep=lambda s: None)
    assert operation.calls == 1


def test_exhausted_attempts_raise_temporary_error_chained():
    operation = _Flaky([_error("VolumeInUse")] * 10)
    with pytest.raises(TemporaryError, match="AttachVolume vol-1 still failing after 3 attempts.*VolumeInUse") as info:
        call_with_retry(operation, what="AttachVolume vol-1", policy=RetryPolicy(max_attempts=3), sleep=lambda s: None)
    assert isinstance(info.value.__cause__, ClientError)
    assert operation.calls == 3


def test_deadline_stops_retrying_before_sleeping_past_it():
    now = [0.0]
    deadline = Deadline(5.0, "attach", clock=lambda: now[0])

    def sleep(seconds):
        now[0] += seconds

    operation = _Flaky([_error("IncorrectState")] * 100)
    with pytest.raises(TemporaryError, match="its 5 s deadline"):
        call_with_retry(operation, what="op", deadline=deadline, sleep=sleep, rng=lambda: 1.0,
                        policy=RetryPolicy(max_attempts=100, base_delay=1.0, max_delay=2.0))
    assert now[0] <= 5.0


def test_jitter_stays_within_the_window():
    policy = RetryPolicy(base_delay=1.0, max_delay=8.0)
    assert [policy.delay(n, rng=lambda: 0.999) for n in range(6)] == pytest.approx([0.999, 1.998, 3.996, 7.992, 7.992, 7.992])
    assert policy.delay(3, rng=lambda: 0.0) == 0.0


def test_waiter_config_covers_the_deadline():
    deadline = Deadline(60.0, "snapshot", clock=lambda: 0.0)
    assert deadline.waiter_config(15) == {"Delay": 15, "MaxAttempts": 5}


def test_client_config_uses_standard_retry_mode():
    assert client_config().retries == {"mode": "standard"}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_attempts": 0}, "max_attempts must be an integer >= 1, got 0"),
    ({"max_attempts": True}, "max_attempts must be an integer >= 1, got True"),
    ({"base_delay": 5.0, "max_delay": 1.0}, "base_delay=5.0, max_delay=1.0"),
])
def test_fails_on_bad_policy(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RetryPolicy(**kwargs)


def test_fails_on_non_positive_deadline():
    with pytest.raises(ValueError, match="deadline for step 'attach' must be > 0 seconds, got 0"):
        Deadline(0, "attach")
