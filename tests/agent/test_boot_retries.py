"""Boot steps that talk to the network retry what clears with time (bounded, jittered backoff) and stop at
once, with exit 78, on what no retry fixes: git clone/fetch of the training code (spot_training.agent.workspace)
and the pip install of the trainer's environment (spot_training.agent.trainer_env). Real git and pip
processes; no sleeping (the backoff is recorded)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from spot_training.agent import trainer_env, workspace
from spot_training.agent.errors import ConfigError, TemporaryError


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: connections are refused


def _git_env() -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "GIT_TERMINAL_PROMPT": "0"}


@pytest.mark.integration  # runs git / a real process
def test_git_clone_of_a_refused_connection_is_retried_with_backoff_then_a_temporary_error(tmp_path: Path) -> None:
    slept: list[float] = []
    url = f"http://127.0.0.1:{_closed_port()}/code.git"
    with pytest.raises(TemporaryError, match=r"git clone of .* still failing after 5 attempts"):
        workspace._git_checkout(url, "v1", tmp_path / "workspace", env=_git_env(), sleep=slept.append, rng=lambda: 1.0)
    assert slept == [2.0, 4.0, 8.0, 16.0]  # full jitter at its top: 2 s doubling, capped at 30 s
    assert not (tmp_path / "workspace").exists() and not (tmp_path / "workspace.partial").exists()


@pytest.mark.integration  # runs git / a real process
def test_git_clone_of_a_repository_that_is_not_there_is_final_at_once(tmp_path: Path) -> None:
    slept: list[float] = []
    with pytest.raises(ConfigError, match=r"training.code.url: git clone of .*nowhere.* retrying will not help"):
        workspace._git_checkout(str(tmp_path / "nowhere"), "v1", tmp_path / "workspace", env=_git_env(),
                                sleep=slept.append)
    assert slept == []


def _completed(returncode: int, stderr: str) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], returncode, stdout="", stderr=stderr)


# pip's own output (pip 24/25): a network failure ends in "No matching distribution" too, after
# pip's per-request retries; only without those is the requirement itself wrong.
PIP_NETWORK = ("WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after "
               "connection broken by 'NewConnectionError(\"Failed to establish a new connection: [Errno -3] "
               "Temporary failure in name resolution\")': /simple/torch/\n"
               "ERROR: Could not find a version that satisfies the requirement torch (from versions: none)\n"
               "ERROR: No matching distribution found for torch")
PIP_NO_SUCH = ("ERROR: Could not find a version that satisfies the requirement no-such-package-xyz==1.0 "
               "(from versions: none)\nERROR: No matching distribution found for no-such-package-xyz==1.0")


@pytest.mark.parametrize(("output", "permanent"), [
    (PIP_NETWORK, False), (PIP_NO_SUCH, True),
    ("ERROR: Invalid requirement: 'torch>>2'", True),
    ("ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/...", True),
    ("ERROR: HTTP error 403 while getting https://pkgs.example/simple/x/", True),
    ("ERROR: Exception: ... ReadTimeoutError: HTTPSConnectionPool(host='files.pythonhosted.org'): Read timed out.", False),
    ("ERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE.", False),
])
def test_pip_failures_are_told_apart(output: str, permanent: bool) -> None:
    assert trainer_env.pip_failure_is_permanent(output) is permanent


def test_pip_install_retries_a_network_failure_with_backoff_and_stops_at_a_wrong_requirement(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    runs: list[list[str]] = []
    outputs = [_completed(1, PIP_NETWORK), _completed(1, PIP_NETWORK), _completed(0, "")]
    monkeypatch.setattr(trainer_env, "_run", lambda argv, log: (runs.append(argv), outputs.pop(0))[1])
    slept: list[float] = []
    assert trainer_env._pip_install(tmp_path, ["torch"], 3, 5.0, lambda line: None, slept.append) == 3
    assert slept == [5.0, 10.0]

    runs.clear()
    slept.clear()
    monkeypatch.setattr(trainer_env, "_run", lambda argv, log: (runs.append(argv), _completed(1, PIP_NO_SUCH))[1])
    with pytest.raises(trainer_env.RequirementError, match=r"no-such-package-xyz==1.0.*retrying will not help"):
        trainer_env._pip_install(tmp_path, ["no-such-package-xyz==1.0"], 3, 5.0, lambda line: None, slept.append)
    assert len(runs) == 1 and slept == []


@pytest.mark.integration
def test_a_requirement_no_index_has_exits_78_from_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real pip, offline: an unknown requirement is a wrong setting (exit 78 once), not three pip runs and exit 69."""
    from spot_training.local.wheels import write_probe_wheel

    wheels = tmp_path / "wheels"
    write_probe_wheel(wheels)
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}
    argv = [sys.executable, "-m", "spot_training.agent.trainer_env", "ensure", "--python", sys.executable, "--root",
            str(tmp_path / "envs"), "--requirement", "no-such-package-xyz", "--attempts", "3", "--backoff-s", "30"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[2],
                          timeout=120)
    assert done.returncode == trainer_env.EXIT_REQUIREMENT == 78, done.stderr
    assert done.stderr.count("pip install failed") == 1
