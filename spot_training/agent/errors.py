"""Exit codes and the exception hierarchy of the node agent.

Exit codes follow sysexits.h so that systemd (``RestartPreventExitStatus=78``) can stop a restart
loop on bad config while still retrying temporary failures (docs/contracts.md, "Agent exit codes").
"""

from __future__ import annotations

from enum import IntEnum
from pathlib import Path

from spot_training import contract


class ExitCode(IntEnum):
    """Process exit status of ``python3 -m spot_training.agent``.

    ``OK`` (0): done. ``UNAVAILABLE`` (69, EX_UNAVAILABLE): this node can no longer work and gave
    up: IMDS answered 403 during training (the agent powered it off for the fleet to replace it), or a
    boot failure was reported and the node is shutting down or its fleet was cancelled (docs/agent.md,
    "Boot failures"); systemd must not restart the agent. ``CHECKPOINT_STORAGE`` (74, EX_IOERR): the
    trainer exited 74 because its checkpoint storage is full or unusable; a restart would fail the
    same way, so systemd does not restart (``RestartPreventExitStatus``). ``TEMPFAIL`` (75,
    EX_TEMPFAIL): try again later (lease held by another node, volume still detaching). ``CONFIG``
    (78, EX_CONFIG): bad configuration, nothing was touched; or the trainer exited 78 (its checkpoint
    cannot serve this job).
    """

    OK = 0
    UNAVAILABLE = contract.EXIT_UNAVAILABLE
    CHECKPOINT_STORAGE = contract.EXIT_CHECKPOINT_STORAGE
    TEMPFAIL = contract.EXIT_TEMPFAIL
    CONFIG = contract.EXIT_CONFIG


class AgentError(Exception):
    """An error the agent reports and exits on, carrying the exit code to use.

    ``exit_code`` defaults to the class attribute (``ExitCode.TEMPFAIL`` for the base class, since an
    unclassified failure is worth a retry by systemd); pass ``exit_code=`` to override it.

    Args:
        message: what went wrong, naming the value and what would be right.
        exit_code: the exit status to use instead of the class's.
    """

    exit_code: ExitCode = ExitCode.TEMPFAIL

    def __init__(self, message: str, *, exit_code: ExitCode | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = ExitCode(exit_code)


class ConfigError(AgentError):
    """The configuration (file, values, or what it names in AWS) is wrong: exit 78, nothing touched.

    ``problems`` lists every individual problem found (each names the key path, the bad value and
    what is allowed); ``str(error)`` joins them.

    Args:
        message: the whole message (default: the problems, one per line).
        problems: every problem found (default: ``message`` alone).
    """

    exit_code = ExitCode.CONFIG

    def __init__(self, message: str | None = None, *, problems: list[str] | tuple[str, ...] = ()) -> None:
        self.problems: tuple[str, ...] = tuple(problems) if problems else ((message,) if message else ())
        if message is None:
            message = "invalid configuration:\n  - " + "\n  - ".join(self.problems)
        super().__init__(message)


class TemporaryError(AgentError):
    """A transient condition (lease held elsewhere, volume still detaching, throttling): exit 75."""

    exit_code = ExitCode.TEMPFAIL


class NodeUnusableError(AgentError):
    """This node can no longer work safely (IMDS answered 403 while training: no interruption notices
    any more). The trainer was stopped the contract's way; the CLI powers the instance off so that the
    fleet replaces it, and exits 69 (docs/agent.md, "A node that can no longer work")."""

    exit_code = ExitCode.UNAVAILABLE


class CheckpointStorageError(AgentError):
    """The trainer exited 74: its checkpoint storage is full or unusable (a save ran out of space,
    or the directory is read-only). Restarting would fail the same way at the next save, so the
    supervisor does not restart it. Exit 74."""

    exit_code = ExitCode.CHECKPOINT_STORAGE


class CheckpointMismatchError(AgentError):
    """The trainer exited 78: the newest checkpoint in its directory was written by another framework,
    adapter or model (its log names the path). Every restart would refuse it the same way, so the
    supervisor does not restart it. Exit 78."""

    exit_code = ExitCode.CONFIG


def give_up_error(status: int, checkpoint_dir: Path) -> AgentError:
    """The error an agent raises when its trainer exited with a status the contract's restart policy
    gives up on (:data:`spot_training.contract.TRAINER_EXIT_POLICY`); it carries the same exit status.

    Args:
        status: the trainer's exit status (74 or 78).
        checkpoint_dir: the trainer's checkpoint directory, for the message.

    Returns:
        :class:`CheckpointStorageError` (74), :class:`CheckpointMismatchError` (78), or an AgentError
        with ``status`` as its exit code for another status the policy gives up on.
    """
    if status == contract.EXIT_CHECKPOINT_STORAGE:
        return CheckpointStorageError(
            f"the trainer exited {status}: its checkpoint storage {str(checkpoint_dir)!r} is full or unusable "
            "(its log names the path, the bytes needed and free); not restarting it, since every restart would "
            "fail the same way; free space or fix the directory, then start the agent again")
    if status == contract.EXIT_CHECKPOINT_MISMATCH:
        return CheckpointMismatchError(
            f"the trainer exited {status}: the newest checkpoint in {str(checkpoint_dir)!r} cannot serve this job "
            "(another framework's, adapter's or model's; its log names the path); not restarting it; point the "
            "job at another checkpoint directory or restore the model it was written for, then start the agent again")
    return AgentError(f"the trainer exited {status}, a status the restart policy gives up on", exit_code=ExitCode(status))
