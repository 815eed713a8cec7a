"""The agent runs as root; the training user owns the data volume's contents.

Every test plants what a hostile training user could plant on the volume (symlinks, git hooks, git
config) and checks that a root-only target stays untouched and that nothing runs as uid 0. The
"training user" is ``nobody``; the tests need root (the agent's situation on an instance) and skip
otherwise.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from git_helpers import git as _git
from git_helpers import two_version_repo
from root_helpers import training_user_tree

from spot_training.agent.config import parse_config
from spot_training.agent.errors import ExitCode
from spot_training.agent.logs import LOGGER_NAME, add_file_handler, close_file_handlers
from spot_training.agent.supervisor import CHECKPOINT_REQUEST_FILE, Supervisor

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the agent's privilege drop")

REPO = Path(__file__).resolve().parents[2]
USER = "nobody"


@pytest.fixture()
def root():
    """A directory 'nobody' can traverse (pytest's tmp_path is 0700): ``volume/`` (the mount point,
    owned by the training user as spot_training.agent.ebs leaves it) and ``secret/`` (root only)."""
    with training_user_tree("spot-priv-", "volume", USER) as base:
        try:
            yield base
        finally:
            close_file_handlers()


def config(base: Path, code: dict | None = None) -> dict:
    mount = base / "volume"
    return {
        "schema_version": 1, "region": "us-east-1", "stack_name": "SpotTraining", "node_role": "single",
        "volume": {"tags": {"spot-training:stack": "SpotTraining", "spot-training:purpose": "data-volume"},
                   "device_name": "/dev/sdf", "mount_point": str(mount), "fs_type": "xfs", "keep_snapshots": 2},
        "efs": None,
        "training": {"framework": "tensorflow", "python": sys.executable,
                     "command": ["/bin/sh", "-c", 'echo "{}" > "$SPOT_TRAINING_CHECKPOINT_DIR/COMPLETED"'],
                     "user": USER, "dataset_dir": str(mount / "datasets"),
                     "checkpoint_dir": str(mount / "checkpoints"), "log_dir": str(mount / "logs"),
                     "code": code or {"type": "asset", "path": str(base)}},
        "cleanup": {"cancel_fleet_on_success": True}, "imds_endpoint": None,
    }


def supervisor(base: Path, code: dict | None = None) -> Supervisor:
    gitconfig = base / "gitconfig"
    gitconfig.write_text(f"[safe]\n\tdirectory = {base / 'repo'}\n\tdirectory = {base / 'repo' / '.git'}\n")
    environ = dict(os.environ, PYTHONPATH=str(REPO), GIT_CONFIG_GLOBAL=str(gitconfig))
    return Supervisor(parse_config(config(base, code)), is_mounted=lambda: True, environ=environ, poll_s=0.05)


def as_user(path: Path, *, symlink_to: Path | None = None) -> None:
    """Plant ``path`` the way the training user would: a symlink owned by them."""
    account = pwd.getpwnam(USER)
    if symlink_to is not None:
        path.symlink_to(symlink_to)
    os.lchown(path, account.pw_uid, account.pw_gid)


def untouched(base: Path) -> None:
    secret = base / "secret"
    assert secret.stat().st_uid == 0 and stat.S_IMODE(secret.stat().st_mode) == 0o700
    assert (secret / "shadow").stat().st_uid == 0
    assert (secret / "shadow").read_text() == "root:secret\n"
    assert sorted(p.name for p in secret.iterdir()) == ["shadow"]


def test_planted_checkpoints_symlink_does_not_give_a_root_directory_away(root):
    as_user(root / "volume" / "checkpoints", symlink_to=root / "secret")
    sup = supervisor(root)
    with pytest.raises(Exception) as info:
        sup.run()
    assert getattr(info.value, "exit_code", None) == ExitCode.CONFIG
    assert "checkpoints" in str(info.value) and "symbolic link" in str(info.value)
    assert sup.starts == 0
    untouched(root)


def test_planted_symlink_in_an_intermediate_component_is_not_followed(root):
    # dataset_dir is <mount>/datasets; plant the mount's "datasets" as a link to the secret parent.
    as_user(root / "volume" / "datasets", symlink_to=root / "secret")
    with pytest.raises(Exception) as info:
        supervisor(root).run()
    assert getattr(info.value, "exit_code", None) == ExitCode.CONFIG
    untouched(root)


@pytest.mark.integration
def test_user_owned_directories_are_still_created_and_given_to_the_user(root):
    sup = supervisor(root)
    assert sup.run().value == "completed"
    uid = pwd.getpwnam(USER).pw_uid
    for name in ("datasets", "checkpoints", "logs"):
        path = root / "volume" / name
        assert path.is_dir() and not path.is_symlink() and path.stat().st_uid == uid


def test_planted_agent_log_symlink_does_not_append_to_a_root_file(root):
    logs = root / "volume" / "logs"
    logs.mkdir()
    as_user(logs)
    as_user(logs / "agent.jsonl", symlink_to=root / "secret" / "shadow")
    with pytest.raises(Exception) as info:
        add_file_handler(logs)
        logging.getLogger(LOGGER_NAME).error("this line must not reach a root file")
    assert getattr(info.value, "exit_code", None) == ExitCode.CONFIG
    untouched(root)


def test_planted_log_dir_symlink_does_not_create_the_agent_log_in_a_root_directory(root):
    as_user(root / "volume" / "logs", symlink_to=root / "secret")
    with pytest.raises(Exception) as info:
        add_file_handler(root / "volume" / "logs")
        logging.getLogger(LOGGER_NAME).error("this line must not reach a root directory")
    assert getattr(info.value, "exit_code", None) == ExitCode.CONFIG
    untouched(root)


def test_agent_log_still_written_on_a_clean_volume(root):
    path = add_file_handler(root / "volume" / "logs")
    logging.getLogger(LOGGER_NAME).error("hello from the agent")
    close_file_handlers()
    assert "hello from the agent" in path.read_text()


@pytest.mark.integration
def test_planted_request_file_symlink_does_not_truncate_a_root_file(root):
    ckpt = root / "volume" / "checkpoints"
    ckpt.mkdir()
    as_user(ckpt)
    as_user(ckpt / f".{CHECKPOINT_REQUEST_FILE}.tmp", symlink_to=root / "secret" / "shadow")
    sup = supervisor(root)
    sup._proc = subprocess.Popen(["sleep", "30"])  # a running trainer, as far as the request is concerned
    try:
        assert sup.request_checkpoint() is True
    finally:
        sup._proc.kill()
        sup._proc.wait()
    untouched(root)
    request = ckpt / CHECKPOINT_REQUEST_FILE
    assert request.is_file() and not request.is_symlink()
    assert request.stat().st_uid == pwd.getpwnam(USER).pw_uid  # the trainer may delete it


# ---- git (item 5) -------------------------------------------------------------------------------
def _source_repo(base: Path) -> tuple[Path, str]:
    """A repository with tags v1 and v2 (root's, readable by all); returns (path, v2 commit). Git refuses
    to read a local repository another user owns unless it is a ``safe.directory``: the agent's environment in
    :func:`supervisor` makes this one one (it stands for an https URL on a real node)."""
    return two_version_repo(base)


@pytest.mark.integration
def test_planted_git_hook_and_config_never_run_as_root(root):
    repo, _ = _source_repo(root)
    code = {"type": "git", "url": str(repo), "ref": "v1"}
    workspace = supervisor(root, code).workspace.prepare_code()
    assert (workspace / "VERSION").read_text() == "1"
    # The training user plants a post-checkout hook and a core.fsmonitor command in the checkout.
    marks = root / "marks"
    marks.mkdir(mode=0o777)
    os.chmod(marks, 0o777)
    hook = workspace / ".git" / "hooks" / "post-checkout"
    hook.write_text(f"#!/bin/sh\nid -u >> {marks}/hook\n")
    hook.chmod(0o755)
    as_user(hook)
    _git("-c", f"safe.directory={workspace}", "config", "core.fsmonitor", f"id -u >> {marks}/fsmonitor; true",
         cwd=workspace)
    os.lchown(workspace / ".git" / "config", pwd.getpwnam(USER).pw_uid, pwd.getpwnam(USER).pw_gid)

    workspace = supervisor(root, dict(code, ref="v2")).workspace.prepare_code()  # the next boot switches refs
    assert (workspace / "VERSION").read_text() == "2"
    ran_as = [line for f in marks.iterdir() for line in f.read_text().split()]
    assert "0" not in ran_as, f"a planted command ran as root: {sorted(p.name for p in marks.iterdir())}"
    assert not (marks / "hook").exists()  # hooks are off for the agent's git
    uid = pwd.getpwnam(USER).pw_uid
    assert (workspace / "VERSION").stat().st_uid == uid  # the checkout stays the user's


@pytest.mark.integration
def test_planted_workspace_symlink_is_not_followed_by_root(root):
    # The user points the workspace at a root-only checkout elsewhere (here: of the same repository).
    repo, _ = _source_repo(root)
    private = root / "secret" / "checkout"
    _git("clone", "-q", str(repo), str(private), cwd=root)
    _git("checkout", "-q", "--detach", "v1", cwd=private)
    as_user(root / "volume" / "workspace", symlink_to=private)
    with pytest.raises(Exception) as info:
        supervisor(root, {"type": "git", "url": str(repo), "ref": "v1"}).workspace.prepare_code()
    assert getattr(info.value, "exit_code", None) == ExitCode.CONFIG
    owners = {os.lstat(os.path.join(d, n)).st_uid for d, dirs, files in os.walk(private) for n in dirs + files}
    assert owners == {0}  # nothing of root's checkout was given to the training user
