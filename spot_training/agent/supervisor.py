"""Run the training command, restart it after a crash, and decide when training is complete.

The supervisor only supervises (docs/contracts.md, "Signals and files"); the node is prepared by
:class:`spot_training.agent.workspace.Workspace` (code, environment, user, trainer environment) and the
trainer runs through :class:`spot_training.agent.process_group.ProcessGroup`. It

1. refuses to do anything unless the data volume is mounted (``is_mounted``, from the storage half),
   so training never writes checkpoints to the root disk;
2. runs ``training.command`` in the workspace's code directory as the training user, in a process
   group of its own, with the contract's environment;
3. decides after every exit by the contract's restart policy (``spot_training.contract.TRAINER_EXIT_POLICY``):
   a crash is restarted with bounded, jittered exponential backoff, giving up after ``max_restarts``
   consecutive crashes (:class:`TrainerFailedError`, exit 75); 74 "checkpoint storage full or unusable"
   and 78 "the checkpoint cannot serve this job" are never restarted (the agent exits with them); 75
   is restarted without counting as a crash;
4. returns :attr:`Outcome.COMPLETED` only when the trainer exited 0, the agent did not stop it, and
   ``<checkpoint_dir>/COMPLETED`` exists (a node that boots and finds COMPLETED returns it at once).

It implements :class:`spot_training.agent.interruption.TrainerControl` (``terminate``, ``request_checkpoint``)
and polls an :class:`~spot_training.agent.interruption.InterruptionWatcher` while it waits. A notice never
counts toward the crash budget: the trainer it stopped is not restarted.

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
import random
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
from spot_training.agent.process_group import ProcessGroup, user_ids
from spot_training.agent.safepath import write_bytes_atomic
from spot_training.agent.workspace import (  # noqa: F401 - re-exported for callers
    EnvironmentBuildFailed, VolumeNotMountedError, Workspace)
# File names are the contract's (docs/contracts.md); re-exported for callers.
from spot_training.contract import CHECKPOINT_REQUEST_FILE, COMPLETED_FILE, TRAINER_GIVE_UP, TRAINER_RETRY, trainer_exit_decision  # noqa: F401

if TYPE_CHECKING:
    from spot_training.agent.interruption import InterruptionWatcher

log = logging.getLogger(__name__)

class Outcome(enum.Enum):
    """How supervision ended: ``COMPLETED`` (run cleanup), ``INTERRUPTED`` (stopped for a spot
    notice), ``STOPPED`` (the agent itself was asked to stop)."""

    COMPLETED = "completed"
    INTERRUPTED = "interrupted"
    STOPPED = "stopped"


class TrainerFailedError(AgentError):
    """The trainer crashed more than ``max_restarts`` times in a row: exit 75."""

    exit_code = ExitCode.TEMPFAIL


class Supervisor:
    """Runs and restarts the trainer (see the module docstring).

    Args:
        config: the validated node config.
        is_mounted: returns True when the data volume is mounted and verified (storage half).
        max_restarts: consecutive crash restarts allowed before giving up (default 5, >= 0).
        backoff_base_s: the n-th restart waits ``min(backoff_max_s, backoff_base_s * 2**(n-1))``
            seconds, scaled by a jitter in [0.5, 1] (default 2 s).
        backoff_max_s: the longest wait between restarts, seconds (default 60 s).
        stable_after_s: a run longer than this (seconds, default 600) resets the crash count.
        stop_timeout_s: how long an agent stop (SIGTERM to the agent) waits for the trainer, seconds
            (default 90).
        checkpoint_request: ``"file"`` (create SPOT_TRAINING_CHECKPOINT_REQUEST_FILE, default) or
            ``"signal"`` (SIGUSR1 to the trainer's group; kills a trainer that does not handle it).
        venv_attempts: whole ``pip install`` attempts when building ``training.venv`` (default 3,
            spot_training.agent.trainer_env's).
        venv_backoff_s: attempt n waits ``venv_backoff_s * n`` seconds (default 5 s).
        run_as_current_user_if_missing: when root and ``training.user`` does not exist, run as root
            instead of raising ConfigError (local mode only; default False).
        environ: base environment for the trainer (default ``os.environ``).
        poll_s: how often the wait loop checks the trainer and ticks the watcher, seconds (0.2).
        output: when given, the trainer's stdout and stderr go through a pipe: a thread copies every
            line to the agent's stdout (as before, so the journal is unchanged) and passes it to
            ``output`` (the CloudWatch publisher's ``add_line``; it must not block). Default None:
            the trainer writes straight to the agent's stdout.
        clock: monotonic seconds (default ``time.monotonic``).
        sleep: sleeps the given seconds (default ``time.sleep``).
        rng: jitter source, uniform in [0, 1) (default ``random.random``).
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
        #: How the node is prepared (code, environment, user, trainer environment): spot_training.agent.workspace.
        self.workspace = Workspace(config, is_mounted=is_mounted,
                                   run_as_current_user_if_missing=run_as_current_user_if_missing,
                                   environ=environ, venv_attempts=venv_attempts, venv_backoff_s=venv_backoff_s)
        self.max_restarts = max_restarts
        self.backoff_base_s, self.backoff_max_s = backoff_base_s, backoff_max_s
        self.stable_after_s = stable_after_s
        self.stop_timeout_s = stop_timeout_s
        self.checkpoint_request = checkpoint_request
        self.poll_s = poll_s
        self.output = output
        self._copier: threading.Thread | None = None
        self._clock, self._sleep, self._rng = clock, sleep, rng
        self._proc: subprocess.Popen | None = None
        self._group: ProcessGroup | None = None
        self._stopped_by_us: str | None = None
        self._stop_requested = False
        self.restarts = 0
        self.starts = 0
        self.last_status: int | None = None

    # ---- running ----------------------------------------------------------------------------
    def start(self, workdir: Path) -> subprocess.Popen:
        """Start one trainer process in its own session/process group; returns the Popen."""
        ws = self.workspace
        ws.require_mounted()
        ws.prepare_dirs()
        argv = self.training.argv(ws.python)
        account = ws.account()
        try:
            group = ProcessGroup.start(argv, cwd=workdir, env=ws.trainer_environment(), user=user_ids(account),
                                       stdout=subprocess.PIPE if self.output is not None else None)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.EACCES, errno.ENOTDIR, errno.ENOEXEC):
                raise ConfigError(f"training.command[0]: {argv[0]!r} cannot be run ({exc.strerror}); expected an "
                                  "executable (training.python for '{python}')") from None
            raise TemporaryError(f"starting the trainer failed: {exc}") from exc
        proc = group.proc
        self._proc, self._group = proc, group
        self.starts += 1
        if self.output is not None:
            self._copier = threading.Thread(target=_copy_output, args=(proc.stdout, self.output),
                                            name="trainer-output", daemon=True)
            self._copier.start()
        log.info("training started", extra={"pid": proc.pid, "argv": argv, "cwd": str(workdir),
                                             "user": account.pw_name if account else None, "start": self.starts})
        return proc

    def run(self, watcher: "InterruptionWatcher | None" = None) -> Outcome:
        """Supervise until training completes, is interrupted, or the agent is stopped.

        Raises:
            VolumeNotMountedError: before anything starts, and before each restart.
            ConfigError: bad code location, unknown user, command not executable.
            TrainerFailedError: more than ``max_restarts`` consecutive crashes.
        """
        self.workspace.require_mounted()
        if self.workspace.completed():
            log.info("training already completed (COMPLETED found); not starting it",
                     extra={"completed_file": str(self.workspace.completed_file)})
            return Outcome.COMPLETED
        workdir = self.workspace.prepare_code()
        self.workspace.prepare_environment()
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
            if status == 0 and self.workspace.completed():
                log.info("training completed", extra={"run_s": round(ran_s, 1), "completed_file": str(self.workspace.completed_file)})
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
        deadline ``timeout_s`` seconds from now).

        Args:
            timeout_s: seconds until SIGKILL.
            reason: why (recorded as the stop's cause and logged).

        Returns:
            its exit status, or None when none is running.
        """
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
        write_bytes_atomic(self.workspace.request_file, body, owner=self.workspace.owner())
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
