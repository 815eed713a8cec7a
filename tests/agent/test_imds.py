"""IMDSv2 client against the instance-metadata emulator, over real HTTP on loopback."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from spot_training.agent.errors import ExitCode
from spot_training.agent.imds import (ImdsClient, ImdsForbiddenError, ImdsUnavailableError, RebalanceRecommendation,
                            SpotInstanceAction, resolve_endpoint)
from spot_training.agent.logs import setup_logging
from spot_training.local.imds_emulator import ImdsEmulator

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def _call(url: str, method: str = "GET", headers: dict | None = None, body: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else (b"" if method in ("PUT", "POST") else None)
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def imds():
    with ImdsEmulator(instance_id="i-0abc", availability_zone="us-east-1b", instance_type="m5.large",
                      local_ipv4="10.1.2.3", tags={"spot-training:stack": "SpotTraining"}) as emulator:
        yield emulator


@pytest.mark.integration
def test_emulator_enforces_imdsv2(imds):
    status, _ = _call(imds.endpoint + "/latest/meta-data/instance-id")
    assert status == 401
    status, _ = _call(imds.endpoint + "/latest/meta-data/instance-id", headers={"X-aws-ec2-metadata-token": "forged"})
    assert status == 401
    status, body = _call(imds.endpoint + "/latest/api/token", "PUT")
    assert status == 400 and "ttl" in body.lower()
    status, token = _call(imds.endpoint + "/latest/api/token", "PUT", {"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    assert status == 200 and len(token) >= 32
    status, body = _call(imds.endpoint + "/latest/meta-data/instance-id", headers={"X-aws-ec2-metadata-token": token})
    assert (status, body) == (200, "i-0abc")


@pytest.mark.integration
def test_client_reads_identity_and_tags(imds):
    client = ImdsClient(imds.endpoint)
    assert client.instance_id() == "i-0abc"
    assert client.availability_zone() == "us-east-1b"
    assert client.region() == "us-east-1"
    assert client.private_ipv4() == "10.1.2.3"
    assert client.instance_type() == "m5.large"
    assert client.tags() == {"spot-training:stack": "SpotTraining"}
    assert client.identity_document()["instanceId"] == "i-0abc"
    # One token for all of that: it is cached.
    assert imds.stats["token_puts"] == 1


@pytest.mark.integration
def test_tags_none_when_not_exposed():
    with ImdsEmulator(instance_id="i-1", availability_zone="us-east-1a") as emulator:
        assert ImdsClient(emulator.endpoint).tags() is None


def test_identity_from_moto_instance(ec2):
    instance = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, InstanceType="c5.xlarge",
                                 Placement={"AvailabilityZone": "us-east-1c"},
                                 TagSpecifications=[{"ResourceType": "instance",
                                                     "Tags": [{"Key": "spot-training:stack", "Value": "S"}]}])
    instance = instance["Instances"][0]
    with ImdsEmulator.from_moto(ec2, instance["InstanceId"]) as emulator:
        client = ImdsClient(emulator.endpoint)
        assert client.instance_id() == instance["InstanceId"]
        assert client.availability_zone() == "us-east-1c"
        assert client.instance_type() == "c5.xlarge"
        assert client.private_ipv4() == instance["PrivateIpAddress"]
        assert client.tags()["spot-training:stack"] == "S"


def test_emulator_command_line_serves_moto_identity(ec2, moto_server):
    instance_id = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1,
                                    Placement={"AvailabilityZone": "us-east-1d"})["Instances"][0]["InstanceId"]
    proc = subprocess.Popen([sys.executable, "-m", "spot_training.local.imds_emulator", "--instance-id", instance_id,
                             "--endpoint-url", moto_server.endpoint_url], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        line = json.loads(proc.stdout.readline())
        client = ImdsClient(line["endpoint"])
        assert client.instance_id() == instance_id
        assert client.availability_zone() == "us-east-1d"
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


@pytest.mark.integration
def test_expired_token_gets_401_then_client_refreshes_once():
    server_clock = FakeClock()
    with ImdsEmulator(instance_id="i-2", availability_zone="us-east-1a", clock=server_clock) as emulator:
        # The client believes its 60 s token is still good (its own clock has not moved) ...
        client = ImdsClient(emulator.endpoint, token_ttl_s=60, refresh_margin_s=0)
        assert client.instance_id() == "i-2"
        server_clock.now += 61  # ... but the server sees it expired.
        assert client.instance_id() == "i-2"
        assert emulator.stats["unauthorized"] == 1
        assert emulator.stats["token_puts"] == 2


@pytest.mark.integration
def test_revoked_token_is_refreshed_over_control_endpoint(imds):
    client = ImdsClient(imds.endpoint)
    client.instance_id()
    assert _call(imds.endpoint + "/control/expire-tokens", "POST", body={})[0] == 200
    assert client.availability_zone() == "us-east-1b"
    stats = json.loads(_call(imds.endpoint + "/control/stats")[1])
    assert (stats["token_puts"], stats["unauthorized"]) == (2, 1)


@pytest.mark.integration
def test_client_refreshes_token_before_it_expires(imds):
    clock = FakeClock()
    client = ImdsClient(imds.endpoint, token_ttl_s=100, refresh_margin_s=10, clock=clock)
    client.instance_id()
    clock.now += 89
    client.instance_id()
    assert imds.stats["token_puts"] == 1
    clock.now += 2  # 91 s: inside the 10 s margin -> new token without a 401
    client.instance_id()
    assert imds.stats["token_puts"] == 2 and imds.stats["unauthorized"] == 0


@pytest.mark.integration
def test_403_is_fatal_with_a_clear_message(imds):
    assert _call(imds.endpoint + "/control/fail-mode", "POST", body={"status": 403})[0] == 200
    client = ImdsClient(imds.endpoint)
    with pytest.raises(ImdsForbiddenError, match="403 Forbidden.*HttpEndpoint=enabled") as info:
        client.instance_id()
    assert info.value.exit_code == ExitCode.CONFIG
    # Not retried: a single token request reached the server.
    assert [r["method"] for r in imds.stats["requests"] if r["path"] == "/latest/api/token"] == ["PUT"]


@pytest.mark.integration
def test_403_on_a_metadata_get_is_fatal(imds):
    client = ImdsClient(imds.endpoint)
    client.instance_id()
    imds.set_fail_mode(status=403)
    with pytest.raises(ImdsForbiddenError, match="403 Forbidden for GET meta-data/spot/instance-action"):
        client.spot_instance_action()


@pytest.mark.integration
def test_timeouts_get_bounded_retries_then_a_clear_error(imds):
    _call(imds.endpoint + "/control/fail-mode", "POST", body={"delay_s": 1.5})
    sleeps: list[float] = []
    client = ImdsClient(imds.endpoint, timeout_s=0.3, attempts=3, sleep=sleeps.append)
    started = time.monotonic()
    with pytest.raises(ImdsUnavailableError, match="after 3 attempts of 0.3 s") as info:
        client.instance_id()
    elapsed = time.monotonic() - started
    assert info.value.exit_code == ExitCode.TEMPFAIL
    assert len(sleeps) == 2 and all(0 <= s <= 0.2 * 4 for s in sleeps)
    assert elapsed < 3 * 0.3 + 1.0
    token_puts = [r for r in imds.stats["requests"] if r["path"] == "/latest/api/token"]
    assert len(token_puts) == 3


@pytest.mark.integration
def test_one_slow_answer_is_retried_and_succeeds(imds):
    imds.set_fail_mode(delay_s=1.0, count=1)
    client = ImdsClient(imds.endpoint, timeout_s=0.3, attempts=3, sleep=lambda s: None)
    assert client.instance_id() == "i-0abc"


@pytest.mark.integration
def test_unreachable_endpoint_is_a_temporary_error():
    client = ImdsClient("http://127.0.0.1:9", timeout_s=0.2, attempts=2, sleep=lambda s: None)
    with pytest.raises(ImdsUnavailableError, match="did not answer PUT /latest/api/token after 2 attempts"):
        client.instance_id()


@pytest.mark.integration
def test_notices_404_means_none_then_posted_then_cleared(imds):
    client = ImdsClient(imds.endpoint)
    assert client.spot_instance_action() is None
    assert client.rebalance_recommendation() is None
    _call(imds.endpoint + "/control/spot/instance-action", "POST", body={"action": "terminate", "time": "2026-11-21T08:00:00Z"})
    _call(imds.endpoint + "/control/rebalance", "POST", body={"noticeTime": "2026-11-21T07:58:00Z"})
    notice = client.spot_instance_action()
    assert isinstance(notice, SpotInstanceAction) and notice.action == "terminate"
    assert notice.time.isoformat() == "2026-11-21T08:00:00+00:00"
    assert notice.id == client.spot_instance_action().id  # the same notice polled twice has one id
    rebalance = client.rebalance_recommendation()
    assert isinstance(rebalance, RebalanceRecommendation) and rebalance.notice_time.minute == 58
    _call(imds.endpoint + "/control/spot/instance-action", "DELETE")
    _call(imds.endpoint + "/control/rebalance", "DELETE")
    assert client.spot_instance_action() is None and client.rebalance_recommendation() is None


def test_endpoint_from_config_then_environment_then_default(monkeypatch):
    monkeypatch.delenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", raising=False)
    assert resolve_endpoint(None) == "http://169.254.169.254"
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:1338/")
    assert resolve_endpoint(None) == "http://127.0.0.1:1338"
    assert resolve_endpoint("http://127.0.0.1:9999") == "http://127.0.0.1:9999"


@pytest.mark.integration
def test_token_never_reaches_the_log(imds):
    stream = io.StringIO()
    logger = logging.getLogger("spot_training.agent")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    setup_logging(stream=stream, level=logging.DEBUG)
    try:
        client = ImdsClient(imds.endpoint)
        client.instance_id()
        imds.expire_tokens()
        imds.set_fail_mode(delay_s=0.5, count=1)
        client2 = ImdsClient(imds.endpoint, timeout_s=0.2, sleep=lambda s: None)
        client2.instance_id()
        client.instance_id()  # 401 -> refresh, logged
        tokens = list(imds._tokens)
    finally:  # leave logging as other tests expect it (caplog needs propagation)
        logger.handlers[:], logger.propagate, logger.level = saved
    text = stream.getvalue()
    assert "401" in text and "retrying" in text  # the events were logged ...
    assert tokens and not any(token in text for token in tokens)  # ... without any token
