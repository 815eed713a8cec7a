"""Shared fixtures: a real moto server over HTTP on loopback, reset between tests.

- ``moto_server_session``: one :class:`spot_training.local.moto_server.MotoServer` process for the session
  (with :mod:`spot_training.local.moto_compat` applied inside it; its EBS data plane under the session's tmp dir).
- ``moto_server``: the same server, emptied with moto's reset API before the test, and the
  environment (fake credentials, ``AWS_ENDPOINT_URL``, region us-east-1) pointed at it for the test.
- ``ec2``: a boto3 EC2 client for that server (standard retry mode); ``image_id``: an AMI id for it.

Nothing here imports TensorFlow or MXNet.
"""

from __future__ import annotations

from collections.abc import Iterator

import boto3
import pytest
from botocore.config import Config

from spot_training.local.moto_server import MotoServer
from tier_guard import pytest_collection_modifyitems, pytest_runtest_call  # noqa: F401  (the test tiers' hooks)

REGION = "us-east-1"
#: Any AMI id works: the server does not load moto's AMI catalogue and moto does not validate ids.
IMAGE_ID = "ami-0123456789abcdef0"


@pytest.fixture(scope="session")
def moto_server_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto server process for the whole session; stopped by PID at the end."""
    with MotoServer(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture
def moto_server(moto_server_session: MotoServer, monkeypatch: pytest.MonkeyPatch) -> MotoServer:
    """The session's moto server, reset to empty, with this test's environment pointed at it."""
    moto_server_session.reset()
    for name in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in moto_server_session.env(REGION).items():
        monkeypatch.setenv(name, value)
    return moto_server_session


@pytest.fixture
def ec2(moto_server: MotoServer):
    """A boto3 EC2 client for the moto server (region us-east-1, fake credentials, standard retries)."""
    return boto3.client(
        "ec2",
        region_name=REGION,
        endpoint_url=moto_server.endpoint_url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(retries={"mode": "standard"}),
    )


@pytest.fixture
def image_id() -> str:
    """An AMI id to pass to RunInstances on the moto server (not validated by moto)."""
    return IMAGE_ID
