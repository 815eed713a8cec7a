"""IMDSv2 client (standard library ``urllib`` only).

Why hand-rolled: botocore's ``InstanceMetadataFetcher`` only fetches credentials and region (it has
no generic GET, no notice paths and swallows errors into empty results), and boto3 has no IMDS
client; the agent must not depend on anything else (docs/architecture.md, "Layers": stdlib + boto3 on the node).

Behaviour (docs/architecture.md, "IMDSv2 only"):

- a session token from ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``
  (default 21600 s), cached and refreshed ``refresh_margin_s`` before it expires;
- a 401 drops the cached token, fetches a new one and retries the request once;
- a 403 is fatal (:class:`ImdsForbiddenError`, exit 78): IMDS is disabled for this instance, or the
  token request was refused;
- every request has a timeout (default 2 s); timeouts, connection errors and 5xx answers get
  ``attempts`` tries in all with jittered exponential backoff, then :class:`ImdsUnavailableError`
  (exit 75);
- a 404 on ``spot/instance-action`` or ``events/recommendations/rebalance`` means "no notice".

The endpoint is, in order: the ``endpoint`` argument (config ``imds_endpoint``), the environment
variable ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` (which botocore honours too), ``http://169.254.169.254``.
The token is never logged.
"""

from __future__ import annotations

import datetime as dt
import http.client
import json
import logging
import os
import random
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from spot_training.agent.errors import AgentError, ExitCode, TemporaryError
from spot_training.contract import check_seconds

DEFAULT_ENDPOINT = "http://169.254.169.254"
ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"

log = logging.getLogger(__name__)


#: What a notice endpoint parses into (:meth:`ImdsClient._notice`).
_Notice = TypeVar("_Notice")


class ImdsError(AgentError):
    """Base class of IMDS failures."""


class ImdsUnavailableError(ImdsError, TemporaryError):
    """IMDS did not answer (timeouts, connection errors, 5xx) within the bounded retries: exit 75."""


class ImdsForbiddenError(ImdsError):
    """IMDS answered 403: disabled for this instance (launch template ``MetadataOptions.HttpEndpoint``)
    or the request was refused. Not retried: exit 78."""

    exit_code = ExitCode.CONFIG


class ImdsNotFoundError(ImdsError):
    """A metadata path that must exist answered 404 (e.g. ``instance-id``): exit 75."""


@dataclass(frozen=True)
class SpotInstanceAction:
    """A spot interruption notice: ``action`` (``terminate``, ``stop`` or ``hibernate``) at ``time``
    (UTC, timezone-aware). ``id`` identifies the notice (same notice polled twice -> same id)."""

    action: str
    time: dt.datetime

    @property
    def id(self) -> str:
        """``spot-interruption:<action>:<time ISO 8601>``: the same for every poll of one notice."""
        return f"spot-interruption:{self.action}:{self.time.isoformat()}"


@dataclass(frozen=True)
class RebalanceRecommendation:
    """A rebalance recommendation issued at ``notice_time`` (UTC, timezone-aware)."""

    notice_time: dt.datetime

    @property
    def id(self) -> str:
        """``rebalance-recommendation:<notice time ISO 8601>``: the same for every poll of one recommendation."""
        return f"rebalance-recommendation:{self.notice_time.isoformat()}"


def resolve_endpoint(configured: str | None = None) -> str:
    """The IMDS base URL: ``configured`` if given, else ``$AWS_EC2_METADATA_SERVICE_ENDPOINT``, else
    ``http://169.254.169.254`` (no trailing slash)."""
    return (configured or os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT).rstrip("/")


def _parse_time(value: str, what: str) -> dt.datetime:
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except (AttributeError, ValueError):
        raise ImdsError(f"IMDS {what} has an unreadable time {value!r}; expected ISO 8601 like "
                        f"'2026-01-01T00:02:00Z'") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


class ImdsClient:
    """An IMDSv2 client.

    Args:
        endpoint: base URL (see :func:`resolve_endpoint`; default: env or ``http://169.254.169.254``).
        timeout_s: per-request timeout in seconds (default 2).
        attempts: tries per request for timeouts, connection errors and 5xx (default 3, >= 1).
        backoff_s: base of the jittered exponential backoff between tries, seconds (default 0.2;
            the n-th wait is uniform in [0, backoff_s * 2**n]).
        token_ttl_s: requested token lifetime, seconds, 1..21600 (default 21600).
        refresh_margin_s: fetch a new token this many seconds before the old one expires (default 60,
            capped at half the TTL).
        clock: monotonic seconds (default ``time.monotonic``); sleep, rng: injectable for tests.

    Raises:
        ValueError: out-of-range arguments. Methods raise :class:`ImdsForbiddenError` (403),
            :class:`ImdsUnavailableError` (no answer after retries) or :class:`ImdsNotFoundError`.
    """

    def __init__(self, endpoint: str | None = None, *, timeout_s: float = 2.0, attempts: int = 3,
                 backoff_s: float = 0.2, token_ttl_s: int = 21600, refresh_margin_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 rng: Callable[[], float] = random.random) -> None:
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ValueError(f"attempts must be an integer >= 1, got {attempts!r}")
        if isinstance(token_ttl_s, bool) or not isinstance(token_ttl_s, int) or not 1 <= token_ttl_s <= 21600:
            raise ValueError(f"token_ttl_s must be an integer 1..21600 seconds, got {token_ttl_s!r}")
        check_seconds("timeout_s", timeout_s)
        self.endpoint = resolve_endpoint(endpoint)
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.token_ttl_s = token_ttl_s
        self.refresh_margin_s = min(refresh_margin_s, token_ttl_s / 2)
        self._clock, self._sleep, self._rng = clock, sleep, rng
        self._token: str | None = None
        self._token_expires = 0.0
        # IMDS is link-local: never go through an HTTP proxy from the environment.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # ---- identity ---------------------------------------------------------------------------
    def instance_id(self) -> str:
        """``meta-data/instance-id``, e.g. ``i-0123456789abcdef0``."""
        return self._required("meta-data/instance-id")

    def availability_zone(self) -> str:
        """``meta-data/placement/availability-zone``, e.g. ``us-east-1b``."""
        return self._required("meta-data/placement/availability-zone")

    def region(self) -> str:
        """``meta-data/placement/region``, e.g. ``us-east-1``."""
        return self._required("meta-data/placement/region")

    def private_ipv4(self) -> str:
        """``meta-data/local-ipv4``."""
        return self._required("meta-data/local-ipv4")

    def instance_type(self) -> str:
        """``meta-data/instance-type``, e.g. ``p3.2xlarge``."""
        return self._required("meta-data/instance-type")

    def identity_document(self) -> dict:
        """``dynamic/instance-identity/document`` decoded (accountId, region, instanceId, ...)."""
        return json.loads(self._required("dynamic/instance-identity/document"))

    def tags(self) -> dict[str, str] | None:
        """Instance tags from ``meta-data/tags/instance``, or None when the instance does not expose
        tags in metadata (``InstanceMetadataTags`` disabled: 404)."""
        status, body = self.get("meta-data/tags/instance")
        if status == 404:
            return None
        tags = {}
        for key in filter(None, body.splitlines()):
            status, value = self.get(f"meta-data/tags/instance/{key}")
            if status == 200:
                tags[key] = value
        return tags

    # ---- notices ----------------------------------------------------------------------------
    def spot_instance_action(self) -> SpotInstanceAction | None:
        """The spot interruption notice, or None (404: no notice)."""
        return self._notice("spot/instance-action", "'action' and 'time'", lambda doc: SpotInstanceAction(
            action=str(doc["action"]), time=_parse_time(doc["time"], "spot/instance-action")))

    def rebalance_recommendation(self) -> RebalanceRecommendation | None:
        """The rebalance recommendation, or None (404: none)."""
        return self._notice("events/recommendations/rebalance", "'noticeTime'", lambda doc: RebalanceRecommendation(
            notice_time=_parse_time(doc["noticeTime"], "rebalance recommendation")))

    def _notice(self, path: str, expected: str, parse: Callable[[Any], _Notice]) -> _Notice | None:
        """GET ``meta-data/<path>``: None on 404, else ``parse(<the JSON body>)``; a body that is not
        JSON or lacks a field (ValueError, KeyError, TypeError) raises :class:`ImdsError` naming the
        ``expected`` fields."""
        status, body = self.get(f"meta-data/{path}")
        if status == 404:
            return None
        try:
            return parse(json.loads(body))
        except (ValueError, KeyError, TypeError):
            raise ImdsError(f"IMDS {path} answered {body[:200]!r}; expected JSON with {expected}") from None

    # ---- transport --------------------------------------------------------------------------
    def get(self, path: str) -> tuple[int, str]:
        """GET ``/latest/<path>`` with a session token: (200, body) or (404, ""). Other statuses raise
        (see the class). A 401 refreshes the token and retries once."""
        for attempt_401 in range(2):
            status, body = self._request("GET", f"/latest/{path}", {TOKEN_HEADER: self._session_token()})
            if status == 401 and attempt_401 == 0:
                log.info("IMDS answered 401: session token expired or revoked; fetching a new one",
                         extra={"path": path})
                self._token = None
                continue
            if status in (200, 404):
                return status, body
            if status == 403:
                raise ImdsForbiddenError(f"IMDS answered 403 Forbidden for GET {path} at {self.endpoint}: the "
                                         "instance metadata service refuses this request (is it disabled in the "
                                         "launch template's MetadataOptions, HttpEndpoint=enabled?)")
            raise ImdsError(f"IMDS answered HTTP {status} for GET {path} at {self.endpoint}")
        raise ImdsError(f"IMDS answered 401 Unauthorized for GET {path} at {self.endpoint} even with a fresh "
                        "session token")

    def _required(self, path: str) -> str:
        status, body = self.get(path)
        if status == 404:
            raise ImdsNotFoundError(f"IMDS has no {path} at {self.endpoint} (404)")
        return body.strip()

    def _session_token(self) -> str:
        if self._token is not None and self._clock() < self._token_expires - self.refresh_margin_s:
            return self._token
        requested_at = self._clock()
        status, body = self._request("PUT", "/latest/api/token", {TTL_HEADER: str(self.token_ttl_s)})
        if status == 403:
            raise ImdsForbiddenError(f"IMDS answered 403 Forbidden to the IMDSv2 token request (PUT /latest/api/"
                                     f"token) at {self.endpoint}: the instance metadata service is disabled for "
                                     "this instance or refuses token requests; enable it with MetadataOptions "
                                     "HttpEndpoint=enabled in the launch template")
        if status != 200 or not body:
            raise ImdsError(f"IMDS answered HTTP {status} to the token request at {self.endpoint}")
        self._token = body.strip()
        self._token_expires = requested_at + self.token_ttl_s
        return self._token

    def _request(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str]:
        """One request with bounded, jittered retries of what is retryable: timeouts, connection
        errors and 5xx. Returns (status, body) for every other answer."""
        url = self.endpoint + path
        last = ""
        for attempt in range(self.attempts):
            if attempt:
                self._sleep(self._rng() * self.backoff_s * (2 ** attempt))
            request = urllib.request.Request(url, method=method, headers=headers,
                                             data=b"" if method == "PUT" else None)
            try:
                with self._opener.open(request, timeout=self.timeout_s) as response:
                    return response.status, response.read().decode("utf-8", "replace")
            except urllib.error.HTTPError as exc:
                with exc:
                    body = exc.read().decode("utf-8", "replace")
                if exc.code < 500:
                    return exc.code, body
                last = f"HTTP {exc.code}"
            except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError,
                    http.client.HTTPException) as exc:  # HTTPException: a truncated or garbled answer
                reason = getattr(exc, "reason", exc)
                last = f"{type(reason).__name__}: {reason}"
            log.warning("IMDS request failed; retrying" if attempt + 1 < self.attempts else "IMDS request failed",
                        extra={"method": method, "path": path, "attempt": attempt + 1, "attempts": self.attempts,
                               "error": last})
        raise ImdsUnavailableError(f"IMDS at {self.endpoint} did not answer {method} {path} after {self.attempts} "
                                   f"attempts of {self.timeout_s:g} s each (last error: {last}); is this an EC2 "
                                   f"instance, or is {ENDPOINT_ENV} / imds_endpoint pointing at a running emulator?")
