"""A node's workspace: the training code, the trainer's environment, the training user and the
trainer's process environment: what every node kind prepares before it runs anything.

The single-node supervisor (spot_training/agent/supervisor.py) and the cluster agents
(spot_training/agent/cluster.py's ``run_node``) both prepare a node through :class:`Workspace`:

- the code: the CDK asset already on disk, or ``git clone`` at a pinned ref into
  ``<volume.mount_point>/workspace`` (idempotent: an existing checkout at that ref is kept);
- the environment: ``training.venv`` built once as the training user (spot_training/agent/trainer_env.py);
- the user: ``training.user`` when the agent is root (privileges dropped), else the current user;
- the trainer's environment: ``SPOT_TRAINING_DATA_DIR``, ``_CHECKPOINT_DIR``, ``_LOG_DIR``,
  ``_CHECKPOINT_REQUEST_FILE`` and the checkpoint cadence (docs/contracts.md, "Trainer environment").

Root never follows a path the training user controls (spot_training/agent/safepath.py).
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Mapping

from spot_training.agent import trainer_env
from spot_training.agent.config import AgentConfig
from spot_training.agent.errors import AgentError, ConfigError, ExitCode, TemporaryError
from spot_training.agent.process_group import user_ids, user_kwargs
from spot_training.agent.safepath import UnsafePathError, open_directory
from spot_training.contract import (
    CHECKPOINT_REQUEST_FILE,
    COMPLETED_FILE,
    ENV_CHECKPOINT_DIR,
    ENV_CHECKPOINT_EVERY_SECONDS,
    ENV_CHECKPOINT_EVERY_STEPS,
    ENV_CHECKPOINT_REQUEST_FILE,
    ENV_DATA_DIR,
    ENV_LOG_DIR,
)

log = logging.getLogger("spot_training.agent.supervisor")

__all__ = ["Workspace", "EnvironmentBuildFailed", "VolumeNotMountedError", "WORKSPACE_DIR"]

WORKSPACE_DIR = "workspace"

_UNSET = object()


class EnvironmentBuildFailed(AgentError):
    """The trainer's virtual environment could not be built (pip failed every attempt): exit 75.
    The node reports it as a failed boot (docs/agent.md, "Boot failures")."""

    exit_code = ExitCode.TEMPFAIL


class VolumeNotMountedError(AgentError):
    """The data volume is not mounted: training must not start on the root disk. Exit 75."""

    exit_code = ExitCode.TEMPFAIL


class Workspace:
    """Prepares one node (see the module docstring).

    Args:
        config: the validated node config.
        is_mounted: returns True when the data volume is mounted and verified (cluster nodes: always).
        run_as_current_user_if_missing: when root and ``training.user`` does not exist, run as root
            instead of raising ConfigError (local mode only; default False).
        environ: base environment for the trainer (default ``os.environ``).
        venv_attempts, venv_backoff_s: whole ``pip install`` attempts when building ``training.venv``
            (default 3), ``venv_backoff_s * n`` seconds apart (default 5 s).

    Attributes:
        python: the trainer's interpreter: ``training.python``, or the venv's once
            :meth:`prepare_environment` ran.
    """

    def __init__(self, config: AgentConfig, *, is_mounted: Callable[[], bool] = lambda: True,
                 run_as_current_user_if_missing: bool = False, environ: Mapping[str, str] | None = None,
                 venv_attempts: int = trainer_env.DEFAULT_ATTEMPTS, venv_backoff_s: float = trainer_env.BACKOFF_S) -> None:
        self.config = config
        self.training = config.training
        self.is_mounted = is_mounted
        self.run_as_current_user_if_missing = run_as_current_user_if_missing
        self.environ = dict(os.environ if environ is None else environ)
        self._account_cache: object = _UNSET
        self.python: str = str(config.training.python)
        self._environment_ready = False
        self.venv_attempts, self.venv_backoff_s = max(1, int(venv_attempts)), float(venv_backoff_s)

    @property
    def completed_file(self) -> Path:
        """``<checkpoint_dir>/COMPLETED``."""
        return self.training.checkpoint_dir / COMPLETED_FILE

    @property
    def request_file(self) -> Path:
        """``<checkpoint_dir>/CHECKPOINT_REQUEST`` (SPOT_TRAINING_CHECKPOINT_REQUEST_FILE)."""
        return self.training.checkpoint_dir / CHECKPOINT_REQUEST_FILE

    def completed(self) -> bool:
        """True when the trainer has written COMPLETED."""
        return self.completed_file.is_file()

    # ---- code -------------------------------------------------------------------------------
    def prepare_code(self) -> Path:
        """The directory the trainer runs in: the asset path, or the git checkout in
        ``<mount_point>/workspace`` at the pinned ref. Raises ConfigError when the asset directory is
        missing or the ref does not exist, TemporaryError when ``git clone``/``fetch`` fails."""
        code = self.training.code
        if code.type == "asset":
            if not code.path.is_dir():
                raise ConfigError(f"training.code.path: {str(code.path)!r} is not a directory on this node; "
                                  "expected the unpacked training code asset")
            return code.path
        self.require_mounted()
        dest = self.config.volume.mount_point / WORKSPACE_DIR
        _git_checkout(code.url, code.ref, dest, env=self._git_env(), account=self.account())
        return dest

    # ---- the trainer's virtual environment ------------------------------------------------------
    def prepare_environment(self) -> str:
        """Reuse or build the trainer's venv (``training.venv``; :mod:`spot_training.agent.trainer_env`) and make
        its interpreter the one ``{python}`` stands for. Without ``training.venv`` (an AMI that ships
        the framework) nothing is built and ``training.python`` runs as it is.

        The build runs as a child process **as the training user** (never root: the environment
        directory belongs to that user), with pip's ``PIP_*`` settings from the agent's environment.
        The environment root is created by the agent and handed to the user; an existing root that is
        a symbolic link is refused. Logs ``environment built`` or ``environment reused``.

        Returns the interpreter path. Raises :class:`EnvironmentBuildFailed` (exit 75) when the build
        failed (pip's last lines in the message), VolumeNotMountedError when the storage is gone.
        """
        if self._environment_ready:
            return self.python
        venv = self.training.venv
        if venv is None:
            self._environment_ready = True
            log.info("no training.venv: the trainer runs training.python as it is",
                     extra={"python": str(self.training.python)})
            return self.python
        self.require_mounted()
        root = venv.root
        # Created and handed to the training user without following a link the user planted
        # (spot_training.agent.safepath), as the training directories are.
        try:
            if root.is_symlink():  # refused even inside a directory only root can write
                raise UnsafePathError(f"{str(root)!r} is a symbolic link")
            os.close(open_directory(root, create=True, owner=self.owner()))
        except (UnsafePathError, NotADirectoryError, FileExistsError) as exc:
            raise ConfigError(f"training.venv.root: {str(root)!r} is not a plain directory (a link or a file is "
                              f"there: {exc}); the agent will not follow it as root. Remove it and restart the "
                              "agent") from exc
        argv = [sys.executable, "-m", "spot_training.agent.trainer_env", "ensure", "--python", str(self.training.python),
                "--root", str(root)]
        for requirement in venv.requirements:
            argv += ["--requirement", requirement]
        if venv.inherit_site_packages:
            argv.append("--inherit-site-packages")
        argv += ["--attempts", str(self.venv_attempts), "--backoff-s", str(self.venv_backoff_s)]
        kwargs = user_kwargs(self.user())
        env = self.trainer_environment()
        # The child imports bootstrap from the agent's code directory (the asset or a checkout).
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
        log.info("preparing the trainer's environment", extra={"root": str(root), "requirements": list(venv.requirements)})
        done = subprocess.run(argv, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              cwd=str(root), **kwargs)
        lines = done.stdout.strip().splitlines()
        try:
            result = json.loads(lines[-1]) if lines else {}
        except ValueError:
            result = {}
        if done.returncode != 0 or "python" not in result:
            reason = result.get("error") or done.stderr.strip()[-1500:] or f"exit status {done.returncode}"
            raise EnvironmentBuildFailed(f"building the trainer's environment under {root} failed: {reason}")
        self.python = result["python"]
        self._environment_ready = True
        log.info(f"environment {result['status']}", extra={
            "key": result["key"], "python": self.python, "seconds": result["seconds"],
            "pip_attempts": result["attempts"], "requirements": list(venv.requirements)})
        return self.python

    def _git_env(self) -> dict[str, str]:
        env = dict(self.environ)
        env["GIT_TERMINAL_PROMPT"] = "0"  # never wait for a password on a headless node
        account = self.account()
        if account is not None:  # git runs as the training user, with their home (credentials, config)
            env.update({"HOME": account.pw_dir, "USER": account.pw_name, "LOGNAME": account.pw_name})
        return env

    # ---- user and environment -----------------------------------------------------------------
    def account(self) -> pwd.struct_passwd | None:
        """The account to drop to, or None to run as the current user (looked up once)."""
        if self._account_cache is not _UNSET:
            return self._account_cache  # type: ignore[return-value]
        self._account_cache = self._lookup_account()
        return self._account_cache  # type: ignore[return-value]

    def _lookup_account(self) -> pwd.struct_passwd | None:
        if os.geteuid() != 0:
            return None
        try:
            return pwd.getpwnam(self.training.user)
        except KeyError:
            if self.run_as_current_user_if_missing:
                log.warning("training user does not exist; running the trainer as the current user (local mode)",
                            extra={"user": self.training.user})
                return None
            raise ConfigError(f"training.user: {self.training.user!r} does not exist on this node; expected an "
                              "existing Unix user (the agent runs as root and will not run training as root)") from None

    def user(self) -> tuple[int, int, list[int]] | None:
        """``(uid, gid, supplementary groups)`` of the training user the agent drops to, or None to run
        as the current user; what :meth:`ProcessGroup.start` takes (the cluster agents use it too).
        Raises ConfigError when the agent is root and ``training.user`` does not exist."""
        return user_ids(self.account())

    def owner(self) -> tuple[int, int] | None:
        """``(uid, gid)`` that the training user's files get, or None (the current user)."""
        account = self.account()
        return None if account is None else (account.pw_uid, account.pw_gid)

    def trainer_environment(self) -> dict[str, str]:
        """The trainer's environment: the base environment plus the four SPOT_TRAINING_* directory and
        request-file variables, the checkpoint cadence ``SPOT_TRAINING_CHECKPOINT_EVERY_STEPS`` /
        ``_EVERY_SECONDS`` where the node config's ``spot_training.training`` section sets it (else the trainer's
        default applies), and HOME/USER/LOGNAME of the training user when privileges are dropped."""
        env = dict(self.environ)
        env.update({
            ENV_DATA_DIR: str(self.training.dataset_dir),
            ENV_CHECKPOINT_DIR: str(self.training.checkpoint_dir),
            ENV_LOG_DIR: str(self.training.log_dir),
            ENV_CHECKPOINT_REQUEST_FILE: str(self.request_file),
            "PYTHONUNBUFFERED": "1",
        })
        # The library's own code directory (the asset holding spot_training/{contract,agent,training}) comes
        # first on the trainer's import path, so a script cloned from git or copied from S3 can
        # `import spot_training.training` wherever it lives; the node's own PYTHONPATH, if any, follows.
        code_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([code_root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != code_root]])
        if self.training.checkpoint_every_steps is not None:
            env[ENV_CHECKPOINT_EVERY_STEPS] = str(self.training.checkpoint_every_steps)
        if self.training.checkpoint_every_seconds is not None:
            env[ENV_CHECKPOINT_EVERY_SECONDS] = f"{self.training.checkpoint_every_seconds:g}"
        account = self.account()
        if account is not None:
            env.update({"HOME": account.pw_dir, "USER": account.pw_name, "LOGNAME": account.pw_name})
        return env

    def prepare_dirs(self) -> None:
        """Create the dataset, checkpoint and log directories, owned by the training user."""
        # Root never follows a symlink the training user planted on the volume (spot_training.agent.safepath):
        # `checkpoints -> /etc` would otherwise hand /etc to the user. Raises UnsafePathError (exit 78).
        for directory in (self.training.dataset_dir, self.training.checkpoint_dir, self.training.log_dir):
            os.close(open_directory(directory, create=True, owner=self.owner()))

    def require_mounted(self) -> None:
        """Raise :class:`VolumeNotMountedError` unless the data volume is mounted."""
        if not self.is_mounted():
            raise VolumeNotMountedError(
                f"the data volume is not mounted at {self.config.volume.mount_point}; refusing to start training "
                "on the root disk (checkpoints there are lost with the instance)")

    # ---- running ----------------------------------------------------------------------------


_GIT_OPTIONS = ("-c", "core.hooksPath=/dev/null")


def _git(args: list[str], *, cwd: Path | None, env: Mapping[str, str],
         account: pwd.struct_passwd | None = None) -> subprocess.CompletedProcess:
    """Run git (``-C cwd`` when given) as ``account`` (None: the current user), hooks disabled."""
    kwargs = user_kwargs(user_ids(account))
    where = ["-C", str(cwd)] if cwd is not None else []
    return subprocess.run(["git", *_GIT_OPTIONS, *where, *args], env=dict(env), capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL, **kwargs)


def _git_checkout(url: str, ref: str, dest: Path, *, env: Mapping[str, str],
                  account: pwd.struct_passwd | None = None) -> None:
    """Make ``dest`` a checkout of ``url`` at ``ref`` (detached). Idempotent: an existing checkout at
    that ref is left alone; one at another ref is fetched and switched. A clone goes to a sibling
    directory first and is renamed into place, so a crash never leaves a half clone at ``dest``.

    git runs as ``account`` (the training user, who owns the checkout) with hooks disabled: run as
    root in a directory the user controls, a planted hook, ``core.fsmonitor`` or filter in
    ``.git/config`` would run as root. ``url`` and ``ref`` never start with ``-``
    (spot_training.agent.config rejects that: git would read them as options). Raises UnsafePathError when
    ``dest`` or its ``.partial`` sibling is a symbolic link."""
    if shutil.which("git", path=env.get("PATH")) is None:
        raise ConfigError("training.code.type is 'git' but there is no git executable on this node's PATH")
    partial = dest.with_name(dest.name + ".partial")
    for path in (dest, partial):
        if path.is_symlink():
            raise UnsafePathError(f"{str(path)!r} is a symbolic link on the data volume; the agent does not follow it. "
                                  f"Remove it (rm {path}) and boot again")
    if (dest / ".git").exists():
        head = _git(["rev-parse", "HEAD"], cwd=dest, env=env, account=account).stdout.strip()
        want = _git(["rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], cwd=dest, env=env,
                    account=account).stdout.strip()
        if head and head == want:
            log.info("training code already checked out", extra={"ref": ref, "commit": head, "path": str(dest)})
            return
        fetched = _git(["fetch", "--tags", "--force", "origin"], cwd=dest, env=env, account=account)
        if fetched.returncode != 0:
            raise TemporaryError(f"git fetch of {url} failed: {fetched.stderr.strip()[-500:]}")
        target = dest
    else:
        if partial.exists():
            shutil.rmtree(partial)  # our own unfinished clone from a crashed run (rmtree never follows links)
        cloned = _git(["clone", "--quiet", "--no-checkout", "--", url, str(partial)], cwd=None, env=env,
                      account=account)
        if cloned.returncode != 0:
            raise TemporaryError(f"git clone of {url} failed: {cloned.stderr.strip()[-500:]}")
        target = partial
    checked = _git(["checkout", "--quiet", "--detach", "--force", ref], cwd=target, env=env, account=account)
    if checked.returncode != 0:
        raise ConfigError(f"training.code.ref: {ref!r} cannot be checked out from {url}: "
                          f"{checked.stderr.strip()[-300:]}; expected an existing commit or tag")
    if target != dest:
        os.rename(target, dest)
    commit = _git(["rev-parse", "HEAD"], cwd=dest, env=env, account=account).stdout.strip()
    log.info("training code checked out", extra={"url": url, "ref": ref, "commit": commit, "path": str(dest),
                                                 "user": account.pw_name if account else None})
