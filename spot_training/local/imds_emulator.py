"""An EC2 instance-metadata service (IMDSv2) emulator for local mode and tests.

One emulator per emulated node, on 127.0.0.1 and a port of its own, served by the standard library's
threaded HTTP server. It behaves as IMDSv2 does on an instance launched with ``HttpTokens=required``
(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html):

- ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds: 1..21600`` returns a token;
  a missing or out-of-range TTL gets 400.
- Every ``GET /latest/...`` needs ``X-aws-ec2-metadata-token``; missing, unknown or expired -> 401.
- Identity: ``meta-data/instance-id``, ``placement/availability-zone``, ``placement/region``,
  ``local-ipv4``, ``instance-type``, ``tags/instance[/KEY]`` and ``dynamic/instance-identity/document``,
  taken from a moto instance (:meth:`ImdsEmulator.from_moto`) or given explicitly.
- ``meta-data/spot/instance-action`` and ``meta-data/events/recommendations/rebalance``: 404 until a
  notice is posted, then the JSON AWS documents (``{"action": "terminate", "time": "...Z"}`` and
  ``{"noticeTime": "...Z"}``).

Control endpoints (no token; loopback only), for tests and the local-mode node runner:

- ``POST /control/spot/instance-action`` ``{"action": "terminate", "time": "2026-01-01T00:02:00Z"}``
  (``time`` defaults to two minutes from now; ``action`` to ``terminate``); ``DELETE`` clears it.
- ``POST /control/rebalance`` ``{"noticeTime": "..."}`` (default now); ``DELETE`` clears it.
- ``POST /control/fail-mode`` ``{"status": 403}`` answers every metadata request (token PUT included)
  with that status; ``{"delay_s": 3.0}`` delays every metadata answer; ``{"count": N}`` limits either
  to the next N requests. ``DELETE`` clears it.
- ``POST /control/expire-tokens``: every token issued so far becomes invalid (as after its TTL).
- ``GET /control/stats``: ``{"token_puts": n, "gets": n, "unauthorized": n, "requests": [...]}``.

Run it from a shell (foreground until SIGTERM/SIGINT; prints one JSON line with the endpoint)::

    python -m spot_training.local.imds_emulator --port 1338 --instance-id i-0123 --endpoint-url http://127.0.0.1:5000

or in tests::

    with ImdsEmulator(instance_id="i-0123", availability_zone="us-east-1b") as imds:
        os.environ["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = imds.endpoint
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import secrets
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping

from spot_training.contract import check_seconds

TOKEN_HEADER = "X-aws-ec2-metadata-token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
MAX_TTL_S = 21600
DEFAULT_NOTICE_LEAD_S = 120  # AWS gives a two-minute warning


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ImdsEmulator:
    """An IMDSv2 emulator serving one instance's metadata on ``127.0.0.1:port``.

    Args:
        instance_id: e.g. ``"i-0123456789abcdef0"``.
        availability_zone: e.g. ``"us-east-1b"``; ``region`` defaults to it minus the last letter.
        region: e.g. ``"us-east-1"``.
        local_ipv4: the private address (default ``"10.0.0.10"``).
        instance_type: default ``"p3.2xlarge"``.
        tags: instance tags exposed under ``meta-data/tags/instance`` (default none: 404, as on an
            instance without ``InstanceMetadataTags=enabled``).
        account_id: for the identity document (default moto's ``"123456789012"``).
        image_id: the AMI id served under ``meta-data/ami-id`` (default ``"ami-12c6146b"``).
        port: TCP port on 127.0.0.1 (default 0: a free one, see :attr:`endpoint`).
        clock: seconds, used for token expiry (default ``time.monotonic``).

    Use as a context manager or call :meth:`start` / :meth:`stop`.

    Raises:
        ValueError: an availability zone without a region suffix.
    """

    def __init__(self, *, instance_id: str, availability_zone: str, region: str | None = None,
                 local_ipv4: str = "10.0.0.10", instance_type: str = "p3.2xlarge",
                 tags: Mapping[str, str] | None = None, account_id: str = "123456789012",
                 image_id: str = "ami-12c6146b", port: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not availability_zone or not availability_zone[-1].isalpha():
            raise ValueError(f"availability_zone must look like 'us-east-1b', got {availability_zone!r}")
        self.instance_id = instance_id
        self.availability_zone = availability_zone
        self.region = region or availability_zone[:-1]
        self.local_ipv4 = local_ipv4
        self.instance_type = instance_type
        self.tags = dict(tags) if tags is not None else None
        self.account_id = account_id
        self.image_id = image_id
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens: dict[str, float] = {}  # token -> expiry (clock seconds)
        self._spot_action: dict[str, str] | None = None
        self._rebalance: dict[str, str] | None = None
        self._fail_status: int | None = None
        self._delay_s = 0.0
        self._fail_count: int | None = None
        self.stats: dict[str, Any] = {"token_puts": 0, "gets": 0, "unauthorized": 0, "requests": []}
        self._requested_port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_moto(cls, ec2: Any, instance_id: str, **kwargs: Any) -> "ImdsEmulator":
        """Build an emulator whose identity is moto's instance ``instance_id``.

        Placement, private IP, type, tags and image are read with the given boto3 EC2 client.

        Args:
            ec2: a boto3 EC2 client of the moto server.
            instance_id: the instance.
            **kwargs: override the emulator's arguments (e.g. ``local_ipv4``: the node's address in its
                network namespace).

        Returns:
            the emulator (not started).

        Raises:
            botocore.exceptions.ClientError: moto has no such instance.
        """
        reservations = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
        inst = reservations[0]["Instances"][0]
        tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
        kwargs.setdefault("tags", tags)
        return cls(instance_id=instance_id, availability_zone=inst["Placement"]["AvailabilityZone"],
                   region=kwargs.pop("region", ec2.meta.region_name),
                   local_ipv4=kwargs.pop("local_ipv4", None) or inst.get("PrivateIpAddress", "10.0.0.10"),
                   instance_type=inst.get("InstanceType", "p3.2xlarge"),
                   image_id=inst.get("ImageId", "ami-12c6146b"), **kwargs)

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        if self._server is None:
            raise RuntimeError("the emulator is not started; call start() or use it as a context manager")
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``, the value for ``AWS_EC2_METADATA_SERVICE_ENDPOINT``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ImdsEmulator":
        """Bind 127.0.0.1 and serve in a daemon thread.

        Raises:
            OSError: the port is taken.
        """
        if self._server is not None:
            return self
        handler = type("Handler", (_Handler,), {"emulator": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", self._requested_port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"imds-emulator-{self.instance_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "ImdsEmulator":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ---- state changes (the control endpoints call these too) -------------------------------
    def post_spot_interruption(self, *, action: str = "terminate", time_iso: str | None = None) -> dict[str, str]:
        """Post a spot interruption notice (``spot/instance-action``).

        Source: Amazon EC2 User Guide, "Spot Instance interruption notices".

        Args:
            action: ``terminate`` (default), ``stop`` or ``hibernate``.
            time_iso: when the action happens, ISO 8601 UTC (default: two minutes from now).

        Returns:
            the notice as served (``{"action", "time"}``).

        Raises:
            ValueError: an unknown action.
        """
        if action not in ("terminate", "stop", "hibernate"):
            raise ValueError(f"action must be terminate, stop or hibernate, got {action!r}")
        notice = {"action": action, "time": time_iso or _iso(time.time() + DEFAULT_NOTICE_LEAD_S)}
        with self._lock:
            self._spot_action = notice
        return notice

    def post_rebalance(self, *, notice_time_iso: str | None = None) -> dict[str, str]:
        """Post a rebalance recommendation (``noticeTime`` defaults to now, UTC)."""
        notice = {"noticeTime": notice_time_iso or _iso(time.time())}
        with self._lock:
            self._rebalance = notice
        return notice

    def clear_notices(self) -> None:
        """Remove both notices (the paths answer 404 again)."""
        with self._lock:
            self._spot_action = None
            self._rebalance = None

    def set_fail_mode(self, *, status: int | None = None, delay_s: float = 0.0, count: int | None = None) -> None:
        """Answer metadata requests with ``status`` and/or after ``delay_s`` seconds, for the next ``count`` requests.

        Args:
            status: an HTTP error status 400..599 to answer with, or None (answer normally).
            delay_s: seconds to wait before answering, >= 0 (default 0).
            count: how many requests (default None: until cleared).

        Raises:
            ValueError: ``status`` outside 400..599 or a negative ``delay_s``.
        """
        if status is not None and not 400 <= status <= 599:
            raise ValueError(f"status must be an HTTP error status 400..599, got {status!r}")
        check_seconds("delay_s", delay_s, zero=True)
        with self._lock:
            self._fail_status, self._delay_s, self._fail_count = status, float(delay_s), count

    def expire_tokens(self) -> None:
        """Invalidate every token issued so far."""
        with self._lock:
            self._tokens.clear()

    # ---- request handling ---------------------------------------------------------------------
    def _take_fault(self) -> tuple[int | None, float]:
        with self._lock:
            if self._fail_status is None and not self._delay_s:
                return None, 0.0
            if self._fail_count is not None:
                if self._fail_count <= 0:
                    self._fail_status, self._delay_s, self._fail_count = None, 0.0, None
                    return None, 0.0
                self._fail_count -= 1
            return self._fail_status, self._delay_s

    def _issue_token(self, ttl: int) -> str:
        token = secrets.token_urlsafe(32)
        with self._lock:
            now = self._clock()
            self._tokens = {t: exp for t, exp in self._tokens.items() if exp > now}
            self._tokens[token] = now + ttl
        return token

    def _token_valid(self, token: str | None) -> bool:
        if not token:
            return False
        with self._lock:
            expiry = self._tokens.get(token)
            return expiry is not None and expiry > self._clock()

    def _metadata(self, path: str) -> tuple[int, str, str]:
        """(status, content type, body) for a GET under /latest/."""
        text = "text/plain"
        with self._lock:
            spot, rebalance = self._spot_action, self._rebalance
        values = {
            "meta-data/instance-id": self.instance_id,
            "meta-data/placement/availability-zone": self.availability_zone,
            "meta-data/placement/region": self.region,
            "meta-data/local-ipv4": self.local_ipv4,
            "meta-data/instance-type": self.instance_type,
            "meta-data/ami-id": self.image_id,
        }
        path = path.rstrip("/") if path not in ("meta-data/", "dynamic/") else path
        if path in values:
            return 200, text, values[path]
        if path == "meta-data/":
            listing = sorted({p.split("/")[1] + ("/" if p.count("/") > 1 else "") for p in values}
                             | {"spot/", "events/"} | ({"tags/"} if self.tags is not None else set()))
            return 200, text, "\n".join(listing)
        if path == "meta-data/spot/instance-action":
            return (200, "application/json", json.dumps(spot)) if spot else (404, text, "Not Found")
        if path == "meta-data/events/recommendations/rebalance":
            return (200, "application/json", json.dumps(rebalance)) if rebalance else (404, text, "Not Found")
        if path == "meta-data/tags/instance" and self.tags is not None:
            return 200, text, "\n".join(sorted(self.tags))
        if path.startswith("meta-data/tags/instance/") and self.tags is not None:
            key = path[len("meta-data/tags/instance/"):]
            if key in self.tags:
                return 200, text, self.tags[key]
        if path == "dynamic/instance-identity/document":
            doc = {"accountId": self.account_id, "architecture": "x86_64",
                   "availabilityZone": self.availability_zone, "imageId": self.image_id,
                   "instanceId": self.instance_id, "instanceType": self.instance_type,
                   "privateIp": self.local_ipv4, "region": self.region, "version": "2017-09-30",
                   "pendingTime": _iso(time.time())}
            return 200, "application/json", json.dumps(doc, indent=2)
        return 404, text, "Not Found"


class _Handler(BaseHTTPRequestHandler):
    emulator: ImdsEmulator
    protocol_version = "HTTP/1.1"
    server_version = "EC2ws"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (BaseHTTPRequestHandler's name)
        pass  # requests are counted in stats; stderr stays quiet in tests

    def _send(self, status: int, body: str, content_type: str = "text/plain", headers: Mapping[str, str] = {}) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _json_body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if not length:
            return {}
        value = json.loads(self.rfile.read(length) or b"{}")
        if not isinstance(value, dict):
            raise ValueError(f"body must be a JSON object, got {value!r}")
        return value

    def _record(self) -> None:
        with self.emulator._lock:
            self.emulator.stats["requests"].append({"method": self.command, "path": self.path})

    def _fault(self) -> bool:
        status, delay = self.emulator._take_fault()
        if delay:
            time.sleep(delay)
        if status is not None:
            self._send(status, "Forbidden" if status == 403 else "Error")
            return True
        return False

    # -- metadata --
    def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
        self._record()
        if self.path != "/latest/api/token":
            self._send(404 if self.path.startswith("/latest/") else 405, "Not Found")
            return
        if self._fault():
            return
        with self.emulator._lock:
            self.emulator.stats["token_puts"] += 1
        raw = self.headers.get(TTL_HEADER)
        try:
            ttl = int(raw) if raw is not None else 0
        except ValueError:
            ttl = 0
        if not 1 <= ttl <= MAX_TTL_S:
            self._send(400, f"{TTL_HEADER} must be an integer 1..{MAX_TTL_S}")
            return
        token = self.emulator._issue_token(ttl)
        self._send(200, token, headers={TTL_HEADER: str(ttl)})

    def do_GET(self) -> None:  # noqa: N802
        self._record()
        if self.path.startswith("/control/"):
            self._control("GET")
            return
        if not self.path.startswith("/latest/"):
            self._send(404, "Not Found")
            return
        if self._fault():
            return
        with self.emulator._lock:
            self.emulator.stats["gets"] += 1
        if not self.emulator._token_valid(self.headers.get(TOKEN_HEADER)):
            with self.emulator._lock:
                self.emulator.stats["unauthorized"] += 1
            self._send(401, "Unauthorized")
            return
        status, ctype, body = self.emulator._metadata(self.path[len("/latest/"):])
        self._send(status, body, ctype)

    # -- control --
    def do_POST(self) -> None:  # noqa: N802
        self._record()
        self._control("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._record()
        self._control("DELETE")

    def _control(self, method: str) -> None:
        em = self.emulator
        try:
            body = self._json_body() if method == "POST" else {}
            route = (method, self.path.rstrip("/"))
            if route == ("POST", "/control/spot/instance-action"):
                result: Any = em.post_spot_interruption(action=body.get("action", "terminate"),
                                                        time_iso=body.get("time"))
            elif route == ("DELETE", "/control/spot/instance-action"):
                with em._lock:
                    em._spot_action = None
                result = {}
            elif route == ("POST", "/control/rebalance"):
                result = em.post_rebalance(notice_time_iso=body.get("noticeTime"))
            elif route == ("DELETE", "/control/rebalance"):
                with em._lock:
                    em._rebalance = None
                result = {}
            elif route == ("POST", "/control/fail-mode"):
                em.set_fail_mode(status=body.get("status"), delay_s=float(body.get("delay_s", 0.0)),
                                 count=body.get("count"))
                result = {"status": body.get("status"), "delay_s": body.get("delay_s", 0.0), "count": body.get("count")}
            elif route == ("DELETE", "/control/fail-mode"):
                em.set_fail_mode()
                result = {}
            elif route == ("POST", "/control/expire-tokens"):
                em.expire_tokens()
                result = {}
            elif route == ("GET", "/control/stats"):
                with em._lock:
                    result = json.loads(json.dumps(em.stats))
            else:
                self._send(404, json.dumps({"error": f"no control endpoint {method} {self.path}"}), "application/json")
                return
        except (ValueError, TypeError) as exc:
            self._send(400, json.dumps({"error": str(exc)}), "application/json")
            return
        self._send(200, json.dumps(result), "application/json")


def main(argv: list[str] | None = None) -> int:
    """Command line: serve one instance's metadata until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m spot_training.local.imds_emulator", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--instance-id", required=True)
    parser.add_argument("--endpoint-url", help="moto server URL: read the instance's identity from it")
    parser.add_argument("--region", default="us-east-1")
    parser.add_argument("--availability-zone", help="explicit identity when --endpoint-url is not given")
    parser.add_argument("--instance-type", default="p3.2xlarge")
    parser.add_argument("--local-ipv4", default="10.0.0.10")
    args = parser.parse_args(argv)
    if args.endpoint_url:
        import boto3  # only this entry point needs boto3
        ec2 = boto3.client("ec2", region_name=args.region, endpoint_url=args.endpoint_url,
                           aws_access_key_id="testing", aws_secret_access_key="testing")
        emulator = ImdsEmulator.from_moto(ec2, args.instance_id, port=args.port)
    elif args.availability_zone:
        emulator = ImdsEmulator(instance_id=args.instance_id, availability_zone=args.availability_zone,
                                region=args.region, instance_type=args.instance_type,
                                local_ipv4=args.local_ipv4, port=args.port)
    else:
        parser.error("give --endpoint-url (identity from moto) or --availability-zone (explicit identity)")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with emulator:
        print(json.dumps({"endpoint": emulator.endpoint, "instance_id": emulator.instance_id,
                          "availability_zone": emulator.availability_zone}), flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
