"""Run the training command, restart it after a crash, and decide when training is complete.

The supervisor (docs/contracts.md, "Environment the agent gives the trainer" and "Signals and files"):

1. refuses to do anything unless the data volume is mounted (``is_mounted``, from the storage half),
   so training never writes checkpoints to the root disk;
2. gets the training code: the CDK asset already on disk, or ``git clone`` at a pinned ref into
   ``<volume.mount_point>/workspace`` (idempotent: an existing checkout at that ref is kept);
3. runs ``training.command`` (``{python}`` -> ``training.python``) in the code directory, as
   ``training.user`` (privileges dropped when the agent is root; the current user otherwise), in a
   process group of its own, with ``SPOT_TRAINING_DATA_DIR``, ``_CHECKPOINT_DIR``, ``_LOG_DIR`` and
   ``_CHECKPOINT_REQUEST_FILE`` in its environment;
4. restarts it after a crash with bounded, jittered exponential backoff, giving up after
   ``max_restarts`` consecutive crashes (:class:`TrainerFailedError`, exit 75); never restarts a
   trainer that exited 74, "checkpoint storage full or unusable" (:class:`CheckpointStorageError`, exit 74),
   or 78, "the checkpoint cannot serve this job" (:class:`CheckpointMismatchError`, exit 78);
5. returns :attr:`Outcome.COMPLETED` only when the trainer exited 0, the agent did not stop it, and
   ``<checkpoint_dir>/COMPLETED`` exists (a node that boots and finds COMPLETED returns it at once).

It implements :class:`spot_training.agent.interruption.TrainerControl` (``terminate``, ``request_checkpoint``)
and polls an :class:`~spot_training.agent.interruption.InterruptionWatcher` while it waits.

Why not systemd or a library for restarts: the restart decision depends on our completion contract
(exit 0 + COMPLETED + not stopped by us) and on interruption notices, which a generic process manager
cannot see; subprocess + a process group is all it takes.
"""

from __future__ import annotations

import enum
import errno
import json
import logging
import os
import pwd
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from spot_training.agent import trainer_env
from spot_training.agent.config import AgentConfig
from spot_training.agent.errors import (  # noqa: F401 - the give-up errors are re-exported for callers
    AgentError, CheckpointMismatchError, CheckpointStorageError, ConfigError, ExitCode, TemporaryError, give_up_error)
from spot_training.agent.process_group import (  # noqa: F401 - re-exported
    ProcessGroup, descendants, signal_group, user_ids, user_kwargs)
from spot_training.agent.safepath import UnsafePathError, open_directory, write_file_replacing
# File and environment variable names are the contract's (docs/contracts.md); re-exported for callers.
from spot_training.contract import (  # noqa: F401
    CHECKPOINT_REQUEST_FILE,
    COMPLETED_FILE,
    ENV_CHECKPOINT_DIR,
    ENV_CHECKPOINT_EVERY_SECONDS,
    ENV_CHECKPOINT_EVERY_STEPS,
    ENV_CHECKPOINT_REQUEST_FILE,
    ENV_DATA_DIR,
    ENV_LOG_DIR,
    TRAINER_GIVE_UP,
    TRAINER_RETRY,
    trainer_exit_decision,
)

if TYPE_CHECKING:
    from spot_training.agent.interruption import InterruptionWatcher

log = logging.getLogger(__name__)

WORKSPACE_DIR = "workspace"


_UNSET = object()


class Outcome(enum.Enum):
    """How supervision ended: ``COMPLETED`` (run cleanup), ``INTERRUPTED`` (stopped for a spot
    notice), ``STOPPED`` (the agent itself was asked to stop)."""

    COMPLETED = "completed"
    INTERRUPTED = "interrupted"
    STOPPED = "stopped"


class TrainerFailedError(AgentError):
    """The trainer crashed more than ``max_restarts`` times in a row: exit 75."""

    exit_code = ExitCode.TEMPFAIL


class EnvironmentBuildFailed(AgentError):
    """The trainer's virtual environment could not be built (pip failed every attempt): exit 75.
    The node reports it as a failed boot (docs/agent.md, "Boot failures")."""

    exit_code = ExitCode.TEMPFAIL


class VolumeNotMountedError(AgentError):
    """The data volume is not mounted: training must not start on the root disk. Exit 75."""

    exit_code = ExitCode.TEMPFAIL


class Supervisor:
    """Runs and restarts the trainer (see the module docstring).

    Args:
        config: the validated node config.
        is_mounted: returns True when the data volume is mounted and verified (storage half).
        max_restarts: consecutive crash restarts allowed before giving up (default 5, >= 0).
        backoff_base_s, backoff_max_s: the n-th restart waits ``min(max, base * 2**(n-1))`` seconds,
            scaled by a jitter in [0.5, 1] (defaults 2 s and 60 s).
        stable_after_s: a run longer than this (seconds, default 600) resets the crash count.
        stop_timeout_s: how long an agent stop (SIGTERM to the agent) waits for the trainer, seconds
            (default 90).
        checkpoint_request: ``"file"`` (create SPOT_TRAINING_CHECKPOINT_REQUEST_FILE, default) or
            ``"signal"`` (SIGUSR1 to the trainer's group; kills a trainer that does not handle it).
        venv_attempts, venv_backoff_s: whole ``pip install`` attempts when building ``training.venv``
            (default 3), ``venv_backoff_s * n`` seconds apart (default 5 s); spot_training.agent.trainer_env's defaults.
        run_as_current_user_if_missing: when root and ``training.user`` does not exist, run as root
            instead of raising ConfigError (local mode only; default False).
        environ: base environment for the trainer (default ``os.environ``).
        poll_s: how often the wait loop checks the trainer and ticks the watcher, seconds (0.2).
        output: when given, the trainer's stdout and stderr go through a pipe: a thread copies every
            line to the agent's stdout (as before, so the journal is unchanged) and passes it to
            ``output`` (the CloudWatch publisher's ``add_line``; it must not block). Default None:
            the trainer writes straight to the agent's stdout.
        clock, sleep, rng: injectable time sources.
    """

    def __init__(self, config: AgentConfig, *, is_mounted: Callable[[], bool], max_restarts: int = 5,
                 backoff_base_s: float = 2.0, backoff_max_s: float = 60.0, stable_after_s: float = 600.0,
                 stop_timeout_s: float = 90.0, checkpoint_request: str = "file",
                 run_as_current_user_if_missing: bool = False, environ: Mapping[str, str] | None = None,
                 venv_attempts: int = trainer_env.DEFAULT_ATTEMPTS, venv_backoff_s: float = trainer_env.BACKOFF_S,
                 poll_s: float = 0.2, output: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, rng: Callable[[], float] = random.random) -> None:
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
        if backoff_base_s < 0 or backoff_max_s < backoff_base_s:
            raise ValueError(f"need 0 <= backoff_base_s <= backoff_max_s, got backoff_base_s={backoff_base_s!r}, "
                             f"backoff_max_s={backoff_max_s!r}")
        if checkpoint_request not in ("file", "signal"):
            raise ValueError(f"checkpoint_request must be 'file' or 'signal', got {checkpoint_request!r}")
        self.config = config
        self.training = config.training
        self.is_mounted = is_mounted
        self.max_restarts = max_restarts
        self.backoff_base_s, self.backoff_max_s = backoff_base_s, backoff_max_s
        self.stable_after_s = stable_after_s
        self.stop_timeout_s = stop_timeout_s
        self.checkpoint_request = checkpoint_request
        self.run_as_current_user_if_missing = run_as_current_user_if_missing
        self.environ = dict(os.environ if environ is None else environ)
        self.poll_s = poll_s
        self.output = output
        self._copier: threading.Thread | None = None
        self._clock, self._sleep, self._rng = clock, sleep, rng
        self._proc: subprocess.Popen | None = None
        self._group: ProcessGroup | None = None
        self._stopped_by_us: str | None = None
        self._stop_requested = False
        self._account_cache: object = _UNSET
        self.restarts = 0
        self.starts = 0
        self.last_status: int | None = None
        #: The trainer's interpreter: ``training.python``, or the venv's once :meth:`prepare_environment` ran.
        self.python: str = str(config.training.python)
        self._environment_ready = False
        self.venv_attempts, self.venv_backoff_s = max(1, int(venv_attempts)), float(venv_backoff_s)

    # ---- paths ------------------------------------------------------------------------------
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
        self._require_mounted()
        dest = self.config.volume.mount_point / WORKSPACE_DIR
        _git_checkout(code.url, code.ref, dest, env=self._git_env(), account=self._account())
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
        self._require_mounted()
        root = venv.root
        # Created and handed to the training user without following a link the user planted
        # (spot_training.agent.safepath), as the training directories are.
        try:
            if root.is_symlink():  # refused even inside a directory only root can write
                raise UnsafePathError(f"{str(root)!r} is a symbolic link")
            os.close(open_directory(root, create=True, owner=self._owner()))
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
        account = self._account()
        if account is not None:  # git runs as the training user, with their home (credentials, config)
            env.update({"HOME": account.pw_dir, "USER": account.pw_name, "LOGNAME": account.pw_name})
        return env

    # ---- user and environment -----------------------------------------------------------------
    def _account(self) -> pwd.struct_passwd | None:
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
        return user_ids(self._account())

    def _owner(self) -> tuple[int, int] | None:
        account = self._account()
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
        if self.training.checkpoint_every_steps is not None:
            env[ENV_CHECKPOINT_EVERY_STEPS] = str(self.training.checkpoint_every_steps)
        if self.training.checkpoint_every_seconds is not None:
            env[ENV_CHECKPOINT_EVERY_SECONDS] = f"{self.training.checkpoint_every_seconds:g}"
        account = self._account()
        if account is not None:
            env.update({"HOME": account.pw_dir, "USER": account.pw_name, "LOGNAME": account.pw_name})
        return env

    def _prepare_dirs(self) -> None:
        # Root never follows a symlink the training user planted on the volume (spot_training.agent.safepath):
        # `checkpoints -> /etc` would otherwise hand /etc to the user. Raises UnsafePathError (exit 78).
        for directory in (self.training.dataset_dir, self.training.checkpoint_dir, self.training.log_dir):
            os.close(open_directory(directory, create=True, owner=self._owner()))

    def _require_mounted(self) -> None:
        if not self.is_mounted():
            raise VolumeNotMountedError(
                f"the data volume is not mounted at {self.config.volume.mount_point}; refusing to start training "
                "on the root disk (checkpoints there are lost with the instance)")

    # ---- running ----------------------------------------------------------------------------
    def start(self, workdir: Path) -> subprocess.Popen:
        """Start one trainer process in its own session/process group; returns the Popen."""
        self._require_mounted()
        self._prepare_dirs()
        argv = self.training.argv(self.python)
        account = self._account()
        try:
            group = ProcessGroup.start(argv, cwd=workdir, env=self.trainer_environment(), user=user_ids(account),
                                       stdout=subprocess.PIPE if self.output is not None else None)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.EACCES, errno.ENOTDIR, errno.ENOEXEC):
                raise ConfigError(f"training.command[0]: {argv[0]!r} cannot be run ({exc.strerror}); expected an "
                                  "executable (training.python for '{python}')") from None
            raise TemporaryError(f"starting the trainer failed: {exc}") from exc
        proc = group.proc
        self._group = group
        self.starts += 1
        if self.output is not None:
            self._copier = threading.Thread(target=_copy_output, args=(proc.stdout, self.output),
                                            name="trainer-output", daemon=True)
            self._copier.start()
        log.info("training started", extra={"pid": proc.pid, "argv": argv, "cwd": str(workdir),
                                             "user": account.pw_name if account else None, "start": self.starts})
        self._proc = proc
        return proc

    def run(self, watcher: "InterruptionWatcher | None" = None) -> Outcome:
        """Supervise until training completes, is interrupted, or the agent is stopped.

        Raises VolumeNotMountedError (before anything starts, and before each restart),
        ConfigError (bad code location, unknown user, command not executable), TrainerFailedError
        (more than ``max_restarts`` consecutive crashes).
        """
        self._require_mounted()
        if self.completed():
            log.info("training already completed (COMPLETED found); not starting it",
                     extra={"completed_file": str(self.completed_file)})
            return Outcome.COMPLETED
        workdir = self.prepare_code()
        self.prepare_environment()
        try:
            return self._supervise(workdir, watcher)
        except BaseException as exc:
            # Never leave a trainer running behind an agent that is about to exit (an IMDS 403 while
            # polling, a bug): stop it the contract's way, so it saves and exits.
            if self._proc is not None and self._proc.poll() is None:
                log.error("the agent is failing; stopping the trainer first", extra={"error": repr(exc)})
                self.terminate(timeout_s=self.stop_timeout_s, reason=f"agent error: {type(exc).__name__}")
            raise

    def _supervise(self, workdir: Path, watcher: "InterruptionWatcher | None") -> Outcome:
        crashes = 0
        while True:
            if self._stop_requested or (watcher is not None and watcher.interrupted is not None):
                return self._stopped_outcome(watcher)
            started = self._clock()
            proc = self.start(workdir)
            status = self._wait(proc, watcher)
            if self._copier is not None:
                self._copier.join(5.0)  # the trainer's last lines reach stdout before we go on
            self.last_status = status
            ran_s = self._clock() - started
            self._proc = self._group = None
            if self._stopped_by_us is not None:
                log.info("trainer stopped by the agent", extra={"exit_status": status, "reason": self._stopped_by_us})
                return self._stopped_outcome(watcher)
            if status == 0 and self.completed():
                log.info("training completed", extra={"run_s": round(ran_s, 1), "completed_file": str(self.completed_file)})
                return Outcome.COMPLETED
            decision = trainer_exit_decision(status)
            if decision == TRAINER_GIVE_UP:
                raise give_up_error(status, self.training.checkpoint_dir)
            if decision == TRAINER_RETRY:
                delay = self.backoff_base_s * (0.5 + self._rng() / 2)
                self.restarts += 1
                log.info("trainer asked to be run again; restarting after backoff (not a crash)",
                         extra={"exit_status": status, "backoff_s": round(delay, 2)})
                self._backoff(delay, watcher)
                continue
            crashes = 1 if ran_s >= self.stable_after_s else crashes + 1
            why = "exited 0 without writing COMPLETED" if status == 0 else f"exited with status {status}"
            if crashes > self.max_restarts:
                log.error("the trainer keeps failing; giving up", extra={
                    "event": "trainer_failed", "exit_status": status, "crashes": crashes})
                raise TrainerFailedError(f"the trainer {why}; it failed {crashes} times in a row, more than "
                                         f"max_restarts={self.max_restarts}; giving up")
            delay = min(self.backoff_max_s, self.backoff_base_s * 2 ** (crashes - 1)) * (0.5 + self._rng() / 2)
            self.restarts += 1
            log.warning(f"trainer {why}; restarting after backoff", extra={
                "exit_status": status, "run_s": round(ran_s, 1), "crashes": crashes,
                "max_restarts": self.max_restarts, "backoff_s": round(delay, 2)})
            self._backoff(delay, watcher)

    def _stopped_outcome(self, watcher: "InterruptionWatcher | None") -> Outcome:
        return Outcome.INTERRUPTED if watcher is not None and watcher.interrupted is not None else Outcome.STOPPED

    def _wait(self, proc: subprocess.Popen, watcher: "InterruptionWatcher | None") -> int:
        while True:
            try:
                return proc.wait(timeout=self.poll_s)
            except subprocess.TimeoutExpired:
                pass
            if self._stop_requested and self._stopped_by_us is None:
                self.terminate(timeout_s=self.stop_timeout_s, reason="agent stop requested")
            if watcher is not None:
                watcher.tick()

    def _backoff(self, delay: float, watcher: "InterruptionWatcher | None") -> None:
        deadline = self._clock() + delay
        while not self._stop_requested and (watcher is None or watcher.interrupted is None):
            left = deadline - self._clock()
            if left <= 0:
                return
            self._sleep(min(left, self.poll_s))
            if watcher is not None:
                watcher.tick()

    # ---- TrainerControl -----------------------------------------------------------------------
    def terminate(self, *, timeout_s: float, reason: str) -> int | None:
        """Stop the trainer the contract's way (:meth:`ProcessGroup.terminate`: SIGTERM to its leader,
        the group's other processes only once the leader has exited, SIGKILL to the whole group at the
        deadline ``timeout_s`` seconds from now). Returns its exit status, or None when none is running."""
        self._stopped_by_us = self._stopped_by_us or reason
        group = self._group
        if group is None:
            return None
        if group.poll() is not None:
            return group.poll()
        log.info("sent SIGTERM to the trainer's leader process", extra={"pid": group.pid, "reason": reason,
                                                                         "timeout_s": round(timeout_s, 1)})
        return group.terminate(timeout_s)

    def request_checkpoint(self) -> bool:
        """Ask the running trainer for an extra checkpoint (request file or SIGUSR1, per
        ``checkpoint_request``). False when no trainer is running."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return False
        if self.checkpoint_request == "signal":
            try:
                os.kill(proc.pid, signal.SIGUSR1)  # the leader only, as SIGTERM (docs/contracts.md)
            except ProcessLookupError:
                return False
            return True
        # Written without following links the user planted (spot_training.agent.safepath); owned by the training
        # user, who deletes it when the checkpoint is saved.
        body = json.dumps({"reason": "rebalance-recommendation", "time": time.time()}).encode()
        write_file_replacing(self.request_file, body, owner=self._owner())
        return True

    def request_stop(self) -> None:
        """Ask for a stop from a signal handler (the agent got SIGTERM): the wait loop sends SIGTERM to
        the trainer's group and returns :attr:`Outcome.STOPPED`. Only sets a flag."""
        self._stop_requested = True


def _copy_output(pipe: Any, output: Callable[[str], None]) -> None:
    """Copy the trainer's output from ``pipe`` to the agent's stdout, line by line, and hand each line
    to ``output``; ends at EOF (the trainer and its children closed the pipe). A failing ``output``
    never stops the copy: the trainer must never block on a full pipe."""
    out = getattr(sys.stdout, "buffer", None)
    for raw in iter(pipe.readline, b""):
        try:
            if out is not None:
                out.write(raw)
                out.flush()
            else:
                sys.stdout.write(raw.decode("utf-8", errors="replace"))
                sys.stdout.flush()
        except (OSError, ValueError):
            pass  # the agent's stdout is gone; still drain the pipe
        try:
            output(raw.decode("utf-8", errors="replace"))
        except Exception:  # noqa: BLE001 - publishing is optional
            pass
    pipe.close()


#: Options for every git command the agent runs: hooks off (a hook planted in the checkout would
#: otherwise run at every boot), never prompt.
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
    ``.git/config`` would run as root (issue 15, item 5). ``url`` and ``ref`` never start with ``-``
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
