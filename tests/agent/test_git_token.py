"""Code from a private git repository: the token comes from Secrets Manager (moto) and reaches git
through a credential helper in git's environment, never argv, the checkout's config, or a log line.

The remote is a real HTTP server on 127.0.0.1 that serves a bare repository with git's "dumb" HTTP
protocol and answers 401 (Basic) to any request without the right ``Authorization`` header, so the
clone succeeds only when git really sent the token.
"""

from __future__ import annotations

import base64
import http.server
import json
import logging
import os
import subprocess
import threading
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from spot_training.agent import workspace
from spot_training.agent.config import parse_config
from spot_training.agent.errors import ConfigError
from spot_training.agent.workspace import Workspace, git_credential_env, read_git_token

#: Every test here runs git (a real clone from a local HTTP server, or git's credential helper).
pytestmark = pytest.mark.integration

TOKEN = "ghp_s3cr3tT0kenThatMustNotLeak42"
SECRET = "spot-training/git-token"


def _git(*args: str, cwd: Path) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@e", "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def private_remote(tmp_path):
    """``(url, commit, seen_headers)``: a bare repo behind Basic auth (user x-access-token, TOKEN)."""
    work = tmp_path / "src"
    work.mkdir()
    _git("init", "-q", "-b", "main", cwd=work)
    (work / "my_train.py").write_text("print('private trainer')\n")
    _git("add", ".", cwd=work)
    _git("commit", "-q", "-m", "one", cwd=work)
    commit = _git("rev-parse", "HEAD", cwd=work)
    bare = tmp_path / "served" / "repo.git"
    _git("clone", "-q", "--bare", str(work), str(bare), cwd=tmp_path)
    _git("update-server-info", cwd=bare)  # what the dumb HTTP protocol reads
    expected = "Basic " + base64.b64encode(f"x-access-token:{TOKEN}".encode()).decode()
    seen: list[str | None] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path / "served"), **kwargs)

        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append(self.headers.get("Authorization"))
            if self.headers.get("Authorization") != expected:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="private"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/repo.git", commit, seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def secrets(monkeypatch):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with mock_aws():
        yield boto3.client("secretsmanager", region_name="us-east-1")


def test_token_secret_plain_or_json(secrets):
    secrets.create_secret(Name=SECRET, SecretString=TOKEN + "\n")
    assert read_git_token(SECRET, region="us-east-1") == ("x-access-token", TOKEN)
    arn = secrets.create_secret(Name="other", SecretString=json.dumps({"username": "ci-bot", "password": "p"}))["ARN"]
    assert read_git_token(arn, region="us-east-1") == ("ci-bot", "p")
    with pytest.raises(ConfigError, match="'missing' cannot be read.*ResourceNotFoundException"):
        read_git_token("missing", region="us-east-1")
    secrets.create_secret(Name="empty", SecretString=json.dumps({"username": "x"}))
    with pytest.raises(ConfigError, match="holds no usable token"):
        read_git_token("empty", region="us-east-1")


def test_git_answers_the_challenge_from_the_environment_only():
    """git itself resolves the credential (``git credential fill``) from the variables, and an
    empty first helper drops any helper of the user's own configuration."""
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", **git_credential_env("x-access-token", TOKEN)}
    out = subprocess.run(["git", "credential", "fill"], input="protocol=https\nhost=example.com\n\n", env=env,
                         capture_output=True, text=True, check=True).stdout
    assert f"username=x-access-token\npassword={TOKEN}\n" in out
    assert all(TOKEN not in value for key, value in git_credential_env("u", TOKEN).items()
               if key != workspace.GIT_TOKEN_ENV)


def test_private_clone_through_the_agent_with_the_token_from_secrets_manager(private_remote, secrets, tmp_path,
                                                                             monkeypatch, caplog):
    url, commit, seen = private_remote
    secrets.create_secret(Name=SECRET, SecretString=TOKEN)
    from tests.agent.test_supervisor import base_config

    config = base_config(tmp_path / "node", code={"type": "git", "url": url, "ref": commit, "token_secret": SECRET})
    argvs: list[list[str]] = []
    real_run = subprocess.run

    def recording_run(argv, *args, **kwargs):
        argvs.append(list(argv))
        return real_run(argv, *args, **kwargs)

    monkeypatch.setattr(workspace.subprocess, "run", recording_run)
    caplog.set_level(logging.DEBUG, logger="spot_training")
    ws = Workspace(parse_config(config), environ={k: v for k, v in os.environ.items() if not k.startswith("GIT_")})
    dest = ws.prepare_code()

    assert (dest / "my_train.py").read_text() == "print('private trainer')\n"
    assert real_run(["git", "-C", str(dest), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() == commit
    assert seen[0] is None and seen[-1] is not None  # challenged first, then answered with the token
    # The token is nowhere but in git's environment: not in any argv, the checkout, or the log.
    assert argvs and not any(TOKEN in arg for argv in argvs for arg in argv)
    assert not [p for p in dest.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert TOKEN not in caplog.text and "training code checked out" in caplog.text
    assert TOKEN not in json.dumps(ws.trainer_environment())  # nor in the trainer's environment


def test_private_clone_without_the_token_fails_and_names_no_secret(private_remote, tmp_path):
    """The same remote refuses git without the credential: the server's auth check is real. No access is
    final at once (exit 78), not retried: a replacement node would be refused alike."""
    url, commit, _ = private_remote
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")}, "GIT_TERMINAL_PROMPT": "0"}
    slept: list[float] = []
    with pytest.raises(ConfigError, match="git clone of .* failed and retrying will not help") as failed:
        workspace._git_checkout(url, commit, tmp_path / "checkout", env=env, sleep=slept.append)
    assert failed.value.exit_code == 78 and slept == []
